"""Triton kernel that writes this step's MLA latent rows into the paged latent cache.

Owns `store_latent`: row j of latent ([num_tokens, entry_size]: the normalised
compressed KV, then the rotated key part) goes to slot slot_mapping[j] = block_id *
block_size + offset of the cache [num_blocks, block_size, entry_size]. Rows whose slot
is -1 are padding (a CUDA graph run at a padded size) and write nothing, decided on
the device, so the write can be captured in a graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_latent_kernel(
    latent_ptr, cache_ptr, slot_mapping_ptr, stride_lt, stride_cache_block, stride_cache_tok,
    PAGE_SIZE: tl.constexpr, ENTRY: tl.constexpr, BLOCK: tl.constexpr,
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
        raise ValueError(f"latent must be [num_tokens, E] and cache [num_blocks, block_size, E], "
                         f"got {tuple(latent.shape)} and {tuple(cache.shape)}")
    if slot_mapping.shape[0] < latent.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{latent.shape[0]} rows")
    if latent.stride(1) != 1 or cache.stride(2) != 1:
        raise ValueError("latent and cache need a contiguous last dimension")
    if latent.shape[0] == 0:
        return
    entry = latent.shape[1]
    _store_latent_kernel[(latent.shape[0],)](
        latent, cache, slot_mapping, latent.stride(0), cache.stride(0), cache.stride(1),
        PAGE_SIZE=cache.shape[1], ENTRY=entry, BLOCK=triton.next_power_of_2(entry),
    )
