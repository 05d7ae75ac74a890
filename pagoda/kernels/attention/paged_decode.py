"""Triton split-K (flash-decoding) paged attention for decode rows (query length 1).

Owns `paged_attention_decode` and its tile kernel (`_decode_kernel`), `choose_num_splits`
and `min_split_tokens` (the split plan the MLA latent kernel shares), and
`short_context_splits` (the plan of a decode CUDA graph for short contexts). Tiles and
the graph plan come from a DecodeAttentionConfig (decode_config.py), which the caller
passes. Grid (requests, kv heads, splits): which context slice a program takes, how it
writes it and how the merge kernel combines the slices is paged_decode_slices.py's;
the launch depends on host values only through num_splits. The word kernel is
paged_decode_words.py's.

Attention sinks (HAS_SINKS): each head's sink logit joins its softmax denominator once.
With one slice the kernel that writes the output adds it (paged_attention.add_sink);
with several, the slices stay sink-free and the merge kernel adds it to the sum of the
slices' weights (paged_decode_slices).

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
from pagoda.kernels.attention.paged_attention import (
    LOG2_E,
    add_sink,
    attend_kv_tile,
    check_sinks,
    check_sliding_window,
)
from pagoda.kernels.attention.paged_decode_slices import (
    _merge_kernel,
    _slice_bounds,
    _wait_then_decode_row,
    _write_slice,
)
from pagoda.kernels.attention.paged_decode_words import _decode_words_kernel
from pagoda.kernels.attention.store_kv import check_kv_scales
from pagoda.kernels.launch.pdl import launch_options

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


# Step-varying ints are not specialised: each new value class would recompile mid-run.
@triton.jit(do_not_specialize=["num_splits", "min_split", "stride_bt", "window"])
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
    window=0,
    SLIDING: tl.constexpr = False,
    sinks_ptr=None,
    HAS_SINKS: tl.constexpr = False,
):
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
    # The one query sits at the last position: every key before kv_end is visible (and,
    # with a window, every key from kv_start on), so no causal or window mask (q_pos is
    # unused; kv_end stands in for it).
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
    if HAS_SINKS and DIRECT_OUT:  # one slice: the sink joins here (else in the merge)
        out = out * (l_i / add_sink(l_i, m_i, sinks_ptr, head, head_ok))[:, None]
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
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of every single-query-row request into out; other requests untouched.
    sliding_window W: the query (at position seq_len - 1) sees its last W keys only.
    sinks (float32 [H]): each head's sink logit joins its softmax denominator.

    num_splits is a runtime argument (no recompilation when it changes); slices hold at
    least min_split_tokens tokens (rounded up to the key tile). config: the tiles
    (default: DecodeAttentionConfig.for_device(q.device)). An FP8 kv_cache needs
    kv_scales.
    """
    if num_reqs == 0:
        return
    check_sliding_window(sliding_window)
    check_sinks(sinks, q)
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
    if sliding_window is not None:
        consts.update(window=sliding_window, SLIDING=True)
    sink_consts = {} if sinks is None else dict(sinks_ptr=sinks, HAS_SINKS=True)
    if num_splits == 1:
        consts.update(sink_consts)
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
            **sink_consts,
            **pdl,
        )
