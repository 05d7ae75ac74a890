"""Triton kernels for the small per-token ops of a decoder layer, used on CUDA only.

Owns `rms_norm`, `fused_add_rms_norm`, `silu_and_mul` and `rotary`, and the switch
`FUSED_OPS_ENABLED` (env PAGODA_FUSED_OPS, read once at import; "0" turns the kernels
off and the layers run their torch code). The torch code in pagoda/model/layers is the
reference: each kernel reproduces its order of operations and roundings (math in
float32, a rounding to the storage dtype wherever torch rounds an intermediate), so the
results agree with it up to float32 reduction order.

Every wrapper allocates its output from shapes alone and launches one kernel: no host
sync and nothing data dependent, so the calls can be captured in a CUDA graph.
The layers import this module lazily, on CUDA inputs only: importing them never
imports triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release

FUSED_OPS_ENABLED = os.environ.get("PAGODA_FUSED_OPS", "1") != "0"

# rms_norm walks a row in chunks of at most this many elements (one chunk for the
# hidden sizes of common models, so the row's second read hits the cache).
_MAX_NORM_BLOCK = 8192
# silu_and_mul: columns per program.
_ACT_BLOCK = 1024


def _num_warps(block: int) -> int:
    return min(8, max(1, block // 512))


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    inner_rows,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PRELOAD_WEIGHT: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    cols = tl.arange(0, BLOCK)
    # PRELOAD_WEIGHT (a row of one chunk, BLOCK >= HIDDEN): the weight, written by no
    # kernel (pdl.py), is loaded before the PDL wait, off the norm's chain after it:
    # Qwen3-30B-A3B batch 1 2.700 -> 2.670 ms, Llama-8B bf16 4.23 -> 4.20 (H200;
    # docs/performance.md, "Measured reasons: Launch").
    if PRELOAD_WEIGHT:
        preloaded = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    pdl_wait_and_release(USE_PDL)  # before any other load, and any store
    # One program per row. A row of an input viewed as [outer, inner, HIDDEN] (2-D
    # inputs have inner_rows == 1) lies at outer * stride_outer + inner * stride_inner.
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // inner_rows, row % inner_rows
    x_row = x_ptr + outer * stride_x_outer + inner * stride_x_inner
    r_row = residual_ptr + outer * stride_r_outer + inner * stride_r_inner
    out_row = row * HIDDEN  # outputs are contiguous [rows, HIDDEN]
    sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
    # Pass 1: the residual sum (rounded to its storage dtype, as torch's `x + residual`)
    # and the sum of squares of the rounded values.
    for start in range(0, HIDDEN, BLOCK):
        mask = start + cols < HIDDEN
        summed = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            summed += tl.load(r_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            summed_stored = summed.to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + out_row + start + cols, summed_stored, mask=mask)
            summed = summed_stored.to(tl.float32)
        sum_sq += summed * summed
    inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=0) / HIDDEN + eps)
    # Pass 2: recompute the (rounded) row rather than reading back what pass 1 stored,
    # normalise in float32, round to the row's dtype, then multiply by the weight.
    for start in range(0, HIDDEN, BLOCK):
        mask = start + cols < HIDDEN
        summed = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            summed += tl.load(r_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            summed = summed.to(residual_out_ptr.dtype.element_ty).to(tl.float32)
            normed = (summed * inv_rms).to(residual_out_ptr.dtype.element_ty)
        else:
            normed = (summed * inv_rms).to(x_ptr.dtype.element_ty)
        if PRELOAD_WEIGHT:
            weight = preloaded
        else:
            weight = tl.load(weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        out = weight * normed.to(tl.float32)
        tl.store(out_ptr + out_row + start + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, inner_rows, outer stride, inner stride) addressing t's rows: 2-D and 3-D
    tensors with a contiguous last dim are used as they are, anything else reshaped."""
    if t.stride(-1) != 1 or t.dim() not in (2, 3):
        t = t.reshape(-1, t.shape[-1]).contiguous()
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, t.shape[1], t.stride(0), t.stride(1)


def check_norm_args(x: torch.Tensor, weight: torch.Tensor, residual) -> int:
    """The row width of an RMSNorm of x (+ residual) by weight, once their shapes agree."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(
            f"weight must be [{hidden}] to normalise rows of {hidden}, got {tuple(weight.shape)}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    return hidden


def _launch_rms_norm(x: torch.Tensor, residual, weight: torch.Tensor, eps: float):
    hidden = check_norm_args(x, weight, residual)
    row_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, row_dtype), device=x.device)
    residual_out = (
        None if residual is None else torch.empty(x.shape, dtype=row_dtype, device=x.device)
    )
    num_rows = x.numel() // hidden if hidden else 0
    if num_rows == 0:
        return out, residual_out
    x_rows, inner_rows, sx0, sx1 = _row_layout(x)
    r_rows, sr0, sr1 = x_rows, 0, 0  # unused unless there is a residual
    if residual is not None:
        r_rows, r_inner, sr0, sr1 = _row_layout(residual)
        if r_inner != inner_rows:  # one of them was reshaped: address both as 2-D rows
            x_rows, inner_rows, sx0, sx1 = _row_layout(x.reshape(-1, hidden))
            r_rows, _, sr0, sr1 = _row_layout(residual.reshape(-1, hidden))
    block = min(triton.next_power_of_2(hidden), _MAX_NORM_BLOCK)
    _rms_norm_kernel[(num_rows,)](
        x_rows,
        r_rows,
        weight.contiguous(),
        out,
        out if residual_out is None else residual_out,
        inner_rows,
        sx0,
        sx1,
        sr0,
        sr1,
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        PRELOAD_WEIGHT=block >= hidden,
        num_warps=_num_warps(block),
        **launch_options(x.device),
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, as RMSNorm's torch code rounds it.
    x: any shape [..., hidden] (2-D/3-D with a contiguous last dim read in place)."""
    out, _ = _launch_rms_norm(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the inputs' dtype."""
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x_row,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    pdl_wait_and_release(USE_PDL)  # before any load or store
    # Program (row, column block); x row = [gate | up], each INTERMEDIATE wide.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    x_row = x_ptr + row * stride_x_row
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + INTERMEDIATE + cols, mask=mask, other=0.0)
    # torch rounds silu(gate) to the storage dtype before the multiply.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * INTERMEDIATE + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] = [gate | up] -> silu(gate) * up [..., I], in x's dtype."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    intermediate = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], intermediate, dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] == 0 or intermediate == 0:
        return out
    block = min(triton.next_power_of_2(intermediate), _ACT_BLOCK)
    grid = (rows.shape[0], triton.cdiv(intermediate, block))
    _silu_and_mul_kernel[grid](
        rows,
        out,
        rows.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        num_warps=_num_warps(block),
        **launch_options(rows.device),
    )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_cos_t,
    stride_sin_t,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token: every head, both halves (rotate_half pairs i and i + HALF).
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    cos = tl.load(cos_ptr + token * stride_cos_t + dims, mask=dims < HALF, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin_t + dims, mask=dims < HALF, other=0.0)
    x_first = x_ptr + token * stride_xt + heads * stride_xh + dims
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos.to(tl.float32) - x2 * sin.to(tl.float32)
    out2 = x2 * cos.to(tl.float32) + x1 * sin.to(tl.float32)
    out_first = out_ptr + token * (NUM_HEADS * 2 * HALF) + heads * (2 * HALF) + dims
    tl.store(out_first, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_first + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides, contiguous last dim) rotated by cos/sin [T, D/2]
    in float32; returns a new contiguous tensor in x's dtype (apply_rotary's contract)."""
    if x.dim() != 3 or x.shape[-1] % 2 != 0:
        raise ValueError(f"rotary needs x [T, H, D] with an even D, got {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[0] != num_tokens or table.shape[1] != half:
            raise ValueError(f"{name} must be [{num_tokens}, {half}], got {tuple(table.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_heads, block_half = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_HEADS=num_heads,
        HALF=half,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=block_half,
        num_warps=_num_warps(block_heads * block_half),
    )
    return out
