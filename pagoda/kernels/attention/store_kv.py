"""Triton kernel that writes this step's K/V rows into the paged KV cache.

Owns `store_kv`: row j of k/v ([num_tokens, num_kv_heads, head_dim]) goes to slot
slot_mapping[j] = block_id * block_size + offset of the cache
[2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V). Rows whose
slot is -1 are padding (a CUDA graph run at a padded size) and write nothing.

FP8 cache (float8 e4m3, kv_cache_dtype fp8): K rows are divided by kv_scales[0], V rows
by kv_scales[1], clamped to +-448 and rounded to e4m3, bit-exact with the torch
reference (attention/kv_quant.py quantize_kv). The rounding is done in float32 first
(`round_to_e4m3`), so the final cast is exact whatever rounding the hardware cast (or
Triton's interpreter, whose float8 cast mis-rounds values that carry into the next
power of two) applies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(y):
    """float32 y with |y| <= 448 -> the nearest float8 e4m3 value (ties to even), still
    in float32. The e4m3 grid around y has step 2^(e - 3) for a normal y of exponent e
    (e >= -6), 2^-9 below (subnormals): scale by the step's inverse (a power of two:
    exact), round to an integer with the 1.5 * 2^23 trick (exact for |m| < 2^22), scale
    back."""
    biased = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF  # float32 exponent, bias 127
    step_exp = tl.maximum(biased, 127 - 6) - 3  # biased exponent of the grid step
    inv_step = ((254 - step_exp) << 23).to(tl.float32, bitcast=True)
    step = (step_exp << 23).to(tl.float32, bitcast=True)
    m = y * inv_step  # |m| < 16
    m = (m + 12582912.0) - 12582912.0
    return tl.where(m == 0.0, y * 0.0, m * step)  # y * 0.0 keeps the sign of a zero


@triton.jit
def quantize_e4m3(x, scale):
    """x / scale as float8 e4m3 (see the module docstring)."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    # 448: e4m3's largest finite value. NaN stays NaN, as in torch's clamp.
    y = tl.clamp(y, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return round_to_e4m3(y).to(tl.float8e4nv)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_mapping_ptr,
    kv_scales_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # One program per token row: all of its heads at once.
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_DIM)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + row * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + row * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = (
        block * stride_cache_block
        + offset * stride_cache_tok
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    if KV_FP8:
        k = quantize_e4m3(k, tl.load(kv_scales_ptr))
        v = quantize_e4m3(v, tl.load(kv_scales_ptr + 1))
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_cache_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def check_kv_scales(kv_scales: torch.Tensor | None, kv_cache: torch.Tensor) -> None:
    """An FP8 cache's kernels read float32 [k_scale, v_scale] on the cache's device."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return
    if kv_scales is None:
        raise ValueError("an FP8 KV cache needs kv_scales (float32 [k_scale, v_scale])")
    if (
        kv_scales.shape != (2,)
        or kv_scales.dtype != torch.float32
        or kv_scales.device != kv_cache.device
    ):
        raise ValueError(
            f"kv_scales must be float32 [2] on {kv_cache.device}, got "
            f"{kv_scales.dtype} {tuple(kv_scales.shape)} on {kv_scales.device}"
        )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Writes k/v [num_tokens, num_kv_heads, head_dim] into kv_cache at slot_mapping.
    An FP8 cache needs kv_scales (float32 [k_scale, v_scale] on the device)."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            f"k and v must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or tuple(kv_cache.shape[3:]) != tuple(k.shape[1:])
    ):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {k.shape[1]}, {k.shape[2]}], "
            f"got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.shape[0] < k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} rows")
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("k, v and kv_cache need a contiguous last (head_dim) dimension")
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    check_kv_scales(kv_scales, kv_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_scales if kv_fp8 else slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        PAGE_SIZE=kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
        KV_FP8=kv_fp8,
    )
