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

Quantized experts: a ``MoEMethod`` (pagoda.model.quant, ``set_quant_method`` before
materialising) replaces the weights by FP8 ones with scale buffers (``w13_<scale>``,
``w2_<scale>``), sliced with the weights (tensor parallel: the blocks of this rank's
rows / columns; expert parallel: whole experts), and the kernels apply them
(``MoEMethod.scales``). A shared MLP then runs apart from the experts' kernels.

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
from pagoda.kernels.moe.reference import ExpertScales, fused_moe_reference
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
from pagoda.model.quant.base import MoEMethod

_EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts)\.(?P<expert>\d+)\."
    r"(?P<proj>gate|up|down)_proj\.(?P<kind>weight|weight_scale_inv|weight_scale)$"
)
# FP8 checkpoints' scale tensors beside an expert's weight (pagoda.model.quant.fp8_moe).
SCALE_KINDS = ("weight_scale_inv", "weight_scale")

# (expert, "gate"|"up"|"down"), or (expert, proj, scale kind) for an FP8 weight's scale.
ExpertShardId = tuple[int, str] | tuple[int, str, str]


def map_expert_weight_name(hf_name: str) -> tuple[str, ExpertShardId] | None:
    """'model.layers.3.mlp.experts.7.up_proj.weight' ->
    ('model.layers.3.mlp.experts.w13_weight', (7, 'up')); an FP8 scale
    ('...experts.7.up_proj.weight_scale_inv') goes to the same parameter's loader with
    shard id (7, 'up', 'weight_scale_inv'); None for other names."""
    m = _EXPERT_RE.match(hf_name)
    if m is None:
        return None
    param = "w2_weight" if m["proj"] == "down" else "w13_weight"
    shard = (int(m["expert"]), m["proj"])
    if m["kind"] != "weight":
        shard = (*shard, m["kind"])
    return f"{m['prefix']}.{param}", shard


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
        # How the experts are stored (None: float weights of the model's dtype).
        self.quant_method: MoEMethod | None = None

    def set_quant_method(self, method: MoEMethod) -> None:
        """Quantized experts (before materialising): method registers their parameters."""
        if self.quant_method is not None:
            raise ValueError("FusedMoE already has a quantization method")
        method.create_weights(self)
        self.quant_method = method

    def scales(self) -> ExpertScales | None:
        """The FP8 weights' scales the kernels apply, None for float experts."""
        return None if self.quant_method is None else self.quant_method.scales(self)

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
        ids: list[ExpertShardId] = [(e, p) for e in range(self.num_experts) for p in projs]
        scale = None if self.quant_method is None else self.quant_method.scale_name
        if scale is not None:  # an FP8 checkpoint's scale beside every weight
            ids += [(e, p, scale) for e, p in list(ids)]
        return ids

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ExpertShardId
    ) -> None:
        if (
            not isinstance(shard_id, tuple)
            or len(shard_id) not in (2, 3)
            or shard_id[1] not in ("gate", "up", "down")
            or shard_id[2:] not in ((), *((k,) for k in SCALE_KINDS))
        ):
            raise ValueError(
                f"FusedMoE needs shard_id (expert, 'gate'|'up'|'down'[, scale kind]), "
                f"got {shard_id!r}"
            )
        expert, proj = shard_id[:2]
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the layer has {self.num_experts})")
        if (proj == "down") != (param is self.w2_weight):
            raise ValueError(f"{proj}_proj does not belong in this parameter")
        if len(shard_id) == 3:
            self._load_scale(expert, proj, shard_id[2], loaded_weight)
            return
        if (param.dtype == torch.float8_e4m3fn) != (loaded_weight.dtype == torch.float8_e4m3fn):
            raise ValueError(
                f"expert {expert} {proj}_proj: a {loaded_weight.dtype} checkpoint tensor "
                f"for {param.dtype} experts (the quantization_config and the weights disagree)"
            )
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

    def _load_scale(self, expert: int, proj: str, kind: str, scale: torch.Tensor) -> None:
        """An FP8 weight's scale ([ceil(N/bn), ceil(K/bk)] blocks, or [N, 1] per row)
        into this rank's w13 / w2 scale buffer, sliced as the weight is."""
        method = self.quant_method
        what = f"expert {expert} {proj}_proj.{kind}"
        if method is None or method.scale_name != kind:
            raise ValueError(f"{what}: these experts keep no {kind} (float or another scheme)")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        bn, bk = method.block or (1, None)
        i, h = self.local_intermediate, self.hidden_size
        start = 0 if self.expert_parallel else self.tp.rank * i
        if proj == "down":  # [H, I]: this rank's column blocks (every row)
            full_rows = -(-h // bn)
        else:  # [I, H]: this rank's row blocks
            full_rows = -(-self.intermediate_size // bn)
        if scale.dim() != 2 or scale.shape[0] != full_rows:
            raise ValueError(
                f"{what}: checkpoint shape {tuple(scale.shape)}, expected {full_rows} rows"
            )
        if proj == "down":
            dst = getattr(self, f"w2_{kind}")[local]
            src = scale if bk is None else scale.narrow(1, start // bk, -(-i // bk))
        else:  # into the gate or the up half of the w13 scale
            half = -(-i // bn)
            dst = getattr(self, f"w13_{kind}")[local].narrow(0, 0 if proj == "gate" else half, half)
            src = scale.narrow(0, start // bn, half)
        copy_checked(dst, src.float(), what)

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
        scales = self.scales()
        shared_weights = None
        if scales is None:  # a shared MLP rides along float experts' kernels only
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
                scales=scales,
            )
        else:
            out = fused_moe_reference(
                hidden_states,
                self.w13_weight,
                self.w2_weight,
                topk_weights,
                topk_ids,
                linear=linear,
                scales=scales,
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
