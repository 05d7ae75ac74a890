"""The MoE router linear and the expert routing in one Triton launch, for decode-sized
batches (T <= MAX_FUSED_TOKENS rows).

``fused_route(hidden, weight, cfg, correction_bias, fp32_logits, scratch)`` returns
what ``select_experts(MoEGate(hidden), cfg, correction_bias)`` returns (its reference,
pagoda.model.layers.moe.routing): (topk_weights float32 [T, k], topk_ids int32 [T, k]).
Unfused that is two launches per MoE layer at decode: the router GEMV through cuBLAS
(badly tiled for a [E, H] weight of half a megabyte) and the routing kernel.
``fused_route_norm`` also folds in the MoE block's input add + RMSNorm at one row (every
program normalises the row itself; program 0 stores it and the new residual).

Design, "the last program routes":
- the grid is cdiv(E, BLOCK_X) programs; each reads BLOCK_X experts' weight rows (so
  the weight streams through many SMs at once) and computes their logits for every row
  (a 3-d [BLOCK_T, BLOCK_X, BLOCK_H] float32 accumulator, reduced once at the end, in
  a fixed order: the result does not depend on which program finishes first, so every
  tensor-parallel rank routes identically);
- the logits are rounded as MoEGate's output is: to the hidden dtype (Qwen3's router
  runs in the model dtype), or kept float32 (``fp32_logits``: DeepSeek's float32 router,
  hidden cast to float32); then written to the layer's float32 scratch [T, E];
- each program then counts itself on the layer's arrival counter (one atomic add,
  acq_rel at gpu scope, after a CTA barrier so that all its threads' scratch stores
  come before the release: the pattern of CUTLASS's semaphores); the program that
  sees it arrived last reads the whole scratch (through L2: cache modifier .cg, no
  stale L1 line) and routes every row with pagoda.kernels.moe.routing.route_rows (the
  same arithmetic as the routing kernel), then stores 0 into the counter.

Invariant of the scratch and the counter (RouterScratch, one per MoE layer, made on the
first call outside CUDA-graph capture): the counter is 0 whenever no launch of that
layer's router is running, and no two launches of one layer's router run at once.
Both hold because launches of one layer are serialized: a layer runs once per model
forward and forwards run one after another on one stream (eagerly or replayed from
CUDA graphs), and each launch's last program resets the counter before the launch
ends. A per-device shared scratch would be just as correct on one stream; per layer it
costs a few kilobytes and stays correct if two models (a draft and a target) ever run
on different streams.

No host sync, outputs allocated from shapes alone: CUDA-graph capturable (replays
find the counter at 0, as the test checks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels.launch.pdl import launch_options, pdl_wait_and_release
from pagoda.kernels.moe.routing import MAX_KERNEL_EXPERTS, RoutingParams, route_rows

# The most rows one launch routes (the whole [T, H] hidden tile is re-read by every
# program, and the decode batches this kernel is for are small).
MAX_FUSED_TOKENS = 16
# The most experts: the last program holds a row's E logits in registers.
MAX_FUSED_EXPERTS = MAX_KERNEL_EXPERTS
# Register budget, in float32 elements per program, of the GEMV accumulator and of the
# tiles the last program routes at once.
_ACC_ELEMENTS = 4096
_ROUTE_ELEMENTS = 4096
# One token: each program loads its expert's whole weight row before the PDL wait (one
# hidden chunk of up to PRELOAD_MAX_HIDDEN), instead of chunks after it: Qwen3-30B-A3B's
# batch-1 step 2.763 -> 2.696 ms. At one row the MoE block's input norm (add + RMSNorm)
# runs in the router's programs too (fused_route_norm), instead of a launch of its own:
# 2.670 -> 2.631 ms (H200; docs/performance.md, "Measured reasons: Launch").
PRELOAD_MAX_HIDDEN = 4096
_ROUNDING = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _router_fused_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    scratch_ptr,
    counter_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    hidden_size,
    stride_x,
    stride_w,
    num_experts,
    group_size,
    routed_scaling_factor,
    residual_ptr,
    norm_w_ptr,
    normed_ptr,
    residual_out_ptr,
    eps,
    LOGITS_DTYPE: tl.constexpr,
    ROUND_LOGITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUTE_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    GROUP_BY_TOP2: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRELOAD_W: tl.constexpr = False,
    HAS_NORM: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # pagoda.kernels.launch.pdl
):
    # -- this program's logits: experts [pid * BLOCK_X, +BLOCK_X), every row ----------
    rows = tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    ex = tl.program_id(0) * BLOCK_X + tl.arange(0, BLOCK_X)
    ex_ok = ex < num_experts
    hs = tl.arange(0, BLOCK_H)
    w_rows = w_ptr + ex[:, None].to(tl.int64) * stride_w
    if PRELOAD_W:
        # One chunk covers the hidden size: the weight rows (written by no kernel) are
        # loaded before the PDL wait, while the norm before this kernel runs.
        h_ok = hs < hidden_size
        w = tl.load(w_rows + hs[None, :], mask=ex_ok[:, None] & h_ok[None, :], other=0.0).to(
            tl.float32
        )
        if HAS_NORM:  # the norm's weight, too
            norm_w = tl.load(norm_w_ptr + hs, mask=h_ok, other=0.0).to(tl.float32)
        pdl_wait_and_release(USE_PDL)  # before any load of what a predecessor writes
        if HAS_NORM:
            x = _add_rms_norm_rows(
                x_ptr,
                residual_ptr,
                norm_w,
                normed_ptr,
                residual_out_ptr,
                rows,
                row_ok,
                hs,
                h_ok,
                stride_x,
                hidden_size,
                eps,
            )
        else:
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + hs[None, :],
                mask=row_ok[:, None] & h_ok[None, :],
                other=0.0,
            ).to(tl.float32)
        acc = x[:, None, :] * w[None, :, :]
    else:
        pdl_wait_and_release(USE_PDL)  # before any load or store
        acc = tl.zeros([BLOCK_T, BLOCK_X, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, hidden_size, BLOCK_H):
            h = h0 + hs
            h_ok = h < hidden_size
            x = tl.load(
                x_ptr + rows[:, None] * stride_x + h[None, :],
                mask=row_ok[:, None] & h_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(w_rows + h[None, :], mask=ex_ok[:, None] & h_ok[None, :], other=0.0).to(
                tl.float32
            )
            acc += x[:, None, :] * w[None, :, :]
    logits = tl.sum(acc, axis=2)  # [BLOCK_T, BLOCK_X]
    if ROUND_LOGITS:  # MoEGate's output dtype, as select_experts sees it
        logits = logits.to(LOGITS_DTYPE).to(tl.float32)
    tl.store(
        scratch_ptr + rows[:, None] * num_experts + ex[None, :],
        logits,
        mask=row_ok[:, None] & ex_ok[None, :],
    )
    # -- arrival: every thread's stores above precede the release of the add ----------
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        # The last program: every tile is in the scratch; route all rows.
        experts = tl.arange(0, BLOCK_E)
        valid = experts < num_experts
        slots = tl.arange(0, BLOCK_K)[None, :]
        for r0 in range(0, num_tokens, ROUTE_T):
            r = r0 + tl.arange(0, ROUTE_T)
            r_ok = r < num_tokens
            tile = tl.load(
                scratch_ptr + r[:, None] * num_experts + experts[None, :],
                mask=r_ok[:, None] & valid[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            chosen_w, chosen_ids = route_rows(
                tile,
                valid,
                experts,
                bias_ptr,
                num_experts,
                group_size,
                routed_scaling_factor,
                TOP_K,
                SIGMOID,
                HAS_BIAS,
                GROUPED,
                GROUP_BY_TOP2,
                N_GROUP,
                TOPK_GROUP,
                RENORMALIZE,
                BLOCK_G,
                BLOCK_K,
            )
            out = r[:, None] * TOP_K + slots
            keep = r_ok[:, None] & (slots < TOP_K)
            tl.store(weights_ptr + out, chosen_w, mask=keep)
            tl.store(ids_ptr + out, chosen_ids, mask=keep)
        tl.store(counter_ptr, 0)  # ready for the next launch (and graph replay)


@triton.jit
def _add_rms_norm_rows(
    x_ptr,
    residual_ptr,
    norm_w,
    normed_ptr,
    residual_out_ptr,
    rows,
    row_ok,
    hs,
    h_ok,
    stride_x,
    hidden_size,
    eps,
):
    """[BLOCK_T, BLOCK_H] float32: rms_norm(x + residual) * norm_w with fused_ops'
    _rms_norm_kernel's roundings (the sum rounded to the rows' dtype, normalised in
    float32 and rounded, times the weight, rounded again), from one chunk of each row
    (x rows at stride_x, residual rows contiguous). Every program computes the same
    rows; program 0 stores them (normed_ptr) and the new residual."""
    offs = rows[:, None] * hidden_size + hs[None, :]
    mask = row_ok[:, None] & h_ok[None, :]
    summed = tl.load(x_ptr + rows[:, None] * stride_x + hs[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    summed += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rounded = summed.to(residual_out_ptr.dtype.element_ty)
    summed = rounded.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(summed * summed, axis=1) / hidden_size + eps)
    normed = (summed * inv_rms[:, None]).to(residual_out_ptr.dtype.element_ty)
    out = (norm_w[None, :] * normed.to(tl.float32)).to(normed_ptr.dtype.element_ty)
    if tl.program_id(0) == 0:
        tl.store(residual_out_ptr + offs, rounded, mask=mask)
        tl.store(normed_ptr + offs, out, mask=mask)
    return out.to(tl.float32)


@dataclass
class RouterScratch:
    """One MoE layer's fused-router state: float32 logits [MAX_FUSED_TOKENS, E] and the
    arrival counter int32 [1] (0 between launches; see the module docstring)."""

    logits: torch.Tensor
    counter: torch.Tensor

    @classmethod
    def create(cls, num_experts: int, device: torch.device) -> RouterScratch:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the fused MoE router's scratch is made on its first call, "
                "which must run eagerly, before CUDA-graph capture"
            )
        return cls(
            torch.empty(MAX_FUSED_TOKENS, num_experts, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )


@dataclass(frozen=True)
class FusedRouterTiles:
    """Launch shape: BLOCK_X experts per program, BLOCK_H hidden columns per step,
    ROUTE_T rows routed at once by the last program, num_warps."""

    block_x: int
    block_h: int
    route_t: int
    num_warps: int


def experts_per_program(num_experts: int) -> int:
    """default_tiles' experts a program: about 128 programs, so 1 up to 128 experts."""
    return max(1, triton.next_power_of_2(num_experts) // 128)


@functools.lru_cache(maxsize=256)  # once per (rows, layer shape): off the launch path
def default_tiles(
    num_tokens: int,
    num_experts: int,
    hidden_size: int,
    cfg: RoutingParams,
    block_x: int | None = None,
    num_warps: int | None = None,
) -> FusedRouterTiles:
    """About 128 programs (one H200 wave: 132 SMs) each streaming a few experts'
    weight rows; the accumulator and the routed tiles within the register budget. One
    token's single expert row a program is one hidden chunk (up to PRELOAD_MAX_HIDDEN:
    the kernel then loads it before the PDL wait)."""
    block_t = triton.next_power_of_2(max(num_tokens, 1))
    if block_x is None:
        block_x = experts_per_program(num_experts)
    # One token: one warp per program (1024-wide hidden chunks), the fastest launch of
    # the router benchmark's sweep on the H200 for both MoE presets
    # (`python -m benchmarks.kernels router`).
    num_warps = num_warps or (1 if block_t == 1 else 4)
    budget = _ACC_ELEMENTS * num_warps // 4
    block_h = max(32, min(triton.next_power_of_2(hidden_size), budget // (block_t * block_x)))
    if block_t == 1 and block_x == 1 and hidden_size <= PRELOAD_MAX_HIDDEN:
        block_h = triton.next_power_of_2(hidden_size)  # one chunk: see the kernel
    block_e = triton.next_power_of_2(num_experts)
    per_row = block_e * (max(2, triton.next_power_of_2(cfg.n_group)) if cfg.grouped else 1)
    route_t = max(1, min(block_t, _ROUTE_ELEMENTS // per_row))
    return FusedRouterTiles(block_x, block_h, triton.next_power_of_2(route_t), num_warps)


def fused_router_covers(hidden: torch.Tensor, weight: torch.Tensor, fp32_logits: bool) -> bool:
    """Whether fused_route computes this call (else: the gate's linear + select_experts)."""
    return (
        hidden.dim() == 2
        and 0 < hidden.shape[0] <= MAX_FUSED_TOKENS
        and weight.shape[0] <= MAX_FUSED_EXPERTS
        and hidden.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and weight.dtype == (torch.float32 if fp32_logits else hidden.dtype)
    )


def fused_route(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    cfg: RoutingParams,
    correction_bias: torch.Tensor | None,
    fp32_logits: bool,
    scratch: RouterScratch,
    tiles: FusedRouterTiles | None = None,
    norm_args: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H], weight [E, H] -> (topk_weights float32 [T, k], topk_ids int32 [T, k]),
    as select_experts(F.linear(hidden, weight) (fp32_logits: in float32), cfg, bias).
    The caller (routing.route) has checked fused_router_covers and the bias.
    norm_args (fused_route_norm's, one chunk a row): (residual, norm weight, normed out,
    residual out, eps); the logits are then of the normalised hidden + residual."""
    num_tokens, hidden_size = hidden.shape
    num_experts = weight.shape[0]
    if not fused_router_covers(hidden, weight, fp32_logits):
        raise ValueError(
            f"fused_route: hidden {tuple(hidden.shape)} {hidden.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}: not covered (at most "
            f"{MAX_FUSED_TOKENS} rows and {MAX_FUSED_EXPERTS} experts; weight "
            f"dtype float32 for fp32 logits, else the hidden dtype)"
        )
    if weight.shape != (cfg.num_experts, hidden_size) or scratch.logits.shape[1] != num_experts:
        raise ValueError(
            f"fused_route: weight {tuple(weight.shape)}, scratch "
            f"{tuple(scratch.logits.shape)} for {cfg.num_experts} experts of "
            f"hidden {hidden_size}"
        )
    k = cfg.num_experts_per_tok
    topk_weights = torch.empty(num_tokens, k, dtype=torch.float32, device=hidden.device)
    topk_ids = torch.empty(num_tokens, k, dtype=torch.int32, device=hidden.device)
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    bias = correction_bias.float().contiguous() if correction_bias is not None else w
    tiles = tiles or default_tiles(num_tokens, num_experts, hidden_size, cfg)
    round_logits = not fp32_logits and hidden.dtype != torch.float32
    one_chunk = tiles.block_h >= hidden_size  # the kernel's preloading form needs it
    if norm_args is not None and not one_chunk:
        raise ValueError(
            f"fused_route: the folded-in norm needs one hidden chunk a row, "
            f"got block_h {tiles.block_h} for hidden {hidden_size}"
        )
    _router_fused_kernel[(triton.cdiv(num_experts, tiles.block_x),)](
        x,
        w,
        bias,
        scratch.logits,
        scratch.counter,
        topk_weights,
        topk_ids,
        num_tokens,
        hidden_size,
        x.stride(0),
        w.stride(0),
        num_experts,
        num_experts // cfg.n_group,
        float(cfg.routed_scaling_factor),
        *(norm_args or (x, x, x, x, 0.0)),
        LOGITS_DTYPE=_ROUNDING.get(hidden.dtype, tl.float32),
        ROUND_LOGITS=round_logits,
        BLOCK_T=triton.next_power_of_2(num_tokens),
        BLOCK_X=tiles.block_x,
        BLOCK_H=tiles.block_h,
        ROUTE_T=tiles.route_t,
        BLOCK_E=triton.next_power_of_2(num_experts),
        TOP_K=k,
        SIGMOID=cfg.scoring_func == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        GROUPED=cfg.grouped,
        GROUP_BY_TOP2=cfg.topk_method == "noaux_tc",
        N_GROUP=cfg.n_group,
        TOPK_GROUP=cfg.topk_group,
        RENORMALIZE=cfg.renormalize,
        BLOCK_G=max(2, triton.next_power_of_2(cfg.n_group)),
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        num_warps=tiles.num_warps,
        PRELOAD_W=one_chunk,
        HAS_NORM=norm_args is not None,
        **launch_options(hidden.device),
    )
    return topk_weights, topk_ids


def fused_route_norm_covers(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    fp32_logits: bool,
) -> bool:
    """Whether fused_route_norm computes this call: one row of a 16-bit model dtype (residual and norm weight alike, everything contiguous), a model-dtype
    router with one expert a program (experts_per_program: at most 128 experts) and a
    hidden size of at most PRELOAD_MAX_HIDDEN (one chunk a program): what default_tiles
    needs to give the one-chunk tiles fused_route requires of a folded-in norm."""
    return (
        not fp32_logits
        and hidden.dim() == 2
        and hidden.shape[0] == 1
        and hidden.dtype in (torch.float16, torch.bfloat16)
        and residual.shape == hidden.shape
        and residual.dtype == hidden.dtype
        and norm_weight.dtype == hidden.dtype
        and norm_weight.shape == hidden.shape[1:]
        and hidden.shape[1] <= PRELOAD_MAX_HIDDEN
        and experts_per_program(weight.shape[0]) == 1
        and hidden.is_contiguous()
        and residual.is_contiguous()
        and norm_weight.is_contiguous()
        and fused_router_covers(hidden, weight, fp32_logits)
    )


def fused_route_norm(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    cfg: RoutingParams,
    correction_bias: torch.Tensor | None,
    scratch: RouterScratch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE block's input norm and its router in one launch (one row):
    (topk_weights, topk_ids, normed, new_residual), where (normed, new_residual) is
    fused_ops.fused_add_rms_norm(hidden, residual, norm_weight, eps) (up to the float32
    order of its sum of squares) and the routing is fused_route's of normed. Every
    program normalises the row itself (4 KB each from L2), so the norm's own launch
    and its step in the PDL chain go away. The caller has checked
    fused_route_norm_covers."""
    normed = torch.empty_like(hidden)
    new_residual = torch.empty_like(hidden)
    tiles = default_tiles(1, weight.shape[0], hidden.shape[1], cfg)
    weights, ids = fused_route(
        hidden,
        weight,
        cfg,
        correction_bias,
        False,
        scratch,
        tiles,
        norm_args=(residual, norm_weight, normed, new_residual, float(eps)),
    )
    return weights, ids, normed, new_residual
