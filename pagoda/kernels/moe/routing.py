"""Expert routing as one Triton kernel, for decode-sized batches.

``route_topk(router_logits, cfg, correction_bias)`` computes what the torch path of
pagoda.model.layers.moe.routing.select_experts computes (its reference), in one launch
instead of the dozen small torch ops (softmax, topk, scatter, masked_fill, gather, sum,
div, mul) that each cost a few microseconds at decode sizes:

- scores: softmax or sigmoid of the float32 logits;
- the choice values: the scores, plus the correction bias for noaux_tc;
- grouped methods: a group's score is its best choice value (group_limited_greedy) or
  the sum of its two best (noaux_tc); the topk_group best groups are kept, the other
  groups' experts are excluded;
- the k best choice values (k rounds of argmax, each chosen expert then masked out);
- the weights: the chosen experts' un-biased scores, renormalised (divided by their sum
  + 1e-20) when cfg.renormalize, then multiplied by routed_scaling_factor.

One program per token row holds all E scores in registers (E up to a few hundred).
The arithmetic is ``route_rows``, a jit function over a tile of rows [R, E], shared with
pagoda.kernels.moe.router_fused (router linear + routing in one launch).
Ties: argmax takes the lowest index, so among exactly equal values the lower expert id
wins (torch.topk's choice among ties is unspecified; with real-valued logits exact ties
do not occur). The k choices come out best first, as torch.topk(sorted=True) gives
them; the MoE output does not depend on the order.

No host sync, outputs allocated from shapes alone: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl


class RoutingParams(Protocol):
    """The routing fields the kernels read (the model's MoEConfig has them)."""

    num_experts: int
    num_experts_per_tok: int
    renormalize: bool
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float

    @property
    def grouped(self) -> bool: ...


# The largest expert count one program routes (all scores of a row live in registers).
MAX_KERNEL_EXPERTS = 1024


@triton.jit
def route_rows(
    logits,
    valid,
    experts,
    bias_ptr,
    num_experts,
    group_size,
    routed_scaling_factor,
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
):
    """The routing of a tile of rows: logits float32 [R, BLOCK_E] (any value where not
    valid), valid / experts [BLOCK_E] (experts = arange, valid = experts < num_experts)
    -> (weights float32 [R, BLOCK_K], ids int32 [R, BLOCK_K]); slots >= TOP_K hold 0.
    Shared by _route_kernel (R = 1) and pagoda.kernels.moe.router_fused (R rows of the
    last program), so both route with the same arithmetic."""
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        shifted = tl.where(valid[None, :], logits, float("-inf"))
        e = tl.exp(shifted - tl.max(shifted, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
        choice = choice + bias[None, :]
    choice = tl.where(valid[None, :], choice, float("-inf"))
    if GROUPED:
        # member[g, e]: expert e belongs to group g (groups of group_size consecutive ids).
        groups = tl.arange(0, BLOCK_G)
        member = (experts[None, :] // group_size) == groups[:, None]
        member = member & valid[None, :] & (groups[:, None] < N_GROUP)
        in_group = tl.where(member[None, :, :], choice[:, None, :], float("-inf"))
        best = tl.max(in_group, axis=2)  # [R, BLOCK_G]
        if GROUP_BY_TOP2:  # the sum of the group's two best (the best one masked once)
            first = tl.argmax(in_group, axis=2)
            second = tl.max(
                tl.where(experts[None, None, :] == first[:, :, None], float("-inf"), in_group),
                axis=2,
            )
            group_score = best + second
        else:
            group_score = best
        group_score = tl.where(groups[None, :] < N_GROUP, group_score, float("-inf"))
        keep = groups[None, :] < 0  # [R, BLOCK_G], all False
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(group_score, axis=1)
            hit = groups[None, :] == g[:, None]
            keep = keep | hit
            group_score = tl.where(hit, float("-inf"), group_score)
        kept = tl.max(tl.where(member[None, :, :] & keep[:, :, None], 1, 0), axis=1) > 0
        choice = tl.where(kept, choice, float("-inf"))
    # The k best choices, best first; the weights are the un-biased scores.
    slots = tl.arange(0, BLOCK_K)[None, :]
    chosen_ids = tl.zeros([logits.shape[0], BLOCK_K], dtype=tl.int32)
    chosen_w = tl.zeros([logits.shape[0], BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pick = tl.argmax(choice, axis=1)  # [R]; among equal values the lowest id
        hit = experts[None, :] == pick[:, None]
        chosen_ids = tl.where(slots == j, pick[:, None].to(tl.int32), chosen_ids)
        picked_w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        chosen_w = tl.where(slots == j, picked_w[:, None], chosen_w)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=1)[:, None] + 1e-20)
    chosen_w = chosen_w * routed_scaling_factor
    return chosen_w, chosen_ids


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    num_experts,
    group_size,
    routed_scaling_factor,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    GROUP_BY_TOP2: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.load(
        logits_ptr + row * stride_logits + experts[None, :], mask=valid[None, :], other=0.0
    ).to(tl.float32)  # [1, BLOCK_E]
    chosen_w, chosen_ids = route_rows(
        logits,
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
    slots = tl.arange(0, BLOCK_K)[None, :]
    tl.store(weights_ptr + row * TOP_K + slots, chosen_w, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def route_topk(
    router_logits: torch.Tensor, cfg: RoutingParams, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype) -> (topk_weights float32 [T, k], topk_ids
    int32 [T, k]); the caller (select_experts) has checked the shapes and the bias."""
    num_tokens, num_experts = router_logits.shape
    if num_experts > MAX_KERNEL_EXPERTS:
        raise ValueError(
            f"route_topk routes at most {MAX_KERNEL_EXPERTS} experts in one "
            f"program, got {num_experts}"
        )
    k = cfg.num_experts_per_tok
    device = router_logits.device
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        logits,
        bias,
        weights,
        ids,
        logits.stride(0),
        num_experts,
        num_experts // cfg.n_group,
        float(cfg.routed_scaling_factor),
        TOP_K=k,
        SIGMOID=cfg.scoring_func == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        GROUPED=cfg.grouped,
        GROUP_BY_TOP2=cfg.topk_method == "noaux_tc",
        N_GROUP=cfg.n_group,
        TOPK_GROUP=cfg.topk_group,
        RENORMALIZE=cfg.renormalize,
        BLOCK_E=block_e,
        BLOCK_G=max(2, triton.next_power_of_2(cfg.n_group)),
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        num_warps=4 if block_e >= 512 else (2 if block_e >= 128 else 1),
    )
    return weights, ids
