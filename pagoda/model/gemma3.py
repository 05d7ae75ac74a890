"""Gemma 3 text decoder (Gemma3ForCausalLM, transformers' ``gemma3_text``).

What differs from the Llama decoder, and how each is done here:
- local and global layers: the layers ArchConfig.layer_types marks "sliding_attention"
  attend over a sliding window (ArchConfig.layer_sliding_window, passed to their
  Attention), the others over the whole context (5 local : 1 global in the released
  checkpoints);
- two rotary tables: the local layers rotate with base local_rope_theta and no scaling,
  the global ones with rope_theta and the config's scaling (linear: positions divided
  by factor); both are looked up once per forward;
- zero-centred RMSNorm weights (the norm multiplies by 1 + weight): the checkpoint's
  weights are loaded plus one into Pagoda's RMSNorm (GemmaRMSNorm's loader), so every
  norm, the per-head q/k norms included, runs the Llama norm code;
- four norms a layer: post-attention and post-feed-forward norms on the block outputs
  before each residual add, pre-feed-forward norm before the MLP;
- embedding scaled by sqrt(hidden_size) rounded to the model's dtype (as transformers
  rounds it); softmax scale query_pre_attn_scalar^-0.5 (the backend's, from
  ArchConfig.attention_shape); MLP activation GELU (tanh approximation);
- final logits soft-capped, cap * tanh(logits / cap), when final_logit_softcapping is
  set (attention-score soft-capping is refused by ArchConfig).

Loading, tying and the merged q/k/v and gate/up parameters are LlamaForCausalLM's.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.attention import Attention
from pagoda.model.layers.embedding import VocabParallelEmbedding
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
    default_weight_loader,
)
from pagoda.model.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_tables,
    default_inv_freq,
    rotary_tables,
)
from pagoda.model.llama import LlamaForCausalLM
from pagoda.model.parallel import TensorParallel


def _plus_one_loader(param: nn.Parameter, tensor: torch.Tensor, shard_id: ShardId = None) -> None:
    """A zero-centred norm weight w loaded as 1 + w (added in float32)."""
    default_weight_loader(param, tensor.float() + 1.0, shard_id)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight is stored zero-centred: it holds 1 + w."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = _plus_one_loader


class LinearScaledRotary(RotaryEmbedding):
    """Rotary embedding with linear position scaling: frequencies divided by factor."""

    def __init__(self, head_dim: int, max_position: int, base: float, factor: float) -> None:
        self.factor = factor  # read by reset_cache, which the base constructor may call
        super().__init__(head_dim, max_position, base, None)

    def reset_cache(self) -> None:
        device = self.cos_cache.device
        inv_freq = default_inv_freq(self.head_dim, self.base).to(device) / self.factor
        positions = torch.arange(self.max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.cos_cache, self.sin_cache = freqs.cos(), freqs.sin()


def make_rotary(arch: ArchConfig, sliding: bool) -> RotaryEmbedding:
    """The local layers' rotary (local_rope_theta, unscaled) or the global layers'."""
    if sliding:
        return RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.local_rope_theta)
    scaling = arch.rope_scaling
    if scaling is not None and scaling["rope_type"] == "linear":
        return LinearScaledRotary(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, scaling["factor"]
        )
    return RotaryEmbedding(
        arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
    )


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype (the embedding scale as transformers multiplies by it)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))


class Gemma3Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=False,
            tp_rank=tp.rank,
            tp_size=tp.size,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            arch.q_size, arch.hidden_size, bias=False, tp_rank=tp.rank, tp_size=tp.size
        )
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            arch.head_dim,
            scale=arch.softmax_scale,
            sliding_window=arch.layer_sliding_window(layer_idx),
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; cos/sin: this layer kind's rotary ([T, D/2] each,
        or rotary_tables' [T, 1, D] on the CPU)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        rotate = apply_rotary_tables if cos.dim() == 3 else apply_rotary
        q = rotate(q, cos, sin).reshape(num_tokens, self.q_size)
        k = rotate(k, cos, sin).reshape(num_tokens, self.kv_size)
        return self.o_proj(self.attn(q, k, v))


class Gemma3MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up as one column-parallel projection."""

    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size,
            [arch.intermediate_size, arch.intermediate_size],
            bias=False,
            tp_rank=tp.rank,
            tp_size=tp.size,
        )
        self.down_proj = RowParallelLinear(
            arch.intermediate_size, arch.hidden_size, bias=False, tp_rank=tp.rank, tp_size=tp.size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.sliding = arch.layer_sliding_window(layer_idx) is not None
        self.self_attn = Gemma3Attention(arch, layer_idx, tp)
        self.mlp = Gemma3MLP(arch, tp)
        eps = arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos, sin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(post-feed-forward-normed MLP output, residual stream before it): the next
        layer's input norm adds them."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, tp_rank=tp.rank, tp_size=tp.size
        )
        self.embed_scale = arch.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(arch, i, tp) for i in range(arch.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_local = make_rotary(arch, sliding=True)
        self.rotary_global = make_rotary(arch, sliding=False)

    def _rotary(self, rotary: RotaryEmbedding, positions: torch.Tensor):
        cos, sin = rotary(positions)
        return rotary_tables(cos, sin) if positions.device.type == "cpu" else (cos, sin)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, output_rows=None
    ) -> torch.Tensor:
        local = self._rotary(self.rotary_local, positions)
        full = self._rotary(self.rotary_global, positions)
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * _rounded(self.embed_scale, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, *(local if layer.sliding else full))
        if output_rows is not None:
            hidden, residual = hidden[output_rows], residual[output_rows]
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model; loading, tying and materializing as LlamaForCausalLM."""

    def make_model(self, arch: ArchConfig, tp: TensorParallel) -> nn.Module:
        return Gemma3Model(arch, tp)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """As LlamaForCausalLM's, soft-capped when the config sets a cap."""
        logits = super().compute_logits(hidden, float32)
        cap = self.arch.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
