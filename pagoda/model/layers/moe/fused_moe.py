"""FusedMoE: a layer's routed experts, stacked, sharded over the tensor-parallel group,
with the weight loaders that take Hugging Face's per-expert tensors.

Parameters (this rank's share):
- ``w13_weight [E_local, 2 * I_local, H]``: each expert's gate rows then up rows;
- ``w2_weight [E_local, H, I_local]``: each expert's down projection;
- ``e_score_correction_bias [E]`` (float32, noaux_tc routing only).

Sharding, chosen at construction:
- tensor parallel (default): every rank holds every expert, I split across ranks
  (gate/up rows and down columns, as a dense MLP's column/row-parallel pair);
- expert parallel: rank r holds experts [r * E / tp, (r + 1) * E / tp) whole; a token's
  choices of other ranks' experts add nothing here (routing ids mapped to -1).
Either way each rank's output is a partial sum over its shards: with reduce_results
the layer all-reduces it; without, the caller does (one all-reduce for several sums).

Loading: ``map_expert_weight_name`` turns ``...mlp.experts.{e}.{gate,up,down}_proj.weight``
into (``...mlp.experts.w13_weight`` or ``w2_weight``, shard id ``(e, "gate"|"up"|"down")``)
and the parameter's ``weight_loader(param, full_tensor, shard_id)`` copies this rank's
slice (nothing for another rank's expert). ``expected_shard_ids`` lists every shard id a
complete checkpoint provides, for the model's completeness check.

Compute: the Triton kernel (pagoda.kernels.moe.fused_moe) on CUDA, the torch reference on
the CPU (it never imports triton there).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagoda.distributed.parallel_state import tp_all_reduce
from pagoda.kernels.moe.config import MoEKernelConfig
from pagoda.kernels.moe.reference import fused_moe_reference
from pagoda.model.layers.linear import (
    LayerWeightLoader,
    check_tp_group,
    copy_checked,
    default_weight_loader,
)
from pagoda.model.layers.matmul import linear
from pagoda.model.layers.moe.routing import select_experts
from pagoda.model.moe_config import MoEConfig
from pagoda.model.parallel import TensorParallel

_EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts)\.(?P<expert>\d+)\."
    r"(?P<proj>gate|up|down)_proj\.weight$"
)

ExpertShardId = tuple[int, str]


def map_expert_weight_name(hf_name: str) -> tuple[str, ExpertShardId] | None:
    """'model.layers.3.mlp.experts.7.up_proj.weight' ->
    ('model.layers.3.mlp.experts.w13_weight', (7, 'up')); None for other names."""
    m = _EXPERT_RE.match(hf_name)
    if m is None:
        return None
    param = "w2_weight" if m["proj"] == "down" else "w13_weight"
    return f"{m['prefix']}.{param}", (int(m["expert"]), m["proj"])


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        moe_config: MoEConfig,
        tp: TensorParallel,
        params_dtype: torch.dtype,
        reduce_results: bool = True,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        if (num_experts, top_k) != (moe_config.num_experts, moe_config.num_experts_per_tok):
            raise ValueError(
                f"FusedMoE({num_experts} experts, top {top_k}) disagrees with its "
                f"MoEConfig ({moe_config.num_experts}, "
                f"top {moe_config.num_experts_per_tok})"
            )
        self.cfg, self.tp = moe_config, tp
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.reduce_results, self.expert_parallel = reduce_results, expert_parallel
        if expert_parallel:
            if num_experts % tp.size:
                raise ValueError(
                    f"expert parallel: {num_experts} experts do not split over {tp.size} ranks"
                )
            self.num_local_experts, self.local_intermediate = (
                num_experts // tp.size,
                intermediate_size,
            )
            self.first_expert = tp.rank * self.num_local_experts
        else:
            if intermediate_size % tp.size:
                raise ValueError(
                    f"moe_intermediate_size ({intermediate_size}) is not divisible "
                    f"by tensor_parallel_size ({tp.size}); enable expert "
                    f"parallelism to keep experts whole"
                )
            self.num_local_experts, self.first_expert = num_experts, 0
            self.local_intermediate = intermediate_size // tp.size
        e, i = self.num_local_experts, self.local_intermediate
        self.w13_weight = nn.Parameter(
            torch.empty(e, 2 * i, hidden_size, dtype=params_dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(e, hidden_size, i, dtype=params_dtype), requires_grad=False
        )
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = LayerWeightLoader(self)
        if moe_config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )
            self.e_score_correction_bias.weight_loader = default_weight_loader
            self.e_score_correction_bias.keep_dtype = True
        else:
            self.register_parameter("e_score_correction_bias", None)
        # The linear layer that runs after this block (set_next_linear), in a tuple so
        # that it is not registered as a submodule of this one.
        self._next_linear: tuple[nn.Module, ...] = ()
        # The kernels' tiles on this layer's device (the model runner's KernelConfigs;
        # None: MoEKernelConfig.for_device at each call).
        self.kernel_config: MoEKernelConfig | None = None

    def set_next_linear(self, layer: nn.Module) -> None:
        """The linear layer the model runs next (the next decoder layer's qkv projection):
        the decode down GEMV prefetches its weight into L2 at its end
        (pagoda.kernels.launch.l2_prefetch), which took Qwen3-30B-A3B's batch-1 step
        down in every A/B round on the H100 (docs/performance.md)."""
        self._next_linear = (layer,)

    def expected_shard_ids(self, param_name: str) -> list[ExpertShardId]:
        """Every shard id a complete checkpoint gives param_name ("w13_weight" or
        "w2_weight"): all experts', including the ones another rank keeps."""
        projs = ("down",) if param_name.endswith("w2_weight") else ("gate", "up")
        return [(e, p) for e in range(self.num_experts) for p in projs]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ExpertShardId
    ) -> None:
        if (
            not isinstance(shard_id, tuple)
            or len(shard_id) != 2
            or shard_id[1] not in ("gate", "up", "down")
        ):
            raise ValueError(
                f"FusedMoE needs shard_id (expert, 'gate'|'up'|'down'), got {shard_id!r}"
            )
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the layer has {self.num_experts})")
        if (proj == "down") != (param is self.w2_weight):
            raise ValueError(f"{proj}_proj does not belong in this parameter")
        full = (
            (self.hidden_size, self.intermediate_size)
            if proj == "down"
            else (self.intermediate_size, self.hidden_size)
        )
        if tuple(loaded_weight.shape) != full:
            raise ValueError(
                f"expert {expert} {proj}_proj: checkpoint shape "
                f"{tuple(loaded_weight.shape)}, expected {full}"
            )
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        i = self.local_intermediate
        start = 0 if self.expert_parallel else self.tp.rank * i
        if proj == "down":  # [H, I]: this rank's columns
            copy_checked(
                param.data[local], loaded_weight.narrow(1, start, i), f"expert {expert} down_proj"
            )
        else:  # [I, H]: this rank's rows, into the gate or the up half
            offset = 0 if proj == "gate" else i
            copy_checked(
                param.data[local].narrow(0, offset, i),
                loaded_weight.narrow(0, start, i),
                f"expert {expert} {proj}_proj",
            )

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's indices, -1 for another rank's experts
        (arithmetic, not a lookup buffer: nothing to rebuild after materialising)."""
        local = topk_ids - self.first_expert
        return torch.where(
            (local >= 0) & (local < self.num_local_experts), local, torch.full_like(local, -1)
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        shared: nn.Module | None = None,
    ) -> torch.Tensor:
        """hidden_states [T, H] and either router_logits [T, E] or topk, the routing
        already done ((weights float32 [T, k], global ids int32 [T, k]), routing.route)
        -> [T, H]: the weighted sum of each token's chosen experts (this rank's part
        when reduce_results is False), plus shared(hidden_states) when a shared MLP
        (a GatedMLP that does not reduce) is given: at decode on CUDA computed in the
        experts' two GEMV launches (kernels/fused_moe_decode.py), else on its own."""
        if (router_logits is None) == (topk is None):
            raise ValueError("FusedMoE.forward takes router_logits or topk (exactly one)")
        topk_weights, topk_ids = (
            topk
            if topk is not None
            else select_experts(router_logits, self.cfg, self.e_score_correction_bias)
        )
        if self.expert_parallel and self.tp.size > 1:
            topk_ids = self._local_ids(topk_ids)
        shared_weights = self._shared_weights(shared, hidden_states, topk_ids.numel())
        if hidden_states.is_cuda:
            from pagoda.kernels.launch import l2_prefetch  # imports triton: CUDA only
            from pagoda.kernels.moe.fused_moe import fused_moe

            following = l2_prefetch.weight_of(self._next_linear[0]) if self._next_linear else None
            out = fused_moe(
                hidden_states,
                self.w13_weight,
                self.w2_weight,
                topk_weights,
                topk_ids,
                shared=shared_weights,
                prefetch_after=following,
                config=self.kernel_config,
            )
        else:
            out = fused_moe_reference(
                hidden_states,
                self.w13_weight,
                self.w2_weight,
                topk_weights,
                topk_ids,
                linear=linear,
            )
        if shared is not None and shared_weights is None:
            out = out + shared(hidden_states)
        if self.reduce_results and self.tp.size > 1:
            check_tp_group("FusedMoE", self.tp.rank, self.tp.size)
            out = tp_all_reduce(out)
        return out

    def _shared_weights(
        self, shared: nn.Module | None, hidden: torch.Tensor, num_pairs: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared MLP's (gate_up, down) weights when the decode kernels take them:
        CUDA, the GEMV path, plain weights of the experts' dtype whose intermediate is a
        whole number of this rank's expert intermediates; else None."""
        if shared is None or not hidden.is_cuda:
            return None
        from pagoda.kernels.moe.fused_moe import gemv_path_takes  # imports triton: CUDA only
        from pagoda.kernels.moe.fused_moe_decode import shared_chunks_of

        if not gemv_path_takes(
            num_pairs, self.kernel_config or MoEKernelConfig.for_device(hidden.device)
        ):
            return None
        weights = (
            getattr(shared.gate_up_proj, "weight", None),
            getattr(shared.down_proj, "weight", None),
        )
        if any(w is None for w in weights):
            return None
        try:
            shared_chunks_of(weights, self.w13_weight, self.w2_weight)
        except ValueError:
            return None
        return weights
