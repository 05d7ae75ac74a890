"""DeepSeek V3-family multi-token prediction (MTP): the extra layer a checkpoint ships
after its decoder (``num_nextn_predict_layers`` of them, names ``model.layers.{L}.*``
with L = num_hidden_layers), as a module, and its loading.

At position i the layer takes the target's final (normed) hidden state h_i and the
embedding e of the token at position i + 1, and guesses the token at i + 2:

    x  = eh_proj(cat([enorm(e), hnorm(h_i)]))
    h' = decoder block L (MLA attention at position i, MoE or dense MLP as index L says)
    logits = shared_head.head(shared_head.norm(h'))

h' (the block's output plus its residual, before shared_head.norm) stands in for the
target's hidden state when the layer is applied again for a further guess. The token
embedding is the target's (the checkpoint's own copy, ``model.layers.{L}.embed_tokens``,
is the same matrix and is not loaded): the caller embeds the tokens.

The block's attention layers keep the KV of their own pool layers: the loader numbers
them from `first_layer` (the target's pool layers come first), as a draft model's are.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagoda.model.arch_config import ArchConfig
from pagoda.model.deepseek import DeepseekDecoderLayer, DeepseekV2ForCausalLM
from pagoda.model.layers.attention import Attention, reset_kv_scales
from pagoda.model.layers.embedding import ParallelLMHead
from pagoda.model.layers.layernorm import RMSNorm
from pagoda.model.layers.linear import materialize_module
from pagoda.model.layers.mla import replicated_linear
from pagoda.model.layers.rotary import RotaryEmbedding, interleaved_to_half
from pagoda.model.loader.safetensors import INDEX_FILE, safetensors_files
from pagoda.model.parallel import SINGLE_RANK, TensorParallel

logger = logging.getLogger(__name__)

MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


class SharedHead(nn.Module):
    """The MTP layer's output norm and LM head (checkpoint names shared_head.*)."""

    def __init__(self, arch: ArchConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.head = ParallelLMHead(
            arch.vocab_size, arch.hidden_size, tp_rank=tp.rank, tp_size=tp.size
        )


class DeepseekMTP(DeepseekDecoderLayer):
    """MTP layer L: a DeepseekDecoderLayer (its parameters carry the checkpoint's names
    under ``model.layers.{L}.``) with the embedding / hidden-state input projection
    and its own output head."""

    # The loading of the target model, over this layer's parameters.
    load_weights = DeepseekV2ForCausalLM.load_weights
    _expected_loads = DeepseekV2ForCausalLM._expected_loads

    def __init__(self, arch: ArchConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        layer_idx = arch.num_hidden_layers
        super().__init__(arch, layer_idx, tp)
        self.arch, self.layer_idx = arch, layer_idx
        self.enorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hnorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Every rank holds it whole: its input is the replicated hidden state.
        self.eh_proj = replicated_linear(2 * arch.hidden_size, arch.hidden_size)
        self.shared_head = SharedHead(arch, tp)
        self.rotary_emb = RotaryEmbedding(
            arch.mla.qk_rope_head_dim,
            arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
        )

    def materialize(self, device: torch.device | str, dtype: torch.dtype | None = None):
        materialize_module(self, device, dtype)
        self.rotary_emb.reset_cache()
        reset_kv_scales(self)
        return self

    def renumber_attention(self, first_layer: int) -> None:
        """Its attention layers (the latent cache, and a sparse indexer's keys when
        there is one) take pool layers first_layer, first_layer + 1, ... in order."""
        for offset, layer in enumerate(self.attention_layers()):
            layer.layer_idx = first_layer + offset

    def attention_layers(self) -> list[Attention]:
        """Its attention layers in pool order."""
        return sorted(
            (m for m in self.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
        )

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list:
        """Its pool layers' specs, in order (they follow the target's)."""
        return [layer.get_kv_cache_spec(block_size, dtype) for layer in self.attention_layers()]

    def forward(  # type: ignore[override]
        self, input_embeds: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor
    ) -> torch.Tensor:
        """h' [T, hidden] of rows whose next tokens are embedded in input_embeds and
        whose previous hidden states (the target's, or this layer's own h') are
        prev_hidden; runs inside the forward context (its attention stores and reads
        its own pool layers)."""
        x = torch.cat([self.enorm(input_embeds), self.hnorm(prev_hidden)], dim=-1)
        cos, sin = self.rotary_emb(positions)
        hidden, residual = super().forward(self.eh_proj(x), None, cos, sin)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        logits = self.shared_head.head(self.shared_head.norm(hidden))
        return logits.float() if float32 else logits

    def _relayout(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Layer L's tensors under their parameter names (the layer prefix dropped; its
        embed_tokens copy left out), interleaved rotary rows permuted as the target's
        loader does."""
        prefix = f"model.layers.{self.layer_idx}."
        mla = self.arch.mla
        for name, tensor in weights:
            if not name.startswith(prefix):
                continue
            name = name[len(prefix) :]
            if name.startswith("embed_tokens.") or name.endswith("rotary_emb.inv_freq"):
                continue
            if mla.rope_interleave:
                if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
                    tensor = interleaved_to_half(
                        tensor, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.qk_head_dim
                    )
                elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
                    tensor = interleaved_to_half(
                        tensor, mla.qk_rope_head_dim, mla.kv_lora_rank, mla.latent_dim
                    )
            yield name, tensor


def num_mtp_layers(model_dir: str | Path) -> int:
    """num_nextn_predict_layers of a Hugging Face directory's config.json (0: none)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return 0
    config = json.loads(config_file.read_text())
    return int(config.get("num_nextn_predict_layers") or 0)


def check_mtp_target(model_path: str, arch: ArchConfig, load_format: str) -> None:
    """Refuses, with the reason, a target whose checkpoint has no MTP layer to load."""
    what = "speculative_config method 'mtp' needs a checkpoint with multi-token prediction layers"
    if arch.architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"{what} (DeepSeek V3 family); {arch.architecture} has none")
    if load_format not in ("auto", "safetensors") or not Path(model_path).is_dir():
        raise ValueError(f"{what}, read from a Hugging Face directory; got {model_path!r}")
    if num_mtp_layers(model_path) < 1:
        raise ValueError(
            f"{what}; {model_path}/config.json has num_nextn_predict_layers missing or 0"
        )
    if arch.quantization_config is not None:
        method = arch.quantization_config.get("quant_method", "?")
        raise ValueError(
            f"speculative_config method 'mtp' does not load quantized MTP layers yet "
            f"(this checkpoint is {method!r}); use another method or a bf16 checkpoint"
        )


def _mtp_tensors(model_dir: Path, layer_idx: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors of layer layer_idx, from the shards that hold them."""
    prefix = f"model.layers.{layer_idx}."
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for n, f in weight_map.items() if n.startswith(prefix)})
    else:
        files = safetensors_files(model_dir)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


def load_deepseek_mtp(
    model_path: str,
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    first_layer: int,
    tp: TensorParallel = SINGLE_RANK,
    load_format: str = "auto",
) -> DeepseekMTP:
    """The checkpoint's first MTP layer (index arch.num_hidden_layers), its attention
    renumbered to pool layers from first_layer."""
    check_mtp_target(model_path, arch, load_format)
    with torch.device("meta"):
        mtp = DeepseekMTP(arch, tp)
    mtp.materialize(device, dtype)
    mtp.load_weights(_mtp_tensors(Path(model_path), arch.num_hidden_layers))
    mtp.renumber_attention(first_layer)
    if num_mtp_layers(model_path) > 1:
        logger.info(
            "%s has %d MTP layers; the first one drafts (applied again for later drafts)",
            model_path,
            num_mtp_layers(model_path),
        )
    return mtp.eval()
