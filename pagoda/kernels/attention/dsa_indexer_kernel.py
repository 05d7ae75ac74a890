"""The lightning indexer's Triton score kernel (imports triton; dsa_indexer.py imports
this module only when it launches the kernel, so the torch path runs without triton).

Owns `launch_indexer_scores` and `indexer_launch` (its arguments, also compiled by
tools/compile_sm90.py). Program (row, chunk) scores tokens [chunk * C, (chunk + 1) * C)
of query row `row` (C = BLOCK_N * TILES), every indexer head at once: a tile of BLOCK_N
gathered keys [BLOCK_N, D] times the row's queries [D, heads] on tensor cores, relu,
then the weighted sum over heads gives BLOCK_N scores. Tokens, not heads, are the dot's
M dimension: the sum over heads then stays within a thread and its quad instead of
crossing warps (at 64 heads x 128 dims in bf16 the loop compiles for sm_90 to 338
instructions against 543, and float32 does not spill). The loop stops at the row's
length, read on the device, so a CUDA graph captured for one width serves any lengths;
with FILL the chunk's positions past it are written -inf, without it (for the top-k,
which reads no score past a row's length) nothing past it is written and a chunk that
starts past it loads nothing. Rows are the grid's first axis: programs that run
together score the same tokens of different rows, which then share the key tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.dsa_config import IndexerTiles


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["width", "stride_bt"])
def _indexer_scores_kernel(
    out_ptr,
    q_ptr,
    w_ptr,
    key_ptr,
    block_tables_ptr,
    row_req_ptr,
    row_len_ptr,
    width,
    stride_on,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_bt,
    stride_kb,
    stride_kt,
    NUM_HEADS: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FILL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk_start = tl.program_id(1) * (BLOCK_N * TILES)
    chunk_end = tl.minimum(chunk_start + BLOCK_N * TILES, width)
    seen_end = tl.minimum(tl.load(row_len_ptr + row), chunk_end)
    req = tl.load(row_req_ptr + row).to(tl.int64)

    head = tl.arange(0, BLOCK_HI)
    dim = tl.arange(0, BLOCK_D)
    head_ok, dim_ok = head < NUM_HEADS, dim < HEAD_DIM
    # A chunk past the row's end loads no query (its loop below does not run).
    live_heads = tl.where(chunk_start < seen_end, NUM_HEADS, 0)
    q = tl.load(
        q_ptr + row * stride_qn + head[:, None] * stride_qh + dim[None, :],
        mask=(head < live_heads)[:, None] & dim_ok[None, :],
        other=0.0,
    )
    # Padded heads have weight 0 and query 0: they add nothing to the sum.
    w = tl.load(w_ptr + row * stride_wn + head, mask=head_ok, other=0.0)
    table = block_tables_ptr + req * stride_bt
    out_row = out_ptr + row * stride_on
    for start in range(chunk_start, seen_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        seen = pos < seen_end  # never load past the context: unused slots may hold NaN
        page = tl.load(table + pos // PAGE_SIZE, mask=seen, other=0).to(tl.int64)
        k = tl.load(
            key_ptr
            + page[:, None] * stride_kb
            + (pos % PAGE_SIZE)[:, None] * stride_kt
            + dim[None, :],
            mask=seen[:, None] & dim_ok[None, :],
            other=0.0,
        )
        logits = _dot(k, tl.trans(q), IEEE_DOT)  # [BLOCK_N, BLOCK_HI] float32
        score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], 1)
        if FILL:
            tl.store(out_row + pos, tl.where(seen, score, float("-inf")), mask=pos < chunk_end)
        else:
            tl.store(out_row + pos, score, mask=seen)
    if FILL:
        # The loop's last tile wrote -inf up to its end; the tiles after it get -inf only.
        scored = tl.cdiv(tl.maximum(seen_end - chunk_start, 0), BLOCK_N) * BLOCK_N
        for start in range(chunk_start + scored, chunk_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            neg_inf = tl.full([BLOCK_N], float("-inf"), tl.float32)
            tl.store(out_row + pos, neg_inf, mask=pos < chunk_end)


def indexer_launch(
    out: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    tiles: IndexerTiles,
    fill: bool = True,
) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, args, kwargs) of the score kernel's launch over out [N, width]: what
    launch_indexer_scores runs and tools/compile_sm90.py compiles. fill: -inf past each
    row's length (else nothing is written there)."""
    num_rows, num_heads, head_dim = q.shape
    width = out.shape[1]
    grid = (num_rows, triton.cdiv(width, tiles.tokens_per_program))
    args = (
        out,
        q,
        weights,
        key_cache,
        block_tables,
        row_req,
        row_len,
        width,
        out.stride(0),
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        block_tables.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
    )
    kwargs = dict(
        NUM_HEADS=num_heads,
        BLOCK_HI=max(16, triton.next_power_of_2(num_heads)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE_SIZE=key_cache.shape[1],
        IEEE_DOT=q.dtype == torch.float32,
        FILL=fill,
        **tiles.launch(),
    )
    return grid, args, kwargs


def launch_indexer_scores(
    out: torch.Tensor,
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    row_len: torch.Tensor,
    tiles: IndexerTiles,
    fill: bool = True,
) -> None:
    """One launch of the score kernel over out [N, width] (arguments checked by
    dsa_indexer.indexer_scores)."""
    grid, args, kwargs = indexer_launch(
        out, q, weights, key_cache, block_tables, row_req, row_len, tiles, fill
    )
    _indexer_scores_kernel[grid](*args, **kwargs)
