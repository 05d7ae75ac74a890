"""The FP8-KV decode kernel's tile step on a cache read as int32 words (decode only):
`attend_word_tile` and the byte-plane conversions it uses (`word_planes`), for
paged_decode_words._decode_words_kernel.

Why words: Triton 3.6 lowers the e4m3 tiles of attend_kv_tile's dots with one
shared-memory load per byte (LDS.U8) and holds whole converted tiles in registers (216
per thread at 128-key tiles: two programs per SM). Read as int32 words instead, each
word holds the entries of dims 4i .. 4i + 3; "byte plane" j is the [tokens, HEAD_DIM / 4]
tile of entries 4i + j, and P.V is four dots whose outputs are the output columns
4i + j: no shuffle of the entries, word loads from shared memory, and about 120
registers per thread. The keys are read as stored, e4m3, for q.K as one FP8 dot with
the queries rounded to e4m3 (paged_decode_words._load_q_fp8).
"""

import triton
import triton.language as tl


@triton.jit
def _f16_halves(x):
    lo = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _e4m3_plane(w, SHIFT: tl.constexpr):
    """Byte SHIFT / 8 of each word as float16, exact (Triton's own e4m3 conversion)."""
    return ((w >> SHIFT) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _e4m3_pairs_to_f16(x):
    """int32 x -> float16 pairs: bytes 0 and 1 of x as the low and high half of the result
    (one cvt.rn.f16x2.e4m3x2 for both; inline PTX, CUDA only), exact."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 pair; cvt.u16.u32 pair, $1; cvt.rn.f16x2.e4m3x2 $0, pair; }",
        "=r,r",
        [x],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def word_planes(w, PTX_PAIRS: tl.constexpr):
    """int32 words [N, W] of four e4m3 entries -> the four byte planes as float16 [N, W],
    exact: PTX_PAIRS by one conversion per two entries (_e4m3_pairs_to_f16, CUDA only),
    else by Triton's conversion, which takes one per entry (the interpreter's form)."""
    if PTX_PAIRS:
        b0, b1 = _f16_halves(_e4m3_pairs_to_f16(w))
        b2, b3 = _f16_halves(_e4m3_pairs_to_f16(w >> 16))
    else:
        b0 = _e4m3_plane(w, 0)
        b1 = _e4m3_plane(w, 8)
        b2 = _e4m3_plane(w, 16)
        b3 = _e4m3_plane(w, 24)
    return b0, b1, b2, b3


@triton.jit
def attend_word_tile(
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
    qk_scale,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    OFFSETS_32: tl.constexpr,
    PTX_PAIRS: tl.constexpr,
):
    """attend_kv_tile for an FP8 cache read as words: keys start_n .. start_n + BLOCK_N - 1
    (those at or past kv_end loaded, and given probability 0) folded into the per-plane
    accumulators a0..a3 ([BLOCK_H, HEAD_DIM / 4], columns 4i + j of the output).
    q8 is the e4m3 query tile [BLOCK_H, HEAD_DIM] and the scores are one FP8 dot with
    the key tile as stored; qk_scale holds the query rows' scales too ([BLOCK_H, 1])."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    words = tl.arange(0, HEAD_DIM // 4)
    n_ok = offs_n < kv_end
    page = tl.load(block_table_ptr + offs_n // PAGE_SIZE, mask=n_ok, other=0)
    if not OFFSETS_32:  # the host found a cache half of 2 GiB or more
        page = page.to(tl.int64)
    # The whole K tile is read, keys past kv_end from their own block or block 0 (page
    # 0 above), any bytes there: their scores are replaced by -inf below (a where, so
    # even a NaN score drops out); fewer instructions a tile than masked loads. V stays
    # masked: a stale V slot of a reused block could hold a NaN (store_kv keeps NaN as
    # NaN), and 0 * NaN is NaN.
    byte_rows = (
        page * stride_cache_block
        + (offs_n % PAGE_SIZE) * stride_cache_tok
        + kv_head * stride_cache_head
    )
    rows = byte_rows // 4  # byte offsets -> word offsets
    offsets = rows[:, None] + words[None, :]
    dims = tl.arange(0, HEAD_DIM)
    k8 = tl.load(
        k_words_ptr.to(tl.pointer_type(tl.float8e4nv)) + byte_rows[:, None] + dims[None, :]
    )
    s = tl.dot(q8, tl.trans(k8))
    s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v0, v1, v2, v3 = word_planes(
        tl.load(v_words_ptr + offsets, mask=n_ok[:, None], other=0), PTX_PAIRS
    )
    p = p.to(tl.float16)
    a0 = tl.dot(p, v0, a0 * alpha[:, None])
    a1 = tl.dot(p, v1, a1 * alpha[:, None])
    a2 = tl.dot(p, v2, a2 * alpha[:, None])
    a3 = tl.dot(p, v3, a3 * alpha[:, None])
    return a0, a1, a2, a3, m_new, l_i
