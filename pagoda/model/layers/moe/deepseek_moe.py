"""DeepSeek's MoE block (V2 / V3): a replicated router, the routed experts (FusedMoE),
and the shared experts (one dense gated MLP of n_shared_experts * moe_intermediate_size,
tensor-parallel), summed and then all-reduced once.

Parameter names follow Hugging Face's, relative to the block (``mlp.`` in a layer):
``gate.weight`` (float32, as transformers keeps it), ``gate.e_score_correction_bias``
(noaux_tc only; the same Parameter as ``experts.e_score_correction_bias``, registered on
the gate first so that named_parameters() gives it the checkpoint's name),
``experts.w13_weight`` / ``experts.w2_weight`` (from ``experts.{e}.{gate,up,down}_proj``
via fused_moe.map_expert_weight_name), ``shared_experts.gate_up_proj.weight`` (from
``shared_experts.gate_proj`` / ``up_proj``, shard ids 0 / 1) and
``shared_experts.down_proj.weight``.

``is_moe_layer(arch, layer_idx)`` says which decoder layers hold an MoE block.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.distributed.parallel_state import tp_all_reduce
from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.activation import SiluAndMul
from pagoda.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear, check_tp_group
from pagoda.model.layers.moe.fused_moe import FusedMoE
from pagoda.model.layers.moe.gate import MoEGate
from pagoda.model.layers.moe.routing import route
from pagoda.model.parallel import TensorParallel


def is_moe_layer(arch: ArchConfig, layer_idx: int) -> bool:
    """Whether decoder layer layer_idx of arch has experts (DeepSeek: index >=
    first_k_dense_replace and index % moe_layer_freq == 0; Qwen3-MoE: (index + 1) %
    decoder_sparse_step == 0 and index not in mlp_only_layers)."""
    return arch.moe is not None and arch.moe.is_moe_layer_index(arch.architecture, layer_idx)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), intermediate split over the tensor-parallel ranks;
    with reduce_results False the output is this rank's partial sum."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TensorParallel,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias=False,
            tp_rank=tp.rank,
            tp_size=tp.size,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            tp_rank=tp.rank,
            tp_size=tp.size,
            reduce_results=reduce_results,
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x, self.act))


class DeepseekMoE(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        tp: TensorParallel,
        params_dtype: torch.dtype,
        expert_parallel: bool | None = None,
    ) -> None:
        """expert_parallel: keep experts whole, split across the ranks (None: the engine's
        choice, tp.expert_parallel)."""
        super().__init__()
        moe = arch.moe
        if moe is None:
            raise ValueError(f"{arch.architecture} has no MoE config: DeepseekMoE needs experts")
        if expert_parallel is None:
            expert_parallel = tp.expert_parallel
        self.tp = tp
        # Registered first: the correction bias below is reached by its gate name.
        self.gate = MoEGate(arch.hidden_size, moe.num_experts, fp32=True)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.num_experts_per_tok,
            arch.hidden_size,
            moe.moe_intermediate_size,
            moe,
            tp,
            params_dtype,
            reduce_results=False,
            expert_parallel=expert_parallel,
        )
        if self.experts.e_score_correction_bias is not None:
            self.gate.e_score_correction_bias = self.experts.e_score_correction_bias
        self.shared_experts = None
        if moe.n_shared_experts:
            self.shared_experts = GatedMLP(
                arch.hidden_size, moe.shared_intermediate_size, tp, reduce_results=False
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]: routed experts (weights scaled by routed_scaling_factor)
        plus shared experts, one all-reduce for both."""
        out = self.experts(
            hidden_states,
            topk=route(
                hidden_states, self.gate, self.experts.cfg, self.experts.e_score_correction_bias
            ),
            shared=self.shared_experts,
        )
        if self.tp.size > 1:
            check_tp_group("DeepseekMoE", self.tp.rank, self.tp.size)
            out = tp_all_reduce(out)
        return out
