"""gpt-oss (GptOssForCausalLM, transformers' ``gpt_oss``).

What differs from the Llama decoder, and how each is done here:
- attention: q/k/v and o projections all carry biases; every layer has attention
  sinks (one learned logit per head in the softmax denominator, the Attention layer's
  float32 ``sinks``, checkpoint ``self_attn.sinks``); layers alternate sliding-window
  (ArchConfig.layer_types "sliding_attention", window 128 as released) and full
  attention; one YaRN rotary table (rope_scaling) for all of them;
- feed-forward: a mixture of experts on every layer (GptOssMoE): a router linear with a
  bias, the top-k logits softmaxed over the k chosen, and experts with biases whose
  activation is a clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha *
  g), g = min(gate, limit), gate and up interleaved in the columns of gate_up_proj.

The experts run in torch: Pagoda's fused MoE kernels have neither expert biases nor
this activation. Eagerly, a loop over the experts a step hits (two matmuls each, a
host sync for the list); under CUDA graph capture, every expert over every token
weighted by its routing weight (0 where not chosen), which needs no sync.
Tensor parallel: heads split as in Llama; each expert's intermediate columns split
across ranks (gate/up pairs kept together), the down bias added on rank 0 before the
all-reduce.

Checkpoint names are transformers' (``mlp.router.{weight,bias}``,
``mlp.experts.{gate_up_proj,down_proj}[_bias]`` in its ``x @ w`` layout [E, in, out]);
a released checkpoint's MXFP4 experts (``..._blocks`` / ``..._scales``) are
dequantized to the model's dtype as their pair completes (pagoda.model.quant.mxfp4).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagoda.distributed.parallel_state import tp_all_reduce
from pagoda.model.arch_config import ArchConfig, GptOssExperts
from pagoda.model.layers.attention import Attention
from pagoda.model.layers.embedding import VocabParallelEmbedding
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import (
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
    check_tp_group,
    copy_checked,
    divide,
)
from pagoda.model.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_tables,
    rotary_tables,
)
from pagoda.model.llama import LlamaForCausalLM
from pagoda.model.parallel import SINGLE_RANK, TensorParallel
from pagoda.model.quant import mxfp4


class GptOssAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=True,
            tp_rank=tp.rank,
            tp_size=tp.size,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            arch.q_size, arch.hidden_size, bias=True, tp_rank=tp.rank, tp_size=tp.size
        )
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            arch.head_dim,
            scale=arch.softmax_scale,
            sliding_window=arch.layer_sliding_window(layer_idx),
            sinks=True,
            tp_rank=tp.rank,
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; cos/sin as GptOssModel.rotary gives them."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        rotate = apply_rotary_tables if cos.dim() == 3 else apply_rotary
        q = rotate(q.reshape(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = rotate(k.reshape(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        out = self.attn(q.reshape(num_tokens, self.q_size), k.reshape(num_tokens, self.kv_size), v)
        return self.o_proj(out)


class GptOssRouter(nn.Module):
    """logits = x W^T + b over the experts (replicated on every rank)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k]: the top-k logits softmaxed over the k, ids [T, k])."""
        logits = nn.functional.linear(hidden, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids


class GptOssExpertStack(nn.Module):
    """The routed experts in transformers' layout, this rank's intermediate columns:
    gate_up_proj [E, H, 2 * I_local] (gate and up interleaved), gate_up_proj_bias
    [E, 2 * I_local], down_proj [E, I_local, H], down_proj_bias [E, H]."""

    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        cfg: GptOssExperts = arch.gpt_oss
        if tp.expert_parallel:
            raise ValueError("expert parallelism is not supported for gpt-oss")
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.tp = tp
        num_experts, hidden = cfg.num_experts, arch.hidden_size
        self.inter = divide(arch.intermediate_size, tp.size, "intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * self.inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * self.inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, self.inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        for name, dim in (("gate_up_proj", 2), ("gate_up_proj_bias", 1), ("down_proj", 1)):
            getattr(self, name).weight_loader = self._sharded_loader(dim)
        self.down_proj_bias.weight_loader = self._replicated_loader

    def _sharded_loader(self, dim: int):
        """A loader taking this rank's slice of dim (the intermediate columns)."""

        def load(param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId = None) -> None:
            if shard_id is not None:
                raise ValueError(f"expert tensors take no shard_id, got {shard_id!r}")
            size = param.shape[dim]
            if tensor.shape[dim] != size * self.tp.size:
                raise ValueError(
                    f"expert tensor {tuple(tensor.shape)}: dim {dim} must be "
                    f"{size * self.tp.size} ({size} per rank)"
                )
            part = tensor.narrow(dim, self.tp.rank * size, size)
            with torch.no_grad():
                copy_checked(param.data, part.to(param.dtype), "expert tensor")

        return load

    def _replicated_loader(
        self, param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"expert tensors take no shard_id, got {shard_id!r}")
        with torch.no_grad():
            copy_checked(param.data, tensor.to(param.dtype), "expert tensor")

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of interleaved [.., 2I] gate/up columns -> [.., I]."""
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights float32 [T, k], ids [T, k] -> [T, H] (all-reduced)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self.forward_dense(x, weights, ids)  # a CUDA graph: no host sync
        else:
            out = self.forward_sparse(x, weights, ids)
        out = out.to(x.dtype)
        if self.tp.size > 1:
            check_tp_group("gpt-oss experts", self.tp.rank, self.tp.size)
            out = tp_all_reduce(out)
        return out

    def _expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert` on rows x [N, H] -> [N, H] (its down bias on rank 0 only)."""
        h = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        y = self.activation(h) @ self.down_proj[expert]
        return y + self.down_proj_bias[expert] if self.tp.rank == 0 else y

    def forward_sparse(self, x, weights, ids) -> torch.Tensor:
        """Each expert the step hits on its own tokens (a host sync for the list):
        float32 [T, H], not reduced."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in torch.unique(ids).tolist():
            token, slot = torch.nonzero(ids == expert, as_tuple=True)
            y = self._expert(x[token], expert)
            out.index_add_(0, token, y.float() * weights[token, slot, None])
        return out

    def forward_dense(self, x, weights, ids) -> torch.Tensor:
        """Every expert on every token, weighted by its routing weight (0 where not
        chosen): no data-dependent shapes, so a CUDA graph can hold it; the same sum
        as forward_sparse at E / k times its arithmetic."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in range(self.gate_up_proj.shape[0]):
            weight = (weights * (ids == expert)).sum(-1, keepdim=True)  # [T, 1]
            out += self._expert(x, expert).float() * weight
        return out


class GptOssMoE(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        cfg = arch.gpt_oss
        self.router = GptOssRouter(arch.hidden_size, cfg.num_experts, cfg.num_experts_per_tok)
        self.experts = GptOssExpertStack(arch, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, *self.router(hidden))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(arch, layer_idx, tp)
        self.mlp = GptOssMoE(arch, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos, sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MoE output, residual stream before it): the next norm adds them."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class GptOssModel(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, tp_rank=tp.rank, tp_size=tp.size
        )
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(arch, i, tp) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary_emb(positions)
        return rotary_tables(cos, sin) if positions.device.type == "cpu" else (cos, sin)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, output_rows=None
    ) -> torch.Tensor:
        cos, sin = self.rotary(positions)
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        if output_rows is not None:
            hidden, residual = hidden[output_rows], residual[output_rows]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss; the LM head, materializing and the completeness check are
    LlamaForCausalLM's."""

    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        if arch.gpt_oss is None:
            raise ValueError("GptOssForCausalLM needs ArchConfig.gpt_oss")
        super().__init__(arch, tp)

    def make_model(self, arch: ArchConfig, tp: TensorParallel) -> nn.Module:
        return GptOssModel(arch, tp)

    def map_hf_name(self, hf_name: str) -> tuple[str, ShardId]:
        if hf_name.endswith(".self_attn.sinks"):
            return hf_name.removesuffix("sinks") + "attn.sinks", None
        return super().map_hf_name(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As LlamaForCausalLM's; MXFP4 expert pairs (``<proj>_blocks`` and
        ``<proj>_scales``) are dequantized to the parameter's dtype once both arrived."""
        return super().load_weights(self._dequantized(weights))

    def _dequantized(self, weights: Iterable[tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for hf_name, tensor in weights:
            suffix = next((s for s in mxfp4.SUFFIXES if hf_name.endswith(s)), None)
            if suffix is None:
                yield hf_name, tensor
                continue
            name = hf_name.removesuffix(suffix)
            pair = pending.setdefault(name, {})
            pair[suffix] = tensor
            if len(pair) == 2:
                del pending[name]
                dtype = params[name].dtype if name in params else torch.float32
                try:
                    weight = mxfp4.expert_weight(pair["_blocks"], pair["_scales"], dtype)
                except ValueError as e:
                    raise ValueError(f"loading {name!r}: {e}") from e
                yield name, weight
        if pending:
            raise ValueError(f"MXFP4 tensors without their pair: {', '.join(sorted(pending)[:4])}")
