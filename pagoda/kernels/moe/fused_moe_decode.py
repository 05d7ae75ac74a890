"""Fused MoE for decode-sized batches: two GEMV-style Triton kernels, no expert sort.

``fused_moe_gemv(hidden, w13, w2, topk_weights, topk_ids)`` computes what
pagoda.kernels.moe.reference.fused_moe_reference computes, for a few (token, choice)
pairs (a batch-1 decode step has k of them):

1. gate/up: one program per (pair, block of I columns) reads the pair's token row and
   the gate rows [n] and up rows [I + n] of its expert's w13, and stores
   silu(gate) * up -> act [T*k, I] (the SiLU-and-mul is the epilogue);
2. down: one program per (token, block of H columns) walks the token's k choices in
   order, multiplies act[pair] by its expert's w2 rows, scales by the routing weight and
   accumulates in float32 registers -> out [T, H]: the sum over the k choices is folded
   into the down projection, written once, in the same order every time (deterministic,
   no atomics, no zeroed buffer, no extra sum kernel).

Why a GEMV rather than the grouped tl.dot GEMM at this size: when each expert sees about
one row, a BLOCK_M = 16 tile (tl.dot's minimum) computes 15 padding rows for one real
one, and the expert sort (moe_align_block_size) is a launch that only serves the tiles.
Here the step is 2 launches and each chosen expert's weights are read once per pair
(the weights' bytes are the whole cost at decode). Past a few pairs, pairs of the same
expert would re-read its weights, so fused_moe switches to the grouped GEMM
(MoEKernelConfig.gemv_max_pairs, pagoda.kernels.moe.config).

Roundings follow the reference: gate and up rounded to the storage dtype, silu rounded
before the multiply (as torch), each choice's down output rounded before its weight is
applied, the k-sum in float32, rounded once. A choice of -1 (another rank's expert)
adds nothing (gate/up skip it; down zeroes its activation row, or reads nothing when the
row is chunked). Outputs are allocated from shapes alone: CUDA-graph
capturable.

FP8 experts (W_SCALED, a constexpr: the float build is unchanged): each weight tile is
widened to float32 and multiplied by its elements' scales (rows n // SCALE_BN, columns
k // SCALE_BK of the expert's scale tensor, gathered per element: the down kernel reads
a whole intermediate row of several 128-wide blocks at once) before the products.

Shared experts (DeepSeek): a shared MLP whose intermediate size Is is a whole number of
expert intermediates I rides along in the same two launches: its Is / I chunks are
extra pairs of every token in the gate/up kernel (weight rows of the shared gate_up
instead of an expert's), and the down kernel adds the shared projection, summed over
its chunks in float32 and rounded once, to the routed sum rounded on its own, as the
unfused block's `routed + shared` rounds. That saves the shared MLP's four launches
(gate/up GEMM, SiLU-and-mul, down GEMM, the add) at decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch import l2_prefetch
from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release
from pagoda.kernels.moe.config import DownTiles, GateUpTiles, MoEKernelConfig
from pagoda.kernels.moe.reference import ExpertScales


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """float32 gate / up accumulators -> silu(gate) * up in float32, with torch's
    roundings of the unfused path: gate and up stored in dtype, silu rounded to dtype."""
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return silu * u


@triton.jit
def scaled_tile(w, s_rows, cols, mask, stride_sk, W_SCALED: tl.constexpr, SCALE_BK: tl.constexpr):
    """A weight tile [BLOCK_N, BLOCK_K] in float32; with W_SCALED, times its scales:
    s_rows [BLOCK_N] pointers to each row's scale row, cols [BLOCK_K] the columns."""
    w = w.to(tl.float32)
    if W_SCALED:
        s = tl.load(s_rows[:, None] + (cols // SCALE_BK)[None, :] * stride_sk, mask=mask, other=0.0)
        w = w * s
    return w


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,
    w13_ptr,
    ids_ptr,
    act_ptr,
    ws13_ptr,
    H,
    I,
    stride_xm,
    stride_we,
    stride_wn,
    num_routed_pairs,
    shared_inter,
    stride_swn,
    TOP_K: tl.constexpr,
    SHARED_CHUNKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
    s13_ptr=None,  # with W_SCALED: w13's scales [E, scale rows, scale cols]
    stride_se=0,
    stride_sn=0,
    stride_sk=0,
    scale_up_off=0,
    W_SCALED: tl.constexpr = False,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
):
    pdl_wait_and_release(USE_PDL)  # before any load or store
    s13_ptr = s13_ptr if W_SCALED else w13_ptr  # (unread without W_SCALED)
    # Pairs [0, num_routed_pairs): (token, choice), expert ids[pair] of w13. Pairs past
    # them (SHARED_CHUNKS > 0): (token, chunk c) of the shared MLP ws13 [2 * Is, H],
    # whose gate rows [c * I, (c + 1) * I) and up rows Is + the same are an expert's.
    pair = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    if pair >= num_routed_pairs:  # (never, without shared chunks)
        shared_pair = pair - num_routed_pairs
        token = shared_pair // SHARED_CHUNKS
        w_gate = (
            ws13_ptr
            + (shared_pair % SHARED_CHUNKS) * I * stride_swn
            + offs_n[:, None] * stride_swn
            + offs_k[None, :]
        )
        w_up = w_gate + shared_inter * stride_swn
        length = H
        s_gate = s13_ptr + offs_n * 0  # (never read: shared chunks are float)
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        token = pair // TOP_K
        w_gate = (
            w13_ptr
            + tl.maximum(expert, 0) * stride_we
            + offs_n[:, None] * stride_wn
            + offs_k[None, :]
        )
        w_up = w_gate + I * stride_wn
        # -1 (another rank's expert): nothing read, and down reads nothing of this row.
        length = tl.where(expert >= 0, H, 0)
        s_gate = s13_ptr + tl.maximum(expert, 0) * stride_se + (offs_n // SCALE_BN) * stride_sn
    s_up = s_gate + scale_up_off * stride_sn
    n_ok = offs_n < I
    x_row = x_ptr + token * stride_xm
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < length - k0
        x = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        cols = k0 + offs_k
        w_g = tl.load(w_gate + k0, mask=mask, other=0.0)
        w_u = tl.load(w_up + k0, mask=mask, other=0.0)
        acc_g += scaled_tile(w_g, s_gate, cols, mask, stride_sk, W_SCALED, SCALE_BK) * x[None, :]
        acc_u += scaled_tile(w_u, s_up, cols, mask, stride_sk, W_SCALED, SCALE_BK) * x[None, :]
    act = silu_mul_rounded(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), act_ptr.dtype.element_ty)
    # A row of another rank's expert is not stored (a vector mask from a scalar bound:
    # the interpreter refuses a scalar bool combined with a vector).
    tl.store(
        act_ptr + pair * I + offs_n,
        act.to(act_ptr.dtype.element_ty),
        mask=offs_n < tl.where(length > 0, I, 0),
    )


@triton.jit
def _gemv_down_sum_kernel(
    act_ptr,
    w2_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    ws2_ptr,
    next_ptr,
    H,
    I,
    stride_we,
    stride_wn,
    stride_om,
    num_routed_pairs,
    stride_swn,
    next_bytes,
    TOP_K: tl.constexpr,
    SHARED_CHUNKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    PREFETCH_NEXT: tl.constexpr = False,  # pagoda.kernels.launch.l2_prefetch
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
    s2_ptr=None,  # with W_SCALED: w2's scales [E, scale rows, scale cols]
    stride_se=0,
    stride_sn=0,
    stride_sk=0,
    W_SCALED: tl.constexpr = False,
    SCALE_BN: tl.constexpr = 1,
    SCALE_BK: tl.constexpr = 1,
):
    pdl_wait_and_release(USE_PDL)  # before any load or store
    s2_ptr = s2_ptr if W_SCALED else w2_ptr  # (unread without W_SCALED)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    shared = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # One loop over the k choices, then the shared MLP's SHARED_CHUNKS chunks, in a
    # fixed order (the same sums every run). ONE_CHUNK (I <= BLOCK_K): each iteration
    # is one load of an expert's (or chunk's) rows, and this loop is the innermost one,
    # so the pipeliner keeps LOOP_STAGES rows in flight across choices and chunks alike
    # (with one program per (token, column block), they are the only serial work).
    for j in tl.range(0, TOP_K + SHARED_CHUNKS, num_stages=LOOP_STAGES):
        routed = j < TOP_K
        pair = token * TOP_K + j  # meaningful for a routed choice only
        expert = tl.load(ids_ptr + pair, mask=routed, other=0).to(tl.int64)
        # -1 (another rank's expert): its act row was never written, so the reduction
        # length is 0 (masked loads read nothing, add 0).
        length = tl.where(expert >= 0, I, 0)
        w_rows = (
            w2_ptr
            + tl.maximum(expert, 0) * stride_we
            + offs_n[:, None] * stride_wn
            + offs_k[None, :]
        )
        act_row = act_ptr + pair * I
        s_rows = s2_ptr + tl.maximum(expert, 0) * stride_se + (offs_n // SCALE_BN) * stride_sn
        if SHARED_CHUNKS > 0:
            # Chunk c of the shared MLP's down weight ws2 [H, SHARED_CHUNKS * I] and the
            # act row its gate/up pair wrote (past the routed pairs).
            c = j - TOP_K
            w_rows = tl.where(
                routed, w_rows, ws2_ptr + offs_n[:, None] * stride_swn + c * I + offs_k[None, :]
            )
            act_row = tl.where(
                routed, act_row, act_ptr + (num_routed_pairs + token * SHARED_CHUNKS + c) * I
            )
            length = tl.where(routed, length, I)
        y = _down_rows(
            act_row,
            w_rows,
            length,
            I,
            n_ok,
            offs_k,
            s_rows,
            stride_sk,
            BLOCK_N,
            BLOCK_K,
            ONE_CHUNK,
            W_SCALED,
            SCALE_BK,
        )
        weight = tl.load(weights_ptr + pair, mask=routed, other=0.0)
        # Adding 0.0 leaves a float32 sum unchanged: each sum sees its own terms only.
        total += tl.where(routed, y.to(out_ptr.dtype.element_ty).to(tl.float32) * weight, 0.0)
        if SHARED_CHUNKS > 0:
            shared += tl.where(routed, 0.0, y)
    if SHARED_CHUNKS > 0:
        # The shared MLP's down projection summed in float32 and rounded once (as its
        # own GEMM), then added to the routed sum rounded on its own:
        # round(round(routed) + round(shared)), the unfused order.
        total = total.to(out_ptr.dtype.element_ty).to(tl.float32)
        total += shared.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
    if PREFETCH_NEXT:  # the next layer's weight, a share per program, during the tail
        l2_prefetch.prefetch_program_share(next_ptr, next_bytes)


@triton.jit
def _down_rows(
    act_row,
    w_rows,
    length,
    I,
    n_ok,
    offs_k,
    s_rows,
    stride_sk,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    W_SCALED: tl.constexpr,
    SCALE_BK: tl.constexpr,
):
    """float32 [BLOCK_N]: the w_rows block times act_row over its first length (<= I)
    columns (w_rows: [BLOCK_N, BLOCK_K] pointers of the first chunk; s_rows: the rows'
    scale rows, read with W_SCALED)."""
    if ONE_CHUNK:
        # Masks along K only (uniform, so the loads stay vectorized).
        k_ok = offs_k < length
        a = tl.load(act_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows, mask=mask, other=0.0)
        w = scaled_tile(w, s_rows, offs_k, mask, stride_sk, W_SCALED, SCALE_BK)
        y = tl.sum(w * a[None, :], axis=1)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            chunk_ok = offs_k < length - k0
            a_chunk = tl.load(act_row + k0 + offs_k, mask=chunk_ok, other=0.0)
            mask = n_ok[:, None] & chunk_ok[None, :]
            w_chunk = tl.load(w_rows + k0, mask=mask, other=0.0)
            w_chunk = scaled_tile(w_chunk, s_rows, k0 + offs_k, mask, stride_sk, W_SCALED, SCALE_BK)
            acc += w_chunk * a_chunk.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
    return y


def fused_moe_gemv(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    prefetch_after: torch.Tensor | None = None,
    config: MoEKernelConfig | None = None,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """fused_moe's contract (shapes already checked by it, hidden contiguous, at least
    one pair) -> [T, H] in hidden's dtype. scales: FP8 weights' scales (checked by
    fused_moe; no shared MLP with them). shared: a shared MLP's (gate_up [2 * Is, H],
    down [H, Is]) with Is a multiple of the experts' I (shared_chunks_of); its output is
    added to every token's (see the module docstring). prefetch_after: a weight the down
    kernel prefetches into L2 at its end (l2_prefetch). config: the tiles (default:
    MoEKernelConfig.for_device)."""
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter = w2.shape[1], w2.shape[2]
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_moe_gemv needs w13 and w2 contiguous along their last dim")
    chunks = 0 if shared is None else shared_chunks_of(shared, w13, w2)
    ws13, ws2 = shared if shared is not None else (w13, w2)  # unread without chunks
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    routed = ids.numel()
    act = torch.empty(routed + num_tokens * chunks, inter, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    config = config or MoEKernelConfig.for_device(hidden.device)
    launch_gate_up(hidden, w13, ids, act, ws13, top_k, chunks, config.gate_up, scales)
    launch_down(
        act,
        w2,
        ids,
        weights,
        out,
        ws2,
        top_k,
        chunks,
        config.down_tiles(inter),
        prefetch=prefetch_after,
        scales=scales,
    )
    return out


def scale_args(scale: torch.Tensor | None, scales: ExpertScales | None, ptr: str) -> dict:
    """A GEMV kernel's scale arguments (its pointer named ptr) for a weight with scale
    (w13_scale or w2_scale of scales); none (W_SCALED off) for float weights."""
    if scale is None:
        return {}
    return {
        ptr: scale,
        "stride_se": scale.stride(0),
        "stride_sn": scale.stride(1),
        # Per channel: the one scale column, whatever k is.
        "stride_sk": scale.stride(2) if scales.block is not None else 0,
        "W_SCALED": True,
        "SCALE_BN": scales.row_block(),
        "SCALE_BK": scales.col_block(),
    }


def launch_gate_up(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    ids: torch.Tensor,
    act: torch.Tensor,
    ws13: torch.Tensor,
    top_k: int,
    chunks: int,
    tiles: GateUpTiles,
    scales: ExpertScales | None = None,
) -> None:
    """The gate/up kernel: hidden [T, H], ids int32 [T * top_k] -> act [T * top_k + T *
    chunks, I]; ws13 is the shared MLP's gate_up (unread without chunks)."""
    inter = w13.shape[1] // 2
    scaling = scale_args(None if scales is None else scales.w13_scale, scales, "s13_ptr")
    if scaling:
        scaling["scale_up_off"] = scales.up_offset(inter)
    _gemv_gate_up_kernel[(act.shape[0], triton.cdiv(inter, tiles.block_n))](
        hidden,
        w13,
        ids,
        act,
        ws13,
        hidden.shape[1],
        inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        ids.numel(),
        ws13.shape[0] // 2,
        ws13.stride(0),
        TOP_K=top_k,
        SHARED_CHUNKS=chunks,
        **tiles.launch(),
        **launch_options(hidden.device),
        **scaling,
    )


def launch_down(
    act: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    ws2: torch.Tensor,
    top_k: int,
    chunks: int,
    tiles: DownTiles,
    prefetch: torch.Tensor | None = None,
    scales: ExpertScales | None = None,
) -> None:
    """The down kernel: act (launch_gate_up's) -> out [T, H], the k choices (and the
    shared chunks) summed. prefetch: a weight asked into L2 at the kernel's end, where
    l2_prefetch allows."""
    hidden_size, inter = w2.shape[1], w2.shape[2]
    next_bytes = l2_prefetch.prefetch_bytes(prefetch, out.shape[0], out.device)
    config = tiles.launch(inter)
    scaling = scale_args(None if scales is None else scales.w2_scale, scales, "s2_ptr")
    _gemv_down_sum_kernel[(out.shape[0], triton.cdiv(hidden_size, tiles.block_n))](
        act,
        w2,
        ids,
        weights,
        out,
        ws2,
        prefetch if next_bytes else w2,
        hidden_size,
        inter,
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        ids.numel(),
        ws2.stride(0),
        next_bytes,
        TOP_K=top_k,
        SHARED_CHUNKS=chunks,
        PREFETCH_NEXT=next_bytes > 0,
        **config,
        **launch_options(act.device),
        **scaling,
    )


def shared_chunks_of(
    shared: tuple[torch.Tensor, torch.Tensor], w13: torch.Tensor, w2: torch.Tensor
) -> int:
    """How many expert-sized chunks a shared MLP (gate_up [2 * Is, H], down [H, Is]) is
    (Is / I); ValueError when it cannot ride along the experts' kernels."""
    gate_up, down = shared
    hidden_size, inter = w2.shape[1], w2.shape[2]
    shared_inter = down.shape[-1]
    if (
        gate_up.dim() != 2
        or down.dim() != 2
        or gate_up.shape != (2 * shared_inter, hidden_size)
        or down.shape[0] != hidden_size
        or shared_inter % inter
        or shared_inter == 0
    ):
        raise ValueError(
            f"shared MLP gate_up {tuple(gate_up.shape)} / down "
            f"{tuple(down.shape)} is no whole number of [{2 * inter}, "
            f"{hidden_size}] experts"
        )
    if gate_up.dtype != w13.dtype or down.dtype != w2.dtype:
        raise ValueError("the shared MLP's weights must have the experts' dtype")
    if gate_up.stride(1) != 1 or down.stride(1) != 1:
        raise ValueError("the shared MLP's weights must be contiguous along their last dim")
    return shared_inter // inter
