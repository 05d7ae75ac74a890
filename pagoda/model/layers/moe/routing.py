"""Expert routing: router logits -> each token's top-k experts and their weights.

``select_experts(router_logits, cfg, correction_bias)`` computes what transformers'
routers compute (Qwen3MoeTopKRouter, DeepseekV2TopkRouter, DeepseekV3TopkRouter):

- scores: softmax or sigmoid of the float32 logits;
- greedy: the k best scores;
- group_limited_greedy (DeepSeek-V2): experts fall in n_group equal groups; a group's
  score is its best expert's; only the topk_group best groups' experts compete;
- noaux_tc (DeepSeek-V3): the choice is made on scores + correction_bias, a group's score
  is the sum of its two best biased scores, and the weights are the chosen experts'
  un-biased scores;
- renormalisation (norm_topk_prob): the k weights divided by their sum (+1e-20);
- routed_scaling_factor: multiplies the weights last.

Everything stays on the device with fixed shapes (no host sync): CUDA-graph capturable.
The order of the k choices within a row is topk's; it does not change the MoE output.

On CUDA the same computation runs as one Triton kernel (pagoda.kernels.moe.routing; this
torch code is its reference) at every batch size: at decode sizes it saves the dozen
launches, at prefill sizes the torch ops' passes over the scores (softmax, topk, gather).

``route(hidden, gate, cfg, correction_bias)`` is what an MoE block calls: the router
gate's logits then select_experts, or on CUDA, up to FUSED_ROUTER_MAX_TOKENS rows, the
router linear and the routing in one launch (pagoda.kernels.moe.router_fused).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagoda.model.moe_config import MoEConfig

if TYPE_CHECKING:
    from pagoda.model.layers.layernorm import RMSNorm
    from pagoda.model.layers.moe.gate import MoEGate

# Rows up to which route() runs the router linear and the routing as one kernel on
# CUDA (0: never; at most moe_router_fused.MAX_FUSED_TOKENS).
FUSED_ROUTER_MAX_TOKENS = 16


def _scores(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = router_logits.float()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


def _grouped_choice(
    choice: torch.Tensor, group_scores: torch.Tensor, cfg: MoEConfig
) -> torch.Tensor:
    """Top-k ids of choice [T, E] among the experts of the topk_group best groups."""
    num_tokens = choice.shape[0]
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, group_idx, True)
    expert_mask = (
        group_mask.unsqueeze(-1)
        .expand(num_tokens, cfg.n_group, cfg.num_experts // cfg.n_group)
        .reshape(num_tokens, -1)
    )
    # -inf, not 0: an excluded expert can never be chosen (softmax and sigmoid scores are
    # > 0, so transformers' 0 fill chooses the same experts).
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    return torch.topk(masked, k=cfg.num_experts_per_tok, dim=-1, sorted=False).indices


def _check_bias(cfg: MoEConfig, correction_bias: torch.Tensor | None) -> None:
    if (correction_bias is not None) != (cfg.topk_method == "noaux_tc"):
        raise ValueError(
            f"topk_method {cfg.topk_method!r} "
            + (
                "needs an e_score_correction_bias"
                if correction_bias is None
                else "takes no e_score_correction_bias"
            )
        )


def route(
    hidden: torch.Tensor, gate: MoEGate, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] -> (topk_weights float32 [T, k], topk_ids int32 [T, k]):
    select_experts(gate(hidden), cfg, correction_bias), in one kernel launch on CUDA for
    up to FUSED_ROUTER_MAX_TOKENS rows when the kernel covers the shapes and dtypes."""
    if hidden.is_cuda and hidden.shape[0] <= FUSED_ROUTER_MAX_TOKENS:
        from pagoda.kernels.moe import router_fused as mrf  # imports triton: CUDA only

        if mrf.fused_router_covers(hidden, gate.weight, gate.fp32):
            _check_bias(cfg, correction_bias)
            return mrf.fused_route(
                hidden,
                gate.weight,
                cfg,
                correction_bias,
                gate.fp32,
                router_scratch(gate, hidden.device),
            )
    return select_experts(gate(hidden), cfg, correction_bias)


def router_scratch(gate: MoEGate, device: torch.device):
    """The gate's fused-router scratch on device, made on first use (which must be
    outside CUDA-graph capture: RouterScratch.create says so)."""
    from pagoda.kernels.moe import router_fused as mrf  # imports triton: CUDA only

    scratch = gate.router_scratch
    if scratch is None or scratch.logits.device != device:
        scratch = gate.router_scratch = mrf.RouterScratch.create(gate.weight.shape[0], device)
    return scratch


# Devices route_after_norm fuses on (tests add "cpu" to run the kernel interpreted).
FUSED_NORM_DEVICES = ("cuda",)


def route_after_norm(
    hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, gate: MoEGate, cfg: MoEConfig
):
    """The MoE block's input norm and its routing in one launch, where the fused router
    covers it (CUDA, one row: moe_router_fused.fused_route_norm_covers): (topk, normed,
    new residual) with topk as route returns it and (normed, new residual) as
    norm(hidden, residual) returns them; else None (the caller runs the norm, then
    route)."""
    if hidden.device.type not in FUSED_NORM_DEVICES:  # (covers checks the shapes)
        return None
    from pagoda.kernels.moe import router_fused as mrf  # imports triton: CUDA only

    if not mrf.fused_route_norm_covers(hidden, residual, norm.weight, gate.weight, gate.fp32):
        return None
    _check_bias(cfg, None)
    weights, ids, normed, new_residual = mrf.fused_route_norm(
        hidden,
        residual,
        norm.weight,
        norm.eps,
        gate.weight,
        cfg,
        None,
        router_scratch(gate, hidden.device),
    )
    return (weights, ids), normed, new_residual


def select_experts(
    router_logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, k], topk_ids int32 [T, k]).

    correction_bias [E]: DeepSeek-V3's e_score_correction_bias, required by noaux_tc and
    refused by the other methods (it would be silently unused)."""
    if router_logits.dim() != 2 or router_logits.shape[1] != cfg.num_experts:
        raise ValueError(
            f"router_logits must be [T, {cfg.num_experts}], got {tuple(router_logits.shape)}"
        )
    _check_bias(cfg, correction_bias)
    if router_logits.is_cuda:
        from pagoda.kernels.moe.routing import MAX_KERNEL_EXPERTS, route_topk  # triton

        if cfg.num_experts <= MAX_KERNEL_EXPERTS:
            return route_topk(router_logits, cfg, correction_bias)
    return select_experts_torch(router_logits, cfg, correction_bias)


def select_experts_torch(
    router_logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts in torch ops (the reference of the routing kernel); the
    arguments are select_experts' after its checks."""
    scores = _scores(router_logits, cfg.scoring_func)
    num_tokens, k = scores.shape[0], cfg.num_experts_per_tok
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, k=k, dim=-1)
    else:
        grouped_shape = (num_tokens, cfg.n_group, cfg.num_experts // cfg.n_group)
        if cfg.topk_method == "group_limited_greedy":
            choice = scores
            group_scores = scores.view(grouped_shape).amax(dim=-1)
        else:  # noaux_tc
            choice = scores + correction_bias.float()
            group_scores = choice.view(grouped_shape).topk(2, dim=-1).values.sum(dim=-1)
        ids = _grouped_choice(choice, group_scores, cfg)
        weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids.to(torch.int32)
