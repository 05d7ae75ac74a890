"""MLA decode: the absorbed query, and the output's value projection, one Triton kernel
each.

``absorb_q(q_nope, q_rope, w_uk, cos, sin)`` -> q [T, H, kv_lora_rank + qk_rope]:
per head, q_nope @ W_UK (the latent part) next to the rotated q_rope (rotate_half
layout, cos/sin float32 [T, rope / 2]), the query MLA's latent attention takes. It
replaces, at decode, the torch path of pagoda.model.layers.mla (its reference): two
transposes, a bmm, the rotary kernel and a cat, each a launch of a few microseconds.

One program per (token, head, block of BLOCK_R latent columns) reduces over qk_nope in
float32 and rounds once to the output dtype (as the bmm does); the programs of the
first column block also write the head's rotated rope part (math in float32, one
rounding, as apply_rotary). Inputs may be strided views (q_nope / q_rope are slices of
the q projection's output, W_UK of kv_b_proj's weight): only their last dim must be
contiguous. No host sync: CUDA-graph capturable.

``project_v(o_lat, w_uv)`` -> [T, H, v_head_dim]: per head, the latent attention output
o_lat [T, H, kv_lora_rank] times W_UV^T (w_uv [H, v_head_dim, kv_lora_rank], a view of
kv_b_proj's weight), float32 accumulation, one rounding (as the bmm it replaces, its
reference). One program per (token, head, block of BLOCK_V output columns); the
output is contiguous, so the layer's reshape to [T, H * v_head_dim] is free (the bmm's
transposed result cost a copy kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Latent columns per program (kv_lora_rank 512 -> 16 programs per head and token) and
# the qk_nope chunk reduced per step.
# (the fastest tiles of the batch-1 kernel sweep on the H200 at DeepSeek-V2-Lite's
# shape: absorb_q 2.40 us, project_v 2.16 us at one token.)
BLOCK_R = 32
BLOCK_D = 64
ABSORB_WARPS = 2
# Value columns per program of project_v (v_head_dim 128 -> 8 programs per head, token).
BLOCK_V = 16
PROJECT_V_WARPS = 8
# The layer (pagoda.model.layers.mla) calls these kernels for at most this many rows:
# every program reads its head's weights again, so large batches go to a bmm, which
# reads them once per head (docs/performance.md has the figures).
PER_TOKEN_MAX_ROWS = 16


@triton.jit
def _absorb_q_kernel(
    q_nope_ptr,
    q_rope_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    s_qn_t,
    s_qn_h,
    s_qr_t,
    s_qr_h,
    s_w_h,
    s_w_d,
    s_cos_t,
    s_sin_t,
    s_o_t,
    s_o_h,
    NOPE: tl.constexpr,
    RANK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token, head = row // num_heads, row % num_heads
    pid_r = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < RANK
    q_row = q_nope_ptr + token * s_qn_t + head * s_qn_h
    w_head = w_ptr + head * s_w_h
    acc = tl.zeros((BLOCK_D, BLOCK_R), dtype=tl.float32)
    for d0 in range(0, NOPE, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < NOPE
        q = tl.load(q_row + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_head + offs_d[:, None] * s_w_d + offs_r[None, :],
            mask=d_ok[:, None] & r_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += q[:, None] * w
    out_row = out_ptr + token * s_o_t + head * s_o_h
    tl.store(out_row + offs_r, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=r_ok)
    if pid_r == 0:  # the rope part: [x1 cos - x2 sin, x2 cos + x1 sin]
        j = tl.arange(0, BLOCK_HALF)
        j_ok = j < HALF
        r_row = q_rope_ptr + token * s_qr_t + head * s_qr_h
        x1 = tl.load(r_row + j, mask=j_ok, other=0.0).to(tl.float32)
        x2 = tl.load(r_row + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + token * s_cos_t + j, mask=j_ok, other=0.0)
        s = tl.load(sin_ptr + token * s_sin_t + j, mask=j_ok, other=0.0)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_row + RANK + j, (x1 * c - x2 * s).to(dtype), mask=j_ok)
        tl.store(out_row + RANK + HALF + j, (x2 * c + x1 * s).to(dtype), mask=j_ok)


def absorb_q(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    w_uk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, rope] (not rotated), w_uk [H, nope, rank],
    cos / sin float32 [T, rope / 2] -> [T, H, rank + rope] in q_nope's dtype."""
    num_tokens, heads, nope = q_nope.shape
    rope, rank = q_rope.shape[-1], w_uk.shape[-1]
    if w_uk.shape[:2] != (heads, nope) or q_rope.shape[:2] != (num_tokens, heads) or rope % 2:
        raise ValueError(
            f"absorb_q: q_nope {tuple(q_nope.shape)}, q_rope "
            f"{tuple(q_rope.shape)} and w_uk {tuple(w_uk.shape)} disagree"
        )
    if cos.shape != (num_tokens, rope // 2) or sin.shape != cos.shape:
        raise ValueError(f"absorb_q: cos / sin must be [{num_tokens}, {rope // 2}]")
    tensors = [
        t if t.stride(-1) == 1 else t.contiguous()
        for t in (q_nope, q_rope, w_uk, cos.float(), sin.float())
    ]
    q_nope, q_rope, w_uk, cos, sin = tensors
    out = torch.empty(num_tokens, heads, rank + rope, dtype=q_nope.dtype, device=q_nope.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens * heads, triton.cdiv(rank, BLOCK_R))
    _absorb_q_kernel[grid](
        q_nope,
        q_rope,
        w_uk,
        cos,
        sin,
        out,
        heads,
        q_nope.stride(0),
        q_nope.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        w_uk.stride(0),
        w_uk.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        NOPE=nope,
        RANK=rank,
        HALF=rope // 2,
        BLOCK_R=BLOCK_R,
        BLOCK_D=BLOCK_D,
        BLOCK_HALF=max(2, triton.next_power_of_2(rope // 2)),
        num_warps=ABSORB_WARPS,
    )
    return out


@triton.jit
def _project_v_kernel(
    o_ptr,
    w_ptr,
    out_ptr,
    num_heads,
    s_o_t,
    s_o_h,
    s_w_h,
    s_w_v,
    s_out_t,
    s_out_h,
    RANK: tl.constexpr,
    V: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_RANK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token, head = row // num_heads, row % num_heads
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < V
    offs_r = tl.arange(0, BLOCK_RANK)
    r_ok = offs_r < RANK
    o = tl.load(o_ptr + token * s_o_t + head * s_o_h + offs_r, mask=r_ok, other=0.0)
    w = tl.load(
        w_ptr + head * s_w_h + offs_v[:, None] * s_w_v + offs_r[None, :],
        mask=v_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    acc = tl.sum(w.to(tl.float32) * o.to(tl.float32)[None, :], axis=1)
    tl.store(
        out_ptr + token * s_out_t + head * s_out_h + offs_v,
        acc.to(out_ptr.dtype.element_ty),
        mask=v_ok,
    )


def project_v(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [T, H, rank], w_uv [H, v, rank] (last dims contiguous) -> [T, H, v]
    contiguous, in o_lat's dtype."""
    num_tokens, heads, rank = o_lat.shape
    if w_uv.dim() != 3 or w_uv.shape[0] != heads or w_uv.shape[2] != rank:
        raise ValueError(
            f"project_v: o_lat {tuple(o_lat.shape)} and w_uv {tuple(w_uv.shape)} disagree"
        )
    if o_lat.stride(2) != 1 or w_uv.stride(2) != 1:
        raise ValueError("project_v needs o_lat and w_uv contiguous along kv_lora_rank")
    v_dim = w_uv.shape[1]
    out = torch.empty(num_tokens, heads, v_dim, dtype=o_lat.dtype, device=o_lat.device)
    if num_tokens == 0:
        return out
    _project_v_kernel[(num_tokens * heads, triton.cdiv(v_dim, BLOCK_V))](
        o_lat,
        w_uv,
        out,
        heads,
        o_lat.stride(0),
        o_lat.stride(1),
        w_uv.stride(0),
        w_uv.stride(1),
        out.stride(0),
        out.stride(1),
        RANK=rank,
        V=v_dim,
        BLOCK_V=BLOCK_V,
        BLOCK_RANK=triton.next_power_of_2(rank),
        num_warps=PROJECT_V_WARPS,
    )
    return out
