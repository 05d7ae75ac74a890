"""Split-K paged decode over an FP8 cache read as int32 words (decode only):
`_decode_words_kernel`, with the queries rounded to e4m3 on the device (`_load_q_fp8`)
and the four byte planes' outputs written through paged_decode_slices
(`_write_word_planes`). Its tile step is fp8_decode_words.attend_word_tile, whose
docstring says why words. paged_decode launches it (words_kernel_reads says for which
caches and queries) and holds the torch reference of its query rounding
(quantize_q_fp8_reference).
"""

import triton
import triton.language as tl

from pagoda.kernels.attention.fp8_decode_words import attend_word_tile
from pagoda.kernels.attention.paged_attention import add_sink
from pagoda.kernels.attention.paged_decode_slices import (
    _slice_bounds,
    _wait_then_decode_row,
    _write_slice,
)


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


@triton.jit(do_not_specialize=["num_splits", "min_split", "stride_bt", "window"])
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
    window=0,
    SLIDING: tl.constexpr = False,
    sinks_ptr=None,
    HAS_SINKS: tl.constexpr = False,
):
    """_decode_kernel for an FP8 cache and 16-bit queries, the cache read as int32 words
    (the byte planes of fp8_decode_words); same grid, slices, workspace and merge. The
    queries are rounded to e4m3 (a power-of-two scale per head) and q.K is one FP8 dot
    on the key tile as stored; P.V reads V as words. OFFSETS_32: cache offsets in int32
    (the host found every offset within 2 GiB); PTX_PAIRS: V converted two entries per
    instruction (fp8_decode_words.word_planes). SLIDING: the slices cover the last
    window keys only (paged_decode_slices._slice_bounds). HAS_SINKS (one slice only: the
    merge adds the sinks otherwise): the sink joins each head's sum here."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row, q_len, seq_len = _wait_then_decode_row(query_start_loc_ptr, seq_lens_ptr, req, USE_PDL)
    if q_len != 1:
        return
    kv_start, kv_end = _slice_bounds(
        seq_len, split, num_splits, min_split, BLOCK_N, window, SLIDING
    )

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

    if HAS_SINKS and DIRECT_OUT:  # out * l / (l + sink term), folded into the V scale
        v_scale = v_scale * (l_i / add_sink(l_i, m_i, sinks_ptr, head, head_ok))
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
