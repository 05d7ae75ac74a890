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
Each head's sum of squares is a 1-D sum as wide as rms_norm's row for that head
(next power of two of head_dim), launched with rms_norm's warp count, so compiled the
reduction runs the same tree too (the GPU tests assert bit equality).

Grid (tokens, head groups): each program handles HEADS_PER_PROGRAM heads of one token
row, q groups first (normed, rotated, written to the new contiguous q), then k groups
(normed, rotated, stored), then v groups (stored only). A decode step of one token
thus spreads over about ten programs instead of one. Rows whose slot is -1 (padding of
a CUDA-graph run) still produce q but store nothing. The wrapper allocates q from
shapes and launches once: no host sync, capturable in a CUDA graph. Imported lazily,
on CUDA only (or by tests under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.store_kv import check_kv_scales, quantize_e4m3
from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release


@triton.jit
def _norm_rope_head(
    head_ptr,
    live_half,
    w1,
    w2,
    cos,
    sin,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
):
    """One head at head_ptr: its (first half, second half) normed and rotated, rounded
    to the row's dtype. live_half: HEAD_DIM // 2 for a real head, 0 for the masked
    tail of a group (a scalar bound, not a scalar mask: the interpreter refuses masks
    combined from a scalar and a vector)."""
    half = HEAD_DIM // 2
    dtype = head_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_HALF)
    half_mask = dims < live_half
    x1 = tl.load(head_ptr + dims, mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(head_ptr + half + dims, mask=half_mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        # The sum of squares as rms_norm takes it: the head as one padded 1-D row of
        # BLOCK_DIM (same launch width: the same reduction tree on the GPU). The halves'
        # loads above hit the same cache lines.
        cols = tl.arange(0, BLOCK_DIM)
        x = tl.load(head_ptr + cols, mask=cols < 2 * live_half, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
        # normed rounded to the dtype, times the weight in float32, rounded again.
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    cache_ptr,
    slot_mapping_ptr,
    kv_scales_ptr,
    stride_qkv_t,
    stride_cos_t,
    stride_sin_t,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
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
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    # Program (token, group): groups [0, q_groups) are q heads, the next kv_groups k
    # heads, the last kv_groups v heads; HEADS_PER_PROGRAM heads each (tail masked),
    # q and k heads one after another (unrolled), v heads as one tile.
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_groups = (NUM_HEADS + HEADS_PER_PROGRAM - 1) // HEADS_PER_PROGRAM
    kv_groups = (NUM_KV_HEADS + HEADS_PER_PROGRAM - 1) // HEADS_PER_PROGRAM
    row = qkv_ptr + token * stride_qkv_t
    weight_ptr = tl.where(group < q_groups, q_weight_ptr, k_weight_ptr)
    # cos / sin (the forward's first kernels wrote them), the slot mapping (the step's
    # input copies) and the norm weights, all written before the kernel ahead of this
    # one (pdl.py), are loaded before the wait; qkv after it. Loaded before the wait,
    # they took Qwen3-30B-A3B's batch-1 step from 2.618 to 2.595 ms (H200;
    # docs/performance.md, "Measured reasons: Launch").
    cos, sin, w1, w2, slot = _row_operands(
        cos_ptr + token * stride_cos_t,
        sin_ptr + token * stride_sin_t,
        weight_ptr,
        slot_mapping_ptr + token,
        HEAD_DIM,
        BLOCK_HALF,
        HAS_QK_NORM,
    )
    pdl_wait_and_release(USE_PDL)  # before any load of what a predecessor writes
    if group < q_groups:
        _norm_rope_heads(
            row,
            group * HEADS_PER_PROGRAM,
            w1,
            w2,
            cos,
            sin,
            eps,
            q_out_ptr + token * (NUM_HEADS * HEAD_DIM),
            HEAD_DIM,
            kv_scales_ptr,
            NUM_HEADS,
            HEAD_DIM,
            HEADS_PER_PROGRAM,
            BLOCK_DIM,
            BLOCK_HALF,
            HAS_QK_NORM,
            False,
        )
    else:
        if slot >= 0:  # -1: a padding row, nothing to store
            slot_ptr = (
                cache_ptr
                + (slot // PAGE_SIZE) * stride_cache_block
                + (slot % PAGE_SIZE) * stride_cache_tok
            )
            if group < q_groups + kv_groups:
                _norm_rope_heads(
                    row + NUM_HEADS * HEAD_DIM,
                    (group - q_groups) * HEADS_PER_PROGRAM,
                    w1,
                    w2,
                    cos,
                    sin,
                    eps,
                    slot_ptr,
                    stride_cache_head,
                    kv_scales_ptr,
                    NUM_KV_HEADS,
                    HEAD_DIM,
                    HEADS_PER_PROGRAM,
                    BLOCK_DIM,
                    BLOCK_HALF,
                    HAS_QK_NORM,
                    KV_FP8,
                )
            else:
                _store_v(
                    row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM,
                    (group - q_groups - kv_groups) * HEADS_PER_PROGRAM,
                    slot_ptr + stride_cache_kv,
                    stride_cache_head,
                    kv_scales_ptr,
                    NUM_KV_HEADS,
                    HEAD_DIM,
                    HEADS_PER_PROGRAM,
                    BLOCK_DIM,
                    KV_FP8,
                )


@triton.jit
def _row_operands(
    cos_row,
    sin_row,
    weight_ptr,
    slot_ptr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
):
    """What a program needs besides its qkv row: the token's cos / sin halves, the norm
    weight's halves (zeros without a q/k norm) and the token's cache slot."""
    half = HEAD_DIM // 2
    dims = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_row + dims, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + dims, mask=dims < half, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        w1 = tl.load(weight_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
    else:
        w1 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        w2 = tl.zeros([BLOCK_HALF], dtype=tl.float32)
    return cos, sin, w1, w2, tl.load(slot_ptr)


@triton.jit
def _norm_rope_heads(
    src_row,
    first_head,
    w1,
    w2,
    cos,
    sin,
    eps,
    dst_row,
    dst_head_stride,
    kv_scales_ptr,
    NUM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    QUANT_FP8: tl.constexpr,
):
    """Heads first_head.. (of NUM) of one row: normed, rotated, written to dst_row +
    head * dst_head_stride: q's output row, or the K half of a cache slot (QUANT_FP8: an
    FP8 cache, quantized from the rounded k, as store_kv quantizes what rotary
    returned)."""
    half = HEAD_DIM // 2
    dims = tl.arange(0, BLOCK_HALF)
    for i in tl.static_range(HEADS_PER_PROGRAM):
        head = first_head + i
        live_half = tl.where(head < NUM, half, 0)
        out1, out2 = _norm_rope_head(
            src_row + head * HEAD_DIM,
            live_half,
            w1,
            w2,
            cos,
            sin,
            eps,
            HEAD_DIM,
            BLOCK_DIM,
            BLOCK_HALF,
            HAS_QK_NORM,
        )
        if QUANT_FP8:
            k_scale = tl.load(kv_scales_ptr)
            out1, out2 = quantize_e4m3(out1, k_scale), quantize_e4m3(out2, k_scale)
        dst = dst_row + head * dst_head_stride + dims
        tl.store(dst, out1.to(dst_row.dtype.element_ty), mask=dims < live_half)
        tl.store(dst + half, out2.to(dst_row.dtype.element_ty), mask=dims < live_half)


@triton.jit
def _store_v(
    v_row,
    first_head,
    slot_ptr,
    stride_cache_head,
    kv_scales_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """v heads first_head.. of one row, copied (or quantized) to slot_ptr (V half)."""
    heads = first_head + tl.arange(0, HEADS_PER_PROGRAM)[:, None]
    cols = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < NUM_KV_HEADS) & (cols < HEAD_DIM)
    v = tl.load(v_row + heads * HEAD_DIM + cols, mask=mask)
    if KV_FP8:
        v = quantize_e4m3(v, tl.load(kv_scales_ptr + 1))
    tl.store(
        slot_ptr + heads * stride_cache_head + cols, v.to(slot_ptr.dtype.element_ty), mask=mask
    )


def default_heads_per_program(num_tokens: int) -> int:
    """Heads per program: one at decode sizes (a batch-1 token spreads over 40 programs
    for 32 + 4 + 4 heads: 1.5 us against 2.7 us with 4 heads per program on the H200),
    4 around 256 rows, 16 for prefill steps, where the count of (token, head group)
    programs, not bytes, bounds the launch: at 16,384 rows 4 heads per program took
    237 / 198 us (Llama-8B / Qwen3-30B-A3B), 16 took 126 / 130 (docs/performance.md,
    "Measured reasons: Decode attention"); `python -m benchmarks.kernels rope-store`
    sweeps it."""
    if num_tokens <= 16:
        return 1
    if num_tokens <= 64:
        return 2
    return 4 if num_tokens <= 512 else 16


def _check_inputs(
    qkv,
    cos,
    sin,
    q_norm_weight,
    k_norm_weight,
    kv_cache,
    slot_mapping,
    num_heads,
    num_kv_heads,
    head_dim,
) -> None:
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [T, {width}] ((heads + 2 * kv_heads) * head_dim) with "
            f"contiguous rows, got {tuple(qkv.shape)} strides {qkv.stride()}"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or tuple(table.shape) != (qkv.shape[0], head_dim // 2):
            raise ValueError(
                f"{name} must be [{qkv.shape[0]}, {head_dim // 2}], got {tuple(table.shape)}"
            )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together (both or neither)")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and (weight.shape != (head_dim,) or weight.dtype != qkv.dtype):
            raise ValueError(
                f"{name} must be [{head_dim}] in qkv's dtype {qkv.dtype}, got "
                f"{weight.dtype} {tuple(weight.shape)}"
            )
    expected = (2, num_kv_heads, head_dim)
    if (
        kv_cache.dim() != 5
        or (kv_cache.shape[0],) + tuple(kv_cache.shape[3:]) != expected
        or kv_cache.stride(4) != 1
    ):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, "
            f"{head_dim}] with a contiguous last dim, got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < qkv.shape[0]:
        raise ValueError(
            f"slot_mapping needs at least {qkv.shape[0]} entries, got {tuple(slot_mapping.shape)}"
        )


def qk_norm_rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """qkv [T, (H + 2*Hkv) * D] (row stride may exceed the width) -> q [T, H*D], new and
    contiguous: q heads normed (q_norm_weight [D], when given) and rotated by cos/sin
    [T, D/2]; k heads normed (k_norm_weight) and rotated, and v, written into kv_cache
    [2, num_blocks, block_size, Hkv, D] at slot_mapping (slot -1: nothing written).
    An FP8 cache needs kv_scales (float32 [k_scale, v_scale] on the device)."""
    _check_inputs(
        qkv,
        cos,
        sin,
        q_norm_weight,
        k_norm_weight,
        kv_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
        head_dim,
    )
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
        qkv,
        cos,
        sin,
        q_norm_weight.contiguous() if has_norm else qkv,
        k_norm_weight.contiguous() if has_norm else qkv,
        q,
        kv_cache,
        slot_mapping,
        kv_scales if kv_fp8 else slot_mapping,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        float(eps),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=kv_cache.shape[2],
        HEADS_PER_PROGRAM=per_program,
        BLOCK_DIM=block_dim,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        HAS_QK_NORM=has_norm,
        KV_FP8=kv_fp8,
        # rms_norm's warps for a row of block_dim: the same reduction order.
        num_warps=min(8, max(1, block_dim // 512)),
        **launch_options(qkv.device),
    )
    return q
