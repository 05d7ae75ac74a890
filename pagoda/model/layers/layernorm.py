"""RMSNorm with an optional fused residual add, numerically matching Hugging Face's.

HF order of operations (kept exactly): add the residual in the input dtype, normalise
in float32, cast back to the input dtype, then multiply by the weight. On CUDA (unless
PAGODA_FUSED_OPS=0) the Triton kernels of pagoda.kernels.norm.fused_ops do the same in one
launch; the torch code here is their reference and the CPU path. On the CPU, float32
takes ``torch.rms_norm`` (F.rms_norm without its Python wrapper): ATen's composite
runs the very same ops in the same order (pow, mean, add eps, rsqrt, multiply,
multiply by the weight) in C++, so the bits are the same and a decode step saves ~6
Python-dispatched ops per norm (61 norms per step for SmolLM2);
tests/model/test_cpu_fused_ops.py asserts the equality.

``forward(..., fp8_out=True)`` gives the normed rows quantized per token as an
``Fp8Activation`` (what an FP8 linear that asked for it multiplies): on CUDA one kernel
of pagoda.kernels.fp8.fused_quant (the same bytes as the norm kernel followed by
per_token_quant_fp8), elsewhere that composition.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.layers.linear import default_weight_loader
from pagoda.model.quant.base import Fp8Activation

NormOutput = torch.Tensor | Fp8Activation
# Devices whose fp8_out runs the fused kernel (tests add "cpu": Triton's interpreter).
FUSED_FP8_DEVICES = ("cuda",)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.normalized_shape = (hidden_size,)
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Tensor flags and one parameter lookup only: on a decode step this runs 61 times
        # and nn.Module attribute lookups cost about a microsecond each.
        weight = self.weight
        if x.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32:
            return torch.rms_norm(x, self.normalized_shape, weight, self.eps)
        return self._normalize_reference(x)

    def _normalize_reference(self, x: torch.Tensor) -> torch.Tensor:
        # The casts are skipped when x is float32 already (same values, fewer torch calls).
        xf = x if x.dtype == torch.float32 else x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        normed = xf * torch.rsqrt(variance + self.eps)
        return self.weight * (normed if normed.dtype == x.dtype else normed.to(x.dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8_out: bool = False
    ) -> NormOutput | tuple[NormOutput, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual). fp8_out:
        norm(...) comes as an Fp8Activation of its rows [numel / hidden, hidden]."""
        if fp8_out:
            return self._forward_fp8(x, residual)
        if x.is_cuda:
            from pagoda.kernels.norm import fused_ops  # imports triton: CUDA only

            if fused_ops.FUSED_OPS_ENABLED:
                if residual is None:
                    return fused_ops.rms_norm(x, self.weight, self.eps)
                return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._normalize(x)
        summed = x + residual
        return self._normalize(summed), summed

    def _forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> Fp8Activation | tuple[Fp8Activation, torch.Tensor]:
        if x.device.type in FUSED_FP8_DEVICES:
            from pagoda.kernels.fp8 import (
                fused_quant as fp8_fused_quant,  # imports triton: CUDA only
            )
            from pagoda.kernels.norm import fused_ops

            if fused_ops.FUSED_OPS_ENABLED:
                data, scale, summed = fp8_fused_quant.rms_norm_fp8(
                    x, self.weight, self.eps, residual
                )
                _, dtype = fp8_fused_quant.norm_dtypes(x, self.weight, residual)
                out = Fp8Activation(data, scale, dtype)
                return out if residual is None else (out, summed)
        if residual is None:
            return Fp8Activation.quantize(self.forward(x))
        normed, summed = self.forward(x, residual)
        return Fp8Activation.quantize(normed), summed
