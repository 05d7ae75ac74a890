"""SiluAndMul: the gated activation of Llama-style MLPs.

On CUDA (unless PAGODA_FUSED_OPS=0) a Triton kernel of pagoda.kernels.fused_ops does
it in one launch; the torch code here is its reference and the CPU path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up (half the width)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagoda.kernels import fused_ops  # imports triton: CUDA only
            if fused_ops.FUSED_OPS_ENABLED:
                return fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place on silu's fresh output: one buffer less
