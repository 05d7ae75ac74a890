"""The Triton kernel of sparse latent attention (imports triton; sparse_mla.py imports
this module only when it launches the kernel, so the torch path runs without triton).

Owns `launch_sparse_latent_attention` and `sparse_launch` (the attention kernel's
arguments, also compiled by tools/compile_sm90.py). Program (row, head block, split)
takes BLOCK_H heads of one query row and folds a slice of the row's selected entries
into an online softmax (base 2, float32): tiles of BLOCK_N positions are read from the
row's position list, each entry gathered through the block table (a -1 position reads
nothing and scores -inf) and loaded once for all BLOCK_H heads. The latent part
(kv_lora_rank values, which are also the value) and the rope part are loaded and
multiplied apart, each padded to a power of two, so neither width has to be one.

The slice is computed on the device (per_split = cdiv(count, num_splits) rounded up to
BLOCK_N, count the row's number of positions to read), so the launch depends on the host
only through num_splits. With one split the kernel writes the output directly; otherwise
each slice writes its normalised output and log-sum-exp (base 2) to a float32 workspace
and mla_decode's merge kernel, whose workspace layout this kernel shares, combines them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.dsa_config import SparseMLATiles
from pagoda.kernels.attention.mla_decode import _dot, _mla_merge_kernel, _store_slice
from pagoda.kernels.attention.paged_attention import LOG2_E


@triton.jit
def _gather_entries(
    cache_ptr, table, pos_row, idx, end, stride_cb, stride_ct, dc, dr, c_ok, r_ok,
    PAGE_SIZE: tl.constexpr, KV_RANK: tl.constexpr,
):  # fmt: skip
    """The latent [BLOCK_N, BLOCK_C] and rope [BLOCK_N, BLOCK_R] parts of the entries
    at list indices idx (zeros where idx >= end or the position is -1), and which are
    real."""
    pos = tl.load(pos_row + idx, mask=idx < end, other=-1)
    real = pos >= 0  # never load an unselected slot: unused slots may hold NaN
    page = tl.load(table + pos // PAGE_SIZE, mask=real, other=0).to(tl.int64)
    entry = cache_ptr + page * stride_cb + (pos % PAGE_SIZE) * stride_ct
    c = tl.load(entry[:, None] + dc[None, :], mask=real[:, None] & c_ok[None, :], other=0.0)
    r = tl.load(
        entry[:, None] + KV_RANK + dr[None, :], mask=real[:, None] & r_ok[None, :], other=0.0
    )
    return c, r, real


@triton.jit(do_not_specialize=["num_selected", "num_splits", "stride_bt", "stride_pn"])
def _sparse_mla_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    row_req_ptr,
    positions_ptr,
    count_ptr,
    qk_scale,
    num_selected,
    num_splits,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    stride_bt,
    stride_pn,
    stride_cb,
    stride_ct,
    HAS_COUNT: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KV_RANK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    count = num_selected
    if HAS_COUNT:
        count = tl.minimum(tl.maximum(tl.load(count_ptr + row), 0), num_selected)
    req = tl.load(row_req_ptr + row).to(tl.int64)
    per_split = tl.cdiv(tl.cdiv(count, num_splits), BLOCK_N) * BLOCK_N
    first = split * per_split
    end = tl.minimum(first + per_split, count)

    head_ok = head < NUM_HEADS
    dc = tl.arange(0, BLOCK_C)
    dr = tl.arange(0, BLOCK_R)
    c_ok, r_ok = dc < KV_RANK, dr < ROPE
    q_base = q_ptr + row * stride_qn + head[:, None] * stride_qh
    q_c = tl.load(q_base + dc[None, :], mask=head_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_base + KV_RANK + dr[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    table = block_tables_ptr + req * stride_bt
    pos_row = positions_ptr + row * stride_pn
    for start in range(first, end, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        c, k_r, real = _gather_entries(
            cache_ptr, table, pos_row, idx, end, stride_cb, stride_ct, dc, dr, c_ok, r_ok,
            PAGE_SIZE, KV_RANK,
        )  # fmt: skip
        s = _dot(q_c, tl.trans(c), IEEE_DOT) + _dot(q_r, tl.trans(k_r), IEEE_DOT)
        s = tl.where(real[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A tile of -1s only, before any real entry, leaves m at -inf: subtract 0 then.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, IEEE_DOT)
        m_i = m_new

    _store_slice(
        out_ptr, partial_out_ptr, partial_lse_ptr, acc, m_i, l_i, row, head, head_ok, dc,
        c_ok, split, num_splits, stride_on, stride_oh, NUM_HEADS, KV_RANK, DIRECT_OUT,
    )  # fmt: skip


def sparse_launch(
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    positions: torch.Tensor,
    count: torch.Tensor | None,
    scale: float,
    kv_lora_rank: int,
    num_splits: int,
    tiles: SparseMLATiles,
) -> tuple[tuple[int, int, int], tuple, dict]:
    """(grid, args, kwargs) of the attention kernel's launch (partial_out [N, H, splits,
    kv_lora_rank] and partial_lse [N, H, splits], float32, are read only with several
    splits): what launch_sparse_latent_attention runs and tools/compile_sm90.py
    compiles."""
    num_rows, num_heads, entry = q.shape
    rope = entry - kv_lora_rank
    grid = (num_rows, triton.cdiv(num_heads, tiles.block_h), num_splits)
    args = (
        out,
        partial_out,
        partial_lse,
        q,
        cache,
        block_tables,
        row_req,
        positions,
        positions if count is None else count,
        scale * LOG2_E,
        positions.shape[1],
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        positions.stride(0),
        cache.stride(0),
        cache.stride(1),
    )
    kwargs = dict(
        HAS_COUNT=count is not None,
        NUM_HEADS=num_heads,
        BLOCK_H=tiles.block_h,
        PAGE_SIZE=cache.shape[1],
        KV_RANK=kv_lora_rank,
        BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)),
        ROPE=rope,
        BLOCK_R=max(16, triton.next_power_of_2(rope)),
        DIRECT_OUT=num_splits == 1,
        IEEE_DOT=q.dtype == torch.float32,
        **tiles.launch(),
    )
    return grid, args, kwargs


def launch_sparse_latent_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_req: torch.Tensor,
    positions: torch.Tensor,
    count: torch.Tensor | None,
    scale: float,
    kv_lora_rank: int,
    num_splits: int,
    tiles: SparseMLATiles,
) -> None:
    """The kernel's launch (and the merge's when num_splits > 1); arguments checked by
    sparse_mla.sparse_latent_attention."""
    num_rows, num_heads, _ = q.shape
    if num_splits > 1:
        partial_out = torch.empty(
            num_rows, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:  # unused: the kernel writes out directly
        partial_out = partial_lse = out
    grid, args, kwargs = sparse_launch(
        out, partial_out, partial_lse, q, cache, block_tables, row_req, positions, count,
        scale, kv_lora_rank, num_splits, tiles,
    )  # fmt: skip
    _sparse_mla_kernel[grid](*args, **kwargs)
    if num_splits > 1:
        _mla_merge_kernel[(num_rows, num_heads)](
            out,
            partial_out,
            partial_lse,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            KV_RANK=kv_lora_rank,
            BLOCK_C=kwargs["BLOCK_C"],
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
