"""FP8 weight matmuls: y = x @ dequant(w_fp8).T (+ bias), for the FP8 linear methods.

Owns:
- ``fp8_linear(x, w_fp8, w_scale)``: per-output-channel weight scales [N]. Decode sizes
  (M <= W8A16_MAX_M) run the W8A16 Triton kernel: fp8 weights converted in registers,
  multiplied by the bf16 activation, the scale applied at the end; no activation
  quantization (one launch; the step is bound by the weight bytes anyway). Larger M
  quantizes the activation per token (pagoda.kernels.fp8.quant) and runs W8A8 on the
  FP8 tensor cores: torch._scaled_mm with rowwise scales where its layout rules hold,
  else the Triton W8A8 GEMM below.
- ``fp8_block_linear(x, w_fp8, w_scale_blocks, block)``: DeepSeek-style 128 x 128 weight
  blocks. Decode sizes: the same W8A16 kernel with block scales; larger M: activation
  groups of block[1] columns (per_token_group_quant_fp8) and the Triton W8A8 GEMM, which
  applies both scales per K block in float32.
- torch references of both (dequantize to float32, matmul, cast).

The W8A16 kernel lives in pagoda.kernels.fp8.w8a16; this module decides when it runs.
Two kernels serve both scale layouts (SCALE_BLOCKED constexpr): the per-channel scale is
applied once to the float32 accumulator; block scales are applied to each BLOCK_K slice's
partial product (BLOCK_K divides the K block, so one slice has one scale per column).
Kernels run on CUDA, or on CPU under TRITON_INTERPRET=1; on CPU otherwise the references
compute the same thing. Outputs are allocated from shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.fp8.quant import (
    FP8_DTYPE,
    dequantize_blockwise,
    dequantize_per_channel,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    per_token_quant_fp8,
    per_token_quant_fp8_ref,
    triton_usable,
)
from pagoda.kernels.fp8.w8a16 import fit_block_k, w8a16_linear
from pagoda.kernels.launch.capability import cuda_capability

# Rows up to which fp8_linear / fp8_block_linear use the W8A16 kernel rather than
# quantizing the activation for a tensor-core GEMM. Both are bound by the weight bytes at
# this size; the fp8-gemm benchmark measures the crossover (it prints it).
W8A16_MAX_M = 16
# W8A8 GEMM tiles (fp8 tl.dot): 64-row tiles for mid M, 128 beyond.
W8A8_SMALL_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
W8A8_LARGE_CONFIG = dict(
    BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3
)


# ------------------------------------------------------------------ checks ---------
def _flatten(x: torch.Tensor, k: int, what: str) -> torch.Tensor:
    if not x.is_floating_point() or x.dtype == FP8_DTYPE or x.shape[-1] != k:
        raise ValueError(
            f"{what}: x must be a float [..., {k}] tensor, got {tuple(x.shape)} {x.dtype}"
        )
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _weight_shape(w_fp8: torch.Tensor, what: str) -> tuple[int, int]:
    if w_fp8.dim() != 2:
        raise ValueError(f"{what}: w_fp8 must be 2-D [N, K], got {tuple(w_fp8.shape)}")
    return int(w_fp8.shape[0]), int(w_fp8.shape[1])


def _check_fp8_weight(w_fp8: torch.Tensor, x: torch.Tensor, what: str) -> None:
    if w_fp8.dtype != FP8_DTYPE or w_fp8.dim() != 2 or w_fp8.stride(1) != 1:
        raise ValueError(
            f"{what}: w_fp8 must be a [N, K] float8_e4m3fn tensor with "
            f"contiguous rows, got {tuple(w_fp8.shape)} {w_fp8.dtype}"
        )
    if w_fp8.device != x.device:
        raise ValueError(f"{what}: x on {x.device}, w_fp8 on {w_fp8.device}")


def _check_bias(bias, n: int, what: str) -> None:
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{what}: bias must have shape [{n}], got {tuple(bias.shape)}")


def _per_channel_scale(w_scale: torch.Tensor, n: int) -> torch.Tensor:
    if w_scale.numel() != n:
        raise ValueError(
            f"fp8_linear: w_scale must have {n} elements (one per output "
            f"row), got shape {tuple(w_scale.shape)}"
        )
    return w_scale.reshape(n).to(torch.float32).contiguous()


def _block_scale(w_scale: torch.Tensor, n: int, k: int, block) -> tuple[torch.Tensor, int, int]:
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"fp8_block_linear: block must be two positive sizes, got {block}")
    bn, bk = int(block[0]), int(block[1])
    want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(w_scale.shape) != want:
        raise ValueError(
            f"fp8_block_linear: w_scale_blocks must have shape {want} for "
            f"weight {n}x{k} and block {block}, got {tuple(w_scale.shape)}"
        )
    return w_scale.to(torch.float32).contiguous(), bn, bk


# --------------------------------------------------------------- W8A8 GEMM ---------
@triton.jit
def _w8a8_gemm_kernel(
    a_ptr,
    b_ptr,
    as_ptr,
    bs_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_asg,
    stride_bsn,
    stride_bsg,
    SCALE_BLOCKED: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c[M, N] = (a_fp8 * a_scale) @ (b_fp8 * b_scale).T on the FP8 tensor cores.
    Per channel: a_scale [M] per row, b_scale [N], applied to the final accumulator.
    Blocked: a_scale [M, K / GROUP_K], b_scale [N / GROUP_N, K / GROUP_K], applied to each
    BLOCK_K slice's product (BLOCK_K divides GROUP_K). Programs walk the output in groups
    of GROUP_M row tiles so neighbouring programs share B tiles in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Out-of-range rows/columns read row 0 / column 0 (in bounds) and are never stored.
    safe_m = tl.where(m_ok, offs_m, 0).to(tl.int64)
    safe_n = tl.where(n_ok, offs_n, 0).to(tl.int64)
    a_tile = a_ptr + safe_m[:, None] * stride_am + offs_k[None, :]
    b_tile = b_ptr + safe_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_tile + k0)
            b = tl.load(b_tile + k0)
        else:
            a = tl.load(a_tile + k0, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_tile + k0, mask=offs_k[:, None] < K - k0, other=0.0)
        if SCALE_BLOCKED:
            g = k0 // GROUP_K
            sa = tl.load(as_ptr + safe_m * stride_asm + g * stride_asg)
            sb = tl.load(bs_ptr + (safe_n // GROUP_N) * stride_bsn + g * stride_bsg)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        else:
            # Hopper's FP8 MMA adds into a narrower accumulator: promote to float32 after
            # each slice (Triton's default there would never promote; cuBLAS's precise mode
            # and DeepSeek's kernels promote at this interval too).
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    if not SCALE_BLOCKED:
        sa = tl.load(as_ptr + safe_m * stride_asm)
        sb = tl.load(bs_ptr + safe_n * stride_bsn)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + safe_n).to(tl.float32)[None, :]
    tl.store(
        c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def w8a8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias=None,
    out_dtype=torch.bfloat16,
    block: tuple[int, int] | None = None,
    config=None,
) -> torch.Tensor:
    """Triton W8A8 GEMM. block=None: x_scale [M, 1], w_scale [N]; block=(bn, bk): x_scale
    [M, ceil(K/bk)] (any strides), w_scale [ceil(N/bn), ceil(K/bk)]."""
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    cfg = dict(config or (W8A8_SMALL_CONFIG if m <= 64 else W8A8_LARGE_CONFIG))
    bn, bk = block if block is not None else (1, 1)
    if block is not None:
        cfg["BLOCK_K"] = fit_block_k(cfg["BLOCK_K"], bk, 16)
    out = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](
        x_fp8,
        w_fp8,
        x_scale,
        w_scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x_fp8.stride(0),
        w_fp8.stride(0),
        out.stride(0),
        x_scale.stride(0),
        x_scale.stride(1) if block is not None else 0,
        w_scale.stride(0),
        w_scale.stride(1) if block is not None else 0,
        SCALE_BLOCKED=block is not None,
        GROUP_N=bn,
        GROUP_K=bk,
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg["BLOCK_K"] == 0,
        **cfg,
    )
    return out


# ------------------------------------------------------------ _scaled_mm path ------
def scaled_mm_usable(x: torch.Tensor, w_fp8: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm's rowwise FP8 GEMM takes this case as is: a CUDA device of
    compute capability >= 8.9; K and N multiples of 16 (cuBLASLt / CUTLASS alignment: the
    column-major weight's leading dimension is K); a 16-byte-aligned contiguous weight
    (w_fp8.t() is then column-major, as required); a bf16/fp16 output."""
    if x.device.type != "cuda" or cuda_capability(x.device) < (8, 9):
        return False
    n, k = w_fp8.shape
    return (
        k % 16 == 0
        and n % 16 == 0
        and w_fp8.is_contiguous()
        and w_fp8.data_ptr() % 16 == 0
        and out_dtype in (torch.bfloat16, torch.float16)
    )


def scaled_mm_linear(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias=None,
    out_dtype=torch.bfloat16,
) -> torch.Tensor:
    """torch._scaled_mm with rowwise scales: x_scale [M, 1], w_scale [N] -> scale_b [1, N].
    The bias is fused when its dtype is the output's (what _scaled_mm accepts), else added.

    Fast accumulation: the FP8 tensor cores' own accumulator over the whole K loop, not
    promoted to float32 every few K blocks (what vLLM's CUTLASS FP8 kernels and torchao's
    float8 forward use): 256 x 1024/128 at 5,729 -> 6,073 tok/s for a logprob error of
    0.1899 -> 0.1915 (H200; docs/performance.md, "Measured reasons: GEMV and FP8 weights")."""
    fuse = bias is not None and bias.dtype == out_dtype
    out = torch._scaled_mm(
        x_fp8,
        w_fp8.t(),
        scale_a=x_scale,
        scale_b=w_scale.view(1, -1),
        bias=bias if fuse else None,
        out_dtype=out_dtype,
        use_fast_accum=True,
    )
    if bias is not None and not fuse:
        out += bias.to(out_dtype)
    return out


# ------------------------------------------------------------ public entries -------
def fp8_linear_silu_and_mul(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
):
    """silu(gate) * up of fp8_linear(x, w_fp8, w_scale) = [gate | up] in one launch, for
    one row on CUDA (the gated W8A16 GEMV: the separate activation launch and its read
    of the [1, 2N] product go away); None where that kernel does not apply (more rows,
    the CPU): the caller then runs the linear and the activation apart."""
    n2, k = _weight_shape(w_fp8, "fp8_linear_silu_and_mul")
    x2 = _flatten(x, k, "fp8_linear_silu_and_mul")
    if x2.shape[0] != 1 or n2 % 2 or not triton_usable(x2):
        return None
    _check_fp8_weight(w_fp8, x2, "fp8_linear_silu_and_mul")
    out = w8a16_linear(
        x2, w_fp8, _per_channel_scale(w_scale, n2), None, out_dtype or x.dtype, gated=True
    )
    return out.reshape(*x.shape[:-1], n2 // 2)


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias=None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] = x @ (w_fp8 * w_scale[:, None]).T (+ bias), in out_dtype
    (default x.dtype). w_fp8 [N, K] float8_e4m3fn, w_scale [N] (or [N, 1]) float32."""
    n, k = _weight_shape(w_fp8, "fp8_linear")
    x2 = _flatten(x, k, "fp8_linear")
    _check_fp8_weight(w_fp8, x2, "fp8_linear")
    _check_bias(bias, n, "fp8_linear")
    scale = _per_channel_scale(w_scale, n)
    out_dtype = out_dtype or x.dtype
    m = x2.shape[0]
    if not triton_usable(x2):
        out = fp8_linear_ref(x2, w_fp8, scale, bias, out_dtype, act_quant=m > W8A16_MAX_M)
    elif m == 0:
        out = torch.empty(0, n, dtype=out_dtype, device=x.device)
    elif m <= W8A16_MAX_M:
        out = w8a16_linear(x2, w_fp8, scale, bias, out_dtype)
    else:
        out = w8a8_linear(*per_token_quant_fp8(x2), w_fp8, scale, bias, out_dtype)
    return out.reshape(*x.shape[:-1], n)


def w8a8_linear(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8_linear's product past its per-token quantization: x_fp8 [M, K] with x_scale
    [M, 1] times w_fp8 [N, K] with w_scale [N] (+ bias) -> [M, N] in out_dtype, by
    torch._scaled_mm where it takes the case, else the Triton W8A8 GEMM (the torch
    reference where Triton cannot run). Also the FP8 linear methods' entry for an
    activation its producer quantized (pagoda.model.quant.fp8)."""
    if not triton_usable(x_fp8):
        return w8a8_linear_ref(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    if scaled_mm_usable(x_fp8, w_fp8, out_dtype):
        return scaled_mm_linear(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    return w8a8_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)


def fp8_block_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_blocks: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias=None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] with block-scaled weights: w_scale_blocks [ceil(N/bn),
    ceil(K/bk)]. Above W8A16_MAX_M rows the activation is quantized in groups of bk."""
    n, k = _weight_shape(w_fp8, "fp8_block_linear")
    x2 = _flatten(x, k, "fp8_block_linear")
    _check_fp8_weight(w_fp8, x2, "fp8_block_linear")
    _check_bias(bias, n, "fp8_block_linear")
    scale, bn, bk = _block_scale(w_scale_blocks, n, k, block)
    out_dtype = out_dtype or x.dtype
    m = x2.shape[0]
    if not triton_usable(x2):
        out = fp8_block_linear_ref(
            x2, w_fp8, scale, (bn, bk), bias, out_dtype, act_quant=m > W8A16_MAX_M
        )
    elif m == 0:
        out = torch.empty(0, n, dtype=out_dtype, device=x.device)
    elif m <= W8A16_MAX_M:
        out = w8a16_linear(x2, w_fp8, scale, bias, out_dtype, block=(bn, bk))
    else:
        x_fp8, x_scale = per_token_group_quant_fp8(x2, bk)
        out = w8a8_gemm(x_fp8, x_scale, w_fp8, scale, bias, out_dtype, block=(bn, bk))
    return out.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------- references -------
def _finish(y: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear_ref(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias=None,
    out_dtype=None,
    act_quant: bool = False,
) -> torch.Tensor:
    """Torch reference: float32 matmul of x (act_quant: quantized per token and
    dequantized, as the W8A8 path does) with the dequantized weight; cast at the end."""
    if act_quant:
        return w8a8_linear_ref(
            *per_token_quant_fp8_ref(x), w_fp8, w_scale, bias, out_dtype or x.dtype
        )
    y = x.float() @ dequantize_per_channel(w_fp8, w_scale).t()
    return _finish(y, bias, out_dtype or x.dtype)


def w8a8_linear_ref(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Torch reference of w8a8_linear: the activation and weight dequantized, a float32
    matmul, cast at the end."""
    y = (x_fp8.float() * x_scale) @ dequantize_per_channel(w_fp8, w_scale).t()
    return _finish(y, bias, out_dtype)


def fp8_block_linear_ref(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    block=(128, 128),
    bias=None,
    out_dtype=None,
    act_quant: bool = False,
) -> torch.Tensor:
    """Torch reference of fp8_block_linear (act_quant: x quantized in groups of block[1])."""
    xf = x.float()
    if act_quant:
        q, s = per_token_group_quant_fp8_ref(x, block[1])
        xf = q.float() * s.repeat_interleave(block[1], dim=1)[:, : x.shape[1]]
    y = xf @ dequantize_blockwise(w_fp8, w_scale, block).t()
    return _finish(y, bias, out_dtype or x.dtype)
