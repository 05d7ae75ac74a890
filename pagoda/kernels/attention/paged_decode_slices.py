"""The context slices of split-K paged decode on the device, shared by the tile kernel
(paged_decode._decode_kernel) and the word kernel (paged_decode_words): the request's
rows loaded before the PDL wait, a program's slice and its write, and the merge kernel.
The host side (how many slices: choose_num_splits) and the launches are paged_decode's.

Grid (requests, kv heads, splits). A program takes the one query row of its request,
all query heads of one KV head (padded to a power of two, DecodeTiles.block_h), and
one slice of the context: tokens split * per_split .. (split + 1) * per_split - 1, where
per_split = max(cdiv(seq_len, num_splits), min_split_tokens) rounded up to BLOCK_N is
computed on the device from seq_lens (a sliding-window layer's slices split only the
window's keys the same way, from seq_len - window on). So the launch depends on host
values only through num_splits: a CUDA graph captured with a fixed num_splits stays correct for any
context length, and slices past a short request's end simply hold no tokens.

With num_splits == 1 the kernel writes the output directly. Otherwise each program
writes its slice's output (normalised by the slice's own softmax sum) and the slice's
log-sum-exp (base 2) to a float32 workspace, and a merge kernel with grid (requests, heads)
combines the slices: weights 2^(lse_s - max lse); empty slices (lse = -inf) weigh 0.
With attention sinks (HAS_SINKS) the merge adds each head's sink term, 2^(sink2 -
max lse) with sink2 its logit in base 2, to the sum of the weights, once per row.
A separate merge kernel, not the last slice's program behind an arrival counter: the
counter form measures slower on the H200 (docs/performance.md, "Rejected designs").
num_splits is a runtime argument, so a changing split count does not recompile.
Requests whose query length is not 1 exit at once in both kernels. With PDL both load
the request's query start and context length before their wait
(_wait_then_decode_row says why that is safe).
"""

import triton
import triton.language as tl

from pagoda.kernels.launch.pdl import pdl_wait_and_release


@triton.jit
def _wait_then_decode_row(query_start_loc_ptr, seq_lens_ptr, req, USE_PDL: tl.constexpr):
    """The request's (first query row, query length, context length), loaded before the
    PDL wait. They are written before the forward (the step's input copies), and at
    least two launches (the qkv projection and the KV store) run between that and any
    decode attention, so pdl.py's rule allows it. The loads before the wait took
    Qwen3-30B-A3B's batch-1 step from 2.600-2.605 to 2.590-2.593 ms (H200;
    docs/performance.md, "Measured reasons: Decode attention"); the block table stays
    inside the key loop (moving the first tile's rows out of it measures slower:
    "Rejected designs")."""
    q_row, q_len = _query_rows(query_start_loc_ptr, req)
    seq_len = tl.load(seq_lens_ptr + req)
    pdl_wait_and_release(USE_PDL)
    return q_row, q_len, seq_len


@triton.jit
def _query_rows(query_start_loc_ptr, req):
    """The request's first query row and its number of query rows."""
    q_row = tl.load(query_start_loc_ptr + req)
    return q_row, tl.load(query_start_loc_ptr + req + 1) - q_row


@triton.jit
def _slice_bounds(
    seq_len,
    split,
    num_splits,
    min_split,
    BLOCK_N: tl.constexpr,
    window=0,
    SLIDING: tl.constexpr = False,
):
    """[kv_start, kv_end) of this program's context slice (see the module docstring).
    SLIDING: the slices split the window's keys seq_len - window .. seq_len - 1 instead
    of the whole context (every key of a slice is then visible: no window mask)."""
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
        per_split = tl.maximum(tl.cdiv(seq_len - first, num_splits), min_split)
        per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
        kv_start = first + split * per_split
    else:
        per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_split)
        per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
        kv_start = split * per_split
    return kv_start, tl.minimum(kv_start + per_split, seq_len)


@triton.jit
def _write_slice(
    out,
    l_i,
    m_i,
    dims,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    q_row,
    req,
    head,
    head_ok,
    split,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Stores out ([BLOCK_H, len(dims)], already divided by the slice's sum) at columns
    dims: the output row itself, or the slice's partial row (and, with WRITE_LSE, its
    log-sum-exp) for the merge."""
    if DIRECT_OUT:
        tl.store(
            out_ptr + q_row.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None],
        )
    else:
        slot = (req.to(tl.int64) * NUM_HEADS + head) * num_splits + split  # [BLOCK_H]
        if WRITE_LSE:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
            tl.store(partial_lse_ptr + slot, lse, mask=head_ok)
        tl.store(
            partial_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :], out, mask=head_ok[:, None]
        )


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
    sinks_ptr=None,
    HAS_SINKS: tl.constexpr = False,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_row, q_len = _query_rows(query_start_loc_ptr, req)  # before the wait: as the decode kernel
    pdl_wait_and_release(USE_PDL)
    if q_len != 1:
        return
    splits = tl.arange(0, SPLITS_PAD)
    base = (req.to(tl.int64) * NUM_HEADS + head) * num_splits
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    filled = lse > float("-inf")  # slice 0 always holds a token, so the max is finite
    top = tl.max(lse, 0)
    weight = tl.where(filled, tl.math.exp2(lse - top), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    # Empty slices were never written: do not read them (0 * garbage may be NaN).
    partial = tl.load(
        partial_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=filled[:, None],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    if HAS_SINKS:  # the sink's share of the denominator, once for the whole row
        total += tl.math.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - top)
    out = tl.sum(partial * weight[:, None], 0) / total
    tl.store(
        out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
    )
