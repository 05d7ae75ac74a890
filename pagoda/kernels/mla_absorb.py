"""MLA decode: the absorbed query in one Triton kernel.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Latent columns per program (kv_lora_rank 512 -> 8 programs per head and token) and
# the qk_nope chunk reduced per step.
BLOCK_R = 64
BLOCK_D = 32


@triton.jit
def _absorb_q_kernel(
    q_nope_ptr, q_rope_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, num_heads,
    s_qn_t, s_qn_h, s_qr_t, s_qr_h, s_w_h, s_w_d, s_cos_t, s_sin_t, s_o_t, s_o_h,
    NOPE: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
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
        w = tl.load(w_head + offs_d[:, None] * s_w_d + offs_r[None, :],
                    mask=d_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
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


def absorb_q(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, rope] (not rotated), w_uk [H, nope, rank],
    cos / sin float32 [T, rope / 2] -> [T, H, rank + rope] in q_nope's dtype."""
    num_tokens, heads, nope = q_nope.shape
    rope, rank = q_rope.shape[-1], w_uk.shape[-1]
    if w_uk.shape[:2] != (heads, nope) or q_rope.shape[:2] != (num_tokens, heads) or rope % 2:
        raise ValueError(f"absorb_q: q_nope {tuple(q_nope.shape)}, q_rope "
                         f"{tuple(q_rope.shape)} and w_uk {tuple(w_uk.shape)} disagree")
    if cos.shape != (num_tokens, rope // 2) or sin.shape != cos.shape:
        raise ValueError(f"absorb_q: cos / sin must be [{num_tokens}, {rope // 2}]")
    tensors = [t if t.stride(-1) == 1 else t.contiguous()
               for t in (q_nope, q_rope, w_uk, cos.float(), sin.float())]
    q_nope, q_rope, w_uk, cos, sin = tensors
    out = torch.empty(num_tokens, heads, rank + rope, dtype=q_nope.dtype, device=q_nope.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens * heads, triton.cdiv(rank, BLOCK_R))
    _absorb_q_kernel[grid](
        q_nope, q_rope, w_uk, cos, sin, out, heads,
        q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1),
        w_uk.stride(0), w_uk.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1),
        NOPE=nope, RANK=rank, HALF=rope // 2, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D,
        BLOCK_HALF=max(2, triton.next_power_of_2(rope // 2)), num_warps=4)
    return out
