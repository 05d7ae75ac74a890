"""Triton paged attention for query chunks of any length (prefill, chunked prefill, spec decode).

Owns the shared inner step `attend_kv_tile` (one tile of keys/values gathered from the
paged cache through the block table, folded into an online softmax) and the chunk
kernel `paged_attention_chunks`.

Tiling. A program owns BLOCK_Q consecutive query tokens of one request and all the
query heads that share one KV head (GQA): its tile has BLOCK_Q * GROUP_PAD rows, row r
being token r // GROUP_PAD, head r % GROUP_PAD of the group, so each K/V tile is loaded
once for the whole group. The grid is (query tiles, kv heads).

Which program serves which request, without a host sync: request i owns the tile ids
query_start_loc[i] // BLOCK_Q + i ... (exclusive) query_start_loc[i + 1] // BLOCK_Q + i + 1.
That range holds at least cdiv(query_len_i, BLOCK_Q) ids, the ranges of consecutive
requests do not overlap, and all of them fit in num_tokens // BLOCK_Q + num_reqs ids; a
program binary-searches query_start_loc for its request and exits if its tile is past the
request's last query token.

Sliding window (SLIDING, a layer's window W passed per call): a query at position p sees
keys p - W + 1 .. p. A tile of queries skips the key tiles wholly left of its first
row's window, masks the tiles that straddle some row's window start (as it masks the
causal edge) and runs the tiles inside every row's window unmasked.

Attention sinks (HAS_SINKS, float32 [num_heads] logits, gpt-oss): after the last key
tile each row's sum gains exp2(sink * log2(e) - m), the sink's share of the softmax
denominator at the row's running max; the sink has no value, so acc is unchanged
(``add_sink``, which the decode kernels share).

Scores are kept in base 2 (scale * log2(e) folded into one factor) so the softmax uses
exp2; accumulation is float32 whatever the input dtype.

FP8 cache (KV_FP8, float8 e4m3 entries, attention/kv_quant.py): K and V tiles are
converted to q's dtype (exact: every e4m3 value is a float16/bfloat16/float32 value)
and the scales applied outside the matmuls: the K scale folded into the score factor,
the V scale into the output. Both are read from kv_scales (float32 [2]) on the device,
so a CUDA graph replays with whatever values the layer holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.store_kv import check_kv_scales

LOG2_E = 1.4426950408889634


@triton.jit
def attend_kv_tile(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    start_n,
    kv_limit,
    q_pos,
    qk_scale,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK_KV_END: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    window=0,
    SLIDING: tl.constexpr = False,
):
    """Folds keys start_n .. start_n + BLOCK_N - 1 into (acc, m_i, l_i).

    MASK_KV_END drops keys at or past kv_limit (never loaded: unused cache slots may hold
    anything, NaN included); CAUSAL also drops keys after each row's position q_pos;
    SLIDING (with MASK_KV_END) also drops keys at or before q_pos - window.
    Without MASK_KV_END every key of the tile must be visible to every row.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    if MASK_KV_END:
        n_ok = offs_n < kv_limit
        page = tl.load(block_table_ptr + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(block_table_ptr + offs_n // PAGE_SIZE).to(tl.int64)
    rows = (
        page * stride_cache_block
        + (offs_n % PAGE_SIZE) * stride_cache_tok
        + kv_head * stride_cache_head
    )
    kv_offsets = rows[:, None] + dims[None, :]
    if MASK_KV_END:
        k = tl.load(k_cache_ptr + kv_offsets, mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + kv_offsets)
    k = k.to(q.dtype)  # FP8 entries; a no-op otherwise
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if MASK_KV_END:
        keep = n_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            keep = keep & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK_KV_END:
        v = tl.load(v_cache_ptr + kv_offsets, mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_cache_ptr + kv_offsets)
    v = v.to(q.dtype)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def add_sink(l_i, m_i, sinks_ptr, head, head_ok):
    """l_i plus each row's sink term exp2(sink2 - m_i), sink2 = the head's sink logit in
    base 2. A row with no key (m_i = -inf) gets an infinite sum: an output of 0."""
    sink = tl.load(sinks_ptr + head, mask=head_ok, other=0.0) * 1.4426950408889634
    return l_i + tl.math.exp2(sink - m_i)


@triton.jit
def _attend_masked(
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
    q_pos,
    qk_scale,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    window,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """attend_kv_tile with every mask: the key end, causality and (SLIDING) the window."""
    return attend_kv_tile(
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
        q_pos,
        qk_scale,
        stride_cache_block,
        stride_cache_tok,
        stride_cache_head,
        PAGE_SIZE,
        BLOCK_N,
        HEAD_DIM,
        True,
        True,
        IEEE_DOT,
        window,
        SLIDING,
    )


@triton.jit
def _find_request(tile, query_start_loc_ptr, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose tile-id range (see the module docstring) holds `tile`."""
    lo = tile * 0
    hi = lo + num_reqs
    while lo < hi:  # first request whose range starts after `tile`
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        after = first_tile > tile
        hi = tl.where(after, mid, hi)
        lo = tl.where(after, lo, mid + 1)
    return lo - 1


# Step-varying ints are not specialised: each new value class would recompile mid-run.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
def _chunk_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_reqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    window,
    sinks_ptr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SKIP_SINGLE_TOKEN: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    # Last tiles first: under the causal mask they see the most keys (shorter tail).
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(tile, query_start_loc_ptr, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_tok = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    done = first_tok >= q_len
    if SKIP_SINGLE_TOKEN:  # decode rows are served by the split-K kernel
        done = done | (q_len == 1)
    if done:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    tok = first_tok + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM)
    tok64 = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q_pos = context_len + tok
    if KV_FP8:  # scores of stored keys, times k_scale: the scores of the real keys
        qk_scale = qk_scale * tl.load(kv_scales_ptr)
        if not IEEE_DOT:  # e4m3 -> float16 is one instruction per pair; -> bfloat16 is not
            q = q.to(tl.float16)

    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    first_pos = context_len + first_tok
    # Keys up to the tile's first query position are visible to every row: no masks there.
    all_visible_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    unmasked_start = 0
    masked_start = all_visible_end
    if SLIDING:
        # Keys left of the first row's window are skipped; from the first tile start at
        # or after the last row's window start, every key is inside every row's window.
        last_pos = context_len + tl.minimum(first_tok + BLOCK_Q, q_len) - 1
        window_lo = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        unmasked_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        unmasked_start = tl.maximum(unmasked_start, window_lo)
        masked_start = tl.maximum(all_visible_end, unmasked_start)
        for start_n in range(window_lo, tl.minimum(unmasked_start, kv_end), BLOCK_N):
            acc, m_i, l_i = _attend_masked(
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
                q_pos,
                qk_scale,
                stride_cache_block,
                stride_cache_tok,
                stride_cache_head,
                window,
                PAGE_SIZE,
                BLOCK_N,
                HEAD_DIM,
                IEEE_DOT,
                SLIDING,
            )
    for start_n in range(unmasked_start, all_visible_end, BLOCK_N):
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
            q_pos,
            qk_scale,
            stride_cache_block,
            stride_cache_tok,
            stride_cache_head,
            PAGE_SIZE,
            BLOCK_N,
            HEAD_DIM,
            False,
            False,
            IEEE_DOT,
        )
    for start_n in range(masked_start, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_masked(
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
            q_pos,
            qk_scale,
            stride_cache_block,
            stride_cache_tok,
            stride_cache_head,
            window,
            PAGE_SIZE,
            BLOCK_N,
            HEAD_DIM,
            IEEE_DOT,
            SLIDING,
        )

    if HAS_SINKS:
        l_i = add_sink(l_i, m_i, sinks_ptr, head, row_ok)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only rows past the chunk's end, never stored
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * tl.load(kv_scales_ptr + 1)
    tl.store(
        out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Sinks are None or float32 [num_heads] on q's device, contiguous."""
    if sinks is None:
        return
    num_heads = q.shape[1]
    if (
        sinks.shape != (num_heads,)
        or sinks.dtype != torch.float32
        or sinks.device != q.device
        or sinks.stride(0) != 1
    ):
        raise ValueError(
            f"sinks must be contiguous float32 [{num_heads}] on {q.device}, got "
            f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}"
        )


def check_sliding_window(sliding_window: int | None) -> None:
    """A window is None (full attention) or a positive number of keys."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def chunk_tile_config(group: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch options of the chunk kernel: BLOCK_Q * GROUP_PAD query rows.

    16-bit heads up to 128: 256 query rows x 64 keys, 8 warps, 3 stages, the fastest of
    the tiles swept on the H200 (docs/performance.md, "Measured reasons: Decode attention").
    """
    group_pad = triton.next_power_of_2(group)
    if dtype == torch.float32 or head_dim > 128:  # fp32 / wide heads: smaller tiles
        return dict(
            GROUP_PAD=group_pad,
            BLOCK_Q=max(1, 64 // group_pad),
            BLOCK_N=32 if dtype == torch.float32 else 64,
            num_warps=4,
            num_stages=2,
        )
    return dict(
        GROUP_PAD=group_pad, BLOCK_Q=max(1, 256 // group_pad), BLOCK_N=64, num_warps=8, num_stages=3
    )


def paged_attention_chunks(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    scale: float,
    skip_single_token: bool,
    config: dict | None = None,
    kv_scales: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal paged attention of the first num_tokens rows of q into out ([T, H, D] each).

    head_dim must be a power of two >= 16 (checked by the backend). skip_single_token
    leaves requests with one query row to the decode kernel. config overrides
    chunk_tile_config (benchmarks sweep it). An FP8 kv_cache needs kv_scales.
    sliding_window W: a query at position p sees keys p - W + 1 .. p only (None: all
    keys up to p). sinks (float32 [H]): each head's sink logit joins its softmax
    denominator.
    """
    if num_reqs == 0 or num_tokens == 0:
        return
    check_sliding_window(sliding_window)
    check_sinks(sinks, q)
    _, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    check_kv_scales(kv_scales, kv_cache)
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    cfg = dict(config) if config is not None else chunk_tile_config(group, head_dim, q.dtype)
    grid = (num_tokens // cfg["BLOCK_Q"] + num_reqs, num_kv_heads)
    _chunk_kernel[grid](
        out,
        q,
        kv_cache[0],
        kv_cache[1],
        kv_scales if kv_fp8 else seq_lens,
        block_tables,
        query_start_loc,
        seq_lens,
        num_reqs,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        sliding_window or 0,
        sinks if sinks is not None else seq_lens,
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        SKIP_SINGLE_TOKEN=skip_single_token,
        IEEE_DOT=q.dtype == torch.float32,
        KV_FP8=kv_fp8,
        SLIDING=sliding_window is not None,
        HAS_SINKS=sinks is not None,
        **cfg,
    )
