"""CPU weight-only quantization schemes ``int8`` and ``int4`` (online, from a float
checkpoint or dummy weights), and what they share with ``gguf`` (gguf_quant.py: a GGUF
file's own Q4_0/Q4_1/Q8_0 blocks, kept quantized).

Every scheme stores a layer's weight as GGUF-style blocks of 32 input columns
(pagoda.model.quant.cpu_kernels: layouts, kernel, reference) in ``layer.weight``,
uint8 [out_per_rank, in_per_rank / 32, bytes per block] (the checkpoint's name, so raw
GGUF blocks load into it like any weight):
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
(ParallelLMHead hands the method a copy; the embedding keeps the float weight). Q4
heads cost quality; a Q8_0 embedding (the embedded SmolLM2's) re-quantizes exactly.

These are CPU methods: on a GPU the schemes refuse to run (use fp8 there).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.quant.base import (
    WEIGHT_DIMS,
    LinearMethod,
    QuantConfig,
    ShardDims,
    replace_parameter,
)
from pagoda.model.quant.cpu_kernels import BLOCK_BYTES, QK, blocks_mm, quantize_q4_1, quantize_q8_0

# A blocks tensor [out, in / 32, bytes]: rows follow the output, blocks the input.
BLOCK_DIMS = ShardDims(output_dim=0, input_dim=1, input_block=QK)


def apply_blocks(
    layer: nn.Module, x: torch.Tensor, kind: str, bias: torch.Tensor | None
) -> torch.Tensor:
    shape = x.shape
    y = blocks_mm(
        x.reshape(-1, shape[-1]).to(torch.float32), layer.weight, kind, layer.cpu_blocks_config
    )
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])


def _check_cpu(name: str, device: torch.device) -> None:
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"--quantization {name} is a CPU method (its kernel is x86 AVX2); "
            f"on a {torch.device(device).type} device use --quantization fp8"
        )


class OnlineBlockMethod(LinearMethod):
    """Quantizes a float weight into blocks after loading (float checkpoints, dummy
    weights, the LM head); the blocks replace the float weight."""

    def __init__(self, kind: str) -> None:
        if kind not in BLOCK_BYTES:
            raise ValueError(f"unknown block kind {kind!r}")
        self.kind = kind
        self.name = f"{kind}-online"

    def create_weights(
        self, layer: nn.Module, in_per_rank: int, out_per_rank: int, num_shards: int
    ) -> None:
        if in_per_rank % QK:
            raise ValueError(
                f"{self.kind} needs in_features per rank divisible by {QK}, got {in_per_rank}"
            )
        layer.register_weight("weight", torch.empty(out_per_rank, in_per_rank), WEIGHT_DIMS)

    def weight_format(self, layer: nn.Module) -> str:
        return self.kind.upper()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if weight.shape[-1] % QK:
            raise ValueError(
                f"{self.kind} needs in_features divisible by {QK}, got {weight.shape[-1]}"
            )
        quantize = quantize_q8_0 if self.kind == "q8_0" else quantize_q4_1
        replace_parameter(layer, "weight", quantize(weight.data.float().cpu()))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return apply_blocks(layer, x, self.kind, bias)


class CpuBlockConfig(QuantConfig):
    """What int8, int4 and gguf share: CPU only, a Q8_0 LM head, float activations."""

    def lm_head_method(self) -> LinearMethod | None:
        return OnlineBlockMethod("q8_0")

    def check_device(self, device: torch.device) -> None:
        _check_cpu(self.name, device)

    def check_model_dtype(self, dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"--quantization {self.name} needs float activations, got {dtype}")


def block_ready(layer: nn.Module) -> bool:
    return getattr(layer, "in_per_rank", 0) % QK == 0


class Int8QuantConfig(CpuBlockConfig):
    name = "int8"

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        return OnlineBlockMethod("q8_0") if block_ready(layer) else None


class Int4QuantConfig(CpuBlockConfig):
    name = "int4"

    def linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        return OnlineBlockMethod("q4_1") if block_ready(layer) else None
