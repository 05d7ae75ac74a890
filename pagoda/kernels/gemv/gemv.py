"""A bf16/fp16 GEMV for decode-sized linear layers: y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
for a few rows (M <= GEMV_MAX_ROWS), and the table that says when the engine uses it.

Why: at batch 1 cuBLAS reaches 2-2.7 TB/s on the small and medium projections of a
decode step (Qwen3-30B-A3B's qkv 2048->5120, o_proj 4096->2048 in two launches:
split-K GEMM + reduce) where the H200 copies at 4.25 TB/s. A step that small is bound
by the weight bytes alone; this kernel streams them with as many loads in flight as the
SMs hold.

Owns:
- ``gemv(x, weight, bias, tiles)``: the Triton kernel's wrapper (CUDA, or CPU under
  TRITON_INTERPRET=1); ``gemv_ref``: its torch reference.
- ``maybe_gemv``: what the unquantized linear method calls, which returns None (take
  F.linear) unless the shape is in the routing table of its GemvConfig
  (pagoda.kernels.gemv.config, filled from the GEMV sweep's output).
- ``default_tiles``: tiles for a shape that is not in the table (direct calls, tests).

Kernel: program (column block, K split) owns BLOCK_N output columns of all M rows and
reads its [BLOCK_N, K split] weight slab exactly once, float32 accumulators, pipelined
K loop (tl.range num_stages = LOOP_STAGES). Three inner products, by constexpr:
- BLOCK_M == 1: a [BLOCK_N, BLOCK_K] float32 accumulator, reduced over K once at the end;
- FMA, 2..16 rows: each K step's [BLOCK_M, BLOCK_N, BLOCK_K] product reduced over K;
- DOT: tl.dot on a [BLOCK_M >= 16, BLOCK_K] x [BLOCK_K, BLOCK_N] tile (padding rows).
SPLIT_K > 1 (too few column blocks to fill the SMs) stays ONE launch: every split stores
its float32 partial, then takes a ticket from a per-column-block counter; the program
that draws the last ticket sums the SPLIT_K partials in split order (so the result does
not depend on which program finishes last: deterministic), adds the bias, rounds once,
stores, and sets the counter back to 0 (the next launch, or CUDA-graph replay, finds it
zeroed). Invariant: launches that share a device's counters run in stream order (the
engine's forward is on one stream).

Outputs and partials are allocated from shapes alone, nothing syncs with the host:
CUDA-graph capturable. The counters are a per-device buffer allocated on first use;
the first use must be outside capture (the graph runner's warm-up forwards are).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagoda.kernels.gemv.config import GemvConfig, GemvTiles
from pagoda.kernels.launch.arrival_counters import arrival_counters
from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release

# The most rows the kernel takes (a decode step's padded batch of up to 16 requests;
# larger steps stay on cuBLAS, whose tensor-core tiles then carry no padding rows).
GEMV_MAX_ROWS = 16

# PAGODA_TRITON_GEMV=0 turns the routing off (the table is ignored).
ENV_SWITCH = "PAGODA_TRITON_GEMV"

# Owner name of the split-K counters (pagoda.kernels.launch.arrival_counters).
COUNTERS_OWNER = "gemv split-K"


def default_tiles(m: int, n: int, k: int) -> GemvTiles:
    """Tiles for a shape not in the routing table (untuned guesses; the table holds
    measured ones): one row reads 8 weight rows x 512 columns per K step; up to 4 rows
    take the FMA product on 4 x 256 (its [M, N, K] accumulator stays within 32 registers
    a thread); more rows take tl.dot on 32 x 128. The K split doubles (up to 8) while
    the programs are fewer than two per SM of an H200 (132), 3 K steps of loads in flight."""
    if m == 1:
        block_n, block_k, dot = 8, 512, False
    elif m <= 4:
        block_n, block_k, dot = 4, 256, False
    else:
        block_n, block_k, dot = 32, 128, True
    blocks, split = triton.cdiv(n, block_n), 1
    while blocks * split < 264 and k >= 2 * split * block_k and split < 8:
        split *= 2
    return GemvTiles(
        block_n=block_n, block_k=block_k, split_k=split, loop_stages=3, num_warps=4, dot=dot
    )


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    """Program (column block pid_n, K split pid_k) -> out[:, block] (SPLIT_K == 1), or its
    float32 partial and, for the last of the block's splits, the reduction.
    EVEN_N / EVEN_K: no weight tile is cut by N's / K's end, so weight loads carry no mask
    (a mask Triton cannot prove uniform splits 16-byte vector loads into narrow ones, and
    the kernel then falls far short of the bandwidth). EVEN_M: M == BLOCK_M."""
    pdl_wait_and_release(USE_PDL)  # before any load or store
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_start = pid_k * K_PER_SPLIT  # a multiple of BLOCK_K
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    if BLOCK_M == 1:
        acc = _one_row(
            x_ptr, w_rows, n_ok, k_start, k_end, BLOCK_N, BLOCK_K, EVEN_N, EVEN_K, LOOP_STAGES
        )
    elif DOT:
        acc = _dot_rows(
            x_rows,
            w_rows,
            m_ok,
            n_ok,
            k_start,
            k_end,
            DOT_PRECISION,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_N,
            EVEN_K,
            LOOP_STAGES,
        )
    else:
        acc = _fma_rows(
            x_rows,
            w_rows,
            m_ok,
            n_ok,
            k_start,
            k_end,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            EVEN_M,
            EVEN_N,
            EVEN_K,
            LOOP_STAGES,
        )
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        _split_k_finish(
            acc,
            part_ptr,
            count_ptr,
            bias_ptr,
            out_ptrs,
            out_mask,
            offs_m,
            offs_n,
            n_ok,
            pid_n,
            pid_k,
            M,
            N,
            HAS_BIAS,
            SPLIT_K,
            BLOCK_M,
            BLOCK_N,
        )


@triton.jit
def load_row_step(
    x_ptr,
    w_rows,
    n_ok,
    offs_k,
    k0,
    k_end,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    X_F32: tl.constexpr = False,
):
    """One K step of a one-row GEMV: x[k0 + offs_k] (as stored, or float32 with X_F32)
    and the weight tile [rows, len(offs_k)] at w_rows' row starts as stored, zero past
    N's or K's end. A load carries a mask only along an axis the tile can be cut on
    (EVEN_N / EVEN_K false): a mask Triton cannot prove uniform splits the 16-byte
    vector loads. X_F32 converts x right after its load, before the weight load (the
    FP8 GEMV's order: converting after it compiles a longer block-scaled loop)."""
    w_ptrs = w_rows[:, None] + (k0 + offs_k)[None, :]
    if EVEN_K:
        x = tl.load(x_ptr + k0 + offs_k)
        if X_F32:
            x = x.to(tl.float32)
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        k_ok = offs_k < k_end - k0
        x = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0)
        if X_F32:
            x = x.to(tl.float32)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    return x, w


@triton.jit
def load_kn_step(
    x_ptrs, w_ptrs, m_ok, n_ok, offs_k, k0, k_end, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr
):
    """One K step of a tl.dot tile, as stored: x [rows, len(offs_k)] at x_ptrs (rows not
    m_ok read as 0) and the weight tile read as [len(offs_k), N] at w_ptrs, zero past N's
    or K's end; the weight load is masked only along an axis the tile can be cut on."""
    if EVEN_K:
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
    else:
        k_ok = offs_k < k_end - k0
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return x, w


@triton.jit
def _one_row(
    x_ptr,
    w_rows,
    n_ok,
    k_start,
    k_end,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """[1, BLOCK_N] float32: one row of x times the block's weight rows over
    [k_start, k_end); a [BLOCK_N, BLOCK_K] accumulator reduced over K once, at the end.
    LOOP_STAGES > 1: Triton's pipeliner keeps that many K steps' loads in flight (the
    kernel is bound by the bytes in flight per SM, not by arithmetic)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        x, w = load_row_step(x_ptr, w_rows, n_ok, offs_k, k0, k_end, EVEN_N, EVEN_K)
        acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc2, axis=1)[None, :]


@triton.jit
def _dot_rows(
    x_rows,
    w_rows,
    m_ok,
    n_ok,
    k_start,
    k_end,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] float32 by tl.dot: x [BLOCK_M >= 16, BLOCK_K] (padding rows
    masked to 0) times the weight slab read as [BLOCK_K, BLOCK_N]."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        w_ptrs = w_rows[None, :] + (k0 + offs_k)[:, None]
        x_ptrs = x_rows[:, None] + (k0 + offs_k)[None, :]
        x, w = load_kn_step(x_ptrs, w_ptrs, m_ok, n_ok, offs_k, k0, k_end, EVEN_N, EVEN_K)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _fma_rows(
    x_rows,
    w_rows,
    m_ok,
    n_ok,
    k_start,
    k_end,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] float32 by FMAs: a [BLOCK_M, BLOCK_N, BLOCK_K] accumulator
    reduced over K once, at the end (a per-step reduction crosses warps through shared
    memory: a barrier every step)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
        w_ptrs = w_rows[:, None] + (k0 + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
        x_ptrs = x_rows[:, None] + (k0 + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
        if EVEN_K:
            if EVEN_M:
                x = tl.load(x_ptrs)
            else:
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < k_end - k0
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return tl.sum(acc3, axis=2)


@triton.jit
def _split_k_finish(
    acc,
    part_ptr,
    count_ptr,
    bias_ptr,
    out_ptrs,
    out_mask,
    offs_m,
    offs_n,
    n_ok,
    pid_n,
    pid_k,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Stores this split's partial part[pid_k, :, block]; the block's last split to
    arrive sums all of them in split order, stores the output and resets the counter."""
    rows = offs_m[:, None] * N + offs_n[None, :]
    tl.store(part_ptr + pid_k * M * N + rows, acc, mask=out_mask)
    # Every thread's partial is written before the ticket is taken (the barrier), and the
    # atomic's release publishes them GPU-wide; its acquire, in the program that reduces,
    # orders the partial loads below after the other splits' stores.
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT_K - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            # .cg: from L2, never a stale L1 line of an earlier launch.
            total += tl.load(
                part_ptr + s * M * N + rows, mask=out_mask, other=0.0, cache_modifier=".cg"
            )
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=out_mask)
        tl.store(count_ptr + pid_n, 0)  # every split of this launch has taken its ticket


def _check(x: torch.Tensor, weight: torch.Tensor, bias) -> tuple[int, int]:
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(
            f"gemv: weight must be 2-D [N, K] with contiguous rows, got "
            f"shape {tuple(weight.shape)} strides {weight.stride()}"
        )
    n, k = weight.shape
    if x.shape[-1] != k or x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(
            f"gemv: x must be [..., {k}] {weight.dtype} on {weight.device}, got "
            f"{tuple(x.shape)} {x.dtype} on {x.device}"
        )
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gemv: weights must be bfloat16, float16 or float32, got {weight.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_floating_point()):
        raise ValueError(
            f"gemv: bias must be a float [{n}] tensor, got {tuple(bias.shape)} {bias.dtype}"
        )
    return n, k


def _check_tiles(tiles: GemvTiles, m: int) -> None:
    if not isinstance(tiles, GemvTiles):
        raise ValueError(f"gemv: tiles must be a GemvTiles, got {type(tiles).__name__}")
    for name in ("block_n", "block_k"):
        value = getattr(tiles, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"gemv: {name} must be a power of two, got {value}")
    if tiles.split_k < 1 or tiles.loop_stages < 1:
        raise ValueError(f"gemv: split_k and loop_stages must be >= 1, got {tiles}")
    if tiles.dot and (m == 1 or tiles.block_n < 16 or tiles.block_k < 16):
        raise ValueError(
            f"gemv: the dot product needs M > 1 and block_n, block_k >= 16, got M={m}, {tiles}"
        )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """x [..., K] (M = its rows, 1..GEMV_MAX_ROWS; rows may be strided) @ weight[N, K].T
    (+ bias) -> [..., N] in x's dtype, float32 accumulation, rounded once. tiles:
    default the device's routing-table entry for the shape, else default_tiles."""
    n, k = _check(x, weight, bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {GEMV_MAX_ROWS} rows, got {m}")
    tiles = tiles or GemvConfig.for_device(x.device).lookup(n, k, m) or default_tiles(m, n, k)
    _check_tiles(tiles, m)
    split, block_n, block_k = tiles.split_k, tiles.block_n, tiles.block_k
    block_m = 1 if m == 1 else max(16 if tiles.dot else 1, triton.next_power_of_2(m))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    blocks = triton.cdiv(n, block_n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    counters = arrival_counters(COUNTERS_OWNER, x.device, blocks) if split > 1 else out
    _gemv_kernel[(blocks, split)](
        x2,
        weight,
        bias if bias is not None else out,
        out,
        part,
        counters,
        m,
        n,
        k,
        k_per_split,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        SPLIT_K=split,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        EVEN_M=m == block_m,
        EVEN_N=n % block_n == 0,
        EVEN_K=k % k_per_split == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        LOOP_STAGES=tiles.loop_stages,
        num_warps=tiles.num_warps,
        DOT=tiles.dot,
        **launch_options(x.device),
    )
    return out.reshape(*x.shape[:-1], n)


def maybe_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor | None:
    """gemv(x, weight, bias) when the engine should take it: x on CUDA (or any device
    under TRITON_INTERPRET=1), fp16 or bf16 x and weight, at most GEMV_MAX_ROWS rows,
    the (N, K, rows bucket) in config's table (default: GemvConfig.for_device) and
    PAGODA_TRITON_GEMV not 0. Otherwise None: the caller's F.linear."""
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return None
    n, k = weight.shape
    m = x.numel() // k if k else 0
    if not 1 <= m <= GEMV_MAX_ROWS or weight.stride(1) != 1:
        return None
    tiles = (config or GemvConfig.for_device(x.device)).lookup(n, k, m)
    if tiles is None or os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    return gemv(x, weight, bias, tiles)


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference: float32 product (+ float32 bias), rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
