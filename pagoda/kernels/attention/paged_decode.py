"""Triton split-K (flash-decoding) paged attention for decode rows (query length 1).

Owns `paged_attention_decode`, `choose_num_splits` and `min_split_tokens` (the split
plan the MLA latent kernel shares), and `short_context_splits` (the plan of a decode
CUDA graph for short contexts). Tiles and the graph plan come from a
DecodeAttentionConfig (decode_config.py), which the caller passes.

Grid (requests, kv heads, splits). A program takes the one query row of its request,
all query heads of one KV head (padded to a power of two, DecodeTiles.block_h), and
one slice of the context: tokens split * per_split .. (split + 1) * per_split - 1, where
per_split = max(cdiv(seq_len, num_splits), min_split_tokens) rounded up to BLOCK_N is
computed on the device from seq_lens. So the launch depends on host values only
through num_splits: a CUDA graph captured with a fixed num_splits stays correct for any
context length, and slices past a short request's end simply hold no tokens.

With num_splits == 1 the kernel writes the output directly. Otherwise each program
writes its slice's output (normalised by the slice's own softmax sum) and the slice's
log-sum-exp (base 2) to a float32 workspace, and a merge kernel with grid (requests, heads)
combines the slices: weights 2^(lse_s - max lse); empty slices (lse = -inf) weigh 0.
A separate merge kernel, not the last slice's program behind an arrival counter: the
counter form measures slower on the H200 (docs/performance.md, "Rejected designs").
num_splits is a runtime argument, so a changing split count does not recompile.
Requests whose query length is not 1 exit at once in both kernels. With PDL both load
the request's query start and context length before their wait
(_wait_then_decode_row says why that is safe).

FP8 cache (KV_FP8): in the tile kernel, as in the chunk kernel (paged_attention.py),
K / V tiles converted to q's dtype, the K scale folded into the score factor and the V
scale applied to each slice's output (the merge is linear in them), both read from
kv_scales on the device. With 16-bit queries the word kernel (_decode_words_kernel)
reads the cache as int32 words instead (fp8_decode_words says why), and rounds the
queries to e4m3 (one power-of-two scale per head, quantize_q_fp8_reference) so that
q.K is a single FP8 dot on the keys as stored, as FlashAttention-3's FP8 path does (on
sm_90 Triton lowers that dot, with few padded query rows, to float16 mma.sync and
converts the whole key tile for it: cheaper than converting the words, not free).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.decode_config import DecodeAttentionConfig
from pagoda.kernels.attention.fp8_decode_words import attend_word_tile
from pagoda.kernels.attention.paged_attention import LOG2_E, attend_kv_tile
from pagoda.kernels.attention.store_kv import check_kv_scales
from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release

# A slice shorter than this costs more in the merge than it saves in parallelism...
MIN_SPLIT_TOKENS = 256
# ...unless the unsplit grid (requests x KV heads) leaves most SMs idle, as a batch-1
# step does: then slices as short as this: batch 1, 1k context, 4 KV heads 9.7 us with 4
# slices, 6.1 with 16 (H200; docs/performance.md, "Measured reasons: Decode attention").
SMALL_GRID_MIN_SPLIT = 32
MAX_SPLITS = 32
# The grid fills the GPU when it holds this many programs an SM: choose_num_splits slices
# contexts until it does (up to MAX_SPLITS).
PROGRAMS_PER_SM = 4


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
def _slice_bounds(seq_len, split, num_splits, min_split, BLOCK_N: tl.constexpr):
    """[kv_start, kv_end) of this program's context slice (see the module docstring)."""
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


# Step-varying ints are not specialised: each new value class would recompile mid-run.
@triton.jit(do_not_specialize=["num_splits", "min_split", "stride_bt"])
def _decode_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    num_splits,
    min_split,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row, q_len, seq_len = _wait_then_decode_row(query_start_loc_ptr, seq_lens_ptr, req, USE_PDL)
    if q_len != 1:
        return
    kv_start, kv_end = _slice_bounds(seq_len, split, num_splits, min_split, BLOCK_N)

    h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + h
    head_ok = h < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
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
            q,
            acc,
            m_i,
            l_i,
            k_cache_ptr,
            v_cache_ptr,
            block_table_ptr,
            kv_head,
            start_n,
            kv_end,
            kv_end,
            qk_scale,
            stride_cache_block,
            stride_cache_tok,
            stride_cache_head,
            PAGE_SIZE,
            BLOCK_N,
            HEAD_DIM,
            True,
            False,
            IEEE_DOT,
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty slice: acc is 0, lse is -inf
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * tl.load(kv_scales_ptr + 1)
    _write_slice(
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
        NUM_HEADS,
        HEAD_DIM,
        DIRECT_OUT,
        True,
    )


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
    q = tl.load(
        q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None],
        other=0.0,
    ).to(tl.float32)
    wanted = tl.max(tl.abs(q), 1) * (1.0 / 448.0)
    # The smallest power of two >= wanted, and its inverse, from the exponent bits.
    exp_bits = (wanted.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    scale = tl.where(wanted > 0, exp_bits.to(tl.float32, bitcast=True), 1.0)
    inverse = tl.where(wanted > 0, ((254 << 23) - exp_bits).to(tl.float32, bitcast=True), 1.0)
    x = tl.minimum(tl.maximum(q * inverse[:, None], -448.0), 448.0)
    return _round_to_e4m3(x).to(tl.float8e4nv), scale


@triton.jit
def _write_word_planes(
    a0,
    a1,
    a2,
    a3,
    l_i,
    m_i,
    v_scale,
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
):
    """Stores the four planes' accumulators (plane j holds dims j, j + 4, ...), scaled by
    v_scale / the slice's sum, through _write_slice (the lse once, with plane 0). An
    empty slice's accumulators are 0 and its lse -inf."""
    factor = v_scale / tl.where(l_i == 0.0, 1.0, l_i)
    cols = tl.arange(0, HEAD_DIM // 4) * 4
    _write_slice(
        a0 * factor[:, None],
        l_i,
        m_i,
        cols,
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
        NUM_HEADS,
        HEAD_DIM,
        DIRECT_OUT,
        True,
    )
    _write_slice(
        a1 * factor[:, None],
        l_i,
        m_i,
        cols + 1,
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
        NUM_HEADS,
        HEAD_DIM,
        DIRECT_OUT,
        False,
    )
    _write_slice(
        a2 * factor[:, None],
        l_i,
        m_i,
        cols + 2,
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
        NUM_HEADS,
        HEAD_DIM,
        DIRECT_OUT,
        False,
    )
    _write_slice(
        a3 * factor[:, None],
        l_i,
        m_i,
        cols + 3,
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
        NUM_HEADS,
        HEAD_DIM,
        DIRECT_OUT,
        False,
    )


@triton.jit(do_not_specialize=["num_splits", "min_split", "stride_bt"])
def _decode_words_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    qk_scale,
    num_splits,
    min_split,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    OFFSETS_32: tl.constexpr = False,
    PTX_PAIRS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    """_decode_kernel for an FP8 cache and 16-bit queries, the cache read as int32 words
    (the byte planes of fp8_decode_words); same grid, slices, workspace and merge. The
    queries are rounded to e4m3 (a power-of-two scale per head) and q.K is one FP8 dot
    on the key tile as stored; P.V reads V as words. OFFSETS_32: cache offsets in int32
    (the host found every offset within 2 GiB); PTX_PAIRS: V converted two entries per
    instruction (fp8_decode_words.word_planes)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row, q_len, seq_len = _wait_then_decode_row(query_start_loc_ptr, seq_lens_ptr, req, USE_PDL)
    if q_len != 1:
        return
    kv_start, kv_end = _slice_bounds(seq_len, split, num_splits, min_split, BLOCK_N)

    h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + h
    head_ok = h < GROUP
    q8, q_scale = _load_q_fp8(q_ptr, q_row, head, head_ok, stride_qt, stride_qh, HEAD_DIM)
    a0 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_H, HEAD_DIM // 4], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    k_scale = tl.load(kv_scales_ptr)
    v_scale = tl.load(kv_scales_ptr + 1)
    k_words_ptr = k_cache_ptr.to(tl.pointer_type(tl.int32))
    v_words_ptr = v_cache_ptr.to(tl.pointer_type(tl.int32))
    score_scale = (qk_scale * k_scale * q_scale)[:, None]
    for start_n in range(kv_start, kv_end, BLOCK_N):
        a0, a1, a2, a3, m_i, l_i = attend_word_tile(
            q8,
            a0,
            a1,
            a2,
            a3,
            m_i,
            l_i,
            k_words_ptr,
            v_words_ptr,
            block_table_ptr,
            kv_head,
            start_n,
            kv_end,
            score_scale,
            stride_cache_block,
            stride_cache_tok,
            stride_cache_head,
            PAGE_SIZE,
            BLOCK_N,
            HEAD_DIM,
            OFFSETS_32,
            PTX_PAIRS,
        )

    _write_word_planes(
        a0,
        a1,
        a2,
        a3,
        l_i,
        m_i,
        v_scale,
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
        NUM_HEADS,
        HEAD_DIM,
        DIRECT_OUT,
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
    weight = tl.where(filled, tl.math.exp2(lse - tl.max(lse, 0)), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    # Empty slices were never written: do not read them (0 * garbage may be NaN).
    partial = tl.load(
        partial_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=filled[:, None],
        other=0.0,
    )
    out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
    )


def min_split_tokens(num_decode_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """The shortest context slice worth its own program: SMALL_GRID_MIN_SPLIT when the
    unsplit grid has fewer programs than the GPU has SMs, else MIN_SPLIT_TOKENS."""
    if num_decode_reqs * num_kv_heads < num_sms:
        return SMALL_GRID_MIN_SPLIT
    return MIN_SPLIT_TOKENS


def choose_num_splits(
    num_decode_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int
) -> int:
    """Context slices per (request, kv head): enough programs to fill the GPU about
    PROGRAMS_PER_SM times over, no slice under min_split_tokens, at most MAX_SPLITS."""
    min_split = min_split_tokens(num_decode_reqs, num_kv_heads, num_sms)
    if num_decode_reqs <= 0 or max_seq_len <= min_split:
        return 1
    by_length = triton.cdiv(max_seq_len, min_split)
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, num_decode_reqs * num_kv_heads)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def short_context_splits(
    num_decode_reqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    config: DecodeAttentionConfig,
) -> int | None:
    """The slices of a second decode graph for steps whose longest context is at most
    config.short_context_tokens, or None where the graph planned for max_seq_len (the
    block table's longest context) has no more slices than that already."""
    if (
        max_seq_len <= config.short_context_tokens
        or choose_num_splits(num_decode_reqs, num_kv_heads, max_seq_len, num_sms)
        <= config.short_context_splits
    ):
        return None
    return config.short_context_splits


def quantize_q_fp8_reference(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the word kernel does to the queries, in torch: q [..., head_dim] -> (e4m3 q,
    float32 scale [..., 1]) with q ~ e4m3 q * scale, the scale the smallest power of two
    that brings each head's largest |value| to at most 448 (1 for an all-zero head)."""
    q = q.float()
    wanted = q.abs().amax(-1, keepdim=True) * (1.0 / 448.0)  # the kernel's float32 product
    mantissa, exponent = torch.frexp(wanted)  # wanted = mantissa * 2^exponent, 0.5 <= m < 1
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # a power of two stays
    scale = torch.where(
        wanted > 0, torch.ldexp(torch.ones_like(wanted), exponent), torch.ones_like(wanted)
    )
    return (q / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _offsets_fit_32(kv_cache: torch.Tensor) -> bool:
    """Every byte offset into kv_cache[0] or kv_cache[1] fits int32 (at most 2^31 - 1), as
    the word kernel's int32 math needs: the products of a block id and the block stride
    included."""
    half = kv_cache[0]
    span = sum((size - 1) * stride for size, stride in zip(half.shape, half.stride())) + 1
    return span * half.element_size() <= 2**31


def words_kernel_reads(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the word kernel takes this call: an FP8 cache whose rows start on 4-byte
    boundaries, 16-bit queries, head_dim a power of two >= 64 (planes of at least 16
    columns for the dots). Elsewhere the tile kernel reads the FP8 cache."""
    head_dim = q.shape[-1]
    return (
        kv_cache.dtype == torch.float8_e4m3fn
        and q.dtype in (torch.float16, torch.bfloat16)
        and head_dim >= 64
        and head_dim & (head_dim - 1) == 0
        and kv_cache.data_ptr() % 4 == 0
        and all(stride % 4 == 0 for stride in kv_cache.stride()[:4])
    )


def paged_attention_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    scale: float,
    num_splits: int,
    min_split_tokens: int = MIN_SPLIT_TOKENS,
    config: DecodeAttentionConfig | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Attention of every single-query-row request into out; other requests untouched.

    num_splits is a runtime argument (no recompilation when it changes); slices hold at
    least min_split_tokens tokens (rounded up to the key tile). config: the tiles
    (default: DecodeAttentionConfig.for_device(q.device)). An FP8 kv_cache needs
    kv_scales.
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
    config = config or DecodeAttentionConfig.for_device(q.device)
    words = kv_fp8 and words_kernel_reads(q, kv_cache)
    tiles = config.tiles_for(q.dtype, kv_fp8, words)
    if num_splits > 1:
        partial_out = torch.empty(
            num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            num_reqs, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:  # unused: the kernel writes out directly
        partial_out = partial_lse = out
    args = (
        out,
        partial_out,
        partial_lse,
        q,
        kv_cache[0],
        kv_cache[1],
        kv_scales if kv_fp8 else seq_lens,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2_E,
        num_splits,
        max(1, min_split_tokens),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
    )
    consts = dict(
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_H=tiles.block_h(group),
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        DIRECT_OUT=num_splits == 1,
    )
    grid = (num_reqs, num_kv_heads, num_splits)
    pdl = launch_options(q.device)
    if words:
        _decode_words_kernel[grid](
            *args,
            **consts,
            OFFSETS_32=_offsets_fit_32(kv_cache),
            PTX_PAIRS=config.e4m3_pairs_ptx,
            **tiles.launch(),
            **pdl,
        )
    else:
        _decode_kernel[grid](
            *args,
            **consts,
            IEEE_DOT=q.dtype == torch.float32,
            KV_FP8=kv_fp8,
            **tiles.launch(),
            **pdl,
        )
    if num_splits > 1:
        _merge_kernel[(num_reqs, num_heads)](
            out,
            partial_out,
            partial_lse,
            query_start_loc,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            **pdl,
        )
