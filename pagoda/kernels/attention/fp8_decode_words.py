"""The FP8-KV decode kernel's tile step on a cache read as int32 words (decode only):
`attend_word_tile` and the byte-plane conversions it uses (`word_planes`), for
paged_decode._decode_words_kernel.

Why words: Triton 3.6 lowers the e4m3 tiles of attend_kv_tile's dots with one
shared-memory load per byte (LDS.U8) and holds whole converted tiles in registers (216
per thread at 128-key tiles: two programs per SM). Read as int32 words instead, each
word holds the entries of dims 4i .. 4i + 3; "byte plane" j is the [tokens, HEAD_DIM / 4]
tile of entries 4i + j. The scores are the sum of four plane dots (q split the same way),
and P.V is four dots whose outputs are the output columns 4i + j: no shuffle of the
entries, word loads from shared memory, and about 120 registers per thread.
"""

import triton
import triton.language as tl


@triton.jit
def _e4m3_halves_to_f16(x):
    """int32 x with e4m3 bytes in bits 0-7 and 16-23 -> the same two entries as float16
    bit patterns in its two halves, each worth entry * 2^-8 (exact for every finite e4m3
    value, subnormals included: e4m3's exponent bias is 7, float16's 15). The NaN byte
    0x7F would read as 480 * 2^-8: store_kv clamps finite values to +-448 and writes it
    only for a NaN input; V slots past a request's end are never read, and K slots read
    past it (FP8_UNMASKED_K) get score -inf whatever they hold."""
    return ((x & 0x00800080) << 8) | ((x & 0x007F007F) << 7)


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
        "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def word_planes(w, BITS: tl.constexpr, PTX_PAIRS: tl.constexpr):
    """int32 words [N, W] of four e4m3 entries -> the four byte planes as float16 [N, W].
    BITS: by shifts and masks, worth entry * 2^-8 (see _e4m3_halves_to_f16); otherwise
    worth the entry: PTX_PAIRS by one conversion per two entries (_e4m3_pairs_to_f16,
    CUDA only), else by Triton's conversion, which takes one per entry."""
    if BITS:
        b0, b2 = _f16_halves(_e4m3_halves_to_f16(w))
        b1, b3 = _f16_halves(_e4m3_halves_to_f16(w >> 8))
    elif PTX_PAIRS:
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
    q0, q1, q2, q3, a0, a1, a2, a3, m_i, l_i, k_words_ptr, v_words_ptr, block_table_ptr,
    kv_head, start_n, kv_end, qk_scale,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
    QK_FP8: tl.constexpr, KEYS_AS_A: tl.constexpr, UNMASKED_K: tl.constexpr,
    OFFSETS_32: tl.constexpr, PTX_PAIRS: tl.constexpr,
):
    """attend_kv_tile for an FP8 cache read as words: keys start_n .. start_n + BLOCK_N - 1
    (those at or past kv_end masked: not loaded, or their keys with UNMASKED_K loaded and
    given probability 0) folded into the per-plane
    accumulators a0..a3 ([BLOCK_H, HEAD_DIM / 4], columns 4i + j of the output).
    QK_FP8: q0 is the whole e4m3 query tile [BLOCK_H, HEAD_DIM] (q2, q3 unused) and the
    scores are one FP8 dot with the key tile as stored; qk_scale then holds the query
    rows' scales too ([BLOCK_H, 1]). q1: q0 again, or with KEYS_AS_A, q0 transposed, and the
    dot is keys x q^T, [BLOCK_N, BLOCK_H], transposed back: with BLOCK_N a multiple of
    64 it qualifies for Hopper's FP8 wgmma (M = keys), which q x K^T (M = 16 padded
    heads) does not: Triton then converts both operands to float16 for mma.sync."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    words = tl.arange(0, HEAD_DIM // 4)
    n_ok = offs_n < kv_end
    page = tl.load(block_table_ptr + offs_n // PAGE_SIZE, mask=n_ok, other=0)
    if not OFFSETS_32:  # the host found a cache half of 2 GiB or more
        page = page.to(tl.int64)
    # UNMASKED_K: the whole K tile is read, keys past kv_end from their own block or
    # block 0 (page 0 above), any bytes there: their scores are replaced by -inf below
    # (a where, so even a NaN score drops out). V stays masked: a stale V slot of a
    # reused block could hold a NaN (store_kv keeps NaN as NaN), and 0 * NaN is NaN.
    k_ok = None if UNMASKED_K else n_ok[:, None]
    word_fill = None if UNMASKED_K else 0
    e4m3_fill = None if UNMASKED_K else 0.0
    byte_rows = (page * stride_cache_block + (offs_n % PAGE_SIZE) * stride_cache_tok
                 + kv_head * stride_cache_head)
    rows = byte_rows // 4  # byte offsets -> word offsets
    offsets = rows[:, None] + words[None, :]
    if QK_FP8:
        dims = tl.arange(0, HEAD_DIM)
        k8 = tl.load(k_words_ptr.to(tl.pointer_type(tl.float8e4nv)) + byte_rows[:, None]
                     + dims[None, :], mask=k_ok, other=e4m3_fill)
        if KEYS_AS_A:
            s = tl.trans(tl.dot(k8, q1))
        else:
            s = tl.dot(q0, tl.trans(k8))
    else:
        k0, k1, k2, k3 = word_planes(tl.load(k_words_ptr + offsets, mask=k_ok, other=word_fill),
                                      BITS, PTX_PAIRS)
        s = tl.dot(q0, tl.trans(k0))
        s = tl.dot(q1, tl.trans(k1), s)
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.dot(q3, tl.trans(k3), s)
    s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v0, v1, v2, v3 = word_planes(tl.load(v_words_ptr + offsets, mask=n_ok[:, None], other=0),
                                  BITS, PTX_PAIRS)
    p = p.to(tl.float16)
    a0 = tl.dot(p, v0, a0 * alpha[:, None])
    a1 = tl.dot(p, v1, a1 * alpha[:, None])
    a2 = tl.dot(p, v2, a2 * alpha[:, None])
    a3 = tl.dot(p, v3, a3 * alpha[:, None])
    return a0, a1, a2, a3, m_new, l_i
