"""SiluAndMul: the gated activation of Llama-style MLPs.

On CUDA (unless PAGODA_FUSED_OPS=0) a Triton kernel of pagoda.kernels.norm.fused_ops does
it in one launch; the torch code here is its reference and the CPU path.
``forward(x, fp8_out=True)`` gives the result quantized per token as an
``Fp8Activation`` (for an FP8 down_proj that asked for it): on CUDA one kernel of
pagoda.kernels.fp8.fused_quant (the same bytes as silu_and_mul followed by
per_token_quant_fp8), elsewhere that composition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.quant.base import Fp8Activation

# Devices whose fp8_out runs the fused kernel (tests add "cpu": Triton's interpreter).
FUSED_FP8_DEVICES = ("cuda",)


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up (half the width)."""

    def forward(self, x: torch.Tensor, fp8_out: bool = False):
        """-> [..., I] in x's dtype; fp8_out: an Fp8Activation of its rows [M, I]."""
        if fp8_out:
            return self._forward_fp8(x)
        if x.is_cuda:
            from pagoda.kernels.norm import fused_ops  # imports triton: CUDA only

            if fused_ops.FUSED_OPS_ENABLED:
                return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place on silu's fresh output: one buffer less

    def _forward_fp8(self, x: torch.Tensor) -> Fp8Activation:
        if x.device.type in FUSED_FP8_DEVICES:
            from pagoda.kernels.fp8 import (
                fused_quant as fp8_fused_quant,  # imports triton: CUDA only
            )
            from pagoda.kernels.norm import fused_ops

            if fused_ops.FUSED_OPS_ENABLED:
                data, scale = fp8_fused_quant.silu_and_mul_fp8(x)
                return Fp8Activation(data, scale, x.dtype)
        return Fp8Activation.quantize(self.forward(x))
