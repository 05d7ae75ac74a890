"""Triton split-K (flash-decoding) paged attention for decode rows (query length 1).

Owns `paged_attention_decode`, `choose_num_splits` and `min_split_tokens` (the split
plan the MLA latent kernel shares), and `short_context_splits` (the plan of a decode
CUDA graph for short contexts).

Grid (requests, kv heads, splits). A program takes the one query row of its request,
all query heads of one KV head (padded to at least 16 rows for the tensor cores), and
one slice of the context: tokens split * per_split .. (split + 1) * per_split - 1, where
per_split = max(cdiv(seq_len, num_splits), min_split_tokens) rounded up to BLOCK_N is
computed on the device from seq_lens. So the launch depends on host values only
through num_splits: a CUDA graph captured with a fixed num_splits stays correct for any
context length, and slices past a short request's end simply hold no tokens.

With num_splits == 1 the kernel writes the output directly. Otherwise each program
writes its slice's output (normalised by the slice's own softmax sum) and the slice's
log-sum-exp (base 2) to a float32 workspace, and a merge kernel with grid (requests, heads)
combines the slices: weights 2^(lse_s - max lse); empty slices (lse = -inf) weigh 0.
(Merging inside the last slice's program instead, behind an arrival counter, was built
twice and measured slower on the H200 both times: docs/performance.md, 2026-12-02.)
num_splits is a runtime argument, so a changing split count does not recompile.
Requests whose query length is not 1 exit at once in both kernels. With PDL both load
the request's query start and context length before their wait (PRELOAD_METADATA;
_wait_then_decode_row says why that is safe).

FP8 cache (KV_FP8): as in the chunk kernel (paged_attention.py), K / V tiles converted
to q's dtype, the K scale folded into the score factor and the V scale applied to each
slice's output (the merge is linear in them), both read from kv_scales on the device.
The word kernel (_decode_words_kernel, config key fp8_path) reads an FP8 cache as int32
words instead; see the section above it for why. Its "words_qk8" form also rounds the
queries to e4m3 (one power-of-two scale per head, quantize_q_fp8_reference) so that
q.K is a single FP8 dot on the keys as stored, as FlashAttention-3's FP8 path does (on
sm_90 Triton lowers that dot, 16 padded query rows, to float16 mma.sync and converts the
whole key tile for it: cheaper than the byte planes, not free; "words_kq8" is the form
that reaches Hopper's FP8 wgmma, measured slower: 175 against 164 us for one Llama-8B
layer at 256 x 1k, two programs an SM where "words_qk8" fits three). The FP8 default
(FP8_WORD_TILES) pads a KV head's query rows to 4 instead of 16, reads whole K tiles and
keeps one K / V buffer, at every grid.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.fp8_decode_words import attend_word_tile
from pagoda.kernels.attention.paged_attention import LOG2_E, attend_kv_tile
from pagoda.kernels.launch.pdl import launch_options, launched, pdl_wait_and_release
from pagoda.kernels.attention.store_kv import check_kv_scales

# A slice shorter than this costs more in the merge than it saves in parallelism...
MIN_SPLIT_TOKENS = 256
# ...unless the unsplit grid (requests x KV heads) leaves most SMs idle, as a batch-1
# step does: then slices as short as this (docs/performance.md, batch-1 kernel sweep).
SMALL_GRID_MIN_SPLIT = 32
MAX_SPLITS = 32
# The grid fills the GPU when it holds this many programs an SM: choose_num_splits slices
# contexts until it does (up to MAX_SPLITS).
PROGRAMS_PER_SM = 4
# A decode CUDA graph is planned for the longest context its block table holds, which
# at small batches means MAX_SPLITS slices; for steps whose contexts are all short, a
# second graph with SHORT_CONTEXT_SPLITS slices (no more than ~64 tokens each up to
# SHORT_CONTEXT_TOKENS) is faster: every slice, empty or not, is a program, and the
# merge reads every slice. From benchmarks/decode_splits.py on the H200 (32 layers, a
# copy between them), Llama-3.1-8B at batch 1, µs a layer, 8 / 32 slices: 5.35 / 6.36 at
# 128 tokens, 5.75 / 6.84 at 512, 7.59 / 7.14 at 768 (docs/performance.md).
SHORT_CONTEXT_TOKENS = 512
SHORT_CONTEXT_SPLITS = 8
SHORT_CONTEXT_GRAPHS = True  # False: one decode graph per size (benchmarks' A/B switch)


@triton.jit
def _wait_then_decode_row(query_start_loc_ptr, seq_lens_ptr, req,
                          PRELOAD_METADATA: tl.constexpr, USE_PDL: tl.constexpr):
    """The PDL wait and the request's (first query row, query length, context length).
    PRELOAD_METADATA: those three are loaded before the wait. They are written before the
    forward (the step's input copies), and at least two launches (the qkv projection and
    the KV store) run between that and any decode attention, so pdl.py's rule allows it."""
    if PRELOAD_METADATA:
        q_row, q_len = _query_rows(query_start_loc_ptr, req)
        seq_len = tl.load(seq_lens_ptr + req)
        pdl_wait_and_release(USE_PDL)
    else:
        pdl_wait_and_release(USE_PDL)  # before any load or store
        q_row, q_len = _query_rows(query_start_loc_ptr, req)
        seq_len = tl.load(seq_lens_ptr + req)
    return q_row, q_len, seq_len


@triton.jit
def _query_rows(query_start_loc_ptr, req):
    """The request's first query row and its number of query rows."""
    q_row = tl.load(query_start_loc_ptr + req)
    return q_row, tl.load(query_start_loc_ptr + req + 1) - q_row


@triton.jit
def _slice_bounds(seq_len, split, num_splits, min_split, BLOCK_N: tl.constexpr):
    """[kv_start, kv_end) of this program's context slice (see the module docstring)."""
    per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_split)
    per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    kv_start = split * per_split
    return kv_start, tl.minimum(kv_start + per_split, seq_len)


@triton.jit
def _write_slice(out, l_i, m_i, dims, out_ptr, partial_out_ptr, partial_lse_ptr, q_row, req,
                 head, head_ok, split, num_splits, stride_ot, stride_oh,
                 NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIRECT_OUT: tl.constexpr,
                 WRITE_LSE: tl.constexpr):
    """Stores out ([BLOCK_H, len(dims)], already divided by the slice's sum) at columns
    dims: the output row itself, or the slice's partial row (and, with WRITE_LSE, its
    log-sum-exp) for the merge."""
    if DIRECT_OUT:
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        slot = (req.to(tl.int64) * NUM_HEADS + head) * num_splits + split  # [BLOCK_H]
        if WRITE_LSE:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
            tl.store(partial_lse_ptr + slot, lse, mask=head_ok)
        tl.store(partial_out_ptr + slot[:, None] * HEAD_DIM + dims[None, :], out,
                 mask=head_ok[:, None])


# Step-varying ints are not specialised: each new value class would recompile mid-run.
@triton.jit(do_not_specialize=["num_splits", "min_split", "stride_bt"])
def _decode_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, qk_scale, num_splits, min_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIRECT_OUT: tl.constexpr, IEEE_DOT: tl.constexpr, KV_FP8: tl.constexpr,
    PRELOAD_METADATA: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row, q_len, seq_len = _wait_then_decode_row(query_start_loc_ptr, seq_lens_ptr, req,
                                                  PRELOAD_METADATA, USE_PDL)
    if q_len != 1:
        return
    kv_start, kv_end = _slice_bounds(seq_len, split, num_splits, min_split, BLOCK_N)

    h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + h
    head_ok = h < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None], other=0.0)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scales_ptr)
        if not IEEE_DOT:  # e4m3 -> float16 is one instruction per pair; -> bfloat16 is not
            q = q.to(tl.float16)
    # The one query sits at the last position: every key before kv_end is visible, so
    # no causal mask (q_pos is unused; kv_end stands in for it).
    for start_n in range(kv_start, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
            start_n, kv_end, kv_end, qk_scale,
            stride_cache_block, stride_cache_tok, stride_cache_head,
            PAGE_SIZE, BLOCK_N, HEAD_DIM, True, False, IEEE_DOT)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty slice: acc is 0, lse is -inf
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * tl.load(kv_scales_ptr + 1)
    _write_slice(out, l_i, m_i, dims, out_ptr, partial_out_ptr, partial_lse_ptr, q_row, req,
                 head, head_ok, split, num_splits, stride_ot, stride_oh,
                 NUM_HEADS, HEAD_DIM, DIRECT_OUT, True)


# --- FP8 cache read as int32 words (decode only): the tile step is
# fp8_decode_words.attend_word_tile, whose docstring says why words. -------------------


@triton.jit
def _round_to_e4m3(x):
    """float32 x with |x| <= 448 -> the nearest e4m3 value (ties to even), as float32:
    exact, so the cast to float8e4nv after it rounds nothing (the same bytes as torch's
    cast; Triton's interpreter mis-rounds values that round up into the next binade)."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal e4m3 (|x| >= 2^-6): keep 3 of float32's 23 mantissa bits, ties to even
    # (a carry out of the mantissa moves the exponent up, as it should).
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal e4m3: multiples of 2^-9, rounded by float32's own addition (24576 =
    # 1.5 * 2^14, whose float32 spacing is 2^-9).
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _load_q_fp8(q_ptr, q_row, head, head_ok, stride_qt, stride_qh, HEAD_DIM: tl.constexpr):
    """The query rows as e4m3 [BLOCK_H, HEAD_DIM] and their float32 scales [BLOCK_H]:
    each row scaled by a power of two (exact both ways) to at most 448 and rounded to
    e4m3 (ref: pagoda.kernels.attention.paged_decode.quantize_q_fp8_reference)."""
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32)
    wanted = tl.max(tl.abs(q), 1) * (1.0 / 448.0)
    # The smallest power of two >= wanted, and its inverse, from the exponent bits.
    exp_bits = (wanted.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    scale = tl.where(wanted > 0, exp_bits.to(tl.float32, bitcast=True), 1.0)
    inverse = tl.where(wanted > 0, ((254 << 23) - exp_bits).to(tl.float32, bitcast=True), 1.0)
    x = tl.minimum(tl.maximum(q * inverse[:, None], -448.0), 448.0)
    return _round_to_e4m3(x).to(tl.float8e4nv), scale


@triton.jit
def _load_q_plane(q_ptr, q_row, head, head_ok, stride_qt, stride_qh, J: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    dims = tl.arange(0, HEAD_DIM // 4) * 4 + J
    return tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
                   mask=head_ok[:, None], other=0.0).to(tl.float16)


@triton.jit
def _load_word_queries(q_ptr, q_row, head, head_ok, stride_qt, stride_qh,
                       HEAD_DIM: tl.constexpr, QK_FP8: tl.constexpr, KEYS_AS_A: tl.constexpr):
    """attend_word_tile's query operands q0..q3 and the rows' scales. QK_FP8: the rows in
    e4m3 (q1 transposed for KEYS_AS_A; q2, q3 unused) and their power-of-two scales;
    else the four float16 planes of every fourth dim (scale 1, unused)."""
    if QK_FP8:
        q0, q_scale = _load_q_fp8(q_ptr, q_row, head, head_ok, stride_qt, stride_qh, HEAD_DIM)
        q1 = tl.trans(q0) if KEYS_AS_A else q0
        q2 = q0
        q3 = q0
    else:
        q0 = _load_q_plane(q_ptr, q_row, head, head_ok, stride_qt, stride_qh, 0, HEAD_DIM)
        q1 = _load_q_plane(q_ptr, q_row, head, head_ok, stride_qt, stride_qh, 1, HEAD_DIM)
        q2 = _load_q_plane(q_ptr, q_row, head, head_ok, stride_qt, stride_qh, 2, HEAD_DIM)
        q3 = _load_q_plane(q_ptr, q_row, head, head_ok, stride_qt, stride_qh, 3, HEAD_DIM)
        q_scale = 1.0
    return q0, q1, q2, q3, q_scale


@triton.jit
def _write_word_planes(a0, a1, a2, a3, l_i, m_i, v_scale, out_ptr, partial_out_ptr,
                       partial_lse_ptr, q_row, req, head, head_ok, split, num_splits,
                       stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       DIRECT_OUT: tl.constexpr):
    """Stores the four planes' accumulators (plane j holds dims j, j + 4, ...), scaled by
    v_scale / the slice's sum, through _write_slice (the lse once, with plane 0). An
    empty slice's accumulators are 0 and its lse -inf."""
    factor = v_scale / tl.where(l_i == 0.0, 1.0, l_i)
    cols = tl.arange(0, HEAD_DIM // 4) * 4
    _write_slice(a0 * factor[:, None], l_i, m_i, cols, out_ptr, partial_out_ptr, partial_lse_ptr,
                 q_row, req, head, head_ok, split, num_splits, stride_ot, stride_oh,
                 NUM_HEADS, HEAD_DIM, DIRECT_OUT, True)
    _write_slice(a1 * factor[:, None], l_i, m_i, cols + 1, out_ptr, partial_out_ptr, partial_lse_ptr,
                 q_row, req, head, head_ok, split, num_splits, stride_ot, stride_oh,
                 NUM_HEADS, HEAD_DIM, DIRECT_OUT, False)
    _write_slice(a2 * factor[:, None], l_i, m_i, cols + 2, out_ptr, partial_out_ptr, partial_lse_ptr,
                 q_row, req, head, head_ok, split, num_splits, stride_ot, stride_oh,
                 NUM_HEADS, HEAD_DIM, DIRECT_OUT, False)
    _write_slice(a3 * factor[:, None], l_i, m_i, cols + 3, out_ptr, partial_out_ptr, partial_lse_ptr,
                 q_row, req, head, head_ok, split, num_splits, stride_ot, stride_oh,
                 NUM_HEADS, HEAD_DIM, DIRECT_OUT, False)


@triton.jit(do_not_specialize=["num_splits", "min_split", "stride_bt"])
def _decode_words_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, kv_scales_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, qk_scale, num_splits, min_split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIRECT_OUT: tl.constexpr, BITS: tl.constexpr, QK_FP8: tl.constexpr,
    KEYS_AS_A: tl.constexpr, UNMASKED_K: tl.constexpr = False,
    OFFSETS_32: tl.constexpr = False, PTX_PAIRS: tl.constexpr = False,
    PRELOAD_METADATA: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    """_decode_kernel for an FP8 cache and 16-bit queries, the cache read as int32 words
    (the byte planes of fp8_decode_words); same grid, slices, workspace and merge.
    QK_FP8: the queries are rounded to e4m3 (a power-of-two scale per head) and q.K is
    one FP8 dot on the key tile as stored (KEYS_AS_A: keys x q^T, see
    fp8_decode_words.attend_word_tile); P.V still reads V as words."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row, q_len, seq_len = _wait_then_decode_row(query_start_loc_ptr, seq_lens_ptr, req,
                                                  PRELOAD_METADATA, USE_PDL)
    if q_len != 1:
        return
    kv_start, kv_end = _slice_bounds(seq_len, split, num_splits, min_split, BLOCK_N)

    h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + h
    head_ok = h < GROUP
    q0, q1, q2, q3, q_scale = _load_word_queries(q_ptr, q_row, head, head_ok, stride_qt,
                                                 stride_qh, HEAD_DIM, QK_FP8, KEYS_AS_A)
    a0 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    k_scale = tl.load(kv_scales_ptr)
    v_scale = tl.load(kv_scales_ptr + 1)
    if BITS:  # the planes hold entry * 2^-8
        k_scale = k_scale * 256.0
        v_scale = v_scale * 256.0
    k_words_ptr = k_cache_ptr.to(tl.pointer_type(tl.int32))
    v_words_ptr = v_cache_ptr.to(tl.pointer_type(tl.int32))
    if QK_FP8:  # K is read as stored, so there are no K planes for BITS to scale
        tl.static_assert(not BITS, "QK_FP8 reads K as e4m3, BITS is for the K / V planes")
        score_scale = (qk_scale * k_scale * q_scale)[:, None]
    else:
        score_scale = qk_scale * k_scale
    for start_n in range(kv_start, kv_end, BLOCK_N):
        a0, a1, a2, a3, m_i, l_i = attend_word_tile(
            q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, k_words_ptr, v_words_ptr,
            block_table_ptr, kv_head, start_n, kv_end, score_scale,
            stride_cache_block, stride_cache_tok, stride_cache_head,
            PAGE_SIZE, BLOCK_N, HEAD_DIM, BITS, QK_FP8, KEYS_AS_A, UNMASKED_K, OFFSETS_32,
            PTX_PAIRS)

    _write_word_planes(a0, a1, a2, a3, l_i, m_i, v_scale, out_ptr, partial_out_ptr,
                       partial_lse_ptr, q_row, req, head, head_ok, split, num_splits,
                       stride_ot, stride_oh, NUM_HEADS, HEAD_DIM, DIRECT_OUT)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, query_start_loc_ptr, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
    PRELOAD_METADATA: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    if PRELOAD_METADATA:  # the query start: see _wait_then_decode_row
        q_row, q_len = _query_rows(query_start_loc_ptr, req)
        pdl_wait_and_release(USE_PDL)
    else:
        pdl_wait_and_release(USE_PDL)  # before any load or store
        q_row, q_len = _query_rows(query_start_loc_ptr, req)
    if q_len != 1:
        return
    splits = tl.arange(0, SPLITS_PAD)
    base = (req.to(tl.int64) * NUM_HEADS + head) * num_splits
    lse = tl.load(partial_lse_ptr + base + splits, mask=splits < num_splits, other=float("-inf"))
    filled = lse > float("-inf")  # slice 0 always holds a token, so the max is finite
    weight = tl.where(filled, tl.math.exp2(lse - tl.max(lse, 0)), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    # Empty slices were never written: do not read them (0 * garbage may be NaN).
    partial = tl.load(partial_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=filled[:, None], other=0.0)
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty))


def min_split_tokens(num_decode_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """The shortest context slice worth its own program: SMALL_GRID_MIN_SPLIT when the
    unsplit grid has fewer programs than the GPU has SMs, else MIN_SPLIT_TOKENS."""
    if num_decode_reqs * num_kv_heads < num_sms:
        return SMALL_GRID_MIN_SPLIT
    return MIN_SPLIT_TOKENS


def choose_num_splits(num_decode_reqs: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int) -> int:
    """Context slices per (request, kv head): enough programs to fill the GPU about
    PROGRAMS_PER_SM times over, no slice under min_split_tokens, at most MAX_SPLITS."""
    min_split = min_split_tokens(num_decode_reqs, num_kv_heads, num_sms)
    if num_decode_reqs <= 0 or max_seq_len <= min_split:
        return 1
    by_length = triton.cdiv(max_seq_len, min_split)
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, num_decode_reqs * num_kv_heads)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def short_context_splits(num_decode_reqs: int, num_kv_heads: int, max_seq_len: int,
                         num_sms: int) -> Optional[int]:
    """The slices of a second decode graph for steps whose longest context is at most
    SHORT_CONTEXT_TOKENS, or None where the graph planned for max_seq_len (the block
    table's longest context) has no more slices than that already."""
    if not SHORT_CONTEXT_GRAPHS or max_seq_len <= SHORT_CONTEXT_TOKENS or \
            choose_num_splits(num_decode_reqs, num_kv_heads, max_seq_len, num_sms) <= \
            SHORT_CONTEXT_SPLITS:
        return None
    return SHORT_CONTEXT_SPLITS


def decode_tile_config(dtype: torch.dtype, kv_fp8: bool = False) -> dict:
    """Key tile and launch options of the decode kernel.

    16-bit: 64-key tiles, 4 warps, 3 stages, the fastest of the tiles swept on the H200
    (docs/performance.md, "measured reasons"); an FP8 cache with 16-bit queries: the
    word kernel (below), which took 179 us for one Llama-8B layer at 256 x 1k where the
    tile kernel took 242 us and bf16 264 us (benchmarks/decode_tiles.py, the H200), 164
    us in its FP8 q.K form (FP8_QK_DOT); the tile kernel where the word kernel cannot
    run.

    Key "fp8_path" (FP8 cache, 16-bit queries) picks the kernel: "tile" (attend_kv_tile
    on converted tiles), "words_bits" or "words_cvt" (_decode_words_kernel, converting by
    bit operations or by Triton's e4m3 cast: the same speed measured, the cast kept) or
    "words_qk8" (the same kernel with the queries rounded to e4m3 and q.K one FP8 dot on
    the stored keys: K converted whole by Triton, not in planes; FP8_QK_DOT makes it the
    default) or "words_kq8"
    (that dot as keys x q^T, an FP8 wgmma on Hopper; 175 us at 5 stages, 171 at 4).
    Note on num_stages: the K / V
    loads depend on the block-table load of the same loop, and Triton 3.6 splits the
    stages between those two levels, so 2-4 stages give one K / V buffer (the next
    tile's copy waits for the current tile's math) and 5 / 7 / 9 give 2 / 3 / 4.

    The FP8 default with FP8_QK_DOT is FP8_WORD_TILES at every grid: "words_qk8" with
    query rows padded to 4 not 16 (config key "min_block_h"), the word kernel's three
    switches on (config keys "unmasked_k", "offsets_32", "ptx_pairs"; where a config
    lacks them the module's FP8_* switches decide), one K / V buffer. Without
    FP8_QK_DOT: "words_cvt" on FP8_CVT_TILES.
    """
    if dtype == torch.float32:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2)
    if kv_fp8:
        if FP8_QK_DOT:  # "words_qk8" unless the tiles (a benchmark's variant) name a path
            return {"fp8_path": "words_qk8", **FP8_WORD_TILES}
        return dict(FP8_CVT_TILES, fp8_path="words_cvt")
    return dict(BLOCK_N=64, num_warps=4, num_stages=3)


FP8_PATHS = ("tile", "words_bits", "words_cvt", "words_qk8", "words_kq8")
# The paths that round the queries to e4m3 (quantize_q_fp8_reference says how).
QUERY_ROUNDING_PATHS = ("words_qk8", "words_kq8")
# True: the FP8-cache default is "words_qk8" (queries rounded to e4m3, q.K one FP8 dot),
# 164 us for one Llama-8B layer at 256 x 1k where "words_cvt" takes 177, with no larger
# decode logprob error measured (docs/performance.md, 2026-12-03); False: "words_cvt"
# (benchmarks' --fp8-qk-dot off).
FP8_QK_DOT = True
# The FP8 decode's default (with FP8_QK_DOT): "words_qk8" on 128-key tiles, 4 warps, 2
# stages (one K / V buffer: 36 KB of shared memory, 117 registers, four programs an SM),
# a KV head's query rows padded to 4 (Llama-8B's group) instead of 16, so the softmax
# works on a quarter of the rows, and the three switches below on. It was the wide-grid
# default (batch 256) from the twenty-fourth session and is now the default at every
# grid: faster than the two-buffer tiles it replaced (FP8_CVT_TILES) in the Llama-8B
# batch-1 FP8-KV step as well (docs/performance.md, 2026-12-07, twenty-sixth session).
FP8_WORD_TILES = dict(BLOCK_N=128, num_warps=4, num_stages=2, fp8_path="words_qk8",
                      min_block_h=4, unmasked_k=True, offsets_32=True, ptx_pairs=True)
# "words_cvt" (FP8_QK_DOT off: no query rounding): 128-key tiles, 4 warps, 5 stages (two
# K / V buffers), the module's switches below: the "words_qk8" default's tiles at every
# grid before the twenty-fourth session, and at narrow grids (batch 1) until the
# twenty-sixth.
FP8_CVT_TILES = dict(BLOCK_N=128, num_warps=4, num_stages=5)
# Three switches of the word kernel, each fewer instructions a tile, for configs that do
# not set them (FP8_WORD_TILES does: on); off, they measured no gain or a loss at batch 1
# in the eighteenth session (docs/performance.md, 2026-12-06), which the twenty-fifth
# session's graph timer showed to be the launch's noise.
# True: the word kernel reads whole K tiles without masks
# (fp8_decode_words.attend_word_tile says why that is safe and why V stays masked);
# False: keys past the context end not loaded.
FP8_UNMASKED_K = False
# True: the word kernel computes cache offsets in int32 where a K or V half of the layer's
# cache spans at most 2 GiB (_offsets_fit_32); False: int64.
FP8_OFFSETS_32 = False
# True: on CUDA the word kernel converts V (and K planes) two entries per instruction
# (fp8_decode_words._e4m3_pairs_to_f16); False, and under the interpreter: Triton's
# conversion, one each.
FP8_PTX_PAIRS = False
# True: the decode and merge kernels load the request's query start and context length
# before the PDL wait (_wait_then_decode_row says why that is allowed); the block table
# stays inside the key loop (the ninth session's try also moved the first tile's rows
# out of it and measured slower: docs/performance.md, 2026-12-02). On: Qwen3-30B-A3B batch 1
# 2.600-2.605 -> 2.590-2.593 ms in one lease (docs/performance.md, 2026-12-03, fifteenth).
PRELOAD_METADATA = True


def quantize_q_fp8_reference(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What "words_qk8" does to the queries, in torch: q [..., head_dim] -> (e4m3 q,
    float32 scale [..., 1]) with q ~ e4m3 q * scale, the scale the smallest power of two
    that brings each head's largest |value| to at most 448 (1 for an all-zero head)."""
    q = q.float()
    wanted = q.abs().amax(-1, keepdim=True) * (1.0 / 448.0)  # the kernel's float32 product
    mantissa, exponent = torch.frexp(wanted)  # wanted = mantissa * 2^exponent, 0.5 <= m < 1
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # a power of two stays
    scale = torch.where(wanted > 0, torch.ldexp(torch.ones_like(wanted), exponent),
                        torch.ones_like(wanted))
    return (q / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _offsets_fit_32(kv_cache: torch.Tensor) -> bool:
    """Every byte offset into kv_cache[0] or kv_cache[1] fits int32 (at most 2^31 - 1), as
    the word kernel's int32 math needs: the products of a block id and the block stride
    included."""
    half = kv_cache[0]
    span = sum((size - 1) * stride for size, stride in zip(half.shape, half.stride())) + 1
    return span * half.element_size() <= 2 ** 31


def split_decode_config(cfg: dict, group: int) -> tuple[str, dict, int]:
    """Takes the keys that are not launch options out of a decode config (in place):
    (fp8_path, the word kernel's switches as its constexprs, BLOCK_H). The switches
    default to the module's FP8_* globals (before the wrapper's checks of the cache and
    device); BLOCK_H is the query heads of one KV head padded to a power of two and to at
    least min_block_h (16 fills an mma tile; fewer rows mean less softmax work on padding)."""
    fp8_path = cfg.pop("fp8_path", "tile")
    switches = dict(UNMASKED_K=cfg.pop("unmasked_k", FP8_UNMASKED_K),
                    OFFSETS_32=cfg.pop("offsets_32", FP8_OFFSETS_32),
                    PTX_PAIRS=cfg.pop("ptx_pairs", FP8_PTX_PAIRS))
    block_h = max(cfg.pop("min_block_h", 16), triton.next_power_of_2(group))
    return fp8_path, switches, block_h


def _words_path_ok(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The word kernel needs 16-bit queries, head_dim a power of two >= 64 (planes of at
    least 16 columns for the dots) and a cache whose rows start on 4-byte boundaries."""
    head_dim = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and head_dim >= 64
            and head_dim & (head_dim - 1) == 0 and kv_cache.data_ptr() % 4 == 0
            and all(stride % 4 == 0 for stride in kv_cache.stride()[:4]))


def paged_attention_decode(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, num_reqs: int, scale: float,
                           num_splits: int, min_split_tokens: int = MIN_SPLIT_TOKENS,
                           config: Optional[dict] = None,
                           kv_scales: Optional[torch.Tensor] = None) -> None:
    """Attention of every single-query-row request into out; other requests untouched.

    num_splits is a runtime argument (no recompilation when it changes); slices hold at
    least min_split_tokens tokens (rounded up to the key tile). config overrides
    decode_tile_config (benchmarks sweep it). An FP8 kv_cache needs kv_scales.
    """
    if num_reqs == 0:
        return
    check_kv_scales(kv_scales, kv_cache)
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    _, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    cfg = dict(config) if config is not None else decode_tile_config(q.dtype, kv_fp8)
    words_ok = kv_fp8 and _words_path_ok(q, kv_cache)
    if config is None and cfg.get("fp8_path", "tile") != "tile" and not words_ok:
        # The default's word kernel cannot take this cache or query: the tile kernel can.
        cfg = dict(BLOCK_N=128, num_warps=4, num_stages=4)
    fp8_path, switches, block_h = split_decode_config(cfg, group)
    if fp8_path not in FP8_PATHS:
        raise ValueError(f"fp8_path must be one of {FP8_PATHS}, got {fp8_path!r}")
    if fp8_path != "tile" and not words_ok:
        raise ValueError(f"fp8_path {fp8_path!r} needs an FP8 cache, 16-bit q and "
                         "head_dim a power of two >= 64")
    if num_splits > 1:
        partial_out = torch.empty(num_reqs, num_heads, num_splits, head_dim,
                                  dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32,
                                  device=q.device)
    else:  # unused: the kernel writes out directly
        partial_out = partial_lse = out
    args = (out, partial_out, partial_lse, q, kv_cache[0], kv_cache[1],
            kv_scales if kv_fp8 else seq_lens, block_tables, query_start_loc, seq_lens,
            scale * LOG2_E, num_splits, max(1, min_split_tokens),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    consts = dict(NUM_HEADS=num_heads, GROUP=group, BLOCK_H=block_h,
                  PAGE_SIZE=page_size, HEAD_DIM=head_dim, DIRECT_OUT=num_splits == 1)
    grid = (num_reqs, num_kv_heads, num_splits)
    pdl = dict(launch_options(q.device), PRELOAD_METADATA=PRELOAD_METADATA)
    if fp8_path == "tile":
        launched(_decode_kernel[grid](*args, **consts, IEEE_DOT=q.dtype == torch.float32,
                                      KV_FP8=kv_fp8, **cfg, **pdl))
    else:
        launched(_decode_words_kernel[grid](
            *args, **consts, BITS=fp8_path == "words_bits",
            QK_FP8=fp8_path in QUERY_ROUNDING_PATHS, KEYS_AS_A=fp8_path == "words_kq8",
            UNMASKED_K=switches["UNMASKED_K"],
            OFFSETS_32=switches["OFFSETS_32"] and _offsets_fit_32(kv_cache),
            PTX_PAIRS=switches["PTX_PAIRS"] and q.is_cuda, **cfg, **pdl))
    if num_splits > 1:
        launched(_merge_kernel[(num_reqs, num_heads)](
            out, partial_out, partial_lse, query_start_loc, num_splits,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits),
            **pdl,
        ))
