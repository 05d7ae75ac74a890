"""GGUF architectures: llama.cpp's metadata keys and tensor names -> Hugging Face's.

Owns, for each ``general.architecture`` the GGUF loader reads (``GGUF_ARCHITECTURES``):
- the Hugging Face architecture it loads as, and the config.json dict its metadata spells
  (``gguf_hf_config``), which ArchConfig.from_hf_config then parses and validates like
  any config.json (``gguf_arch_config``). What llama.cpp's metadata does not say is read
  from the tensor list (Qwen2's q/k/v biases, tied embeddings, Qwen3-MoE's dense layers)
  or fixed by what llama.cpp computes for the architecture (Qwen3-MoE's softmax routing
  with renormalised top-k weights);
- whether llama.cpp's converter permuted the Q/K rows (``permutes_qk``): it does for
  ``llama`` alone (its Llama converter reorders rotary pairs; the Qwen converters write
  HF's rows as they are);
- the tensor names (``hf_name``), and the stacked expert tensors
  (``blk.N.ffn_{gate,up,down}_exps``, torch shape [experts, rows, cols]) that stand for
  one HF tensor per expert (``stacked_expert_name``).

Everything else is refused with the key's or the tensor's name: rope scaling, partial
rotary, keys and values of different widths, shared experts, another gating function.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pagoda.model.arch_config import ArchConfig

# general.architecture -> the Hugging Face architecture it loads as.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# The architectures whose converter permutes the Q and K rows for llama.cpp's rotary.
_PERMUTED_QK = frozenset({"llama"})
# llama.cpp's expert gating function ids ({arch}.expert_gating_func): 1 softmax.
_GATING_SOFTMAX = 1

# llama.cpp tensor name -> HF name; {i} is the block index.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Stacked expert tensors -> the projection each expert's slice is in HF's checkpoints.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor that has exactly one (stacked experts have one per
    expert: stacked_expert_name)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        of_its_own = " of its own (it stacks every expert's)" if _is_stacked(m) else ""
        raise ValueError(
            f"GGUF tensor {gguf_name!r} has no known Hugging Face counterpart{of_its_own}"
        )
    layer, kind, suffix = m.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"


def _is_stacked(m: re.Match | None) -> bool:
    return m is not None and m.group(2) in _EXPERT_NAMES and m.group(3) == "weight"


def stacked_expert_name(gguf_name: str) -> str | None:
    """For a stacked expert tensor, the HF name of one expert's slice with {} for the
    expert index ('blk.3.ffn_up_exps.weight' -> 'model.layers.3.mlp.experts.{}.up_proj.weight');
    None for every other tensor."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if not _is_stacked(m):
        return None
    return f"model.layers.{m.group(1)}.mlp.experts.{{}}.{_EXPERT_NAMES[m.group(2)]}.weight"


def gguf_architecture(reader) -> str:
    """general.architecture, refused unless the loader maps it."""
    name = _field(reader, "general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {name!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return name


def permutes_qk(gguf_arch: str) -> bool:
    """Whether llama.cpp's converter permuted this architecture's Q/K rows."""
    return gguf_arch in _PERMUTED_QK


def gguf_arch_config(reader) -> ArchConfig:
    """The ArchConfig of an open GGUF file (a gguf.GGUFReader), from its metadata and
    tensor list; no tensor data is read."""
    return ArchConfig.from_hf_config(gguf_hf_config(reader))


def gguf_hf_config(reader) -> dict[str, Any]:
    """The config.json dict the file's metadata and tensor list spell."""
    gguf_arch = gguf_architecture(reader)
    p = gguf_arch + "."
    tensor_names = {t.name for t in reader.tensors}
    _reject_rope_scaling(reader, p, tensor_names)
    hidden = _int(reader, p + "embedding_length")
    heads = _int(reader, p + "attention.head_count")
    head_dim = _int(reader, p + "attention.key_length", hidden // heads)
    _reject_other_widths(reader, p, head_dim)
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[gguf_arch]],
        "hidden_size": hidden,
        "num_hidden_layers": _int(reader, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(reader, p + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "vocab_size": _vocab_size(reader, p),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": _int(reader, p + "context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        # A bias tensor on q asks for attention_bias, which from_hf_config refuses for
        # every architecture but Qwen2 (whose GGUF carries its q/k/v biases).
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        # Weights are dequantized to float32; callers pick another dtype explicitly.
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
    }
    if gguf_arch == "qwen3moe":
        config.update(_moe_config(reader, p, tensor_names, config["num_hidden_layers"]))
    else:
        config["intermediate_size"] = _int(reader, p + "feed_forward_length")
    return config


def _moe_config(reader, p: str, tensor_names: set[str], num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's expert fields. llama.cpp runs every qwen3moe layer as softmax top-k
    with the chosen weights renormalised, and keys that would say otherwise are refused;
    a layer stored with a dense MLP (no router) is listed in mlp_only_layers."""
    if _int(reader, p + "expert_shared_count", 0):
        raise ValueError(f"GGUF {p}expert_shared_count > 0: shared experts are not supported")
    gating = _field(reader, p + "expert_gating_func", _GATING_SOFTMAX)
    if gating != _GATING_SOFTMAX:
        raise ValueError(
            f"GGUF {p}expert_gating_func={gating} is not supported (softmax routing only)"
        )
    expert_ff = _int(reader, p + "expert_feed_forward_length")
    return {
        "num_experts": _int(reader, p + "expert_count"),
        "num_experts_per_tok": _int(reader, p + "expert_used_count"),
        "moe_intermediate_size": expert_ff,
        "norm_topk_prob": bool(_field(reader, p + "expert_weights_norm", True)),
        # The dense layers' width; files whose layers are all sparse may omit it.
        "intermediate_size": _int(reader, p + "feed_forward_length", expert_ff),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
        ],
    }


def _reject_rope_scaling(reader, p: str, tensor_names: set[str]) -> None:
    scaling = _field(reader, p + "rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"GGUF rope scaling ({p}rope.scaling.type {scaling!r}, rope_freqs tensor: "
            f"{'rope_freqs.weight' in tensor_names}) is not supported"
        )


def _reject_other_widths(reader, p: str, head_dim: int) -> None:
    rope_dim = _int(reader, p + "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"partial rotary ({p}rope.dimension_count {rope_dim} != head_dim "
            f"{head_dim}) is not supported"
        )
    value_dim = _int(reader, p + "attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ValueError(
            f"GGUF {p}attention.value_length {value_dim} differs from key_length "
            f"{head_dim}: not supported"
        )


def _field(reader, key: str, default: Any = dataclasses.MISSING) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is dataclasses.MISSING:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return f.contents()


def _int(reader, key: str, default: Any = dataclasses.MISSING) -> int:
    value = _field(reader, key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        # Per-layer arrays (e.g. head_count_kv of hybrid models) are not supported.
        raise ValueError(f"GGUF {key} must be one integer, got {value!r}")
    return value


def _vocab_size(reader, p: str) -> int:
    """The token list's length (the spec'd source), else the vocab_size key."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    return _int(reader, p + "vocab_size")
