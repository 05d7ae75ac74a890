"""Rotary position embedding (HF rotate_half / neox layout) with optional llama3 scaling.

One RotaryEmbedding serves every layer of a model: the model looks up cos/sin for the
step's positions once, and each attention layer applies them to q and k. The cache
holds cos and sin of every position below max_position in float32, half the head
dim wide (the two halves of a head share a frequency); it is a non-persistent buffer,
rebuilt by ``reset_cache`` after a model built on the meta device is materialised.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """1 / base^(2i / head_dim) for i < head_dim / 2, in float32 on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    the band in between interpolated smoothly between the two."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # smooth = 0 at the low-frequency edge (fully scaled), 1 at the high one (unscaled).
    smooth = (original_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    in_band = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_band, interpolated, scaled)


def compute_inv_freq(head_dim: int, base: float, scaling: Optional[dict]) -> torch.Tensor:
    inv_freq = default_inv_freq(head_dim, base)
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") != "llama3":
        raise ValueError(f"unsupported rope_scaling type {scaling.get('rope_type')!r}; "
                         f"supported: default, llama3")
    return llama3_inv_freq(inv_freq, scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: Optional[dict] = None) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim, self.max_position = head_dim, max_position
        self.base, self.scaling = base, scaling
        self.register_buffer("cos_cache", torch.empty(max_position, head_dim // 2),
                             persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_position, head_dim // 2),
                             persistent=False)
        if self.cos_cache.device.type != "meta":
            self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)computes cos/sin on the buffers' device, in float32."""
        device = self.cos_cache.device
        inv_freq = compute_inv_freq(self.head_dim, self.base, self.scaling).to(device)
        positions = torch.arange(self.max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.cos_cache = freqs.cos()
        self.sin_cache = freqs.sin()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for the given positions, each [T, head_dim // 2] float32."""
        return self.cos_cache[positions].float(), self.sin_cache[positions].float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D/2] in float32 (rotate_half layout: the first
    and second halves of each head form the pairs); returns x's dtype. On CUDA (unless
    PAGODA_FUSED_OPS=0) a Triton kernel does it; this torch code is its reference."""
    if x.is_cuda:
        from pagoda.kernels import fused_ops  # imports triton: CUDA only
        if fused_ops.FUSED_OPS_ENABLED:
            return fused_ops.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    xf = x if x.dtype == torch.float32 else x.float()  # no no-op casts: CPU decode pays per op
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)
