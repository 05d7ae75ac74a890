"""Qwen3-MoE (Qwen3MoeForCausalLM): the Qwen3 decoder (per-head q/k RMSNorm, no
attention bias) with a sparse MoE block in place of the dense MLP on the layers
is_moe_layer names (decoder_sparse_step / mlp_only_layers); the others keep a dense
MLP of intermediate_size.

The block is transformers' Qwen3MoeSparseMoeBlock: a router linear ``mlp.gate``
(replicated, in the model's dtype), softmax top-k (renormalised when norm_topk_prob),
and the routed experts (FusedMoE; no shared experts), all-reduced over the
tensor-parallel group; the router linear and the routing go through routing.route (one
kernel on CUDA at decode sizes). Everything else, loading included, is LlamaForCausalLM's; this
file only adds the block and the per-expert checkpoint names
(``mlp.experts.{e}.{gate,up,down}_proj.weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.linear import ShardId
from pagoda.model.layers.moe.deepseek_moe import is_moe_layer
from pagoda.model.layers.moe.fused_moe import FusedMoE, map_expert_weight_name
from pagoda.model.layers.moe.gate import MoEGate
from pagoda.model.layers.moe.routing import route, route_after_norm
from pagoda.model.llama import LlamaForCausalLM
from pagoda.model.parallel import SINGLE_RANK, TensorParallel


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        moe = arch.moe
        self.gate = MoEGate(arch.hidden_size, moe.num_experts)
        # Built on the meta device; materialize() gives every weight the model's dtype.
        self.experts = FusedMoE(
            moe.num_experts,
            moe.num_experts_per_tok,
            arch.hidden_size,
            moe.moe_intermediate_size,
            moe,
            tp,
            torch.get_default_dtype(),
            reduce_results=True,
            expert_parallel=tp.expert_parallel,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, topk=route(hidden, self.gate, self.experts.cfg))

    def forward_after_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(forward(norm(hidden + residual)), hidden + residual) with the norm computed
        inside the router's launch (routing.route_after_norm), or None where that does
        not cover the call (the decoder layer then runs the norm and forward)."""
        fused = route_after_norm(hidden, residual, norm, self.gate, self.experts.cfg)
        if fused is None:
            return None
        topk, normed, new_residual = fused
        return self.experts(normed, topk=topk), new_residual


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        if arch.moe is None or not arch.qk_norm:
            raise ValueError("Qwen3MoeForCausalLM needs an MoE config and qk_norm")
        super().__init__(arch, tp)
        # Each MoE block's decode down GEMV may prefetch the next layer's qkv weight
        # (pagoda.kernels.launch.l2_prefetch).
        layers = list(self.model.layers)
        for layer, following in zip(layers, layers[1:]):
            if isinstance(layer.mlp, Qwen3MoeSparseBlock):
                layer.mlp.experts.set_next_linear(following.self_attn.qkv_proj)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        if is_moe_layer(self.arch, layer_idx):
            return Qwen3MoeSparseBlock(self.arch, self.tp)
        return None

    def map_hf_name(self, hf_name: str) -> tuple[str, ShardId]:
        # Expert names first: the dense mapping would fold their gate_proj/up_proj.
        expert = map_expert_weight_name(hf_name)
        if expert is not None:
            return expert
        return super().map_hf_name(hf_name)

    def expected_loads(self, name: str) -> list[str]:
        if name.endswith(("experts.w13_weight", "experts.w2_weight")):
            experts = self.get_submodule(name.rsplit(".", 1)[0])
            return [f"{name}[{shard}]" for shard in experts.expected_shard_ids(name)]
        return super().expected_loads(name)
