"""Triton flash attention for MLA's decompressed path (prefill chunks), forward only.

Owns `mla_prefill_attention` and its tile table `prefill_tile_table`; its tiles and
launch options come from an MLAKernelConfig (mla_config.py). Reference: pagoda.attention.mla_backend.prefill_attention
on the assembled q = [q_nope, q_rope], k = [k_nope, k_rope expanded over heads], v.

The inputs are the pieces the layer (pagoda/model/layers/mla.py) already holds, read in
place through their strides:
- q_nope [T, H, Dn] and q_rope [T, H, Dr] (rotated): every row of the step; prefill
  row p is step row q_rows[p] (the plan's prefill_rows), so no gathered copy is made;
- k_nope [C, H, Dn] and v [C, H, Dv]: the two halves of kv_b_proj's output viewed as
  [C, H, Dn + Dv]; k_rope [C, Dr]: the rope part of the gathered latent entries, one
  key shared by every head (never expanded);
- out [T, H, Dv]: the kernel writes rows q_rows of it and nothing else.
A query/key score is q_nope . k_nope + q_rope . k_rope: two dots into one tile.

Chunks: chunk c holds prefill rows [row_start, row_end) and context rows [ctx_start,
ctx_end) of k_nope / k_rope / v. Its query row j (of qlen) sits at position klen -
qlen + j of its klen context rows and sees positions 0 .. klen - qlen + j (causal after
a cached prefix when klen > qlen).

Tiles: the host splits every chunk into tiles of at most BLOCK_M consecutive rows and
writes one row [q_start, q_end, ctx_start, first_pos] per tile (int32 [num_tiles, 4]):
its prefill rows, its chunk's first context row and the position of its first row.
Tiles are listed longest context first, so the heaviest programs start first. One
program per (tile, head), heads fastest (the programs of one tile share its q_rows and
k_rope reads). Keys before first_pos + 1 (rounded down to BLOCK_N) are visible to every
row of the tile: no masks there; the tiles from there to the tile's last position are
masked (causal, and never loaded past it); later keys are skipped.

Online softmax in base 2 (scale * log2(e) folded into one factor, exp2), float32
accumulation whatever the input dtype; float32 inputs use IEEE dots. Head widths are
powers of two; those under 16 (tl.dot's smallest) are padded, masked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.mla_config import MLAKernelConfig
from pagoda.kernels.attention.paged_attention import LOG2_E

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE_FIELDS = 4  # q_start, q_end, ctx_start, first_pos


@triton.jit
def _dot(a, b, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _load_rows(ptrs, row_ok, dims, D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """ptrs [R, BLOCK_D]: rows outside row_ok (MASK_ROWS) and padded dims read as 0,
    never loaded; the unmasked case is a plain load."""
    if MASK_ROWS:
        if BLOCK_D > D:
            x = tl.load(ptrs, mask=row_ok[:, None] & (dims < D)[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        if BLOCK_D > D:
            x = tl.load(ptrs, mask=(dims < D)[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q_n,
    q_r,
    kn_base,
    kr_base,
    v_base,
    start_n,
    kv_end,
    q_pos,
    qk_scale,
    stride_kn_c,
    stride_kr_c,
    stride_v_c,
    DN: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DN: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """Folds context rows start_n .. start_n + BLOCK_N - 1 into (acc, m_i, l_i).

    The *_base pointers sit at the chunk's first context row (and the program's head).
    MASKED: keys at or past kv_end are not loaded and each row drops keys after its
    position q_pos; otherwise every key of the tile must be visible to every row.
    """
    n = start_n + tl.arange(0, BLOCK_N)
    dn, dr, dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    n_ok = n < kv_end
    n64 = n.to(tl.int64)[:, None]  # a long context times H * (Dn + Dv) may pass 2^31
    k_n = _load_rows(kn_base + n64 * stride_kn_c + dn[None, :], n_ok, dn, DN, BLOCK_DN, MASKED)
    k_r = _load_rows(kr_base + n64 * stride_kr_c + dr[None, :], n_ok, dr, DR, BLOCK_DR, MASKED)
    s = _dot(q_n, tl.trans(k_n), IEEE_DOT) + _dot(q_r, tl.trans(k_r), IEEE_DOT)
    s = s * qk_scale
    if MASKED:
        # Causal only: a real row's position is below kv_end, so it drops every key
        # that was not loaded; rows past the tile's end are never stored.
        s = tl.where(n[None, :] <= q_pos[:, None], s, float("-inf"))
    # Key 0 is in the first tile folded and visible to every row: m_i is finite from
    # then on, so rows with no visible key in a later masked tile get p = 0, not NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_base + n64 * stride_v_c + dv[None, :], n_ok, dv, DV, BLOCK_DV, MASKED)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_DOT)
    return acc, m_new, l_i


@triton.jit
def _mla_prefill_kernel(
    out_ptr,
    qn_ptr,
    qr_ptr,
    kn_ptr,
    kr_ptr,
    v_ptr,
    q_rows_ptr,
    tiles_ptr,
    qk_scale,
    stride_qn_t,
    stride_qn_h,
    stride_qr_t,
    stride_qr_h,
    stride_kn_c,
    stride_kn_h,
    stride_kr_c,
    stride_v_c,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    DN: tl.constexpr,
    DR: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DN: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    tile = tl.program_id(0) // NUM_HEADS
    head = tl.program_id(0) % NUM_HEADS
    info = tiles_ptr + tile * 4
    q_start = tl.load(info)
    q_end = tl.load(info + 1)  # q_end - q_start <= BLOCK_M (checked on the host)
    ctx_start = tl.load(info + 2).to(tl.int64)  # offsets of C * H * D may pass 2^31
    first_pos = tl.load(info + 3)
    i = tl.arange(0, BLOCK_M)
    row_ok = q_start + i < q_end
    rows = tl.load(q_rows_ptr + q_start + i, mask=row_ok, other=0).to(tl.int64)
    q_pos = first_pos + i
    kv_end = first_pos + (q_end - q_start)  # one past the tile's last position

    dn, dr, dv = tl.arange(0, BLOCK_DN), tl.arange(0, BLOCK_DR), tl.arange(0, BLOCK_DV)
    q_n = _load_rows(
        qn_ptr + rows[:, None] * stride_qn_t + head * stride_qn_h + dn[None, :],
        row_ok,
        dn,
        DN,
        BLOCK_DN,
        True,
    )
    q_r = _load_rows(
        qr_ptr + rows[:, None] * stride_qr_t + head * stride_qr_h + dr[None, :],
        row_ok,
        dr,
        DR,
        BLOCK_DR,
        True,
    )
    kn_base = kn_ptr + ctx_start * stride_kn_c + head * stride_kn_h
    kr_base = kr_ptr + ctx_start * stride_kr_c
    v_base = v_ptr + ctx_start * stride_v_c + head * stride_v_h

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    all_visible_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    for start_n in range(0, all_visible_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q_n,
            q_r,
            kn_base,
            kr_base,
            v_base,
            start_n,
            kv_end,
            q_pos,
            qk_scale,
            stride_kn_c,
            stride_kr_c,
            stride_v_c,
            DN,
            DR,
            DV,
            BLOCK_DN,
            BLOCK_DR,
            BLOCK_DV,
            BLOCK_N,
            False,
            IEEE_DOT,
        )
    for start_n in range(all_visible_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q_n,
            q_r,
            kn_base,
            kr_base,
            v_base,
            start_n,
            kv_end,
            q_pos,
            qk_scale,
            stride_kn_c,
            stride_kr_c,
            stride_v_c,
            DN,
            DR,
            DV,
            BLOCK_DN,
            BLOCK_DR,
            BLOCK_DV,
            BLOCK_N,
            True,
            IEEE_DOT,
        )

    out = acc / l_i[:, None]  # l_i >= 1 on every row: its largest score gives exp2(0)
    o_ptrs = out_ptr + rows[:, None] * stride_o_t + head * stride_o_h + dv[None, :]
    if BLOCK_DV > DV:
        tl.store(
            o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < DV)[None, :]
        )
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_tile_table(
    chunks: Sequence[tuple[int, int, int, int]], block_m: int
) -> list[list[int]]:
    """The tile rows [q_start, q_end, ctx_start, first_pos] of chunks given as
    (row_start, row_end, ctx_start, ctx_end), tiles of at most block_m rows, longest
    context first (ties in chunk order). Host lists: the caller copies them once."""
    tiles = []
    for row_start, row_end, ctx_start, ctx_end in chunks:
        qlen, klen = row_end - row_start, ctx_end - ctx_start
        if not 0 < qlen <= klen:
            raise ValueError(f"a chunk needs 0 < query rows <= context rows, got {qlen}, {klen}")
        for start in range(row_start, row_end, block_m):
            tiles.append(
                [start, min(start + block_m, row_end), ctx_start, klen - qlen + start - row_start]
            )
    tiles.sort(key=lambda t: t[3] + t[1] - t[0], reverse=True)
    return tiles


def supports_widths(dn: int, dr: int, dv: int) -> bool:
    """Whether the kernel takes these head widths (powers of two)."""
    return all(d > 0 and not d & (d - 1) for d in (dn, dr, dv))


def _check_inputs(out, q_nope, q_rope, k_nope, k_rope, v) -> None:
    tensors = (out, q_nope, q_rope, k_nope, k_rope, v)
    if len({t.dtype for t in tensors}) != 1 or q_nope.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            "out, q and k/v pieces must share one of float16, bfloat16, float32; "
            f"got {[t.dtype for t in tensors]}"
        )
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("every input needs a contiguous last dimension")
    (T, H, dn), dr, dv = q_nope.shape, q_rope.shape[-1], v.shape[-1]
    C = k_nope.shape[0]
    shapes_ok = (
        q_rope.shape == (T, H, dr)
        and out.shape == (T, H, dv)
        and k_nope.shape == (C, H, dn)
        and k_rope.shape == (C, dr)
        and v.shape == (C, H, dv)
    )
    if not shapes_ok:
        raise ValueError(
            f"shapes must be q_nope [T, H, Dn], q_rope [T, H, Dr], out [T, H, Dv], k_nope "
            f"[C, H, Dn], k_rope [C, Dr], v [C, H, Dv]; got {tuple(q_nope.shape)}, "
            f"{tuple(q_rope.shape)}, {tuple(out.shape)}, {tuple(k_nope.shape)}, "
            f"{tuple(k_rope.shape)}, {tuple(v.shape)}"
        )
    if not supports_widths(dn, dr, dv):
        raise ValueError(f"head widths must be powers of two, got {dn}, {dr}, {dv}")


def mla_prefill_attention(
    out: torch.Tensor,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    q_rows: torch.Tensor,
    tiles: torch.Tensor,
    tile_rows: int,
    scale: float,
    config: MLAKernelConfig | None = None,
) -> None:
    """Causal attention of the prefill rows into out's rows q_rows (see the module
    docstring). tiles: prefill_tile_table(chunks, tile_rows) on the device (int32
    [num_tiles, 4]); config: the kernel's tiles (default: MLAKernelConfig.for_device),
    whose block_m must hold tile_rows rows."""
    _check_inputs(out, q_nope, q_rope, k_nope, k_rope, v)
    launch = (
        (config or MLAKernelConfig.for_device(q_nope.device)).prefill_tiles(q_nope.dtype).launch()
    )
    if tile_rows > launch["BLOCK_M"]:
        raise ValueError(f"tiles of {tile_rows} rows do not fit BLOCK_M {launch['BLOCK_M']}")
    if tiles.dim() != 2 or tiles.shape[1] != TILE_FIELDS or tiles.dtype != torch.int32:
        raise ValueError(
            f"tiles must be int32 [num_tiles, {TILE_FIELDS}], got "
            f"{tiles.dtype} {tuple(tiles.shape)}"
        )
    num_tiles, num_heads = tiles.shape[0], q_nope.shape[1]
    if num_tiles == 0:
        return
    dn, dr, dv = q_nope.shape[-1], q_rope.shape[-1], v.shape[-1]
    _mla_prefill_kernel[(num_tiles * num_heads,)](
        out,
        q_nope,
        q_rope,
        k_nope,
        k_rope,
        v,
        q_rows,
        tiles.contiguous(),
        scale * LOG2_E,
        q_nope.stride(0),
        q_nope.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_rope.stride(0),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        DN=dn,
        DR=dr,
        DV=dv,
        BLOCK_DN=max(16, dn),
        BLOCK_DR=max(16, dr),
        BLOCK_DV=max(16, dv),
        IEEE_DOT=q_nope.dtype == torch.float32,
        **launch,
    )
