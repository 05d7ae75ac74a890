"""The Triton top-k of the lightning indexer's scores (imports triton; dsa_indexer.py
imports this module only when it launches the kernel).

Owns `launch_topk_positions`, `topk_launch` and `split_launches` (their arguments, also
compiled by tools/compile_sm90.py). The positions of the k largest of scores[n,
:row_len[n]] are found with row_len read on the device (nothing at or past it is
loaded), no host sync and no data-dependent shape, so a CUDA graph captured once serves
any lengths.

A radix select on the scores' float32 bits made order-preserving as uint32 (negatives
get every bit flipped, positives their sign bit; -0 counts as +0): each pass counts,
over the row's tokens whose key matches the digits found so far, the next 8-bit digit
(a 256-bin histogram), and takes the bin where the count from the top reaches the k
still wanted. Up to four passes give the k-th largest key exactly; a pass whose bin
holds exactly the tokens still wanted ends the search early. A last pass writes, in
position order, every token above that key and the first of those equal to it (the
tie rule: among equal scores the lowest positions win). A row of at most k tokens gets
0..row_len-1 without reading a score; unused slots get -1.

Many rows (a prefill, a large batch) take one program per row and one launch
(`_topk_positions_kernel`). Rows too few to fill the GPU (a decode step over long
contexts) are cut into segments, one program each, in six launches of
`_topk_split_kernel`: four add their segment's digit counts to the row's with atomics
(each program replays the earlier passes' choices from those counts, so no launch waits
on the host), one counts the segment's tokens above and tied with the threshold, and
the last writes the segment's picks after those of the segments before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.dsa_config import TopkTiles


@triton.jit
def _order_keys(x):
    """float32 -> uint32 keys in the floats' order (-inf lowest; -0 equal to +0)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, tl.zeros_like(bits), bits)
    negative = (bits >> 31) != 0
    return tl.where(negative, ~bits, bits | 0x80000000)


@triton.jit
def _digit_counts(row_ptr, lo, hi, prefix, shift, BLOCK: tl.constexpr):
    """Counts [256] of digit (key >> shift) & 255 over tokens lo..hi-1 whose key
    matches prefix above that digit."""
    counts = tl.zeros([256], dtype=tl.int32)
    # The bits above this digit: two shifts, since a shift by 32 is undefined.
    high = (tl.full([], 0xFFFFFFFF, tl.uint32) << shift) << 8
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < hi
        key = _order_keys(tl.load(row_ptr + offs, mask=inside, other=float("-inf")))
        match = inside & ((key & high) == prefix)
        digit = ((key >> shift) & 0xFF).to(tl.int32)
        counts += tl.histogram(digit, 256, mask=match)
    return counts


@triton.jit
def _pick_digit(counts, prefix, shift, wanted):
    """One pass's answer from its digit counts: (prefix, shift, wanted, searching) for
    the next pass, or, with searching false, the final (key, shift, wanted) of
    _select_threshold."""
    bins = tl.arange(0, 256)
    at_least = tl.cumsum(counts, 0, reverse=True)  # tokens with a digit >= bin
    digit = tl.max(tl.where(at_least >= wanted, bins, 0), 0)
    wanted -= tl.sum(tl.where(bins > digit, counts, 0), 0)
    in_bin = tl.sum(tl.where(bins == digit, counts, 0), 0)
    prefix |= digit.to(tl.uint32) << shift
    # A bin holding exactly the tokens still wanted is taken whole: no more passes.
    searching = (shift > 0) & (in_bin > wanted)
    return prefix, tl.where(searching, shift - 8, shift), wanted, searching


@triton.jit
def _select_threshold(row_ptr, length, K, BLOCK: tl.constexpr):
    """(key, shift, wanted): the row's k-th largest key agrees with `key` above bit
    shift; every token whose key >> shift exceeds key >> shift is among the k, and so
    are the first `wanted` whose key >> shift equals it."""
    prefix = tl.full([], 0, tl.uint32)
    wanted = tl.full([], 0, tl.int32) + K
    shift = tl.full([], 24, tl.uint32)
    searching = length > K
    while searching:
        counts = _digit_counts(row_ptr, 0, length, prefix, shift, BLOCK)
        prefix, shift, wanted, searching = _pick_digit(counts, prefix, shift, wanted)
    return prefix, shift, wanted


@triton.jit
def _tile_ranks(row_ptr, start, hi, top, shift, BLOCK: tl.constexpr):
    """Tokens start..start+BLOCK-1 (below hi): their offsets, whether each is above the
    threshold or tied with it, and both counts before each token, packed in one
    int32 (ties << 16: a tile holds fewer than 2**16 tokens, so one scan counts both)."""
    offs = start + tl.arange(0, BLOCK)
    inside = offs < hi
    high = _order_keys(tl.load(row_ptr + offs, mask=inside, other=float("-inf"))) >> shift
    is_above = inside & (high > top)
    is_tie = inside & (high == top)
    packed = is_above.to(tl.int32) + (is_tie.to(tl.int32) << 16)
    return offs, is_above, is_tie, tl.cumsum(packed, 0) - packed, tl.sum(packed, 0)


@triton.jit
def _write_selected(
    row_ptr, out_ptr, lo, hi, key, shift, wanted, above, ties, K, BLOCK: tl.constexpr
):
    """Writes, in position order, the tokens lo..hi-1 that _select_threshold's answer
    picks, given `above` tokens above the threshold and `ties` equal to it before lo;
    returns how many the row holds up to hi (k for a whole row longer than k)."""
    top = key >> shift
    start = lo
    while (start < hi) & (above + tl.minimum(ties, wanted) < K):
        offs, is_above, is_tie, before, total = _tile_ranks(row_ptr, start, hi, top, shift, BLOCK)
        # A token's slot: the tokens above before it plus the taken ties before it.
        ties_before = ties + (before >> 16)
        slot = above + (before & 0xFFFF) + tl.minimum(ties_before, wanted)
        take = is_above | (is_tie & (ties_before < wanted))
        tl.store(out_ptr + slot, offs, mask=take & (slot < K))
        above += total & 0xFFFF
        ties += total >> 16
        start += BLOCK
    return tl.minimum(above + tl.minimum(ties, wanted), K)


@triton.jit
def _write_leading(out_row, count, K, BLOCK: tl.constexpr):
    """0..count-1 then -1s into out_row[:K]."""
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_row + offs, tl.where(offs < count, offs, -1), mask=offs < K)


@triton.jit(do_not_specialize=["width"])
def _topk_positions_kernel(
    out_ptr,
    scores_ptr,
    row_len_ptr,
    width,
    stride_sn,
    stride_on,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = scores_ptr + row * stride_sn
    out_row = out_ptr + row * stride_on
    seen = tl.maximum(tl.load(row_len_ptr + row).to(tl.int32), 0)
    if seen > K:
        length = tl.minimum(seen, width)  # row_len <= width by contract; never read past it
        key, shift, wanted = _select_threshold(row_ptr, length, K, BLOCK)
        zero = tl.full([], 0, tl.int32)
        count = _write_selected(
            row_ptr, out_row, zero, length, key, shift, wanted, zero, zero, K, BLOCK
        )
        # A longer row fills all k (count < k only for scores outside the contract).
        for start in range(count, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(out_row + offs, tl.full([BLOCK], -1, tl.int32), mask=offs < K)
    else:  # every token, whatever its score: none is read
        _write_leading(out_row, seen, K, BLOCK)


@triton.jit
def _replay_passes(row_counts, PASSES: tl.constexpr, K, searching):
    """_select_threshold's state after PASSES passes, from their digit counts [4, 256]
    (summed over a row's segments): (prefix, shift, wanted, searching)."""
    prefix = tl.full([], 0, tl.uint32)
    wanted = tl.full([], 0, tl.int32) + K
    shift = tl.full([], 24, tl.uint32)
    for p in tl.static_range(PASSES):
        counts = tl.load(row_counts + p * 256 + tl.arange(0, 256))
        next_prefix, next_shift, next_wanted, next_searching = _pick_digit(
            counts, prefix, shift, wanted
        )
        # A search that ended earlier keeps its answer (later counts are all zero).
        prefix = tl.where(searching, next_prefix, prefix)
        shift = tl.where(searching, next_shift, shift)
        wanted = tl.where(searching, next_wanted, wanted)
        searching = searching & next_searching
    return prefix, shift, wanted, searching


@triton.jit(do_not_specialize=["width", "segment"])
def _topk_split_kernel(
    out_ptr,
    scores_ptr,
    row_len_ptr,
    counts_ptr,
    segments_ptr,
    width,
    segment,
    stride_sn,
    stride_on,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGE: tl.constexpr,
    PASSES: tl.constexpr,
    MAX_SEGMENTS: tl.constexpr,
):
    """Stage s < 4: pass s's digit counts of one segment of a row, added to the row's
    counts [4, 256]; stage 4: the segment's tokens above and tied with the threshold;
    stage 5: the segment's selected tokens, written after the earlier segments'.
    PASSES = min(STAGE, 4): the passes whose counts it replays."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row_ptr = scores_ptr + row * stride_sn
    row_counts = counts_ptr + row * (4 * 256)
    row_segments = segments_ptr + row * (2 * MAX_SEGMENTS)
    seen = tl.maximum(tl.load(row_len_ptr + row).to(tl.int32), 0)
    length = tl.minimum(seen, width)
    lo = tl.minimum(part * segment, length)
    hi = tl.minimum(lo + segment, length)
    key, shift, wanted, searching = _replay_passes(row_counts, PASSES, K, seen > K)
    if STAGE < 4:
        if searching & (lo < hi):
            counts = _digit_counts(row_ptr, lo, hi, key, shift, BLOCK)
            tl.atomic_add(row_counts + STAGE * 256 + tl.arange(0, 256), counts, sem="relaxed")
    elif STAGE == 4:
        top = key >> shift
        above = tl.full([], 0, tl.int32)
        ties = tl.full([], 0, tl.int32)
        if seen > K:
            for start in range(lo, hi, BLOCK):
                _, _, _, _, total = _tile_ranks(row_ptr, start, hi, top, shift, BLOCK)
                above += total & 0xFFFF
                ties += total >> 16
        tl.store(row_segments + part, above)
        tl.store(row_segments + MAX_SEGMENTS + part, ties)
    else:
        out_row = out_ptr + row * stride_on
        if seen > K:
            earlier = tl.arange(0, MAX_SEGMENTS) < part
            above = tl.sum(tl.load(row_segments + tl.arange(0, MAX_SEGMENTS), earlier, 0), 0)
            ties = tl.load(row_segments + MAX_SEGMENTS + tl.arange(0, MAX_SEGMENTS), earlier, 0)
            ties = tl.sum(ties, 0)
            _write_selected(row_ptr, out_row, lo, hi, key, shift, wanted, above, ties, K, BLOCK)
        elif part == 0:
            _write_leading(out_row, seen, K, BLOCK)


def topk_launch(
    out: torch.Tensor, scores: torch.Tensor, row_len: torch.Tensor, k: int, tiles: TopkTiles
) -> tuple[tuple[int], tuple, dict]:
    """(grid, args, kwargs) of the whole-row top-k kernel's launch over scores [N, W]
    into out [N, k]: what launch_topk_positions runs and tools/compile_sm90.py
    compiles."""
    args = (out, scores, row_len, scores.shape[1], scores.stride(0), out.stride(0))
    return (scores.shape[0],), args, dict(K=k, **tiles.launch())


def split_launches(
    out: torch.Tensor,
    scores: torch.Tensor,
    row_len: torch.Tensor,
    k: int,
    tiles: TopkTiles,
    segments: int,
) -> list[tuple[tuple[int, int], tuple, dict]]:
    """(grid, args, kwargs) of the split kernel's six launches, each row cut into
    `segments` parts (at most tiles.max_segments) of whole tiles; allocates their
    scratch (digit counts, zeroed, and each segment's counts)."""
    num_rows, width = scores.shape
    segments = min(segments, tiles.max_segments)
    segment = triton.cdiv(triton.cdiv(width, segments), tiles.block) * tiles.block
    segments = triton.cdiv(width, segment)
    counts = torch.zeros(num_rows, 4, 256, dtype=torch.int32, device=scores.device)
    parts = torch.empty(num_rows, 2, tiles.max_segments, dtype=torch.int32, device=scores.device)
    args = (out, scores, row_len, counts, parts, width, segment, scores.stride(0), out.stride(0))
    launch = dict(K=k, MAX_SEGMENTS=tiles.max_segments, **tiles.launch())
    # Stage s replays the min(s, 4) passes before it.
    stages = [dict(STAGE=stage, PASSES=min(stage, 4), **launch) for stage in range(6)]
    return [((num_rows, segments), args, kwargs) for kwargs in stages]


def launch_topk_positions(
    out: torch.Tensor,
    scores: torch.Tensor,
    row_len: torch.Tensor,
    k: int,
    tiles: TopkTiles,
    segments: int = 1,
) -> None:
    """The top-k kernel over whole rows (segments == 1: one launch), or the split
    kernel's six launches with each row cut into `segments` parts (arguments checked by
    dsa_indexer.topk_positions)."""
    if segments <= 1:
        grid, args, kwargs = topk_launch(out, scores, row_len, k, tiles)
        _topk_positions_kernel[grid](*args, **kwargs)
        return
    for grid, args, kwargs in split_launches(out, scores, row_len, k, tiles, segments):
        _topk_split_kernel[grid](*args, **kwargs)
