"""DeepSeek V4's MoE block: a router (hash-routed or top-k), clamped-SwiGLU routed experts
and one clamped-SwiGLU shared expert, summed and then all-reduced once.

Routing (``DeepseekV4Router``, float32 logits as DeepseekMoE's gate keeps them):
- scores = sqrtsoftplus(logits) = sqrt(softplus(logits)) (or sigmoid, as the config says);
- top-k layers ("moe"): the k best of scores + e_score_correction_bias (no groups);
- hash layers ("hash_moe", the first ones): the k experts of a frozen table
  tid2eid[token id] ([vocab, k]); the block therefore takes the step's input ids;
- both: weights = the chosen experts' unbiased scores, divided by their sum (+1e-20),
  times routed_scaling_factor. transformers' V4 routers always renormalise, so a config
  with norm_topk_prob false is refused rather than run differently.

Experts: x -> down(silu(min(gate, L)) * clamp(up, -L, L)), L = swiglu_limit, for the
routed experts and the shared one alike. ``DeepseekV4Experts`` is FusedMoE (its stacked
w13 / w2 weights, tensor- or expert-parallel sharding and per-expert loaders) with its
own forward: the clamp sits between the two products, where FusedMoE's kernels run a
plain SiLU-and-mul, so the experts run ``clamped_moe_reference`` (torch, on any device;
a host sync per layer on CUDA). The Triton kernels (kernels/moe/fused_moe.py's GATE_UP_ACT
epilogue and fused_moe_decode's silu_mul_rounded) need a swiglu_limit argument that
clamps the gate accumulator from above and the up accumulator on both sides before
silu(gate) * up; the routing kernels need the sqrtsoftplus score and an ungrouped
biased top-k (MoEConfig and routing.py know neither yet).

Parameter names, relative to the block (``mlp.`` in a layer; the original checkpoint's
``ffn.`` renamed as transformers does): ``gate.weight`` (float32),
``gate.e_score_correction_bias`` (top-k layers, float32) or ``gate.tid2eid`` (hash
layers, int32), ``experts.w13_weight`` / ``experts.w2_weight`` (``expert_weight_loads``
maps transformers' stacked ``experts.gate_up_proj`` / ``down_proj`` and the per-expert
``experts.{e}.w1 / w3 / w2`` or ``{gate,up,down}_proj`` names), and
``shared_experts.gate_up_proj.weight`` (from ``gate_proj`` / ``up_proj``, shard ids 0 / 1)
and ``shared_experts.down_proj.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.parallel_state import tp_all_reduce
from pagoda.kernels.moe.reference import check_moe_shapes
from pagoda.model.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    check_tp_group,
    default_weight_loader,
)
from pagoda.model.layers.matmul import linear
from pagoda.model.layers.moe.fused_moe import FusedMoE, map_expert_weight_name
from pagoda.model.layers.moe.gate import MoEGate
from pagoda.model.moe_config import MoEConfig
from pagoda.model.parallel import TensorParallel

V4_SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
MLP_LAYER_TYPES = ("hash_moe", "moe")
_DEFAULT_NUM_HASH_LAYERS = 3  # transformers' default when a config names no schedule


@dataclass(frozen=True)
class DeepseekV4MoEConfig:
    hidden_size: int
    num_experts: int  # routed experts
    top_k: int
    moe_intermediate_size: int  # each routed expert's, and the one shared expert's
    vocab_size: int  # rows of a hash layer's tid2eid table
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0

    def __post_init__(self) -> None:
        if self.scoring_func not in V4_SCORING_FUNCS:
            raise ValueError(
                f"DeepSeek V4 scoring_func must be one of {V4_SCORING_FUNCS}, "
                f"got {self.scoring_func!r}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, {self.num_experts}]"
            )
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.swiglu_limit!r}")

    @classmethod
    def from_hf_config(cls, config: dict) -> DeepseekV4MoEConfig:
        """The MoE fields of a DeepSeek V4 config.json dict; refuses, naming the field,
        what transformers' V4 block does not run (it hard-codes one shared expert of
        moe_intermediate_size, SiLU and renormalised weights)."""
        for key, want in (("hidden_act", "silu"), ("norm_topk_prob", True)):
            if config.get(key, want) != want:
                raise ValueError(f"DeepSeek V4 needs {key}={want!r}, got {config[key]!r}")
        if config.get("n_shared_experts", 1) != 1:
            raise ValueError(
                f"DeepSeek V4 runs exactly one shared expert, got "
                f"n_shared_experts={config['n_shared_experts']!r}"
            )
        return cls(
            hidden_size=config["hidden_size"],
            num_experts=config["n_routed_experts"],
            top_k=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            vocab_size=config["vocab_size"],
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.5)),
            scoring_func=config.get("scoring_func", "sqrtsoftplus"),
            swiglu_limit=float(config.get("swiglu_limit", 10.0)),
        )


def mlp_layer_types(config: dict) -> list[str]:
    """Each decoder layer's MoE kind ("hash_moe" or "moe"): the config's mlp_layer_types,
    else num_hash_layers (older configs) or 3 hash layers, then top-k layers."""
    num_layers = config["num_hidden_layers"]
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        num_hash = config.get("num_hash_layers", _DEFAULT_NUM_HASH_LAYERS)
        kinds = ["hash_moe"] * min(num_layers, num_hash) + ["moe"] * max(0, num_layers - num_hash)
    if len(kinds) != num_layers or any(k not in MLP_LAYER_TYPES for k in kinds):
        raise ValueError(
            f"mlp_layer_types must list {num_layers} entries of {MLP_LAYER_TYPES}, got {kinds!r}"
        )
    return list(kinds)


# ---- routing -------------------------------------------------------------------------


def v4_scores(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = router_logits.float()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"unknown DeepSeek V4 scoring_func {scoring_func!r}")


def _weights_of(scores: torch.Tensor, ids: torch.Tensor, scaling: float):
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids.to(torch.int32)


def select_topk_v4(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, cfg: DeepseekV4MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] -> (weights float32 [T, k], ids int32 [T, k]): chosen on the biased scores,
    weighted by the unbiased ones."""
    scores = v4_scores(router_logits, cfg.scoring_func)
    ids = torch.topk(scores + correction_bias.float(), cfg.top_k, dim=-1, sorted=False).indices
    return _weights_of(scores, ids, cfg.routed_scaling_factor)


def select_hashed(
    router_logits: torch.Tensor,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    cfg: DeepseekV4MoEConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] and token_ids [T] -> (weights float32 [T, k], ids int32 [T, k]): the experts
    tid2eid[token id] names, weighted by their scores."""
    if token_ids.shape != router_logits.shape[:1]:
        raise ValueError(
            f"a hash-routed MoE needs one token id per row: ids {tuple(token_ids.shape)}, "
            f"rows {router_logits.shape[0]}"
        )
    scores = v4_scores(router_logits, cfg.scoring_func)
    return _weights_of(scores, tid2eid[token_ids.long()].long(), cfg.routed_scaling_factor)


class DeepseekV4Router(MoEGate):
    """The float32 router linear plus the layer's expert choice: a correction bias
    (top-k layers) or a frozen token-id -> experts table (hash layers)."""

    def __init__(self, cfg: DeepseekV4MoEConfig, hashed: bool) -> None:
        super().__init__(cfg.hidden_size, cfg.num_experts, fp32=True)
        self.cfg, self.hashed = cfg, hashed
        if hashed:
            table = torch.empty(cfg.vocab_size, cfg.top_k, dtype=torch.int32)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
            self.tid2eid.weight_loader = default_weight_loader
        else:
            bias = torch.empty(cfg.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader
            self.e_score_correction_bias.keep_dtype = True

    def route(
        self, hidden: torch.Tensor, token_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] (and token_ids [T] on a hash layer; top-k layers take none)."""
        logits = self(hidden)
        if self.hashed:
            if token_ids is None:
                raise ValueError("a hash-routed DeepSeek V4 MoE layer needs the step's input ids")
            return select_hashed(logits, token_ids, self.tid2eid, self.cfg)
        return select_topk_v4(logits, self.e_score_correction_bias, self.cfg)


# ---- experts -------------------------------------------------------------------------


def clamped_silu_and_mul(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def clamped_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """As kernels/moe/reference.fused_moe_reference, with clamped_silu_and_mul between
    the products: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, k] (id -1:
    another rank's expert) -> [T, H] in hidden's dtype, summed in float32."""
    check_moe_shapes(hidden, w13, w2, topk_weights, topk_ids)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        if expert < 0:
            continue
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        act = clamped_silu_and_mul(linear(hidden.index_select(0, tokens), w13[expert]), limit)
        y = linear(act, w2[expert])
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)


class DeepseekV4Experts(FusedMoE):
    """FusedMoE's weights and sharding; forward runs the clamped SwiGLU experts.

    The MoEConfig handed to FusedMoE carries the shapes only: routing is the router's
    (forward takes the choices, never router logits)."""

    def __init__(
        self,
        cfg: DeepseekV4MoEConfig,
        tp: TensorParallel,
        params_dtype: torch.dtype,
        reduce_results: bool = True,
        expert_parallel: bool = False,
    ) -> None:
        shapes = MoEConfig(cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size)
        super().__init__(
            cfg.num_experts,
            cfg.top_k,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            shapes,
            tp,
            params_dtype,
            reduce_results=reduce_results,
            expert_parallel=expert_parallel,
        )
        self.swiglu_limit = cfg.swiglu_limit

    def forward(
        self, hidden_states: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """hidden [T, H], topk (weights float32 [T, k], global ids int32 [T, k]) -> [T, H]
        (this rank's partial sum unless reduce_results)."""
        topk_weights, topk_ids = topk
        if self.expert_parallel and self.tp.size > 1:
            topk_ids = self._local_ids(topk_ids)
        out = clamped_moe_reference(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            self.swiglu_limit,
        )
        if self.reduce_results and self.tp.size > 1:
            check_tp_group("DeepseekV4Experts", self.tp.rank, self.tp.size)
            out = tp_all_reduce(out)
        return out


class ClampedGatedMLP(nn.Module):
    """The shared expert: down(clamped_silu_and_mul(gate_up(x))), intermediate split over
    the ranks; its output is this rank's partial sum (the block reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, tp) -> None:
        super().__init__()
        self.limit = limit
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, tp_rank=tp.rank, tp_size=tp.size
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            tp_rank=tp.rank,
            tp_size=tp.size,
            reduce_results=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up_proj(x), not forward_silu_and_mul: a fused SiLU step would skip the clamp.
        return self.down_proj(clamped_silu_and_mul(self.gate_up_proj(x), self.limit))


class DeepseekV4MoE(nn.Module):
    def __init__(
        self,
        cfg: DeepseekV4MoEConfig,
        hashed: bool,
        tp: TensorParallel,
        params_dtype: torch.dtype,
        expert_parallel: bool | None = None,
    ) -> None:
        """hashed: a "hash_moe" layer (tid2eid routing); expert_parallel: keep experts
        whole, split across the ranks (None: tp.expert_parallel)."""
        super().__init__()
        self.tp = tp
        self.gate = DeepseekV4Router(cfg, hashed)
        self.experts = DeepseekV4Experts(
            cfg,
            tp,
            params_dtype,
            reduce_results=False,
            expert_parallel=tp.expert_parallel if expert_parallel is None else expert_parallel,
        )
        self.shared_experts = ClampedGatedMLP(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit, tp
        )

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, H] -> [T, H]: routed plus shared experts, one all-reduce for both.
        input_ids [T]: the step's token ids, required on a hash layer (the decoder
        passes them to every layer; a top-k layer does not read them)."""
        topk = self.gate.route(hidden_states, input_ids)
        out = self.experts(hidden_states, topk) + self.shared_experts(hidden_states)
        if self.tp.size > 1:
            check_tp_group("DeepseekV4MoE", self.tp.rank, self.tp.size)
            out = tp_all_reduce(out)
        return out


# ---- loading -------------------------------------------------------------------------

_STACKED_RE = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<proj>gate_up_proj|down_proj)$")
_ORIGINAL_RE = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<expert>\d+)\.w(?P<w>[123])\.weight$")
_ORIGINAL_PROJ = {"1": "gate", "3": "up", "2": "down"}

ExpertLoad = tuple[str, tuple[int, str], torch.Tensor]


def expert_weight_loads(name: str, tensor: torch.Tensor) -> list[ExpertLoad] | None:
    """A checkpoint's expert tensor -> [(param name, (expert, 'gate'|'up'|'down'),
    tensor)] for DeepseekV4Experts' loaders; None for any other name. Takes
    transformers' stacked ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj``
    [E, H, I], the original per-expert ``experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2``
    (down), and ``experts.{e}.{gate,up,down}_proj.weight``."""
    m = _STACKED_RE.match(name)
    if m is not None:
        if m["proj"] == "down_proj":
            return [(f"{m['prefix']}.w2_weight", (e, "down"), t) for e, t in enumerate(tensor)]
        gate, up = tensor.chunk(2, dim=1)
        target = f"{m['prefix']}.w13_weight"
        return [(target, (e, "gate"), gate[e]) for e in range(tensor.shape[0])] + [
            (target, (e, "up"), up[e]) for e in range(tensor.shape[0])
        ]
    m = _ORIGINAL_RE.match(name)
    if m is not None:
        proj = _ORIGINAL_PROJ[m["w"]]
        param = "w2_weight" if proj == "down" else "w13_weight"
        return [(f"{m['prefix']}.{param}", (int(m["expert"]), proj), tensor)]
    mapped = map_expert_weight_name(name)
    return None if mapped is None else [(mapped[0], mapped[1], tensor)]
