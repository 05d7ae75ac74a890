"""CPU weight-only quantization schemes: ``int8``, ``int4`` (online, from a float
checkpoint) and ``gguf`` (a GGUF file's own Q4_0/Q4_1/Q8_0 blocks, kept quantized).

Every scheme stores a layer's weight as GGUF-style blocks of 32 input columns
(pagoda.model.quant.cpu_kernels: layouts, kernel, reference) in ``layer.qweight``,
uint8 [out_per_rank, in_per_rank / 32, bytes per block]:
- int8: Q8_0, symmetric int8 with one fp16 scale per 32 weights (1.06 bytes/weight).
  Group-wise rather than one scale per output channel: better quality for 6% more
  bytes, one kernel for it and for GGUF's Q8_0, and a Q8_0 file's tensor re-quantizes
  to exactly its own blocks.
- int4: Q4_1, asymmetric 4-bit with fp16 scale and minimum per 32 weights
  (0.625 bytes/weight); group 32 so that GGUF's Q4_0/Q4_1 are the same layout.
- gguf: Q4_1 and Q8_0 blocks as stored in the file; Q4_0 repacked exactly to Q4_1.
  Other types (K-quants, F16, F32) are dequantized to float, as are merged layers
  (q/k/v, gate/up) whose parts have different types.
The LM head of every scheme is Q8_0, quantized from its float weight after loading
(it may be the embedding's weight: the float weight stays for the embedding). Q4 heads
cost quality; a Q8_0 embedding (the embedded SmolLM2's) re-quantizes exactly.

These are CPU methods: on a GPU the schemes refuse to run (use fp8 there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import torch
from torch import nn

from pagoda.model.quant.base import WEIGHT_DIMS, LinearMethod, QuantConfig, ShardDims
from pagoda.model.quant.cpu_kernels import (BLOCK_BYTES, Q4_0_BYTES, QK, blocks_mm,
                                            q4_0_to_q4_1, quantize_q4_1, quantize_q8_0)

# A blocks tensor [out, in / 32, bytes]: rows follow the output, blocks the input.
BLOCK_DIMS = ShardDims(output_dim=0, input_dim=1, input_block=QK)

# Merged layers of the Llama family -> the checkpoint projections they hold.
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _set_blocks(layer: nn.Module, blocks: torch.Tensor) -> None:
    """Stores blocks as layer.qweight (a frozen parameter, so memory reports count it)."""
    if "qweight" in layer._parameters:
        del layer._parameters["qweight"]
    layer.register_parameter("qweight", nn.Parameter(blocks, requires_grad=False))


def _apply_blocks(layer: nn.Module, x: torch.Tensor, kind: str,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    shape = x.shape
    y = blocks_mm(x.reshape(-1, shape[-1]).to(torch.float32), layer.qweight, kind)
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])


def _check_cpu(name: str, device: torch.device) -> None:
    if torch.device(device).type != "cpu":
        raise ValueError(f"--quantization {name} is a CPU method (its kernel is x86 AVX2); "
                         f"on a {torch.device(device).type} device use --quantization fp8")


class OnlineBlockMethod(LinearMethod):
    """Quantizes a float weight into blocks after loading (float checkpoints, dummy
    weights, the LM head). keep_float: leave the float weight in place (a head tied to
    the embedding) instead of dropping it."""

    def __init__(self, kind: str, keep_float: bool = False) -> None:
        if kind not in BLOCK_BYTES:
            raise ValueError(f"unknown block kind {kind!r}")
        self.kind, self.keep_float = kind, keep_float
        self.name = f"{kind}-online"

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int,
                       num_shards: int) -> None:
        if in_per_rank % QK:
            raise ValueError(f"{self.kind} needs in_features per rank divisible by {QK}, "
                             f"got {in_per_rank}")
        layer.register_weight("weight", torch.empty(out_per_rank, in_per_rank), WEIGHT_DIMS)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if weight.shape[-1] % QK:
            raise ValueError(f"{self.kind} needs in_features divisible by {QK}, got "
                             f"{weight.shape[-1]}")
        quantize = quantize_q8_0 if self.kind == "q8_0" else quantize_q4_1
        _set_blocks(layer, quantize(weight.data.float().cpu()))
        if not self.keep_float:
            del layer._parameters["weight"]
            if hasattr(layer, "_method_params"):  # LinearBase's list of method parameters
                layer._method_params = [n for n in layer._method_params if n != "weight"]
                layer._method_params.append("qweight")

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _apply_blocks(layer, x, self.kind, bias)


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

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int,
                       num_shards: int) -> None:
        if in_per_rank % QK:
            raise ValueError(f"GGUF blocks need in_features per rank divisible by {QK}, "
                             f"got {in_per_rank}")
        layer.register_weight(
            "qweight", torch.empty(out_per_rank, in_per_rank // QK,
                                   self._FILE_BYTES[self.ggml_type], dtype=torch.uint8),
            BLOCK_DIMS)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.ggml_type == "Q4_0":
            _set_blocks(layer, q4_0_to_q4_1(layer.qweight.data))

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _apply_blocks(layer, x, self.kind, bias)


class _CpuBlockConfig(QuantConfig):
    """What int8, int4 and gguf share: CPU only, a Q8_0 LM head, float activations."""

    def lm_head_method(self) -> Optional[LinearMethod]:
        return OnlineBlockMethod("q8_0", keep_float=True)

    def check_device(self, device: torch.device) -> None:
        _check_cpu(self.name, device)

    def check_model_dtype(self, dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"--quantization {self.name} needs float activations, got {dtype}")


def _block_ready(layer: nn.Module) -> bool:
    return getattr(layer, "in_per_rank", 0) % QK == 0


class Int8QuantConfig(_CpuBlockConfig):
    name = "int8"

    def linear_method(self, prefix: str, layer: nn.Module) -> Optional[LinearMethod]:
        return OnlineBlockMethod("q8_0") if _block_ready(layer) else None


class Int4QuantConfig(_CpuBlockConfig):
    name = "int4"

    def linear_method(self, prefix: str, layer: nn.Module) -> Optional[LinearMethod]:
        return OnlineBlockMethod("q4_1") if _block_ready(layer) else None


class GGUFQuantConfig(_CpuBlockConfig):
    """tensor_types: HF tensor name -> GGML type name ('Q4_1', 'F32', ...), read from
    the file before the model is built (pagoda.model.loader.gguf.gguf_tensor_types).
    raw_tensor_names() lists the tensors the loader must hand over as raw blocks: those
    of the layers linear_method gave a block method."""

    name = "gguf"

    def __init__(self, tensor_types: Mapping[str, str]) -> None:
        self.tensor_types = dict(tensor_types)
        self._raw: set[str] = set()

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> "GGUFQuantConfig":
        from pagoda.model.loader import find_gguf_file
        from pagoda.model.loader.gguf import FastGGUFReader, gguf_tensor_types

        file = find_gguf_file(Path(path))
        if file is None:
            raise ValueError(f"--quantization gguf keeps a GGUF file's blocks, but {path} is "
                             f"not a .gguf file (nor a directory holding one); for a float "
                             f"checkpoint use --quantization int8 or int4")
        return cls(gguf_tensor_types(FastGGUFReader(str(file))))

    def tensor_names(self, prefix: str) -> list[str]:
        """The checkpoint weights merged into the layer named prefix."""
        parent, _, leaf = prefix.rpartition(".")
        parts = _MERGED.get(leaf, (leaf,))
        return [f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in parts]

    def linear_method(self, prefix: str, layer: nn.Module) -> Optional[LinearMethod]:
        names = self.tensor_names(prefix)
        types = {self.tensor_types.get(n) for n in names}
        if len(types) != 1 or None in types or not _block_ready(layer):
            return None  # mixed or unknown types: this layer stays float
        ggml_type = types.pop()
        if ggml_type not in GGUFBlockMethod._KIND:
            return None  # K-quants, F16, F32: dequantized to float
        self._raw.update(names)
        return GGUFBlockMethod(ggml_type)

    def raw_tensor_names(self) -> frozenset[str]:
        return frozenset(self._raw)
