"""Triton kernels that write this step's MLA latent rows into the paged latent cache.

Owns `store_latent`: row j of latent ([num_tokens, entry_size]: the normalised
compressed KV, then the rotated key part) goes to slot slot_mapping[j] = block_id *
block_size + offset of the cache [num_blocks, block_size, entry_size]. Rows whose slot
is -1 are padding (a CUDA graph run at a padded size) and write nothing, decided on
the device, so the write can be captured in a graph.

And `norm_rope_store_latent`: the same write, but from the raw kv_a_proj_with_mqa
output [c | k_rope]: RMSNorm of c (kv_a_layernorm) and the rotary of k_rope in the
kernel, so a decode step's latent costs one launch instead of five (a contiguous copy
of c, the norm, the rotary, the cat, the store). Roundings as the unfused CUDA path
(pagoda.kernels.norm.fused_ops' rms_norm and rotary): the norm in float32, the normalised row
rounded to the dtype, times the weight, rounded; the rotary in float32 on the rounded
k_rope, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_latent_kernel(
    latent_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_lt,
    stride_cache_block,
    stride_cache_tok,
    PAGE_SIZE: tl.constexpr,
    ENTRY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row)
    if slot < 0:
        return
    dims = tl.arange(0, BLOCK)
    mask = dims < ENTRY
    values = tl.load(latent_ptr + row * stride_lt + dims, mask=mask)
    dst = (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_tok
    tl.store(cache_ptr + dst + dims, values.to(cache_ptr.dtype.element_ty), mask=mask)


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes latent [num_tokens, entry_size] into cache at slot_mapping (-1: skipped)."""
    if latent.dim() != 2 or cache.dim() != 3 or cache.shape[2] != latent.shape[1]:
        raise ValueError(
            f"latent must be [num_tokens, E] and cache [num_blocks, block_size, E], "
            f"got {tuple(latent.shape)} and {tuple(cache.shape)}"
        )
    if slot_mapping.shape[0] < latent.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {latent.shape[0]} rows"
        )
    if latent.stride(1) != 1 or cache.stride(2) != 1:
        raise ValueError("latent and cache need a contiguous last dimension")
    if latent.shape[0] == 0:
        return
    entry = latent.shape[1]
    _store_latent_kernel[(latent.shape[0],)](
        latent,
        cache,
        slot_mapping,
        latent.stride(0),
        cache.stride(0),
        cache.stride(1),
        PAGE_SIZE=cache.shape[1],
        ENTRY=entry,
        BLOCK=triton.next_power_of_2(entry),
    )


@triton.jit
def _norm_rope_store_kernel(
    kv_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    slot_mapping_ptr,
    eps,
    stride_kv,
    stride_cos,
    stride_sin,
    stride_cache_block,
    stride_cache_tok,
    PAGE_SIZE: tl.constexpr,
    RANK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row)
    if slot < 0:
        return
    dtype = kv_ptr.dtype.element_ty
    src = kv_ptr + row * stride_kv
    dst = (
        cache_ptr + (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_tok
    )
    dims = tl.arange(0, BLOCK_C)
    c_ok = dims < RANK
    c = tl.load(src + dims, mask=c_ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(c * c, axis=0) / RANK + eps)
    normed = (c * inv_rms).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + dims, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(dst + dims, (weight * normed).to(cache_ptr.dtype.element_ty), mask=c_ok)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    x1 = tl.load(src + RANK + j, mask=j_ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + RANK + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + row * stride_cos + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_sin + j, mask=j_ok, other=0.0).to(tl.float32)
    out_dtype = cache_ptr.dtype.element_ty
    tl.store(dst + RANK + j, (x1 * cos - x2 * sin).to(dtype).to(out_dtype), mask=j_ok)
    tl.store(dst + RANK + HALF + j, (x2 * cos + x1 * sin).to(dtype).to(out_dtype), mask=j_ok)


def norm_rope_store_latent(
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """kv_a [T, kv_lora_rank + rope] (the projection's output, rows may be strided),
    norm_weight [kv_lora_rank], cos / sin [T, rope / 2] -> [norm(c), rope(k_rope)]
    written into cache [num_blocks, block_size, kv_lora_rank + rope] at slot_mapping
    (-1: skipped)."""
    num_tokens, entry = kv_a.shape
    rank = norm_weight.shape[0]
    half = (entry - rank) // 2
    if cache.dim() != 3 or cache.shape[2] != entry or entry - rank != 2 * half or half < 1:
        raise ValueError(
            f"kv_a {tuple(kv_a.shape)}, norm weight [{rank}] and cache "
            f"{tuple(cache.shape)} disagree"
        )
    if cos.shape != (num_tokens, half) or sin.shape != cos.shape:
        raise ValueError(f"cos / sin must be [{num_tokens}, {half}], got {tuple(cos.shape)}")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} rows")
    if kv_a.stride(1) != 1 or cache.stride(2) != 1 or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("kv_a, cos, sin and cache need a contiguous last dimension")
    if num_tokens == 0:
        return
    block_c = triton.next_power_of_2(rank)
    _norm_rope_store_kernel[(num_tokens,)](
        kv_a,
        norm_weight.contiguous(),
        cos,
        sin,
        cache,
        slot_mapping,
        float(eps),
        kv_a.stride(0),
        cos.stride(0),
        sin.stride(0),
        cache.stride(0),
        cache.stride(1),
        PAGE_SIZE=cache.shape[1],
        RANK=rank,
        HALF=half,
        BLOCK_C=block_c,
        BLOCK_HALF=max(2, triton.next_power_of_2(half)),
        num_warps=4 if block_c >= 512 else 1,
    )
