"""Per-token FP8 quantization fused into the kernels that produce a W8A8 linear's input.

Above ``fp8_linear.W8A16_MAX_M`` rows an FP8 linear quantizes its activation per token
(``fp8_quant.per_token_quant_fp8``) before the FP8 GEMM. In a Llama layer three of the
four linears take the output of a small row kernel: qkv_proj and gate_up_proj an RMSNorm
(with or without the residual add), down_proj the SiLU-and-mul. This module owns those
producers with the quantization folded in, so the float activation is never written
and read back:

- ``rms_norm_fp8(x, weight, eps, residual=None)`` -> (x_fp8 [M, H], scale [M, 1] float32,
  residual_out or None);
- ``silu_and_mul_fp8(x)`` -> (x_fp8 [M, I], scale [M, 1] float32) for x = [gate | up];
- their torch references (``rms_norm_fp8_ref``, ``silu_and_mul_fp8_ref``): the layers'
  torch code followed by ``per_token_quant_fp8_ref``.

Exactness contract: the bytes and scales are those of the unfused composition, i.e.
fused_ops.rms_norm / fused_add_rms_norm / silu_and_mul rounding their output to the
activation dtype, then per_token_quant_fp8 on those rounded values, and the norm's
residual output is that of fused_add_rms_norm. So each kernel recomputes the unfused
kernel's values with the same operations in the same order (math in float32, the same
roundings to the storage dtype), rounds them to the activation dtype, and quantizes the
rounded values exactly as fp8_quant does (scale = max(amax / 448, FLOAT32_TINY), q =
round_to_e4m3(clamp(v / scale))). The amax is a max, exact in any order. The one
reduction whose order matters, the norm's sum of squares, is computed over the same
BLOCK with the same warps as fused_ops' kernel (its constants are imported, not copied)
and in the same register layout (see _rms_norm_fp8_kernel; a test compiles both for
sm_90 and compares). Only the silu's exp and the rsqrt are approximate instructions, the
same ones in both paths.

Why one program holds a whole row: a row's scale needs the row's amax before any of its
bytes can be written. Holding the row in registers (BLOCK >= the width: the default up
to 16384, so 4096 for the norm and next_power_of_2(14336) = 16384 for the SiLU, 32
values a thread at 16 warps) reads every input byte from DRAM once. A two-pass walk
over chunks (wider rows, or a smaller ``block``) recomputes each chunk from its inputs
in the second pass; those re-reads hit L2 only while the rows in flight fit in it, and
with many small programs per SM (each 14336-wide bf16 [gate | up] row is 57 KB) they
would not: the two-pass kernel could read nearly as much as the unfused pair.
`python -m benchmarks.kernels fp8-quant` times both (fused_us_by_block).

Wrappers allocate from shapes alone and launch one kernel (no host sync, nothing data
dependent): CUDA-graph capturable. Kernels take part in PDL (pagoda.kernels.launch.pdl).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagoda.kernels.fp8.quant import (
    FLOAT32_TINY,
    FP8_DTYPE,
    FP8_MAX,
    per_token_quant_fp8_ref,
    round_to_e4m3,
)
from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release

# The unfused norm's chunk size and warps: the fused norm must reduce its sum of squares
# over the same BLOCK with the same layout to round inv_rms the same way.
from pagoda.kernels.norm.fused_ops import _MAX_NORM_BLOCK, _num_warps, check_norm_args

# silu_and_mul_fp8 holds rows up to this width in registers (one read of every byte);
# wider rows are walked in chunks of _ACT_CHUNK, twice.
_ACT_MAX_BLOCK = 16384
_ACT_CHUNK = 2048

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _tl_dtype(dtype: torch.dtype):
    if dtype not in _TL_DTYPES:
        raise ValueError(f"expected a float16 / bfloat16 / float32 activation, got {dtype}")
    return _TL_DTYPES[dtype]


# ------------------------------------------------------------------ shared -----------
@triton.jit
def _row_scale(amax_vec, FP8_MAX_C: tl.constexpr, TINY: tl.constexpr):
    """fp8_quant's scale of a row from its elementwise running max of |v|."""
    return tl.maximum(tl.max(amax_vec, axis=0) / FP8_MAX_C, TINY)


@triton.jit
def _store_fp8(v, scale, q_ptrs, mask, FP8_MAX_C: tl.constexpr):
    """fp8_quant's quantization of float32 values v (already rounded to the activation
    dtype) with the row's scale."""
    q = round_to_e4m3(tl.minimum(tl.maximum(v / scale, -FP8_MAX_C), FP8_MAX_C))
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _running_amax(amax_vec, v, mask):
    # Lanes past the row's end hold no value of it (an eps of 0 could make them NaN).
    return tl.maximum(amax_vec, tl.where(mask, tl.abs(v), 0.0))


# ----------------------------------------------------------------- rms_norm ----------
@triton.jit
def _norm_input(x_ptrs, r_ptrs, mask, HAS_RESIDUAL: tl.constexpr, ROW_DTYPE: tl.constexpr):
    """x (+ residual, the sum rounded to the row's dtype as torch's x + residual) in float32."""
    summed = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        summed += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        summed = summed.to(ROW_DTYPE).to(tl.float32)
    return summed


@triton.jit
def _norm_output(
    x_ptrs,
    r_ptrs,
    w_ptrs,
    mask,
    inv_rms,
    HAS_RESIDUAL: tl.constexpr,
    ROW_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """The unfused norm's output values at one chunk, recomputed from the inputs (float32,
    rounded to OUT_DTYPE): normalise in float32, round to the row's dtype, multiply by
    the weight, round to the output's."""
    summed = _norm_input(x_ptrs, r_ptrs, mask, HAS_RESIDUAL, ROW_DTYPE)
    normed = (summed * inv_rms).to(ROW_DTYPE)
    weight = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    return (weight * normed.to(tl.float32)).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    q_ptr,
    scale_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROW_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    TINY: tl.constexpr,
    VEC: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    """One program per row: the residual sum (stored) and inv_rms, then the norm's
    output rounded to OUT_DTYPE, its amax, the fp8 bytes and the row's scale.

    Pass 1 is fused_ops._rms_norm_kernel's, op for op, with its BLOCK and warps: the sum
    of squares accumulated lane-wise over chunks, then reduced. The order of that
    reduction follows the layout of the values reduced (which elements each thread
    holds), and the compiler picks one layout for the row from its memory accesses:
    the unfused kernel's bf16 loads and stores make it VEC = 8 values a thread (16
    bytes); left alone, this kernel's one-byte stores would make it 16, and inv_rms
    could round differently. So the fp8 stores' offsets are written as VEC-long runs
    (equal values; the compiler then sees no wider contiguity) and every access wants
    the unfused kernel's layout. tests/kernels/test_fp8_fused_quant.py compiles both kernels
    for sm_90 and compares the layouts.
    HIDDEN <= BLOCK: one chunk, the output held in registers for its amax and its
    bytes; else two more passes over chunks (amax, quantize), each recomputing the
    chunk from x / residual / weight (the unfused kernel also reads the row twice)."""
    pdl_wait_and_release(USE_PDL)  # before any load or store
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = residual_ptr + row * stride_r
    q_row = q_ptr + row * HIDDEN  # outputs are contiguous [rows, HIDDEN]
    res_row = residual_out_ptr + row * HIDDEN
    cols = tl.arange(0, BLOCK)
    sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK):
        mask = start + cols < HIDDEN
        summed = _norm_input(
            x_row + start + cols, r_row + start + cols, mask, HAS_RESIDUAL, ROW_DTYPE
        )
        if HAS_RESIDUAL:
            tl.store(res_row + start + cols, summed.to(ROW_DTYPE), mask=mask)
        sum_sq += summed * summed
    inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=0) / HIDDEN + eps)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    if HIDDEN <= BLOCK:
        mask = cols < HIDDEN
        out = _norm_output(
            x_row + cols,
            r_row + cols,
            weight_ptr + cols,
            mask,
            inv_rms,
            HAS_RESIDUAL,
            ROW_DTYPE,
            OUT_DTYPE,
        )
        scale = _row_scale(_running_amax(amax, out, mask), FP8_MAX_C, TINY)
        _store_fp8(out, scale, q_row + (cols // VEC) * VEC + cols % VEC, mask, FP8_MAX_C)
    else:
        for start in range(0, HIDDEN, BLOCK):
            mask = start + cols < HIDDEN
            out = _norm_output(
                x_row + start + cols,
                r_row + start + cols,
                weight_ptr + start + cols,
                mask,
                inv_rms,
                HAS_RESIDUAL,
                ROW_DTYPE,
                OUT_DTYPE,
            )
            amax = _running_amax(amax, out, mask)
        scale = _row_scale(amax, FP8_MAX_C, TINY)
        for start in range(0, HIDDEN, BLOCK):
            mask = start + cols < HIDDEN
            out = _norm_output(
                x_row + start + cols,
                r_row + start + cols,
                weight_ptr + start + cols,
                mask,
                inv_rms,
                HAS_RESIDUAL,
                ROW_DTYPE,
                OUT_DTYPE,
            )
            _store_fp8(
                out, scale, q_row + start + (cols // VEC) * VEC + cols % VEC, mask, FP8_MAX_C
            )
    tl.store(scale_ptr + row, scale)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def norm_vec(dtype: torch.dtype) -> int:
    """Values of the row per thread in the unfused norm's layout: a 16-byte access of x."""
    return 16 // dtype.itemsize


def norm_dtypes(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.dtype, torch.dtype]:
    """(row dtype, output dtype) of the unfused norm: the residual sum is in the inputs'
    promoted dtype, the output in that promoted with the weight's."""
    row = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return row, torch.promote_types(weight.dtype, row)


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """per_token_quant_fp8 of rms_norm(x) (residual None) or of fused_add_rms_norm(x,
    residual)'s norm, in one launch: (x_fp8 [M, H], scale [M, 1] float32, the residual
    sum in x's shape or None), M = x.numel() / H."""
    hidden = check_norm_args(x, weight, residual)
    row_dtype, out_dtype = norm_dtypes(x, weight, residual)
    x_rows = _rows(x, hidden)
    num_rows = x_rows.shape[0]
    q = torch.empty(num_rows, hidden, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    residual_out = (
        None if residual is None else torch.empty(x.shape, dtype=row_dtype, device=x.device)
    )
    if num_rows == 0 or hidden == 0:
        scale.fill_(FLOAT32_TINY)  # per_token_quant_fp8's scale of an empty row
        return q, scale, residual_out
    r_rows = x_rows if residual is None else _rows(residual, hidden)
    block = min(triton.next_power_of_2(hidden), _MAX_NORM_BLOCK)
    _rms_norm_fp8_kernel[(num_rows,)](
        x_rows,
        r_rows,
        weight.contiguous(),
        q,
        scale,
        q if residual_out is None else residual_out,
        x_rows.stride(0),
        r_rows.stride(0),
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        ROW_DTYPE=_tl_dtype(row_dtype),
        OUT_DTYPE=_tl_dtype(out_dtype),
        FP8_MAX_C=FP8_MAX,
        TINY=FLOAT32_TINY,
        VEC=norm_vec(x_rows.dtype),
        num_warps=_num_warps(block),
        **launch_options(x.device),
    )
    return q, scale, residual_out


def rms_norm_fp8_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Torch reference of rms_norm_fp8: RMSNorm's torch order of operations (add in the
    inputs' dtype, normalise in float32, round, multiply by the weight), then
    per_token_quant_fp8_ref."""
    summed = x if residual is None else x + residual
    xf = summed.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(summed.dtype)
    q, s = per_token_quant_fp8_ref(out.reshape(-1, x.shape[-1]))
    return q, s, None if residual is None else summed


# ------------------------------------------------------------- silu_and_mul ----------
@triton.jit
def _silu_mul(x_row, offs, mask, INTERMEDIATE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """fused_ops._silu_and_mul_kernel's values at offs, float32 rounded to OUT_DTYPE:
    silu(gate) rounded to the storage dtype, times up, rounded."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + INTERMEDIATE + offs, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(OUT_DTYPE).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    stride_x_row,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    TINY: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    """One program per row of x = [gate | up] (each INTERMEDIATE wide): silu(gate) * up
    rounded to x's dtype, its amax, then the fp8 bytes and the row's scale.
    INTERMEDIATE <= BLOCK: the row stays in registers; else two passes over chunks
    (amax, quantize), the second recomputing each chunk from gate and up."""
    pdl_wait_and_release(USE_PDL)  # before any load or store
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    q_row = q_ptr + row * INTERMEDIATE  # the output is contiguous [rows, INTERMEDIATE]
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    if INTERMEDIATE <= BLOCK:
        mask = cols < INTERMEDIATE
        out = _silu_mul(x_row, cols, mask, INTERMEDIATE, x_ptr.dtype.element_ty)
        scale = _row_scale(_running_amax(amax, out, mask), FP8_MAX_C, TINY)
        _store_fp8(out, scale, q_row + cols, mask, FP8_MAX_C)
    else:
        for start in range(0, INTERMEDIATE, BLOCK):
            mask = start + cols < INTERMEDIATE
            out = _silu_mul(x_row, start + cols, mask, INTERMEDIATE, x_ptr.dtype.element_ty)
            amax = _running_amax(amax, out, mask)
        scale = _row_scale(amax, FP8_MAX_C, TINY)
        for start in range(0, INTERMEDIATE, BLOCK):
            mask = start + cols < INTERMEDIATE
            out = _silu_mul(x_row, start + cols, mask, INTERMEDIATE, x_ptr.dtype.element_ty)
            _store_fp8(out, scale, q_row + start + cols, mask, FP8_MAX_C)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_block(intermediate: int) -> int:
    """The default BLOCK of silu_and_mul_fp8: the whole row up to _ACT_MAX_BLOCK."""
    whole = triton.next_power_of_2(max(intermediate, 1))
    return whole if whole <= _ACT_MAX_BLOCK else _ACT_CHUNK


def silu_and_mul_warps(block: int) -> int:
    """Warps of a silu_and_mul_fp8 program: 32 values a thread at the default 16384."""
    return min(16, max(4, block // 1024))


def silu_and_mul_fp8(
    x: torch.Tensor, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_quant_fp8 of silu_and_mul(x) in one launch: x [..., 2 * I] = [gate | up]
    -> (x_fp8 [M, I], scale [M, 1] float32), M = x.numel() / (2 I). block: the columns a
    program handles at once (a power of two; default silu_and_mul_block(I); >= I keeps
    the row in registers)."""
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"silu_and_mul_fp8 needs an even last dim, got {x.shape[-1]}")
    _tl_dtype(x.dtype)
    intermediate = x.shape[-1] // 2
    rows = _rows(x, x.shape[-1])
    q = torch.empty(rows.shape[0], intermediate, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
    if rows.shape[0] == 0 or intermediate == 0:
        scale.fill_(FLOAT32_TINY)
        return q, scale
    block = block or silu_and_mul_block(intermediate)
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    _silu_and_mul_fp8_kernel[(rows.shape[0],)](
        rows,
        q,
        scale,
        rows.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        FP8_MAX_C=FP8_MAX,
        TINY=FLOAT32_TINY,
        num_warps=silu_and_mul_warps(block),
        **launch_options(rows.device),
    )
    return q, scale


def silu_and_mul_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of silu_and_mul_fp8: SiluAndMul's torch code, then
    per_token_quant_fp8_ref."""
    gate, up = x.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return per_token_quant_fp8_ref(out.reshape(-1, out.shape[-1]))
