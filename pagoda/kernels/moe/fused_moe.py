"""Fused mixture-of-experts on the GPU: Triton grouped GEMMs over expert-sorted tokens.

``fused_moe(hidden, w13, w2, topk_weights, topk_ids)`` computes what
``fused_moe_reference`` (pagoda.kernels.moe.reference, re-exported here) computes:

1. ``moe_align_block_size``: the T*k (token, choice) pairs are sorted by expert into
   groups each padded to a multiple of BLOCK_M, so every block of BLOCK_M sorted rows
   belongs to one expert (Triton kernels, pagoda.kernels.moe.align). Pairs routed to
   experts of another rank (id -1) form one more group whose blocks carry expert id -1:
   the GEMMs write zeros for them.
2. a grouped GEMM: row block of pairs x w13[expert]^T (A rows gathered by token =
   pair // k), each program computing the gate and the up columns of the same outputs
   and storing silu(gate) * up -> [T*k, I] (the SiLU-and-mul is its epilogue);
3. a grouped GEMM x w2[expert]^T, each row multiplied by its routing weight in the
   kernel -> [T*k, H];
4. the sum over the k choices -> [T, H] (``sum_choices``: one Triton pass, float32 in
   choice order, one rounding).

Up to MoEKernelConfig.gemv_max_pairs pairs (decode), pagoda.kernels.moe.fused_moe_decode
does it in two GEMV-style kernels instead, without the sort, the sum over the choices
folded into the down projection (its docstring says why). The paths, by name
(``path=``): "gemv" (that one) and "fused" (the steps above); the default takes "gemv"
for decode sizes. Tiles come from a MoEKernelConfig (pagoda.kernels.moe.config), which
the caller passes.

Why the k-sum is not folded into the grouped GEMM by fp32 atomics: it would need a
zeroed fp32 [T, H] buffer and a cast kernel after it (no fewer launches than the sum),
and its result would depend on the order the atomics land (greedy runs could differ
from run to run). Where the fold pays, at decode, the GEMV path does it in registers.

FP8 experts (W8A16): with ``scales`` (an ExpertScales, pagoda.kernels.moe.reference)
the weights are float8_e4m3fn and both paths run the same kernels with W_SCALED set (a
constexpr, so the float build is unchanged): each weight tile is dequantized in
registers, times its block's (or row's) scale, before its products: in the grouped GEMM
rounded to the activation's dtype for tl.dot (a BLOCK_K tile lies inside one 128-wide
scale block, so a column's scale is one value), in the GEMVs in float32. Activations
stay in the model's dtype.

No host sync: the sorted buffer has a fixed upper bound (T*k + (E+1)*(BLOCK_M-1), rounded
up to BLOCK_M) and the number of used rows stays on the device, read by the kernels (the
programs past it return at once). So the whole call is CUDA-graph capturable; its
shapes depend only on T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagoda.kernels.launch.capability import cuda_capability
from pagoda.kernels.moe.align import moe_align_block_size
from pagoda.kernels.moe.config import HOPPER, MOE_CONFIGS, MoEKernelConfig
from pagoda.kernels.moe.fused_moe_decode import fused_moe_gemv, silu_mul_rounded
from pagoda.kernels.moe.reference import ExpertScales, check_moe_shapes, fused_moe_reference

__all__ = [
    "ExpertScales",
    "fused_moe",
    "fused_moe_reference",
    "moe_align_block_size",
    "pick_config",
]

PATHS = ("gemv", "fused")
# Tokens per program of the sum over the k choices (sum_choices).
SUM_BLOCK_T = 8


def pick_config(
    num_pairs: int,
    num_experts: int,
    element_size: int = 2,
    gemm: str = "gate_up",
    config: MoEKernelConfig | None = None,
) -> dict:
    """The tiles and launch options of one grouped GEMM ("gate_up" or "down") for
    num_pairs pairs over num_experts experts of element_size-byte operands, from
    config's tiers (default: Hopper's)."""
    config = config or MOE_CONFIGS[HOPPER]
    return config.grouped_tiles(num_pairs, num_experts, element_size, gemm).launch()


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    b_desc,  # with B_TMA: a tensor descriptor over b as [E * b_rows, K], else unused
    N,
    K,
    num_pairs,
    max_padded,
    b_rows,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,  # pairs per A row: k for the first GEMM (A = tokens), else 1
    MUL_WEIGHT: tl.constexpr,
    GATE_UP_ACT: tl.constexpr,  # B rows [0, N) gate, [N, 2N) up; C = silu(gate) * up
    IEEE_FP32: tl.constexpr,
    B_TMA: tl.constexpr,  # B tiles by the bulk tensor copy engine (Hopper's TMA)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    scale_ptr=None,  # with W_SCALED: b's float32 scales [E, scale rows, scale cols]
    stride_se=0,
    stride_sn=0,
    stride_sk=0,
    scale_up_off=0,  # the up half's first scale row (GATE_UP_ACT)
    W_SCALED: tl.constexpr = False,  # b is FP8: scale row n // SCALE_BN, col k // SCALE_BK
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
):
    # C[pair, n] = sum_k A[pair // A_ROW_DIV, k] * B[expert(pair), n, k] (* weight[pair]).
    # With GATE_UP_ACT the program also accumulates the up rows (B rows N + n) of the
    # same columns and stores silu(gate) * up: the [pairs, 2N] intermediate never exists.
    scale_ptr = scale_ptr if W_SCALED else b_ptr  # (unread without W_SCALED)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(max_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order: GROUP_M row blocks share each weight tile while it is in L2.
    pids_in_group = GROUP_M * num_pid_n
    first_m = (pid // pids_in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_in_group) % group_m
    pid_n = (pid % pids_in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = row_ok[:, None] & col_ok[None, :]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # another rank's experts: they add nothing here
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    # TMA: the tile's first row of b viewed as [E * b_rows, K]. Rows past N (a partial
    # last column block) read the next rows of b or the descriptor's zero fill: they
    # only reach columns the store masks off. Columns past K are zero-filled.
    b_row = (expert * b_rows + pid_n * BLOCK_N).to(tl.int32)
    # Per column of the tile: its scale row (gate, and up below), at k-block 0.
    s_ptrs = scale_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        s_col = ((k0 * BLOCK_K) // SCALE_BK) * stride_sk
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if B_TMA:
            b = b_desc.load([b_row, k0 * BLOCK_K]).T
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _mma(acc, a, b, s_ptrs + s_col, col_ok, W_SCALED, IEEE_FP32)
        if GATE_UP_ACT:
            if B_TMA:
                b_up = b_desc.load([b_row + N, k0 * BLOCK_K]).T
            else:
                b_up = tl.load(
                    b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0
                )
            up_scales = s_ptrs + scale_up_off * stride_sn + s_col
            acc_up = _mma(acc_up, a, b_up, up_scales, col_ok, W_SCALED, IEEE_FP32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATE_UP_ACT:
        acc = silu_mul_rounded(acc, acc_up, c_ptr.dtype.element_ty)
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
        acc = acc * weight[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _mma(acc, a, b, scale_ptrs, col_ok, W_SCALED: tl.constexpr, IEEE_FP32: tl.constexpr):
    """acc + a @ b; with W_SCALED, b is an FP8 tile [BLOCK_K, BLOCK_N] dequantized first
    (times each column's scale, rounded to a's dtype, as the reference's dequantized
    weight), so the product still accumulates in place."""
    if W_SCALED:
        scale = tl.load(scale_ptrs, mask=col_ok, other=0.0)
        b = (b.to(tl.float32) * scale[None, :]).to(a.dtype)
    if IEEE_FP32:
        acc += tl.dot(a, b, input_precision="ieee")
    else:
        acc += tl.dot(a, b)
    return acc


def has_tma(device: torch.device) -> bool:
    """Hopper or newer (the bulk tensor copy engine), or the CPU's Triton interpreter."""
    return device.type != "cuda" or cuda_capability(device)[0] >= 9


def tma_takes(b: torch.Tensor) -> bool:
    """Whether a tensor descriptor can cover b [E, rows, K]: contiguous (a view as
    [E * rows, K], no copy) with 16-byte aligned rows and base, as TMA requires."""
    return (
        b.is_contiguous() and b.data_ptr() % 16 == 0 and (b.shape[2] * b.element_size()) % 16 == 0
    )


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor,
    a_row_div: int,
    mul_weight: bool,
    config: dict[str, int],
    gate_up_act: bool = False,
    b_scale: torch.Tensor | None = None,
    scales: ExpertScales | None = None,
) -> None:
    """b_scale: b's scales (w13_scale or w2_scale of scales) when b is FP8."""
    num_experts, b_rows, k = b.shape
    n = b_rows // 2 if gate_up_act else b_rows
    max_padded = sorted_ids.shape[0]
    config = dict(config)
    scaled = b_scale is not None
    s = b_scale if scaled else b  # unread without W_SCALED
    bn, bk = (scales.row_block(), scales.col_block()) if scaled else (1, config["BLOCK_K"])
    if scaled and bk % config["BLOCK_K"]:
        raise ValueError(f"BLOCK_K {config['BLOCK_K']} does not divide the scale block {bk}")
    b_tma = config.pop("B_TMA", False) and tma_takes(b) and has_tma(b.device)
    b_desc = b  # unused without B_TMA
    if b_tma:
        b_desc = TensorDescriptor.from_tensor(
            b.reshape(num_experts * b_rows, k), [config["BLOCK_N"], config["BLOCK_K"]]
        )
    grid = (triton.cdiv(max_padded, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a,
        b,
        out,
        weights,
        sorted_ids,
        expert_ids,
        num_post_padded,
        b_desc,
        n,
        k,
        out.shape[0],
        max_padded,
        b_rows,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        scale_ptr=s,
        stride_se=s.stride(0),
        stride_sn=s.stride(1),
        stride_sk=s.stride(2) if scaled and scales.block is not None else 0,
        scale_up_off=scales.up_offset(n) if scaled else 0,
        A_ROW_DIV=a_row_div,
        MUL_WEIGHT=mul_weight,
        GATE_UP_ACT=gate_up_act,
        IEEE_FP32=a.dtype == torch.float32,
        B_TMA=b_tma,
        W_SCALED=scaled,
        SCALE_BN=bn,
        SCALE_BK=bk,
        **config,
    )


@triton.jit
def _sum_choices_kernel(
    rows_ptr,
    out_ptr,
    num_tokens,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # out[t, h] = sum over j of rows[t * TOP_K + j, h]: float32, j in order, one rounding.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (offs_t < num_tokens)[:, None] & (offs_h < hidden)[None, :]
    first = offs_t.to(tl.int64)[:, None] * TOP_K * hidden + offs_h[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + first + j * hidden, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + offs_t.to(tl.int64)[:, None] * hidden + offs_h[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def sum_choices(rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """rows [T * k, H] contiguous (each token's k weighted expert outputs, in choice
    order) -> [T, H]: one pass over the rows (torch's sum over dim 1 of the [T, k, H]
    view reduces across a strided dim)."""
    num_pairs, hidden = rows.shape
    num_tokens = num_pairs // top_k
    out = torch.empty(num_tokens, hidden, dtype=rows.dtype, device=rows.device)
    block_h = min(512, triton.next_power_of_2(hidden))
    grid = (triton.cdiv(num_tokens, SUM_BLOCK_T), triton.cdiv(hidden, block_h))
    _sum_choices_kernel[grid](
        rows,
        out,
        num_tokens,
        hidden,
        TOP_K=top_k,
        BLOCK_T=SUM_BLOCK_T,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out


def gemv_path_takes(num_pairs: int, config: MoEKernelConfig | None = None) -> bool:
    """Whether fused_moe's default path for num_pairs (token, choice) pairs is the
    decode GEMV, the one path that also takes a shared MLP (config default: Hopper's)."""
    config = config or MOE_CONFIGS[HOPPER]
    return 0 < num_pairs <= config.gemv_max_pairs


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    path: str | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    prefetch_after: torch.Tensor | None = None,
    config: MoEKernelConfig | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """Same contract as fused_moe_reference: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [T, k] float32, topk_ids [T, k] int (-1: another rank's expert)
    -> [T, H] in hidden's dtype; scales: FP8 weights' scales (W8A16; no shared MLP
    then). path: one of PATHS (None: the default choice).
    shared: a shared MLP's (gate_up, down) weights added in the same launches, on the
    gemv path only (fused_moe_decode.fused_moe_gemv). prefetch_after: the weight of the
    layer that runs next, which the gemv path's down kernel prefetches into L2. config:
    the tiles (default: MoEKernelConfig.for_device(hidden.device))."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    config = config or MoEKernelConfig.for_device(hidden.device)
    if path is None:
        path = "gemv" if gemv_path_takes(num_pairs, config) else "fused"
    if path not in PATHS:
        raise ValueError(f"unknown fused_moe path {path!r}; one of {', '.join(PATHS)}")
    if shared is not None and (path != "gemv" or num_pairs == 0):
        raise ValueError("a shared MLP rides along the gemv path only (gemv_path_takes)")
    if scales is not None:
        scales.check(w13, w2)
        if shared is not None:
            raise ValueError("a shared MLP does not ride along FP8 experts' kernels")
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    hidden = hidden.contiguous()
    if path == "gemv":
        return fused_moe_gemv(
            hidden, w13, w2, topk_weights, topk_ids, shared, prefetch_after, config, scales
        )
    # FP8 weights are widened to the activation's dtype: they take its tiles.
    size = hidden.element_size() if scales is not None else w13.element_size()
    gate_up = config.grouped_tiles(num_pairs, w13.shape[0], size, "gate_up").launch()
    down = config.grouped_tiles(num_pairs, w13.shape[0], size, "down").launch()
    sorted_ids, expert_ids, num_post_padded = moe_align_block_size(
        topk_ids, gate_up["BLOCK_M"], w13.shape[0]
    )
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(num_pairs, w2.shape[2], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(
        hidden,
        w13,
        act,
        weights,
        sorted_ids,
        expert_ids,
        num_post_padded,
        top_k,
        False,
        gate_up,
        gate_up_act=True,
        b_scale=None if scales is None else scales.w13_scale,
        scales=scales,
    )
    rows = torch.empty(num_pairs, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(
        act,
        w2,
        rows,
        weights,
        sorted_ids,
        expert_ids,
        num_post_padded,
        1,
        True,
        down,
        b_scale=None if scales is None else scales.w2_scale,
        scales=scales,
    )
    return sum_choices(rows, top_k)
