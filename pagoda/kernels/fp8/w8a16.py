"""The W8A16 Triton kernel: y = x @ dequant(w_fp8).T (+ bias) for decode-sized M, the fp8
weights converted in registers and multiplied by the 16-bit activation (no activation
quantization), per-channel or block scales (SCALE_BLOCKED constexpr).

Owns ``w8a16_linear`` (the kernel's wrapper; its arguments are checked by the public
entries of pagoda.kernels.fp8.linear, which decides when it runs: W8A16_MAX_M), its tiles
(``w8a16_config``) and weight decodes (``W8A16_DECODES``), and the split-K reduction.
One row is an FMA-and-reduce GEMV (optionally gated: silu(gate) * up in the epilogue);
2..64 rows take tl.dot on one tile of all rows. Runs on CUDA, or on CPU under
TRITON_INTERPRET=1; outputs are allocated from shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.gemv.gemv import load_kn_step, load_row_step
from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release

# The most rows w8a16_linear takes (one program holds all rows' accumulators).
W8A16_ROWS_LIMIT = 64

# W8A16 tiles. BLOCK_M = 1: an FMA-and-reduce GEMV over a [BLOCK_N, BLOCK_K] tile (no
# padding rows); 2..64 rows: tl.dot on one tile of all rows (16 at least, tl.dot's
# minimum), so the weight tile is read once for all of them. Narrow BLOCK_N gives batch-1
# GEMVs enough programs to keep every SM streaming (N = 4096 -> 256 programs); SPLIT_K > 1
# adds programs along K and a reduce. Untuned guesses: the fp8-gemm benchmark's --sweep.
W8A16_GEMV_CONFIG = dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=4)
W8A16_DOT_CONFIG = dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4)
# One row of a projection no wider than 8192 with K <= 4096 (Llama-8B's qkv and o):
# 16 columns a program, 3 loads in flight. The batch-1 kernel sweep on the H200
# (launches back to back in a CUDA graph, as in the step), us: o 7.22 -> 4.33, qkv 7.00
# -> 6.60 over W8A16_GEMV_CONFIG's rule (docs/performance.md, "Measured reasons: GEMV and
# FP8 weights").
SHORT_K_GEMV_CONFIG = dict(BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=4, LOOP_STAGES=3)


def w8a16_config(m: int, n: int, k: int) -> dict:
    """The W8A16 tiles for an [m, k] x [n, k] product, from the H200 sweeps
    (docs/performance.md): batch 1 reads 16 rows x 512 columns per step for N <= 8192
    and K <= 4096 (SHORT_K_GEMV_CONFIG), else 8 x 512 (1024 for a long K such as
    down_proj's), with 3-4 steps' loads in flight, 32 x 256 for a
    vocabulary-wide N; 2..16 rows split a long K four ways (two for K <= 4096) and
    decode the weights by bit operations (8 rows of the Llama-8B shapes: qkv 18.0 ->
    17.5, o 15.1 -> 14.9, down 30.4 -> 28.3 us, gate_up equal; at one row the cvt decode
    measured faster: the fp8-gemm benchmark's --decode-compare)."""
    if m == 1:
        if n >= 65536:
            return dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4)
        if n <= 8192 and k <= 4096:
            return dict(SHORT_K_GEMV_CONFIG)
        # Pipelined K loop: 3 loads in flight for the wide-N projections, 4 for down.
        return dict(
            W8A16_GEMV_CONFIG,
            BLOCK_K=1024 if k >= 8192 else 512,
            LOOP_STAGES=3 if n > 4096 and k <= 4096 else 4,
        )
    if n >= 65536:
        return dict(W8A16_DOT_CONFIG, DECODE="bits")
    return dict(W8A16_DOT_CONFIG, SPLIT_K=4 if k >= 8192 else 2, DECODE="bits")


# -------------------------------------------------------------- W8A16 kernel -------
# Weight decodes (the DECODE config key / constexpr). "cvt": Triton's fp8 casts (sm_90:
# F2FP e4m3x2 -> f16x2 per pair, then f16 -> f32 per element; the tl.dot path adds an
# f16 -> bf16 F2F per element). "bits": the e4m3 bits placed in a float's bit pattern with
# integer ops (sign-extend, shift, mask; no conversion instructions), leaving a power of two
# that the kernel applies to the accumulator, the scale or (tl.dot path) each element.
# e4m3fn's NaN codes (0x7f / 0xff) never occur in weights Pagoda quantizes (finite amax and
# scales; quantize_weight_* refuse non-finite weights), so no decode need preserve them.
W8A16_DECODES = ("cvt", "bits")


@triton.jit
def _e4m3_bits_f32(w):
    """e4m3fn -> float32 holding exactly value * 2^-120: the sign-extended byte shifted so
    that its 4 exponent + 3 mantissa bits land on float32's exponent LSBs (bits 26..20), the
    mask keeping the sign (bit 31) and those 7 bits. A subnormal e4m3 (exponent 0) becomes a
    float32 subnormal of the same significand: also exact. The compiled code keeps such
    values (sm_90 SASS of the kernel: FFMA, no .FTZ: Triton does not flush denormals), and
    each product with x is added to a float32 accumulator by one fused multiply-add."""
    b = w.to(tl.int8, bitcast=True).to(tl.int32)
    return ((b << 20) & -2014314496).to(tl.float32, bitcast=True)  # mask 0x87F00000


@triton.jit
def _e4m3_bits_to(w, dtype: tl.constexpr):
    """e4m3fn -> dtype (bfloat16, float16 or float32) of exactly the same value, for the
    tl.dot path: the bits placed on dtype's exponent LSBs as in _e4m3_bits_f32 (value *
    2^-120 for bfloat16 / float32, value * 2^-8 for float16; subnormal for a subnormal
    e4m3), then one multiply by that power of two in dtype (exact: at most 4 significant
    bits, and the result is a normal number)."""
    if dtype == tl.bfloat16:
        b = w.to(tl.int8, bitcast=True).to(tl.int16)
        t = ((b << 4) & -30736).to(tl.bfloat16, bitcast=True)  # mask 0x87F0
        return t * tl.full((), 1.329227995784916e36, tl.bfloat16)  # 2^120
    elif dtype == tl.float16:
        b = w.to(tl.int8, bitcast=True).to(tl.int16)
        t = ((b << 7) & -16512).to(tl.float16, bitcast=True)  # mask 0xBF80
        return t * tl.full((), 256.0, tl.float16)
    else:
        return _e4m3_bits_f32(w) * 1.329227995784916e36


@triton.jit
def _block_scales(
    s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr
):
    """The block scales of weight rows offs_n at K offset k0: one per (GROUP_N, GROUP_K)
    block, [len(offs_n)] float32, 0 for rows past N."""
    return tl.load(
        s_ptr + (offs_n // GROUP_N) * stride_sn + (k0 // GROUP_K) * stride_sk, mask=n_ok, other=0.0
    )


@triton.jit
def _gemv_one_row(
    x_ptr,
    s_ptr,
    w_rows,
    offs_n,
    n_ok,
    offs_k,
    k_start,
    k_end,
    stride_sn,
    stride_sk,
    SCALE_BLOCKED: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    DECODE: tl.constexpr,
):
    """One x row times the ROWS weight rows at w_rows over [k_start, k_end): [1, ROWS]
    float32, block scales applied, per-channel scales not (the kernel's epilogue does).
    DECODE "bits": acc2 sums products with value * 2^-120 weights; per channel the
    factor is undone on the reduced sums. Block scales are raised by 2^64 and the rest
    (2^56) applied at the end, so w * s stays a normal float32 (exact products) for any
    scale in [2^-70, 2^64)."""
    acc2 = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
    # LOOP_STAGES > 1: Triton's software pipeliner keeps that many K steps' loads in
    # flight (the GEMV is bound by bytes in flight per SM, not by arithmetic).
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        x, w = load_row_step(x_ptr, w_rows, n_ok, offs_k, k0, k_end, EVEN_N, EVEN_K, True)
        if DECODE == "bits":
            w = _e4m3_bits_f32(w)
        else:
            w = w.to(tl.float32)
        if SCALE_BLOCKED:
            s = _block_scales(s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, GROUP_N, GROUP_K)
            if DECODE == "bits":
                s = s * 18446744073709551616.0  # 2^64
            w = w * s[:, None]
        acc2 += w * x[None, :]
    acc = tl.sum(acc2, axis=1)[None, :]
    if DECODE == "bits":
        if SCALE_BLOCKED:
            acc = acc * 72057594037927936.0  # 2^56
        else:
            acc = acc * 1.329227995784916e36  # 2^120; the scale multiplies below
    return acc


@triton.jit
def _dot_tiles(
    x_ptr,
    s_ptr,
    w_rows,
    offs_m,
    offs_n,
    n_ok,
    offs_k,
    k_start,
    k_end,
    M,
    stride_xm,
    stride_sn,
    stride_sk,
    SCALE_BLOCKED: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    DECODE: tl.constexpr,
):
    """x's rows (BLOCK_M, those >= M zero) times the BLOCK_N weight rows at w_rows over
    [k_start, k_end) by tl.dot on weights decoded to x's dtype: [BLOCK_M, BLOCK_N]
    float32, block scales applied, per-channel scales not."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    for k0 in range(k_start, k_end, BLOCK_K):
        w_ptrs = w_rows[None, :] + (k0 + offs_k)[:, None]
        x, w = load_kn_step(
            x_rows + (k0 + offs_k)[None, :],
            w_ptrs,
            offs_m < M,
            n_ok,
            offs_k,
            k0,
            k_end,
            EVEN_N,
            EVEN_K,
        )
        if DECODE == "bits":
            w = _e4m3_bits_to(w, x.dtype)
        else:
            w = w.to(x.dtype)
        part = tl.dot(x, w, input_precision=DOT_PRECISION)
        if SCALE_BLOCKED:
            s = _block_scales(s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, GROUP_N, GROUP_K)
            part = part * s[None, :]
        acc += part
    return acc


@triton.jit
def _silu_mul_pairs(acc, out_dtype: tl.constexpr, BLOCK_N: tl.constexpr):
    """[1, 2 * BLOCK_N] accumulators of interleaved gate / up rows -> [1, BLOCK_N]
    silu(gate) * up, each rounded to out_dtype first as the unfused gate_up linear and
    silu_and_mul round them."""
    gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
    gate = gate.to(out_dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype)
    return (silu.to(tl.float32) * up.to(out_dtype).to(tl.float32))[None, :]


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_om,
    stride_sn,
    stride_sk,
    SCALE_BLOCKED: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    DECODE: tl.constexpr,
    GATED: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    """Program (n block, k split) -> out[:, n block] (SPLIT_K == 1) or the split's float32
    partial sums part[k split, :, n block]. The weights are read once for all M rows.
    DECODE: how the fp8 weights become float32 / the dot's dtype (W8A16_DECODES).
    EVEN_K / EVEN_N: no tile is cut by K's / N's end, so the weight loads carry no
    mask along that axis (a mask Triton cannot prove uniform splits the 16-byte vector
    loads into narrower ones: the GEMV then falls far short of the memory bandwidth).
    GATED (one row, SPLIT_K 1, no bias): the weight is [gate; up], 2N rows, and out[:, j]
    = silu(gate_j) * up_j (_silu_mul_pairs); the program's accumulator rows interleave
    gate row j and up row N + j, so one tile streams both."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if GATED:
        pair = tl.arange(0, 2 * BLOCK_N)
        cols = pid_n * BLOCK_N + pair // 2
        offs_n = cols + (pair % 2) * N  # the weight row of each accumulator row
        n_ok = cols < N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    k_start = pid_k * K_PER_SPLIT  # a multiple of BLOCK_K, hence of one K block's start
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    pdl_wait_and_release(USE_PDL)  # before any load or store
    if BLOCK_M == 1:
        acc = _gemv_one_row(
            x_ptr,
            s_ptr,
            w_rows,
            offs_n,
            n_ok,
            offs_k,
            k_start,
            k_end,
            stride_sn,
            stride_sk,
            SCALE_BLOCKED,
            GROUP_N,
            GROUP_K,
            2 * BLOCK_N if GATED else BLOCK_N,
            BLOCK_K,
            EVEN_K,
            EVEN_N,
            LOOP_STAGES,
            DECODE,
        )
    else:
        acc = _dot_tiles(
            x_ptr,
            s_ptr,
            w_rows,
            offs_m,
            offs_n,
            n_ok,
            offs_k,
            k_start,
            k_end,
            M,
            stride_xm,
            stride_sn,
            stride_sk,
            SCALE_BLOCKED,
            GROUP_N,
            GROUP_K,
            DOT_PRECISION,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_K,
            EVEN_N,
            DECODE,
        )
    if not SCALE_BLOCKED:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    if GATED:
        acc = _silu_mul_pairs(acc, out_ptr.dtype.element_ty, BLOCK_N)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    mask = (offs_m[:, None] < M) & n_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """out[m, n block] = sum over splits of part[split, m, n block] (+ bias), in a fixed
    order (deterministic, no atomics)."""
    pdl_wait_and_release(USE_PDL)  # before any load or store
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + m) * N + offs_n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fit_block_k(block_k: int, group_k: int, minimum: int) -> int:
    """The largest power of two <= block_k dividing group_k (a BLOCK_K slice must not
    straddle two K blocks of scales)."""
    while block_k > minimum and group_k % block_k:
        block_k //= 2
    if group_k % block_k:
        raise ValueError(
            f"a K block of {group_k} columns needs a power-of-two divisor "
            f">= {minimum} for the FP8 block kernels"
        )
    return block_k


def w8a16_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale: torch.Tensor,
    bias=None,
    out_dtype=None,
    block: tuple[int, int] | None = None,
    config=None,
    gated: bool = False,
) -> torch.Tensor:
    """x [M <= W8A16_ROWS_LIMIT, K] -> [M, N] with weights dequantized in registers.
    block=None: scale [N] per channel; block=(bn, bk): scale [ceil(N/bn), ceil(K/bk)]
    (BLOCK_K is narrowed to divide bk). Arguments are checked by the public entries.
    config (default w8a16_config): BLOCK_N, BLOCK_K, SPLIT_K, num_warps; optional
    LOOP_STAGES (one-row loop), DECODE (W8A16_DECODES, default "cvt"), DOT (one row on
    the tl.dot path). gated: w_fp8 is [gate; up] (2N rows), the result silu(gate) * up
    [1, N] (one row, per-channel scales, no bias; the default tile halves BLOCK_N, so a
    K step reads as many weight rows as the plain GEMV's)."""
    m, k = x.shape
    n = w_fp8.shape[0] // 2 if gated else w_fp8.shape[0]
    if not 0 < m <= W8A16_ROWS_LIMIT:
        raise ValueError(f"w8a16_linear takes 1 to {W8A16_ROWS_LIMIT} rows, got {m}")
    if gated and (m != 1 or bias is not None or block is not None):
        raise ValueError("w8a16_linear(gated=True) takes one row, per-channel scales, no bias")
    if config is None and gated:
        config = dict(w8a16_config(1, 2 * n, k))
        config["BLOCK_N"] //= 2
    cfg = dict(config or w8a16_config(m, n, k))
    if gated and (cfg["SPLIT_K"] != 1 or cfg.get("DOT", False)):
        raise ValueError("w8a16_linear(gated=True) needs SPLIT_K 1 and the one-row loop")
    split_k = cfg.pop("SPLIT_K")
    loop_stages = cfg.pop("LOOP_STAGES", 1)
    decode = cfg.pop("DECODE", "cvt")
    # DOT=True: one row through the tl.dot path too (a 16-row tile, 15 padding rows).
    one_row_dot = cfg.pop("DOT", False)  # popped for any m: it is no kernel argument
    block_m = 1 if m == 1 and not one_row_dot else max(16, triton.next_power_of_2(m))
    if decode not in W8A16_DECODES:
        raise ValueError(f"w8a16_linear: DECODE must be one of {W8A16_DECODES}, got {decode!r}")
    bn, bk = block if block is not None else (1, 1)
    if block is not None:
        cfg["BLOCK_K"] = fit_block_k(cfg["BLOCK_K"], bk, 16 if block_m > 1 else 1)
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    _w8a16_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split_k)](
        x,
        w_fp8,
        scale,
        bias if bias is not None else out,
        out,
        part,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        w_fp8.stride(0),
        out.stride(0),
        scale.stride(0),
        scale.stride(1) if block is not None else 0,
        SCALE_BLOCKED=block is not None,
        GROUP_N=bn,
        GROUP_K=bk,
        HAS_BIAS=bias is not None,
        SPLIT_K=split_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        EVEN_K=k % (k_per_split) == 0 and k_per_split % cfg["BLOCK_K"] == 0,
        EVEN_N=n % cfg["BLOCK_N"] == 0,
        LOOP_STAGES=loop_stages,
        DECODE=decode,
        GATED=gated,
        **cfg,
        **launch_options(x.device),
    )
    if split_k > 1:
        _split_k_reduce_kernel[(m, triton.cdiv(n, 1024))](
            part,
            bias if bias is not None else out,
            out,
            m,
            n,
            out.stride(0),
            SPLIT_K=split_k,
            HAS_BIAS=bias is not None,
            BLOCK_N=1024,
            **launch_options(x.device),
        )
    return out
