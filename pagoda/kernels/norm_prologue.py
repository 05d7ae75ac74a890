"""An RMSNorm (with its residual add) computed inside the one-row GEMV that consumes it.

At batch 1 a decoder layer's input_layernorm and post_attention_layernorm are kernels
of their own between two GEMVs: each reads a [1, hidden] row and its residual, writes
the normed row and the summed residual, and the GEMV after it reads the normed row
back. The GEMVs of a decode step are bound by their weight bytes; the norm's own cost
is its launch and its chain of dependent loads. Here every program of the GEMV
normalises the row itself (the row and the residual are a few KB, read from L2 by each
program): one launch less per norm.

Owns:
- ``RowNorm``: what a fused GEMV needs of the norm (the residual row, the norm weight,
  eps, and the buffer it writes x + residual into); ``row_norm_for`` builds one where
  the fusion applies, else None;
- the Triton helpers the GEMV kernels call: ``row_inv_rms`` (the prologue: the row's
  inverse RMS, and the summed residual stored by one program) and ``normed_chunk``
  (a chunk of the normed row, as the GEMV's K loop reads x);
- ``add_rms_norm_ref``: the torch reference (what RMSNorm computes).

Roundings are the norm kernel's (pagoda.kernels.fused_ops, itself HF's order): x +
residual rounded to the row dtype, the sum of squares of the rounded values in float32,
normed = (summed * inv_rms) rounded to the row dtype, times the weight, rounded again.
So the fused GEMV multiplies the very values the unfused norm would have written, up to
the float32 order of the sum of squares.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

# PAGODA_NORM_INTO_GEMV=0 keeps the norm a kernel of its own (for A/B measurements).
ENABLED = os.environ.get("PAGODA_NORM_INTO_GEMV", "1") != "0"
# Widest row the prologue holds in registers at once (hidden sizes of common models).
MAX_HIDDEN = 8192


@dataclass(frozen=True)
class RowNorm:
    """The RMSNorm of x + residual by weight, for a fused GEMV of one row x [1, K]:
    residual [1, K] and weight [K] in x's dtype, contiguous; summed [1, K] receives x +
    residual (the residual stream the layer carries on)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    summed: torch.Tensor

    def kernel_args(self) -> tuple:
        """(residual, weight, summed, eps): the fused kernels' norm arguments."""
        return self.residual, self.weight, self.summed, float(self.eps)

    @property
    def block(self) -> int:
        """The prologue's register block (the NORM_BLOCK constexpr)."""
        return triton.next_power_of_2(self.weight.shape[0])


def row_norm_for(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> Optional[RowNorm]:
    """A RowNorm for x [1, K] where the fusion applies (enabled, one row, residual and
    weight of x's dtype and shape, K <= MAX_HIDDEN); None otherwise (the caller runs
    the norm and the GEMV apart)."""
    if not ENABLED or residual is None or x.dim() != 2 or x.shape[0] != 1:
        return None
    k = x.shape[1]
    if (residual.shape != x.shape or weight.shape != (k,) or k > MAX_HIDDEN
            or residual.dtype != x.dtype or weight.dtype != x.dtype
            or not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous())):
        return None
    return RowNorm(residual, weight, eps, torch.empty_like(x))


@triton.jit
def row_inv_rms(x_ptr, r_ptr, summed_ptr, K, eps, write_summed, NORM_BLOCK: tl.constexpr):
    """1 / rms(x + residual) of the row (float32 scalar); where write_summed (one
    program of the launch) it also stores x + residual, rounded to x's dtype, to
    summed_ptr. Call after the PDL wait: it loads what the kernel before produced."""
    offs = tl.arange(0, NORM_BLOCK)
    ok = offs < K
    summed = (tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
              + tl.load(r_ptr + offs, mask=ok, other=0.0).to(tl.float32))
    summed = summed.to(x_ptr.dtype.element_ty)
    if write_summed:
        tl.store(summed_ptr + offs, summed, mask=ok)
    summed = summed.to(tl.float32)
    return tl.rsqrt(tl.sum(summed * summed, axis=0) / K + eps)


@triton.jit
def normed_chunk(x_ptr, r_ptr, w_ptr, offs, mask, inv_rms, MASKED: tl.constexpr):
    """float32 values of the normed row at offs (rounded as the norm kernel stores
    them); MASKED: offs may run past the row (masked lanes give 0)."""
    if MASKED:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs).to(tl.float32)
        r = tl.load(r_ptr + offs).to(tl.float32)
        w = tl.load(w_ptr + offs).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    summed = (x + r).to(dtype).to(tl.float32)
    normed = (summed * inv_rms).to(dtype).to(tl.float32)
    return (w * normed).to(dtype).to(tl.float32)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, x + residual) as pagoda.model.layers.layernorm.RMSNorm computes them."""
    summed = x + residual
    sf = summed.float()
    normed = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, summed
