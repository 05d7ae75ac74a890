"""Triton kernels of the causal depthwise conv1d over a pool of conv states.

A sequence's conv state is its last K-1 inputs, oldest first, in a pool
``[num_slots, K-1, C]`` (channels contiguous, so a tile of channels is one coalesced
row per tap); ``slot_ids [N]`` names each sequence's slot, a negative one marking a
padding row that reads and writes nothing. The weight is [C, K], the bias [C] or None,
the activation None or "silu"; outputs come back in x's dtype.

- ``causal_conv1d_update``: one token per sequence (decode): x [N, C]; one program per
  (sequence, channel tile) shifts the state by one and writes the token in.
- ``causal_conv1d_prefill``: concatenated sequences x [T, C] with ``cu_seqlens``; one
  program per (sequence, channel tile) walks the sequence in tiles of tokens (each
  output reads x, or the state before the sequence's first token) and then writes the
  sequence's last K-1 inputs back as the new state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.linear_attention.config import HOPPER, ConvTiles, LinearAttentionKernelConfig


@triton.jit
def _finish(acc, bias_ptr, offs_c, mask_c, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _update_kernel(
    x_ptr, w_ptr, bias_ptr, o_ptr, state_ptr, slot_ptr, channels,
    WIDTH: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < channels
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    taps = tl.arange(0, BP)  # state rows 0 .. WIDTH-2, then the token at row WIDTH-1
    live = (taps * 0 + slot) >= 0
    in_state = (taps < WIDTH - 1) & live
    row_ptrs = state_ptr + (slot * (WIDTH - 1) + taps[:, None]) * channels + offs_c[None, :]
    old = tl.load(row_ptrs, mask=in_state[:, None] & mask_c[None, :], other=0.0)
    x = tl.load(x_ptr + seq * channels + offs_c, mask=mask_c, other=0.0)
    window = tl.where((taps == WIDTH - 1)[:, None], x[None, :], old).to(tl.float32)
    w_ptrs = w_ptr + offs_c[None, :] * WIDTH + taps[:, None]
    w = tl.load(w_ptrs, mask=(taps < WIDTH)[:, None] & mask_c[None, :], other=0.0)
    acc = tl.sum(window * w.to(tl.float32), axis=0)
    acc = _finish(acc, bias_ptr, offs_c, mask_c, HAS_BIAS, SILU)
    o_mask = mask_c & ((offs_c * 0 + slot) >= 0)
    tl.store(o_ptr + seq * channels + offs_c, acc.to(o_ptr.dtype.element_ty), mask=o_mask)
    # The new state is the window moved up by one row: row r takes row r + 1.
    shifted = tl.load(
        row_ptrs + channels, mask=((taps < WIDTH - 2) & live)[:, None] & mask_c[None, :], other=0.0
    )
    shifted = tl.where((taps == WIDTH - 2)[:, None], x[None, :].to(shifted.dtype), shifted)
    tl.debug_barrier()  # every row is read before any is overwritten
    tl.store(row_ptrs, shifted, mask=in_state[:, None] & mask_c[None, :])


@triton.jit
def _prefill_kernel(
    x_ptr, w_ptr, bias_ptr, o_ptr, state_ptr, slot_ptr, cu_ptr, channels,
    WIDTH: tl.constexpr, BP: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < channels
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    bos = tl.load(cu_ptr + seq)
    eos = tl.where(slot >= 0, tl.load(cu_ptr + seq + 1), bos)
    state_base = state_ptr + slot * (WIDTH - 1) * channels
    offs_t = tl.arange(0, BT)
    for start in range(bos, eos, BT):
        pos = start + offs_t
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for tap in tl.static_range(WIDTH):
            src = pos - (WIDTH - 1) + tap  # the input this tap reads
            from_x = (src >= bos) & (pos < eos)
            from_state = (src < bos) & (pos < eos)
            xv = tl.load(x_ptr + src[:, None] * channels + offs_c[None, :],
                         mask=from_x[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
            row = src - bos + (WIDTH - 1)
            sv = tl.load(state_base + row[:, None] * channels + offs_c[None, :],
                         mask=from_state[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
            w = tl.load(w_ptr + offs_c * WIDTH + tap, mask=mask_c, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
        acc = _finish(acc, bias_ptr, offs_c[None, :], mask_c[None, :], HAS_BIAS, SILU)
        o_mask = (pos < eos)[:, None] & mask_c[None, :]
        tl.store(
            o_ptr + pos[:, None] * channels + offs_c[None, :],
            acc.to(o_ptr.dtype.element_ty),
            mask=o_mask,
        )
    # The new state: the last K-1 inputs, the old state's last rows where the sequence is short.
    rows = tl.arange(0, BP)
    src = eos - (WIDTH - 1) + rows
    keep = (rows < WIDTH - 1) & ((rows * 0 + slot) >= 0)
    from_x = keep & (src >= bos)
    from_state = keep & (src < bos)
    xv = tl.load(x_ptr + src[:, None] * channels + offs_c[None, :],
                 mask=from_x[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
    row = src - bos + (WIDTH - 1)
    sv = tl.load(state_base + row[:, None] * channels + offs_c[None, :],
                 mask=from_state[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
    new = tl.where(from_x[:, None], xv.to(sv.dtype), sv)
    tl.debug_barrier()  # every old row is read before any is overwritten
    tl.store(state_base + rows[:, None] * channels + offs_c[None, :], new,
             mask=keep[:, None] & mask_c[None, :])  # fmt: skip


def _check(x, weight, bias, conv_state, slot_ids, activation) -> tuple[int, int]:
    channels, width = weight.shape
    if x.shape[-1] != channels or (bias is not None and bias.shape != (channels,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} do not fit")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (width - 1, channels):
        raise ValueError(
            f"conv state {tuple(conv_state.shape)}: expected [S, {width - 1}, {channels}]"
        )
    if not conv_state.is_contiguous() or slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("the conv state pool must be contiguous and slot_ids an integer tensor")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r} (silu or None)")
    if width < 2:
        raise ValueError(f"conv width {width}: at least 2")
    return channels, width


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slot_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    tiles: ConvTiles | None = None,
) -> torch.Tensor:
    """One token per sequence: out [N, C]; conv_state[slot_ids[n]] shifted in place.
    tiles (block_c, num_warps): Hopper's when None."""
    channels, width = _check(x, weight, bias, conv_state, slot_ids, activation)
    tiles = tiles or LinearAttentionKernelConfig.for_capability(HOPPER).conv
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    grid = (x.shape[0], triton.cdiv(channels, tiles.block_c))
    _update_kernel[grid](
        x, weight, x if bias is None else bias, out, conv_state, slot_ids, channels,
        WIDTH=width, BP=triton.next_power_of_2(width), BC=tiles.block_c, num_warps=tiles.num_warps,
        HAS_BIAS=bias is not None, SILU=activation is not None,
    )  # fmt: skip
    return out


def causal_conv1d_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    tiles: ConvTiles | None = None,
) -> torch.Tensor:
    """Concatenated sequences: out [T, C]; conv_state[slot_ids[n]] replaced in place by
    each sequence's last K-1 inputs. tiles: Hopper's when None."""
    channels, width = _check(x, weight, bias, conv_state, slot_ids, activation)
    tiles = tiles or LinearAttentionKernelConfig.for_capability(HOPPER).conv
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    grid = (cu_seqlens.shape[0] - 1, triton.cdiv(channels, tiles.block_c))
    _prefill_kernel[grid](
        x, weight, x if bias is None else bias, out, conv_state, slot_ids, cu_seqlens, channels,
        WIDTH=width, BP=triton.next_power_of_2(width - 1), BT=tiles.block_t, BC=tiles.block_c,
        num_warps=tiles.num_warps,
        HAS_BIAS=bias is not None, SILU=activation is not None,
    )  # fmt: skip
    return out
