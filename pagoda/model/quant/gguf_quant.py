"""``--quantization gguf``: a GGUF file's Q4_0, Q4_1 and Q8_0 tensors stay quantized.

It is also what a GGUF file loads with when ``--quantization`` is not given, where it
runs faster than float weights (``default_gguf_scheme``): on the CPU, for a dense model,
with the native block kernel built, and with some linear layer stored in such blocks.
Elsewhere (a GPU, MoE or MLA layers, no kernel) the file is expanded to float as with
``--quantization none``.

The loader (pagoda.model.loader.gguf) hands the tensors of the layers this scheme keeps
as raw blocks, uint8 [rows, blocks per row, bytes per block]; the layer's shard plan
slices them in whole blocks (BLOCK_DIMS). Q4_1 and Q8_0 blocks are multiplied as
stored; Q4_0 is repacked to Q4_1 exactly (cpu_kernels.q4_0_to_q4_1). A layer stays
float (dequantized by the loader) when its type has no block kernel (K-quants, F16,
F32) or when the tensors merged into it (q/k/v, gate/up) have different types. The
LM head is Q8_0 from its float weight (cpu_int.CpuBlockConfig).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from pagoda.model.loader.gguf import gguf_tensor_types
from pagoda.model.quant.base import LinearMethod, checkpoint_layers, replace_parameter
from pagoda.model.quant.cpu_int import BLOCK_DIMS, CpuBlockConfig, apply_blocks, block_ready
from pagoda.model.quant.cpu_kernels import (
    BLOCK_BYTES,
    Q4_0_BYTES,
    QK,
    native_kernel,
    native_status,
    q4_0_to_q4_1,
)

logger = logging.getLogger(__name__)


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

    def weight_format(self, layer: nn.Module) -> str:
        return self.ggml_type if self.ggml_type != "Q4_0" else "Q4_0 (as Q4_1)"

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


# Block tensors that speak for no linear layer: the embedding stays float, and the LM
# head is quantized to Q8_0 from its float weight whatever the file stores.
_NOT_LINEAR = ("model.embed_tokens.weight", "lm_head.weight")


def _linear_block_types(tensor_types: Mapping[str, str]) -> set[str]:
    """The block types (Q4_0, Q4_1, Q8_0) the file stores some linear layer in."""
    return {
        t
        for name, t in tensor_types.items()
        if t in GGUFBlockMethod._KIND and name not in _NOT_LINEAR and "norm" not in name
    }


def _why_expanded(arch, device) -> str | None:
    """Why a GGUF file of arch on device is expanded to float by default; None when its
    blocks run there."""
    if arch is None or device is None:
        return "no model or device given"
    if torch.device(device).type != "cpu":
        return f"the gguf block kernel runs on the CPU, not on {torch.device(device).type}"
    if arch.moe is not None or arch.mla is not None:
        return f"{arch.architecture}'s MoE experts and MLA layers have no block path"
    if native_kernel() is None:
        return f"no native block kernel here: {native_status()}"
    return None


def default_gguf_scheme(reader, arch, device) -> GGUFQuantConfig | None:
    """The scheme a GGUF file loads with when --quantization is not given: the gguf
    scheme where it runs (CPU, dense model, native kernel) and the file stores some
    linear layer as Q4_0/Q4_1/Q8_0 blocks (the embedded SmolLM2's batch-1 decode: 4.4x
    the float32 weights', docs/performance.md#cpu); None (float weights) otherwise."""
    tensor_types = gguf_tensor_types(reader)
    block_types = _linear_block_types(tensor_types)
    if not block_types:
        return None  # nothing to keep: F16/F32 and K-quant files expand to float
    why = _why_expanded(arch, device)
    if why is not None:
        logger.info("GGUF %s blocks expanded to float (%s)", "/".join(sorted(block_types)), why)
        return None
    return GGUFQuantConfig(tensor_types)
