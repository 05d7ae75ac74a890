"""Triton kernel that writes this step's K/V rows into the paged KV cache.

Owns `store_kv`: row j of k/v ([num_tokens, num_kv_heads, head_dim]) goes to slot
slot_mapping[j] = block_id * block_size + offset of the cache
[2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V). Rows whose
slot is -1 are padding (a CUDA graph run at a padded size) and write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head,
    PAGE_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
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
    dst = (block * stride_cache_block + offset * stride_cache_tok
           + heads[:, None] * stride_cache_head + dims[None, :])
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_cache_kv + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes k/v [num_tokens, num_kv_heads, head_dim] into kv_cache at slot_mapping."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != tuple(k.shape[1:]):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {k.shape[1]}, {k.shape[2]}], "
                         f"got {tuple(kv_cache.shape)}")
    if slot_mapping.shape[0] < k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} rows")
    if k.stride(2) != 1 or v.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("k, v and kv_cache need a contiguous last (head_dim) dimension")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        PAGE_SIZE=kv_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
    )
