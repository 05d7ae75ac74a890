"""DeepSeek V2 / V3 / V3.2 decoders: multi-head latent attention, dense or MoE MLPs.

``DeepseekV2ForCausalLM`` serves both versions (``DeepseekV3ForCausalLM`` is the same
code; where they differ, the config says how: V2's softmax greedy / group-limited
routing, V3's sigmoid noaux_tc routing with its score-correction bias, both in
arch.moe). Layers are the Llama layout (pre-norm, residual fused into the next norm)
with MLAAttention (pagoda/model/layers/mla.py) instead of grouped-query attention;
the feed-forward block is the dense gate/up/down MLP (LlamaMLP) on the first
first_k_dense_replace layers and DeepseekMoE (routed + shared experts,
pagoda/model/layers/moe/deepseek_moe.py) on the layers is_moe_layer names.
``DeepseekV32ForCausalLM`` is V3 with DeepSeek Sparse Attention: every MLAAttention
holds a lightning indexer (pagoda/model/layers/dsa.py), whose keys take pool layers
num_hidden_layers .. 2 * num_hidden_layers - 1.

Loading (``load_weights``) takes Hugging Face names, and:
- skips the multi-token-prediction layers (index >= num_hidden_layers; V3 ships
  num_nextn_predict_layers of them for speculative decoding, loaded only by the mtp
  speculative method: pagoda/model/deepseek_mtp.py), logging once how many tensors
  it skipped;
- when the checkpoint rotates interleaved pairs (mla.rope_interleave), permutes the
  rotary rows of q_proj / q_b_proj (per head) and of kv_a_proj_with_mqa into the
  half-split layout apply_rotary uses (rotary.interleaved_to_half);
- maps per-expert tensors (mlp.experts.{e}.{gate,up,down}_proj) into the fused expert
  weights, and folds gate_proj / up_proj (dense and shared experts) into gate_up_proj.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import default_weight_loader, materialize_module
from pagoda.model.layers.mla import MLAAttention
from pagoda.model.layers.mlp import LlamaMLP
from pagoda.model.layers.moe.deepseek_moe import DeepseekMoE, is_moe_layer
from pagoda.model.layers.moe.fused_moe import map_expert_weight_name
from pagoda.model.layers.rotary import RotaryEmbedding, interleaved_to_half
from pagoda.model.parallel import SINGLE_RANK, TensorParallel

logger = logging.getLogger(__name__)

# (merged param, checkpoint projection, shard id)
_STACKED_PARAMS = (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = MLAAttention(arch, layer_idx, tp)
        if is_moe_layer(arch, layer_idx):
            # Built on the meta device; materialize() gives the experts the model's dtype
            # (the router keeps float32).
            self.mlp = DeepseekMoE(arch, tp, torch.get_default_dtype())
        else:
            self.mlp = LlamaMLP(arch, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it), as LlamaDecoderLayer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, tp_rank=tp.rank, tp_size=tp.size
        )
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(arch, i, tp) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Rotary over the qk_rope_head_dim part only (arch.head_dim for MLA).
        self.rotary_emb = RotaryEmbedding(
            arch.mla.qk_rope_head_dim,
            arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cos, sin = self.rotary_emb(positions)
        hidden, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos, sin, output_rows if i == last else None)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        if arch.mla is None:
            raise ValueError(f"{arch.architecture} needs an MLA config")
        self.arch, self.tp = arch, tp
        self.model = DeepseekModel(arch, tp)
        self.lm_head = ParallelLMHead(
            arch.vocab_size, arch.hidden_size, tp_rank=tp.rank, tp_size=tp.size
        )
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def materialize(
        self, device: torch.device | str, dtype: torch.dtype | None = None
    ) -> DeepseekV2ForCausalLM:
        """As LlamaForCausalLM.materialize: storage on device, then the rotary cache."""
        materialize_module(self, device, dtype)
        self.model.rotary_emb.reset_cache()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, output_rows)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """As LlamaForCausalLM.compute_logits."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads (HF name, full tensor) pairs; raises on unknown names and on parameters
        no tensor reached. Returns the loaded parameter names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in self._relayout(weights):
            name, shard_id = _map_hf_name(hf_name)
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} matches no parameter of "
                    f"{self.arch.architecture}"
                )
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"loading {hf_name!r}: {e}") from e
            loaded.add(name if shard_id is None else f"{name}[{shard_id}]")
        missing = [e for name in params for e in self._expected_loads(name) if e not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} weights: {shown}")
        return loaded

    def _relayout(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as the parameters want them: MTP layers and rotary
        buffers dropped, interleaved rotary rows permuted."""
        arch, mla = self.arch, self.arch.mla
        skipped = 0
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and arch.tie_word_embeddings:
                continue
            match = _LAYER_INDEX.match(name)
            if match and int(match.group(1)) >= arch.num_hidden_layers:
                skipped += 1
                continue
            if mla.rope_interleave:
                if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
                    tensor = _rotary_rows_to_half(
                        name, tensor, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.qk_head_dim
                    )
                elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
                    tensor = _rotary_rows_to_half(
                        name, tensor, mla.qk_rope_head_dim, mla.kv_lora_rank, mla.latent_dim
                    )
            yield name, tensor
        if skipped:
            logger.info(
                "skipped %d checkpoint tensors of layers >= %d (multi-token "
                "prediction layers, not run by Pagoda)",
                skipped,
                arch.num_hidden_layers,
            )

    def _expected_loads(self, name: str) -> list[str]:
        """What load_weights records once the checkpoint filled parameter name."""
        if name.endswith(("experts.w13_weight", "experts.w2_weight")):
            experts = self.get_submodule(name.rsplit(".", 1)[0])
            return [f"{name}[{shard}]" for shard in experts.expected_shard_ids(name)]
        shards = [shard for merged, _, shard in _STACKED_PARAMS if f".{merged}." in name]
        return [f"{name}[{s}]" for s in shards] or [name]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """The same decoder; V3's differences (sigmoid noaux_tc routing, rope_interleave
    flag) come from its config."""


class DeepseekV32ForCausalLM(DeepseekV2ForCausalLM):
    """V3 with sparse attention; the indexer comes from the config's index_* fields
    (arch.mla.indexer)."""


# Rows of an FP8 checkpoint's weight that share one scale (its 128 x 128 blocks).
_FP8_SCALE_BLOCK = 128


def _rotary_rows_to_half(name, tensor, rotary_dim: int, row_start: int, group: int):
    """interleaved_to_half, refusing an FP8 weight whose rotary rows of a group straddle
    two scale blocks: permuted rows must keep the scale they were quantized with."""
    if tensor.dtype == torch.float8_e4m3fn:
        for first in range(row_start, tensor.shape[0], group):
            last = first + rotary_dim - 1
            if first // _FP8_SCALE_BLOCK != last // _FP8_SCALE_BLOCK:
                raise ValueError(
                    f"{name}: FP8 rotary rows {first}..{last} cross a "
                    f"{_FP8_SCALE_BLOCK}-row scale block; they cannot be permuted"
                )
    return interleaved_to_half(tensor, rotary_dim, row_start, group)


def _map_hf_name(hf_name: str):
    expert = map_expert_weight_name(hf_name)  # before gate_proj/up_proj folding
    if expert is not None:
        return expert
    for merged, proj, shard_id in _STACKED_PARAMS:
        if f".{proj}." in hf_name:
            return hf_name.replace(f".{proj}.", f".{merged}."), shard_id
    return hf_name, None
