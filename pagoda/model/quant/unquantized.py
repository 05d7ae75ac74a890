"""The default linear method: one float weight [out, in] in the model's dtype, multiplied
by ``pagoda.model.layers.matmul.rows_linear`` (F.linear, split into column blocks on the
CPU; a register-tile kernel for steps of a few rows there). On CUDA, steps of a few bf16 /
fp16 rows whose shape pagoda.kernels.gemv.GEMV_CONFIGS lists take that Triton GEMV
instead (PAGODA_TRITON_GEMV=0 turns it off); at one row that GEMV may also compute the
RMSNorm before it (``apply_rms_norm``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagoda.model.layers.matmul import rows_linear
from pagoda.model.quant.base import WEIGHT_DIMS, LinearMethod

# Devices whose steps may take the Triton GEMV. Its module is imported on first use there,
# so CPU-only runs never load triton. (Tests add "cpu": the kernel's interpreter.)
GEMV_DEVICES = ("cuda",)
_gemv_module = None  # pagoda.kernels.gemv once imported (no import per call)


def _gemv_kernels():
    global _gemv_module
    if _gemv_module is None:
        from pagoda.kernels import gemv
        _gemv_module = gemv
    return _gemv_module


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int,
                       num_shards: int) -> None:
        layer.register_weight("weight", torch.empty(out_per_rank, in_per_rank), WEIGHT_DIMS)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.device.type in GEMV_DEVICES:
            y = _gemv_kernels().maybe_gemv(x, layer.weight, bias)  # None unless tuned
            if y is not None:                                      # faster than cuBLAS
                return y
        return rows_linear(x, layer.weight, bias)

    def apply_rms_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                       norm_weight: torch.Tensor, eps: float, bias: Optional[torch.Tensor],
                       silu_and_mul: bool = False
                       ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The Triton GEMV with the norm in its prologue, for one row of a shape the GEMV
        takes (no gated bf16 GEMV: silu_and_mul gives None)."""
        if silu_and_mul or x.device.type not in GEMV_DEVICES:
            return None
        return _gemv_kernels().maybe_gemv_rms_norm(x, residual, norm_weight, eps,
                                                   layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()
