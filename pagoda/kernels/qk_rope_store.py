"""One Triton launch for what an attention layer does between its QKV projection and
the attention itself: per-head RMSNorm of q and k (Qwen3's qk_norm; optional), rotary
on q and k, and the write of k and v into the paged KV cache.

Owns `qk_norm_rope_store`. Unfused, the same work is up to five launches per layer
(fused_ops.rms_norm on q and on k, fused_ops.rotary on q and on k, store_kv.store_kv);
this kernel reproduces their roundings exactly, in their order:
  - norm (as fused_ops.rms_norm): sum of squares in float32, x * rsqrt(mean + eps)
    rounded to qkv's dtype, times the weight in float32, rounded to qkv's dtype;
  - rotary (as fused_ops.rotary): float32 math on those rounded values (rotate-half
    pairs i and i + D/2), rounded to qkv's dtype;
  - store (as store_kv): the rounded k and plain v cast to the cache dtype, or for an
    FP8 cache divided by the layer's scale and rounded to e4m3 by store_kv's own
    `quantize_e4m3`.
Only float32 reduction order may differ from fused_ops.rms_norm on a GPU (a 2-D tile's
row sums against a 1-D sum).

Grid (tokens, head groups): each program handles HEADS_PER_PROGRAM heads of one token
row, q groups first (normed, rotated, written to the new contiguous q), then k groups
(normed, rotated, stored), then v groups (stored only). A decode step of one token
thus spreads over about ten programs instead of one. Rows whose slot is -1 (padding of
a CUDA-graph run) still produce q but store nothing. The wrapper allocates q from
shapes and launches once: no host sync, capturable in a CUDA graph. Imported lazily,
on CUDA only (or by tests under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pagoda.kernels.store_kv import check_kv_scales, quantize_e4m3


@triton.jit
def _norm_rope_heads(
    base_ptr, heads, head_mask, weight_ptr, cos, sin, eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
):
    """Heads `heads` of a row starting at base_ptr (each HEAD_DIM wide, adjacent):
    (first halves, second halves) normed and rotated, rounded to the row's dtype."""
    half: tl.constexpr = HEAD_DIM // 2
    dtype = base_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    half_mask = head_mask[:, None] & (dims < half)
    first = base_ptr + heads[:, None] * HEAD_DIM + dims
    x1 = tl.load(first, mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=half_mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        # The sum of squares over the whole head as one padded row, as rms_norm sums it
        # (the halves' loads above hit the same lines in the cache).
        cols = tl.arange(0, BLOCK_DIM)[None, :]
        x = tl.load(base_ptr + heads[:, None] * HEAD_DIM + cols,
                    mask=head_mask[:, None] & (cols < HEAD_DIM), other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
        # normed rounded to the dtype, times the weight in float32, rounded again.
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, q_out_ptr, cache_ptr,
    slot_mapping_ptr, kv_scales_ptr,
    stride_qkv_t, stride_cos_t, stride_sin_t,
    stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # Program (token, group): groups [0, q_groups) are q heads, the next kv_groups k
    # heads, the last kv_groups v heads; HEADS_PER_PROGRAM heads each (tail masked).
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_groups: tl.constexpr = (NUM_HEADS + HEADS_PER_PROGRAM - 1) // HEADS_PER_PROGRAM
    kv_groups: tl.constexpr = (NUM_KV_HEADS + HEADS_PER_PROGRAM - 1) // HEADS_PER_PROGRAM
    half: tl.constexpr = HEAD_DIM // 2
    row = qkv_ptr + token * stride_qkv_t
    lanes = tl.arange(0, HEADS_PER_PROGRAM)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    if group < q_groups + kv_groups:  # q or k: both rotate
        cos = tl.load(cos_ptr + token * stride_cos_t + dims, mask=dims < half, other=0.0)
        sin = tl.load(sin_ptr + token * stride_sin_t + dims, mask=dims < half, other=0.0)
        cos, sin = cos.to(tl.float32), sin.to(tl.float32)
        if group < q_groups:
            heads = group * HEADS_PER_PROGRAM + lanes
            head_mask = heads < NUM_HEADS
            out1, out2 = _norm_rope_heads(row, heads, head_mask, q_weight_ptr, cos, sin, eps,
                                          HEAD_DIM, BLOCK_DIM, BLOCK_HALF, HAS_QK_NORM)
            mask = head_mask[:, None] & (dims < half)
            q_first = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims
            tl.store(q_first, out1, mask=mask)
            tl.store(q_first + half, out2, mask=mask)
        else:
            slot = tl.load(slot_mapping_ptr + token)
            if slot >= 0:  # -1: a padding row, nothing to store
                heads = (group - q_groups) * HEADS_PER_PROGRAM + lanes
                head_mask = heads < NUM_KV_HEADS
                out1, out2 = _norm_rope_heads(row + NUM_HEADS * HEAD_DIM, heads, head_mask,
                                              k_weight_ptr, cos, sin, eps,
                                              HEAD_DIM, BLOCK_DIM, BLOCK_HALF, HAS_QK_NORM)
                if KV_FP8:
                    k_scale = tl.load(kv_scales_ptr)
                    out1, out2 = quantize_e4m3(out1, k_scale), quantize_e4m3(out2, k_scale)
                dst = (cache_ptr + (slot // PAGE_SIZE) * stride_cache_block
                       + (slot % PAGE_SIZE) * stride_cache_tok
                       + heads[:, None] * stride_cache_head + dims)
                mask = head_mask[:, None] & (dims < half)
                tl.store(dst, out1.to(cache_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + half, out2.to(cache_ptr.dtype.element_ty), mask=mask)
    else:  # v: copied (or quantized) as it is
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:
            heads = (group - q_groups - kv_groups) * HEADS_PER_PROGRAM + lanes
            cols = tl.arange(0, BLOCK_DIM)[None, :]
            mask = (heads < NUM_KV_HEADS)[:, None] & (cols < HEAD_DIM)
            src = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + heads[:, None] * HEAD_DIM + cols
            v = tl.load(src, mask=mask)
            if KV_FP8:
                v = quantize_e4m3(v, tl.load(kv_scales_ptr + 1))
            dst = (cache_ptr + stride_cache_kv + (slot // PAGE_SIZE) * stride_cache_block
                   + (slot % PAGE_SIZE) * stride_cache_tok
                   + heads[:, None] * stride_cache_head + cols)
            tl.store(dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def default_heads_per_program(num_tokens: int) -> int:
    """Heads per program: few at small batches (a decode token spreads over ~10
    programs for 32 + 4 + 4 heads), more at large ones (fewer, fuller programs)."""
    return 4 if num_tokens <= 128 else 8


def _check_inputs(qkv, cos, sin, q_norm_weight, k_norm_weight, kv_cache, slot_mapping,
                  num_heads, num_kv_heads, head_dim) -> None:
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {width}] ((heads + 2 * kv_heads) * head_dim) with "
                         f"contiguous rows, got {tuple(qkv.shape)} strides {qkv.stride()}")
    if head_dim % 2 != 0:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or tuple(table.shape) != (qkv.shape[0], head_dim // 2):
            raise ValueError(f"{name} must be [{qkv.shape[0]}, {head_dim // 2}], "
                             f"got {tuple(table.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together (both or neither)")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != qkv.dtype):
            raise ValueError(f"{name} must be [{head_dim}] in qkv's dtype {qkv.dtype}, got "
                             f"{weight.dtype} {tuple(weight.shape)}")
    expected = (2, num_kv_heads, head_dim)
    if (kv_cache.dim() != 5 or (kv_cache.shape[0],) + tuple(kv_cache.shape[3:]) != expected
            or kv_cache.stride(4) != 1):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, "
                         f"{head_dim}] with a contiguous last dim, got {tuple(kv_cache.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < qkv.shape[0]:
        raise ValueError(f"slot_mapping needs at least {qkv.shape[0]} entries, "
                         f"got {tuple(slot_mapping.shape)}")


def qk_norm_rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm_weight: Optional[torch.Tensor],
                       k_norm_weight: Optional[torch.Tensor], eps: float,
                       kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       kv_scales: Optional[torch.Tensor], num_heads: int, num_kv_heads: int,
                       head_dim: int, heads_per_program: Optional[int] = None) -> torch.Tensor:
    """qkv [T, (H + 2*Hkv) * D] (row stride may exceed the width) -> q [T, H*D], new and
    contiguous: q heads normed (q_norm_weight [D], when given) and rotated by cos/sin
    [T, D/2]; k heads normed (k_norm_weight) and rotated, and v, written into kv_cache
    [2, num_blocks, block_size, Hkv, D] at slot_mapping (slot -1: nothing written).
    An FP8 cache needs kv_scales (float32 [k_scale, v_scale] on the device)."""
    _check_inputs(qkv, cos, sin, q_norm_weight, k_norm_weight, kv_cache, slot_mapping,
                  num_heads, num_kv_heads, head_dim)
    check_kv_scales(kv_scales, kv_cache)
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    per_program = heads_per_program or default_heads_per_program(num_tokens)
    if per_program & (per_program - 1):
        raise ValueError(f"heads_per_program must be a power of two, got {per_program}")
    groups = 2 * triton.cdiv(num_kv_heads, per_program) + triton.cdiv(num_heads, per_program)
    has_norm = q_norm_weight is not None
    block_dim = triton.next_power_of_2(head_dim)
    _qk_norm_rope_store_kernel[(num_tokens, groups)](
        qkv, cos, sin,
        q_norm_weight.contiguous() if has_norm else qkv,
        k_norm_weight.contiguous() if has_norm else qkv,
        q, kv_cache, slot_mapping, kv_scales if kv_fp8 else slot_mapping,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        float(eps),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        PAGE_SIZE=kv_cache.shape[2], HEADS_PER_PROGRAM=per_program,
        BLOCK_DIM=block_dim, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        HAS_QK_NORM=has_norm, KV_FP8=kv_fp8,
        num_warps=min(8, max(1, per_program * block_dim // 512)),
    )
    return q
