"""The default linear method: one float weight [out, in] in the model's dtype, multiplied
by ``pagoda.model.quant.cpu_kernels.rows_linear`` (F.linear, split into column blocks on the
CPU; a register-tile kernel for steps of a few rows there). On CUDA, steps of a few bf16 /
fp16 rows whose shape the layer's GemvConfig lists (``layer.gemv_config``, set by the
model runner; pagoda.kernels.gemv.config) take the Triton GEMV instead
(PAGODA_TRITON_GEMV=0 turns it off)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.quant.base import WEIGHT_DIMS, LinearMethod
from pagoda.model.quant.cpu_kernels import rows_linear

# Devices whose steps may take the Triton GEMV. Its module is imported on first use there,
# so CPU-only runs never load triton. (Tests add "cpu": the kernel's interpreter.)
GEMV_DEVICES = ("cuda",)
_maybe_gemv = None  # pagoda.kernels.gemv.gemv.maybe_gemv once imported (no import per call)


def _gemv_router():
    global _maybe_gemv
    if _maybe_gemv is None:
        from pagoda.kernels.gemv.gemv import maybe_gemv  # Triton: CUDA only

        _maybe_gemv = maybe_gemv
    return _maybe_gemv


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def create_weights(
        self, layer: nn.Module, in_per_rank: int, out_per_rank: int, num_shards: int
    ) -> None:
        layer.register_weight("weight", torch.empty(out_per_rank, in_per_rank), WEIGHT_DIMS)

    def weight_format(self, layer: nn.Module) -> str:
        return str(layer.weight.dtype).removeprefix("torch.")

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.device.type in GEMV_DEVICES:
            # None unless tuned faster than cuBLAS at this shape.
            y = _gemv_router()(x, layer.weight, bias, layer.gemv_config)
            if y is not None:
                return y
        return rows_linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()
