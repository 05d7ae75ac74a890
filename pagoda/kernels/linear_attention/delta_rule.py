"""Triton kernels of the gated delta rule over a pool of recurrent states.

The engine holds one state per sequence and layer in a pool ``[num_slots, Hv, Dk, Dv]``
(float32 by default) and names each sequence's slot with ``slot_ids [N]`` (int32; a
negative slot marks a padding row, which reads and writes nothing). Both kernels read a
sequence's state from its slot and write the final state back in place.

- ``gated_delta_rule_decode``: the recurrent form, one program per (sequence, value head,
  Dv tile) keeping its state tile in registers; one token per sequence (decode), or a
  few with ``cu_seqlens`` (draft verification), token after token, optionally writing
  the state after each token to a slot of its own (the states rejected drafts roll
  back to).
- ``gated_delta_rule_prefill``: the chunked (WY) form, one program per (sequence, value
  head, Dv tile) walking the sequence's chunks in order. Inside a chunk it builds the
  strictly lower system A (beta_i k_i . k_j decayed from j to i), inverts I + A by
  forward substitution, and turns the chunk into matrix products against the state.

Inputs follow reference.py: q, k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] (one gate per
head) or [T, Hv, Dk] (one per key channel), beta [T, Hv]; o comes back [T, Hv, Dv] in
v's dtype. A new sequence's slot must hold zeros (the allocator clears it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.linear_attention.config import (
    HOPPER,
    DecodeTiles,
    LinearAttentionKernelConfig,
    PrefillTiles,
)
from pagoda.kernels.linear_attention.reference import L2_EPS


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slot_ptr, cu_ptr, snap_ptr,
    num_k_heads, num_v_heads, dk, dv, scale, eps,
    HAS_CU: tl.constexpr, HAS_SNAPSHOTS: tl.constexpr, PER_CHANNEL_G: tl.constexpr,
    USE_L2NORM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    k_head = head // (num_v_heads // num_k_heads)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if HAS_CU:
        bos = tl.load(cu_ptr + seq)
        eos = tl.load(cu_ptr + seq + 1)
    else:
        bos = seq
        eos = seq + 1
    live = slot >= 0
    eos = tl.where(live, eos, bos)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k = offs_k < dk
    mask_v = offs_v < dv
    # The slot test broadcast to a tile: the interpreter rejects a tile mask and-ed with a scalar.
    mask_s = mask_k[:, None] & mask_v[None, :] & (offs_k[:, None] * 0 + slot >= 0)
    s_ptrs = state_ptr + ((slot * num_v_heads + head) * dk + offs_k[:, None]) * dv + offs_v[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        qk_base = (t * num_k_heads + k_head) * dk
        q = tl.load(q_ptr + qk_base + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_base + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if USE_L2NORM:
            q = q / tl.sqrt(tl.sum(q * q) + eps)
            k = k / tl.sqrt(tl.sum(k * k) + eps)
        q = q * scale
        v = tl.load(v_ptr + (t * num_v_heads + head) * dv + offs_v, mask=mask_v, other=0.0)
        beta = tl.load(beta_ptr + t * num_v_heads + head).to(tl.float32)
        if PER_CHANNEL_G:
            g = tl.load(g_ptr + (t * num_v_heads + head) * dk + offs_k, mask=mask_k, other=0.0)
            s = s * tl.exp(g.to(tl.float32))[:, None]
        else:
            s = s * tl.exp(tl.load(g_ptr + t * num_v_heads + head).to(tl.float32))
        predicted = tl.sum(s * k[:, None], axis=0)
        delta = (v.to(tl.float32) - predicted) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        o_ptrs = o_ptr + (t * num_v_heads + head) * dv + offs_v
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_v)
        if HAS_SNAPSHOTS:
            snap = tl.load(snap_ptr + t).to(tl.int64)
            snap_mask = mask_k[:, None] & mask_v[None, :] & (offs_k[:, None] * 0 + snap >= 0)
            snap_row = (snap * num_v_heads + head) * dk + offs_k[:, None]
            snap_ptrs = state_ptr + snap_row * dv + offs_v[None, :]
            tl.store(snap_ptrs, s.to(state_ptr.dtype.element_ty), mask=snap_mask)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask_s)


@triton.jit
def _row(tile, offs_t, i):
    """Row i of a [BT, X] register tile, as a [X] vector."""
    return tl.sum(tl.where(offs_t[:, None] == i, tile, 0.0), axis=0)


@triton.jit
def _pairwise_per_channel(q, k, g_cum, offs_t, BT: tl.constexpr):
    """k_i . k_j and q_i . k_j, each channel decayed by exp(G_i - G_j), for j <= i
    (zero above the diagonal). A column at a time: exp(G_i - G_j) <= 1 there, where a
    factorised exp(G_i) * exp(-G_j) would overflow over a long chunk of strong decay."""
    kk = tl.zeros((BT, BT), dtype=tl.float32)
    qk = tl.zeros((BT, BT), dtype=tl.float32)
    for j in range(BT):
        k_j = _row(k, offs_t, j)
        g_j = _row(g_cum, offs_t, j)
        below = (offs_t >= j)[:, None]
        decay = tl.exp(tl.where(below, g_cum - g_j[None, :], float("-inf")))
        kd_j = k_j[None, :] * decay
        column = offs_t[None, :] == j
        kk = tl.where(column, tl.sum(k * kd_j, axis=1)[:, None], kk)
        qk = tl.where(column, tl.sum(q * kd_j, axis=1)[:, None], qk)
    return kk, qk


@triton.jit
def _unit_lower_inverse(a, offs_t, BT: tl.constexpr):
    """(I + a)^-1 for a strictly lower [BT, BT] a, by forward substitution on rows."""
    eye = offs_t[:, None] == offs_t[None, :]
    inv = tl.where(eye, 1.0, 0.0)
    for i in range(1, BT):
        a_i = _row(a, offs_t, i)
        update = tl.sum(a_i[:, None] * inv, axis=0)
        inv = tl.where(offs_t[:, None] == i, inv - update[None, :], inv)
    return inv


@triton.jit
def _chunk_inputs(q_ptr, k_ptr, g_ptr, beta_ptr, pos, valid, head, k_head,
                  num_k_heads, num_v_heads, dk, scale, eps, offs_k, mask_k,
                  PER_CHANNEL_G: tl.constexpr, USE_L2NORM: tl.constexpr):  # fmt: skip
    """A chunk's q (scaled), k, cumulative log decay and beta, float32, zero past its end."""
    qk_off = (pos[:, None] * num_k_heads + k_head) * dk + offs_k[None, :]
    mask_qk = valid[:, None] & mask_k[None, :]
    q = tl.load(q_ptr + qk_off, mask=mask_qk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + qk_off, mask=mask_qk, other=0.0).to(tl.float32)
    if USE_L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=1) + eps)[:, None]
        k = k / tl.sqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    q = q * scale
    beta = tl.load(beta_ptr + pos * num_v_heads + head, mask=valid, other=0.0).to(tl.float32)
    if PER_CHANNEL_G:
        g_off = (pos[:, None] * num_v_heads + head) * dk + offs_k[None, :]
        g = tl.load(g_ptr + g_off, mask=mask_qk, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr + pos * num_v_heads + head, mask=valid, other=0.0).to(tl.float32)
    return q, k, tl.cumsum(g, axis=0), beta


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slot_ptr, cu_ptr,
    num_k_heads, num_v_heads, dk, dv, scale, eps,
    PER_CHANNEL_G: tl.constexpr, USE_L2NORM: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    k_head = head // (num_v_heads // num_k_heads)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    live = slot >= 0
    bos = tl.load(cu_ptr + seq)
    eos = tl.where(live, tl.load(cu_ptr + seq + 1), bos)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k = offs_k < dk
    mask_v = offs_v < dv
    # The slot test broadcast to a tile: the interpreter rejects a tile mask and-ed with a scalar.
    mask_s = mask_k[:, None] & mask_v[None, :] & (offs_k[:, None] * 0 + slot >= 0)
    s_ptrs = state_ptr + ((slot * num_v_heads + head) * dk + offs_k[:, None]) * dv + offs_v[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    strictly_lower = offs_t[:, None] > offs_t[None, :]
    for start in range(bos, eos, BT):
        pos = start + offs_t
        valid = pos < eos
        q, k, g_cum, beta = _chunk_inputs(
            q_ptr, k_ptr, g_ptr, beta_ptr, pos, valid, head, k_head, num_k_heads,
            num_v_heads, dk, scale, eps, offs_k, mask_k, PER_CHANNEL_G, USE_L2NORM,
        )  # fmt: skip
        if PER_CHANNEL_G:
            kk, qk = _pairwise_per_channel(q, k, g_cum, offs_t, BT)
            g_end = _row(g_cum, offs_t, BT - 1)  # padding adds no decay: the chunk's last token
            k_decayed = k * tl.exp(g_cum)
            q_decayed = q * tl.exp(g_cum)
            k_to_end = k * tl.exp(g_end[None, :] - g_cum)
            s_decay = tl.exp(g_end)[:, None]
        else:
            below = offs_t[:, None] >= offs_t[None, :]
            decay = tl.exp(tl.where(below, g_cum[:, None] - g_cum[None, :], float("-inf")))
            kk = tl.dot(k, tl.trans(k), input_precision="ieee") * decay
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
            g_end = tl.sum(tl.where(offs_t == BT - 1, g_cum, 0.0))
            k_decayed = k * tl.exp(g_cum)[:, None]
            q_decayed = q * tl.exp(g_cum)[:, None]
            k_to_end = k * tl.exp(g_end - g_cum)[:, None]
            s_decay = tl.exp(g_end)
        a = tl.where(strictly_lower, beta[:, None] * kk, 0.0)
        inv = _unit_lower_inverse(a, offs_t, BT)
        v_off = (pos[:, None] * num_v_heads + head) * dv + offs_v[None, :]
        mask_tv = valid[:, None] & mask_v[None, :]
        v = tl.load(v_ptr + v_off, mask=mask_tv, other=0.0).to(tl.float32)
        # u = (I + A)^-1 beta (v - (k * exp(G)) s): what each token writes into the state.
        w_v = tl.dot(inv, beta[:, None] * v, input_precision="ieee")
        w_k = tl.dot(inv, beta[:, None] * k_decayed, input_precision="ieee")
        u = w_v - tl.dot(w_k, s, input_precision="ieee")
        o = tl.dot(q_decayed, s, input_precision="ieee") + tl.dot(qk, u, input_precision="ieee")
        tl.store(o_ptr + v_off, o.to(o_ptr.dtype.element_ty), mask=mask_tv)
        s = s * s_decay + tl.dot(tl.trans(k_to_end), u, input_precision="ieee")
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask_s)


def _check(q, k, v, g, beta, state_pool, slot_ids):
    t, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    if q.shape != k.shape or v.shape[0] != t or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if g.shape not in ((t, num_v_heads), (t, num_v_heads, dk)):
        raise ValueError(f"g {tuple(g.shape)}: expected [T, Hv] or [T, Hv, Dk]")
    if beta.shape != (t, num_v_heads):
        raise ValueError(f"beta {tuple(beta.shape)}: expected {(t, num_v_heads)}")
    if state_pool.dim() != 4 or state_pool.shape[1:] != (num_v_heads, dk, dv):
        raise ValueError(
            f"state pool {tuple(state_pool.shape)}: expected [S, {num_v_heads}, {dk}, {dv}]"
        )
    if not state_pool.is_contiguous() or slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("the state pool must be contiguous and slot_ids an integer tensor")
    return num_k_heads, num_v_heads, dk, dv


def _key_block(dk: int) -> int:
    return max(16, triton.next_power_of_2(dk))


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    token_state_slots: torch.Tensor | None = None,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """The recurrent step: o [T, Hv, Dv]; state_pool[slot_ids[n]] advanced in place.
    Without cu_seqlens token n belongs to sequence n (T == N). token_state_slots [T]
    (optional): where to also write the state after each token (-1: nowhere), the states
    a verify step rolls back to when it rejects drafts. tiles: Hopper's when None."""
    num_k_heads, num_v_heads, dk, dv = _check(q, k, v, g, beta, state_pool, slot_ids)
    num_seqs = slot_ids.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is None and num_seqs != q.shape[0]:
        raise ValueError(f"{q.shape[0]} tokens for {num_seqs} slots: pass cu_seqlens")
    if token_state_slots is not None and token_state_slots.shape != (q.shape[0],):
        raise ValueError(f"token_state_slots {tuple(token_state_slots.shape)}: one per token")
    tiles = tiles or LinearAttentionKernelConfig.for_capability(HOPPER).decode
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    _decode_kernel[(num_seqs, num_v_heads, triton.cdiv(dv, tiles.block_v))](
        q, k, v, g, beta, o, state_pool, slot_ids,
        slot_ids if cu_seqlens is None else cu_seqlens,
        slot_ids if token_state_slots is None else token_state_slots,
        num_k_heads, num_v_heads, dk, dv, dk**-0.5 if scale is None else scale, L2_EPS,
        HAS_CU=cu_seqlens is not None, HAS_SNAPSHOTS=token_state_slots is not None,
        PER_CHANNEL_G=g.dim() == 3, USE_L2NORM=use_qk_l2norm,
        BK=_key_block(dk), BV=tiles.block_v, num_warps=tiles.num_warps,
    )  # fmt: skip
    return o


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """The chunked form over concatenated sequences: o [T, Hv, Dv]; each sequence's
    state (state_pool[slot_ids[n]]) carried through it and written back in place.
    tiles: Hopper's when None."""
    num_k_heads, num_v_heads, dk, dv = _check(q, k, v, g, beta, state_pool, slot_ids)
    tiles = tiles or LinearAttentionKernelConfig.for_capability(HOPPER).prefill
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty_like(v)
    _prefill_kernel[(cu_seqlens.shape[0] - 1, num_v_heads, triton.cdiv(dv, tiles.block_v))](
        q, k, v, g, beta, o, state_pool, slot_ids, cu_seqlens,
        num_k_heads, num_v_heads, dk, dv, dk**-0.5 if scale is None else scale, L2_EPS,
        PER_CHANNEL_G=g.dim() == 3, USE_L2NORM=use_qk_l2norm,
        BT=tiles.chunk, BK=_key_block(dk), BV=tiles.block_v, num_warps=tiles.num_warps,
    )  # fmt: skip
    return o
