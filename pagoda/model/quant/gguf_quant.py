"""``--quantization gguf``: a GGUF file's Q4_0, Q4_1 and Q8_0 tensors stay quantized.

The loader (pagoda.model.loader.gguf) hands the tensors of the layers this scheme keeps
as raw blocks, uint8 [rows, blocks per row, bytes per block]; the layer's shard plan
slices them in whole blocks (BLOCK_DIMS). Q4_1 and Q8_0 blocks are multiplied as
stored; Q4_0 is repacked to Q4_1 exactly (cpu_kernels.q4_0_to_q4_1). A layer stays
float (dequantized by the loader) when its type has no block kernel (K-quants, F16,
F32) or when the tensors merged into it (q/k/v, gate/up) have different types. The
LM head is Q8_0 from its float weight (cpu_int.CpuBlockConfig).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pagoda.model.loader.gguf import gguf_tensor_types
from pagoda.model.quant.base import LinearMethod, checkpoint_layers, replace_parameter
from pagoda.model.quant.cpu_int import BLOCK_DIMS, CpuBlockConfig, apply_blocks, block_ready
from pagoda.model.quant.cpu_kernels import BLOCK_BYTES, Q4_0_BYTES, QK, q4_0_to_q4_1


class GGUFBlockMethod(LinearMethod):
    """A layer whose checkpoint tensors are GGUF blocks of one type (Q4_0, Q4_1 or
    Q8_0), loaded raw (uint8 [rows, blocks per row, bytes per block]) and kept."""

    _KIND = {"Q4_0": "q4_1", "Q4_1": "q4_1", "Q8_0": "q8_0"}
    _FILE_BYTES = {"Q4_0": Q4_0_BYTES, "Q4_1": BLOCK_BYTES["q4_1"], "Q8_0": BLOCK_BYTES["q8_0"]}

    def __init__(self, ggml_type: str) -> None:
        if ggml_type not in self._KIND:
            raise ValueError(f"GGUF type {ggml_type} has no block method (Q4_0, Q4_1, Q8_0)")
        self.ggml_type, self.kind = ggml_type, self._KIND[ggml_type]
        self.name = f"gguf-{ggml_type.lower()}"

    def create_weights(
        self, layer: nn.Module, in_per_rank: int, out_per_rank: int, num_shards: int
    ) -> None:
        if in_per_rank % QK:
            raise ValueError(
                f"GGUF blocks need in_features per rank divisible by {QK}, got {in_per_rank}"
            )
        layer.register_weight(
            "weight",
            torch.empty(
                out_per_rank, in_per_rank // QK, self._FILE_BYTES[self.ggml_type], dtype=torch.uint8
            ),
            BLOCK_DIMS,
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.ggml_type == "Q4_0":
            replace_parameter(layer, "weight", q4_0_to_q4_1(layer.weight.data))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return apply_blocks(layer, x, self.kind, bias)


class GGUFQuantConfig(CpuBlockConfig):
    """tensor_types: HF tensor name -> GGML type name ('Q4_1', 'F32', ...), read from
    the file before the model is built (pagoda.model.loader.gguf.gguf_tensor_types).
    raw_tensor_names() lists the tensors the loader must hand over as raw blocks: those
    of the layers linear_method gave a block method."""

    name = "gguf"

    def __init__(self, tensor_types: Mapping[str, str]) -> None:
        self.tensor_types = dict(tensor_types)
        self._raw: set[str] = set()

    @classmethod
    def from_reader(cls, reader) -> GGUFQuantConfig:
        """The scheme for the open GGUF file (a gguf.GGUFReader)."""

        return cls(gguf_tensor_types(reader))

    def tensor_names(self, prefix: str) -> list[str]:
        """The checkpoint weights merged into the layer named prefix."""
        return [f"{name}.weight" for name in checkpoint_layers(prefix)]

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        names = self.tensor_names(prefix)
        types = {self.tensor_types.get(n) for n in names}
        if len(types) != 1 or None in types or not block_ready(layer):
            return None  # mixed or unknown types: this layer stays float
        ggml_type = types.pop()
        if ggml_type not in GGUFBlockMethod._KIND:
            return None  # K-quants, F16, F32: dequantized to float
        self._raw.update(names)
        return GGUFBlockMethod(ggml_type)

    def raw_tensor_names(self) -> frozenset[str]:
        return frozenset(self._raw)
