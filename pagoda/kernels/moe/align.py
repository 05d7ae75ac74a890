"""The expert sort of the fused MoE GEMMs: (token, choice) pairs grouped by expert into
blocks of BLOCK_M rows (``moe_align_block_size``), on the GPU without a host sync.

Two ways to the same result on the GPU, exactly (tests/kernels/test_fused_moe_kernel.py), and
the torch ops:
- up to SMALL_ALIGN_PAIRS pairs, one Triton program (``_align_small_kernel``);
- above, three launches over chunks of ALIGN_CHUNK pairs, any number of pairs:
  ``_align_count_kernel`` (per chunk the pairs per expert, each pair's rank among its
  chunk's pairs of the same expert, and a share of the padding fill),
  ``_align_scan_kernel`` (per expert, the running count over the chunks before each
  chunk, and the total) and ``_align_place_kernel`` (every pair's row: its expert's
  start + the chunks before + its rank). A decode step at batch 256 of a top-8 model
  has 2,048 pairs, a 16,384-token prefill step 131,072;
- torch ops (argsort and friends, about fifteen launches): the CPU path and the
  reference.

The sort is stable within an expert's group (pairs in ascending order), so every way
gives the same rows; padding rows hold T*k. Pairs routed to experts of another rank
(id -1) form one more group, last, whose blocks carry expert id -1. The sorted buffer
has a fixed upper bound (T*k + (E+1)*(BLOCK_M-1), rounded up to BLOCK_M) and the number
of used rows stays on the device, so the call is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["moe_align_block_size", "max_padded_rows"]

# Up to this many (token, choice) pairs, one Triton program aligns them (decode and
# small batches: one launch instead of a dozen small torch ops per layer).
SMALL_ALIGN_PAIRS = 256
# Pairs per program of the chunked kernels (64: no register spills at 256 buckets on
# sm_90, by tools/compile_sm90.py), and the scan's tile: chunks x buckets per step.
ALIGN_CHUNK = 64
SCAN_CHUNKS = 256
SCAN_BUCKETS = 8


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int, use_kernel: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (ids in [0, num_experts), or -1 for another rank's expert) ->

    - sorted_ids int32 [max_padded]: flat pair indices (t * k + j) grouped by expert in
      ascending expert order (-1's group last), stable within a group; padding rows
      hold T*k;
    - expert_ids int32 [max_padded // block_m]: each block's expert (-1: the other ranks'
      group, or a block past the end);
    - num_post_padded int32 [1]: how many rows of sorted_ids are used.

    use_kernel (None: on CUDA, and for up to SMALL_ALIGN_PAIRS pairs elsewhere, where
    the kernels run interpreted): Triton kernels (one program up to SMALL_ALIGN_PAIRS
    pairs, the chunked launches above) instead of torch ops; every way gives the same
    result.
    """
    num_pairs = topk_ids.numel()
    if use_kernel is None:
        use_kernel = topk_ids.is_cuda or num_pairs <= SMALL_ALIGN_PAIRS
    if not use_kernel:
        return _align_torch(topk_ids, block_m, num_experts)
    if num_pairs <= SMALL_ALIGN_PAIRS:
        return _align_small(topk_ids, block_m, num_experts)
    return _align_chunked(topk_ids, block_m, num_experts)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted buffer: every group (experts and the -1 group) padded."""
    return triton.cdiv(num_pairs + (num_experts + 1) * (block_m - 1), block_m) * block_m


def _align_torch(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs, num_buckets = flat.numel(), num_experts + 1
    bucket = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)
    counts = torch.zeros(num_buckets, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    first_of_bucket = counts.cumsum(0) - counts
    rank_in_bucket = torch.arange(num_pairs, device=device) - first_of_bucket[sorted_bucket]
    dest = starts[sorted_bucket] + rank_in_bucket
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_bucket = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = torch.where(
        block_bucket < num_experts, block_bucket, torch.full_like(block_bucket, -1)
    ).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _buckets_of(topk_ids_ptr, pairs, num_pairs, num_experts):
    """Each pair's bucket: its expert, num_experts for -1, and -2 past the pairs (a lane
    that matches no bucket)."""
    pair_ok = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=pair_ok, other=0)
    bucket = tl.where(ids < 0, num_experts, ids)
    return tl.where(pair_ok, bucket, -2)


@triton.jit
def _fill_padding(sorted_ids_ptr, first, step, max_padded, num_pairs, CHUNK: tl.constexpr):
    """sorted_ids[first::step-strided chunks] = num_pairs (the padding value)."""
    for off in range(first, max_padded, step):
        rows = off + tl.arange(0, CHUNK)
        tl.store(
            sorted_ids_ptr + rows,
            tl.zeros([CHUNK], dtype=tl.int32) + num_pairs,
            mask=rows < max_padded,
        )


@triton.jit
def _write_block_experts(
    expert_ids_ptr, ends, num_blocks, num_experts, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr
):
    """A block's bucket: how many buckets end at or before its first row."""
    for off in range(0, num_blocks, CHUNK):
        blocks = off + tl.arange(0, CHUNK)
        owner = tl.sum((ends[:, None] <= (blocks * BLOCK_M)[None, :]).to(tl.int32), axis=0)
        tl.store(
            expert_ids_ptr + blocks,
            tl.where(owner < num_experts, owner, -1),
            mask=blocks < num_blocks,
        )


@triton.jit
def _align_small_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_pairs,
    num_experts,
    max_padded,
    num_blocks,
    BLOCK_M: tl.constexpr,
    PAIRS: tl.constexpr,
    BUCKETS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One program. Buckets 0..E-1 are the experts, bucket E the other ranks' (-1).
    pairs = tl.arange(0, PAIRS)
    bucket = _buckets_of(topk_ids_ptr, pairs, num_pairs, num_experts)
    buckets = tl.arange(0, BUCKETS)
    onehot = (bucket[None, :] == buckets[:, None]).to(tl.int32)  # [BUCKETS, PAIRS]
    counts = tl.sum(onehot, axis=1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # A pair's row: its bucket's start + how many earlier pairs share the bucket (stable).
    earlier = (bucket[:, None] == bucket[None, :]) & (pairs[None, :] < pairs[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    dest = tl.sum(onehot * starts[:, None], axis=0) + rank
    _fill_padding(sorted_ids_ptr, 0, CHUNK, max_padded, num_pairs, CHUNK)
    tl.debug_barrier()  # the padding fill lands before the pairs overwrite their rows
    tl.store(sorted_ids_ptr + dest, pairs, mask=pairs < num_pairs)
    tl.store(num_post_padded_ptr, tl.sum(padded, axis=0))
    _write_block_experts(expert_ids_ptr, ends, num_blocks, num_experts, BLOCK_M, CHUNK)


def _align_small(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    num_pairs = flat.numel()
    sorted_ids, expert_ids, used = _align_outputs(num_pairs, num_experts, block_m, flat.device)
    _align_small_kernel[(1,)](
        flat,
        sorted_ids,
        expert_ids,
        used,
        num_pairs,
        num_experts,
        sorted_ids.numel(),
        expert_ids.numel(),
        BLOCK_M=block_m,
        PAIRS=max(16, triton.next_power_of_2(num_pairs)),
        BUCKETS=triton.next_power_of_2(num_experts + 1),
        CHUNK=256,
        num_warps=8,
    )
    return sorted_ids, expert_ids, used


def _align_outputs(
    num_pairs: int, num_experts: int, block_m: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    return (
        torch.empty(max_padded, dtype=torch.int32, device=device),
        torch.empty(max_padded // block_m, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
    )


@triton.jit
def _align_count_kernel(
    topk_ids_ptr,
    counts_ptr,
    rank_ptr,
    sorted_ids_ptr,
    num_pairs,
    num_experts,
    max_padded,
    num_chunks,
    BUCKETS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # Program c: counts[c, b] = pairs of chunk c in bucket b; rank[p] = how many earlier
    # pairs of p's chunk share its bucket; and its share of the padding fill.
    chunk = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + lanes
    bucket = _buckets_of(topk_ids_ptr, pairs, num_pairs, num_experts)
    buckets = tl.arange(0, BUCKETS)
    onehot = (bucket[None, :] == buckets[:, None]).to(tl.int32)  # [BUCKETS, CHUNK]
    tl.store(counts_ptr + chunk * BUCKETS + buckets, tl.sum(onehot, axis=1))
    # Inclusive running count along the chunk, read at each pair's own bucket, minus 1.
    rank = tl.sum(onehot * tl.cumsum(onehot, axis=1), axis=0) - 1
    tl.store(rank_ptr + pairs, rank, mask=pairs < num_pairs)
    _fill_padding(sorted_ids_ptr, chunk * CHUNK, num_chunks * CHUNK, max_padded, num_pairs, CHUNK)


@triton.jit
def _align_scan_kernel(
    counts_ptr,
    before_ptr,
    totals_ptr,
    num_chunks,
    BUCKETS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # Program b: for buckets [b * BLOCK_B, (b + 1) * BLOCK_B), before[c, bucket] = the
    # pairs of that bucket in chunks 0..c-1, and totals[bucket] = all of them.
    buckets = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    carry = tl.zeros([BLOCK_B], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        offs = chunks[:, None] * BUCKETS + buckets[None, :]
        ok = (chunks < num_chunks)[:, None]
        tile = tl.load(counts_ptr + offs, mask=ok, other=0)
        tl.store(before_ptr + offs, tl.cumsum(tile, axis=0) - tile + carry[None, :], mask=ok)
        carry += tl.sum(tile, axis=0)
    tl.store(totals_ptr + buckets, carry)


@triton.jit
def _align_place_kernel(
    topk_ids_ptr,
    before_ptr,
    totals_ptr,
    rank_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BUCKETS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # Program c: the rows of chunk c's pairs.
    chunk = tl.program_id(0)
    buckets = tl.arange(0, BUCKETS)
    padded = (tl.load(totals_ptr + buckets) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    base = ends - padded + tl.load(before_ptr + chunk * BUCKETS + buckets)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    bucket = _buckets_of(topk_ids_ptr, pairs, num_pairs, num_experts)
    onehot = (bucket[None, :] == buckets[:, None]).to(tl.int32)  # [BUCKETS, CHUNK]
    pair_ok = pairs < num_pairs
    rank = tl.load(rank_ptr + pairs, mask=pair_ok, other=0)
    dest = tl.sum(onehot * base[:, None], axis=0) + rank
    tl.store(sorted_ids_ptr + dest, pairs, mask=pair_ok)
    if chunk == 0:
        tl.store(num_post_padded_ptr, tl.sum(padded, axis=0))
        _write_block_experts(expert_ids_ptr, ends, num_blocks, num_experts, BLOCK_M, CHUNK)


def _align_chunked(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    num_pairs, device = flat.numel(), flat.device
    sorted_ids, expert_ids, used = _align_outputs(num_pairs, num_experts, block_m, device)
    num_chunks = triton.cdiv(num_pairs, ALIGN_CHUNK)
    buckets = max(SCAN_BUCKETS, triton.next_power_of_2(num_experts + 1))
    counts = torch.empty(num_chunks, buckets, dtype=torch.int32, device=device)
    before = torch.empty_like(counts)
    totals = torch.empty(buckets, dtype=torch.int32, device=device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    # One stream: the count kernel's padding fill lands before the place kernel writes
    # the pairs' rows.
    _align_count_kernel[(num_chunks,)](
        flat,
        counts,
        rank,
        sorted_ids,
        num_pairs,
        num_experts,
        sorted_ids.numel(),
        num_chunks,
        BUCKETS=buckets,
        CHUNK=ALIGN_CHUNK,
        num_warps=8,
    )
    _align_scan_kernel[(buckets // SCAN_BUCKETS,)](
        counts,
        before,
        totals,
        num_chunks,
        BUCKETS=buckets,
        BLOCK_C=SCAN_CHUNKS,
        BLOCK_B=SCAN_BUCKETS,
        num_warps=4,
    )
    _align_place_kernel[(num_chunks,)](
        flat,
        before,
        totals,
        rank,
        sorted_ids,
        expert_ids,
        used,
        num_pairs,
        num_experts,
        expert_ids.numel(),
        BLOCK_M=block_m,
        BUCKETS=buckets,
        CHUNK=ALIGN_CHUNK,
        num_warps=8,
    )
    return sorted_ids, expert_ids, used
