"""Rotary position embedding (HF rotate_half / neox layout) with optional llama3 or
YaRN scaling.

One RotaryEmbedding serves every layer of a model: the model looks up cos/sin for the
step's positions once, and each attention layer applies them to q and k. The cache
holds cos and sin of every position below max_position in float32, half the head
dim wide (the two halves of a head share a frequency); it is a non-persistent buffer,
rebuilt by ``reset_cache`` after a model built on the meta device is materialised.

YaRN (as transformers computes it) blends interpolated and extrapolated frequencies
along a linear ramp between two correction dimensions and multiplies cos and sin by an
attention factor (mscale / mscale_all_dim). Checkpoints that rotate interleaved pairs
(DeepSeek) have their weight rows permuted at load time (``interleaved_to_half``) so
that this one layout serves them too.

On the CPU a forward may instead turn (cos, sin) once into full-width tables
(``rotary_tables``) that every layer applies with four torch calls
(``apply_rotary_tables``) instead of seven: same arithmetic, same bits.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagoda.model.mla_config import yarn_mscale


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """1 / base^(2i / head_dim) for i < head_dim / 2, in float32 on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


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


def yarn_attention_factor(scaling: dict) -> float:
    """The factor cos and sin are multiplied by: attention_factor when given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
    mscale(factor)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_inv_freq(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN frequencies: dimensions rotating more than beta_fast times over the original
    context keep their frequency, those rotating fewer than beta_slow times are divided
    by factor, a linear ramp blends the ones between (bounds rounded out unless
    truncate is false)."""
    factor = float(scaling["factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (
            head_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = default_inv_freq(head_dim, base)
    interpolated = extrapolated / factor
    keep = 1 - ramp  # 1 where the original frequency is kept
    return interpolated * (1 - keep) + extrapolated * keep


def compute_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    if scaling is None:
        return default_inv_freq(head_dim, base)
    rope_type = scaling.get("rope_type")
    if rope_type == "llama3":
        return llama3_inv_freq(default_inv_freq(head_dim, base), scaling)
    if rope_type == "yarn":
        return yarn_inv_freq(head_dim, base, scaling)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: default, llama3, yarn"
    )


def attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by (YaRN's magnitude correction; else 1)."""
    if scaling is not None and scaling.get("rope_type") == "yarn":
        return yarn_attention_factor(scaling)
    return 1.0


def interleaved_to_half(
    weight: torch.Tensor, rotary_dim: int, row_start: int, group: int
) -> torch.Tensor:
    """Weight rows reordered for a checkpoint that rotates adjacent pairs (2i, 2i+1):
    in every group of `group` rows, the rotary_dim rows starting at row_start become
    [even rows, odd rows], the half-split layout apply_rotary rotates. Only q.k dot
    products see these rows, and q and k are permuted alike, so attention is unchanged."""
    rows = weight.shape[0]
    if rows % group or row_start + rotary_dim > group:
        raise ValueError(
            f"cannot permute rotary rows [{row_start}, {row_start + rotary_dim}) "
            f"in groups of {group} of a {rows}-row weight"
        )
    order = torch.arange(rows, device=weight.device).view(rows // group, group)
    seg = order[:, row_start : row_start + rotary_dim]
    order[:, row_start : row_start + rotary_dim] = torch.cat((seg[:, 0::2], seg[:, 1::2]), dim=1)
    return weight.index_select(0, order.flatten())


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim, self.max_position = head_dim, max_position
        self.base, self.scaling = base, scaling
        self.register_buffer(
            "cos_cache", torch.empty(max_position, head_dim // 2), persistent=False
        )
        self.register_buffer(
            "sin_cache", torch.empty(max_position, head_dim // 2), persistent=False
        )
        if self.cos_cache.device.type != "meta":
            self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)computes cos/sin on the buffers' device, in float32."""
        device = self.cos_cache.device
        inv_freq = compute_inv_freq(self.head_dim, self.base, self.scaling).to(device)
        positions = torch.arange(self.max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        factor = attention_factor(self.scaling)
        self.cos_cache = freqs.cos() * factor
        self.sin_cache = freqs.sin() * factor

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for the given positions, each [T, head_dim // 2] float32."""
        return self.cos_cache[positions].float(), self.sin_cache[positions].float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, D/2] in float32 (rotate_half layout: the first
    and second halves of each head form the pairs); returns x's dtype. On CUDA (unless
    PAGODA_FUSED_OPS=0) a Triton kernel does it; this torch code is its reference."""
    if x.is_cuda:
        from pagoda.kernels.norm import fused_ops  # imports triton: CUDA only

        if fused_ops.FUSED_OPS_ENABLED:
            return fused_ops.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    xf = x if x.dtype == torch.float32 else x.float()  # no no-op casts: CPU decode pays per op
    x1, x2 = xf[..., :half], xf[..., half:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, D/2] -> full-width tables ([cos | cos], [-sin | sin]), each
    [T, 1, D] float32, built once per forward for ``apply_rotary_tables``."""
    return (
        torch.cat((cos, cos), dim=-1).unsqueeze(1),
        torch.cat((sin.neg(), sin), dim=-1).unsqueeze(1),
    )


def apply_rotary_tables(
    x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor
) -> torch.Tensor:
    """apply_rotary with rotary_tables' tables (the CPU path): x * [cos | cos] +
    [x2 | x1] * [-sin | sin]. Bit-identical to apply_rotary: x2 * -sin is exactly
    -(x2 * sin) and a + -b is exactly a - b (IEEE rounding is symmetric); each element
    is still one product or two products and one add, never fused into an FMA."""
    half = x.shape[-1] // 2
    xf = x if x.dtype == torch.float32 else x.float()
    swapped = xf.roll(half, dims=-1)  # [x2 | x1]: one call (slicing and cat took three)
    rotated = (xf * cos_full).add_(swapped.mul_(sin_signed))
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)
