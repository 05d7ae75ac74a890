"""Loaders, ArchConfig parsing, presets and TP-ready weight loaders (no HF reference needed)."""

from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pagoda.model.arch_config import SUPPORTED_ARCHITECTURES, ArchConfig
from pagoda.model.dtypes import resolve_dtype
from pagoda.model.layers.embedding import VocabParallelEmbedding
from pagoda.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.model.llama import LlamaForCausalLM
from pagoda.model.loader import build_model, detect_load_format, load_model
from pagoda.model.loader.gguf import hf_name, unpermute_qk
from pagoda.model.presets import get_preset
from pagoda.model.registry import get_model_class

torch.set_num_threads(1)

HF_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128,
    "torch_dtype": "float32",
}


def write_hf_dir(path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def to_hf_checkpoint(model, arch: ArchConfig) -> dict[str, torch.Tensor]:
    """A Pagoda model's weights under Hugging Face names (merged params split back)."""
    hf = {}
    for name, t in state_of(model).items():
        if "qkv_proj" in name:
            parts = zip(
                ("q_proj", "k_proj", "v_proj"), t.split([arch.q_size, arch.kv_size, arch.kv_size])
            )
            hf |= {name.replace("qkv_proj", proj): x.contiguous() for proj, x in parts}
        elif "gate_up_proj" in name:
            parts = zip(("gate_proj", "up_proj"), t.chunk(2))
            hf |= {name.replace("gate_up_proj", proj): x.contiguous() for proj, x in parts}
        else:
            hf[name] = t
    return hf


# ---- format detection ----


def test_auto_detects_gguf_file_and_directory(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert detect_load_format(str(tmp_path / "m.gguf")) == "gguf"
    assert detect_load_format(str(tmp_path)) == "gguf"
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files"):
        detect_load_format(str(tmp_path))


def test_auto_detects_safetensors_dir(tmp_path):
    model, arch = load_model("tiny-llama", load_format="dummy", seed=3)
    write_hf_dir(tmp_path, HF_LLAMA, to_hf_checkpoint(model, arch))
    assert detect_load_format(str(tmp_path)) == "safetensors"
    loaded, arch = load_model(str(tmp_path))
    assert arch.architecture == "LlamaForCausalLM"
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_auto_rejects_preset_and_unknown_paths(tmp_path):
    with pytest.raises(ValueError, match="load_format='dummy'"):
        detect_load_format("tiny-llama")
    (tmp_path / "config.json").write_text("{}")  # config without weights: not a model dir
    with pytest.raises(
        ValueError, match=r"looked for a \.gguf file.*config\.json and \*\.safetensors"
    ):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="load_format 'pt'"):
        load_model(str(tmp_path), load_format="pt")


# ---- ArchConfig parsing and rejections ----


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError) as err:
        ArchConfig.from_hf_config({**HF_LLAMA, "architectures": ["GPT2LMHeadModel"]})
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


@pytest.mark.parametrize(
    "rope_fields",
    [
        {"rope_scaling": {"type": "longrope", "factor": 4.0}},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
    ],
)
def test_unsupported_rope_type_rejected(rope_fields):
    with pytest.raises(
        ValueError, match="unsupported rope_scaling type .*supported: default, llama3, yarn"
    ):
        ArchConfig.from_hf_config({**HF_LLAMA, **rope_fields})


def test_yarn_without_its_original_length_rejected():
    with pytest.raises(ValueError, match="yarn lacks original_max_position_embeddings"):
        ArchConfig.from_hf_config({**HF_LLAMA, "rope_scaling": {"type": "yarn", "factor": 4.0}})


def test_rope_fields_in_both_transformers_layouts():
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    v4 = ArchConfig.from_hf_config(
        {**HF_LLAMA, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    v5 = ArchConfig.from_hf_config(
        {**HF_LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert v4 == v5
    assert v4.rope_theta == 5e5 and v4.rope_scaling == {"rope_type": "llama3", **scaling}
    plain = ArchConfig.from_hf_config(
        {**HF_LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    with pytest.raises(ValueError, match="lacks high_freq_factor"):
        ArchConfig.from_hf_config(
            {
                **HF_LLAMA,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 8,
                },
            }
        )


def test_other_unsupported_fields_rejected():
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        ArchConfig.from_hf_config({**HF_LLAMA, "hidden_act": "gelu"})
    mistral = {**HF_LLAMA, "architectures": ["MistralForCausalLM"]}
    assert ArchConfig.from_hf_config({**mistral, "sliding_window": 4096}).sliding_window == 4096
    assert ArchConfig.from_hf_config({**mistral, "sliding_window": None}).sliding_window is None
    qwen2 = {**HF_LLAMA, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ArchConfig.from_hf_config({**qwen2, "use_sliding_window": False}).attention_bias
    with pytest.raises(ValueError, match="sliding_window"):
        ArchConfig.from_hf_config({**qwen2, "use_sliding_window": True})
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        ArchConfig.from_hf_config({**HF_LLAMA, "mlp_bias": True})
    with pytest.raises(
        ValueError, match="attention_bias=true is not supported for LlamaForCausalLM"
    ):
        ArchConfig.from_hf_config({**HF_LLAMA, "attention_bias": True})


def test_quantization_config_is_kept_for_the_loader():
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    arch = ArchConfig.from_hf_config({**HF_LLAMA, "quantization_config": fp8})
    assert arch.quantization_config == fp8
    assert (
        ArchConfig.from_hf_config({**HF_LLAMA, "quantization_config": None}).quantization_config
        is None
    )
    with pytest.raises(ValueError, match="must be an object with a quant_method"):
        ArchConfig.from_hf_config({**HF_LLAMA, "quantization_config": {"bits": 4}})


def test_hf_config_defaults_and_flags():
    arch = ArchConfig.from_hf_config({**HF_LLAMA, "eos_token_id": [5, 7]})
    assert arch.head_dim == 16 and arch.eos_token_ids == (5, 7)
    v5_llama = {k: v for k, v in HF_LLAMA.items() if k != "torch_dtype"}  # v5 says "dtype"
    qwen3 = ArchConfig.from_hf_config(
        {**v5_llama, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "dtype": "bfloat16"}
    )
    assert (qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim, qwen3.torch_dtype) == (
        True,
        False,
        32,
        "bfloat16",
    )
    assert (
        ArchConfig.from_hf_config(
            {k: v for k, v in HF_LLAMA.items() if k != "architectures"} | {"model_type": "qwen2"}
        ).architecture
        == "Qwen2ForCausalLM"
    )


# ---- presets, meta build, dummy weights ----


def count_params(arch: ArchConfig) -> int:
    """Parameter count from the shape alone (independent of the model code)."""
    h, d = arch.hidden_size, arch.head_dim
    attn = h * arch.q_size + 2 * h * arch.kv_size + arch.q_size * h
    mlp = 3 * h * arch.intermediate_size
    norms = 2 * h + (2 * d if arch.qk_norm else 0)
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return arch.num_hidden_layers * (attn + mlp + norms) + embeddings + h


@pytest.mark.parametrize(
    "preset,expected",
    [("llama-3.1-8b", 8_030_261_248), ("qwen3-8b", 8_190_735_360), ("smollm2-135m", 134_515_008)],
)
def test_preset_parameter_counts_on_meta(preset, expected):
    arch = get_preset(preset)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    assert count_params(arch) == expected
    assert sum(p.numel() for p in model.parameters()) == expected


def test_dummy_weights_deterministic_by_seed():
    a, _ = load_model("tiny-llama", load_format="dummy", seed=0)
    b, _ = load_model("tiny-llama", load_format="dummy", seed=0)
    c, _ = load_model("tiny-llama", load_format="dummy", seed=1)
    sa, sb, sc = state_of(a), state_of(b), state_of(c)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(64))
    w = sa["model.layers.0.mlp.gate_up_proj.weight"]
    assert abs(w.std().item() - 0.02) < 0.002


def test_dummy_dtype_tying_and_rotary_cache():
    model, arch = load_model("tiny-qwen3", load_format="dummy", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying survives materialize
    rope = model.model.rotary_emb
    assert rope.cos_cache.dtype == torch.float32
    assert torch.allclose(rope.cos_cache[3, 1], torch.cos(torch.tensor(3.0) * 1e6 ** (-2 / 32)))
    assert model.model.layers[0].self_attn.qkv_proj.weight.weight_loader is not None
    # No reference cycles: dropping the model frees its memory without the gc.
    dropped = weakref.ref(model.model.layers[0].self_attn.qkv_proj.weight)
    gc.disable()
    try:
        del model
        assert dropped() is None
    finally:
        gc.enable()
    auto, _ = load_model("tiny-llama", load_format="dummy")
    assert next(auto.parameters()).dtype == torch.float32  # the preset's torch_dtype
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model("tiny-llama", load_format="dummy", dtype="int8")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        load_model("nope", load_format="dummy")


def test_resolve_dtype_one_rule_for_engine_and_loaders():
    # The engine resolves "auto" by device before any checkpoint is read; loaders by checkpoint.
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", "cuda", checkpoint_dtype="float16") is torch.float16
    assert resolve_dtype("bf16", "cpu", checkpoint_dtype="float32") is torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu", checkpoint_dtype="float32") is torch.float16
    with pytest.raises(ValueError, match="unsupported dtype torch.int8"):
        resolve_dtype(torch.int8, "cpu")
    with pytest.raises(ValueError, match="unsupported dtype 'int8'; supported: auto, float32"):
        resolve_dtype("int8", "cpu")


# ---- load_weights strictness ----


def test_load_weights_rejects_unknown_missing_and_misshapen():
    arch = get_preset("tiny-llama")
    model = build_model(arch, torch.float32, "cpu")
    source = load_model("tiny-llama", load_format="dummy")[0]
    full, hf = state_of(source), to_hf_checkpoint(source, arch)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # skipped
    model.load_weights(hf.items())
    assert all(torch.equal(model.state_dict()[k], full[k]) for k in full)
    with pytest.raises(ValueError, match="'model.extra.weight' matches no parameter"):
        model.load_weights([*hf.items(), ("model.extra.weight", torch.zeros(1))])
    partial = {k: v for k, v in hf.items() if "layers.1.self_attn.v_proj" not in k}
    with pytest.raises(
        ValueError, match=r"lacks 1 weights: model.layers.1.self_attn.qkv_proj.weight\[v\]"
    ):
        model.load_weights(partial.items())
    bad = {**hf, "model.norm.weight": torch.ones(65)}
    misshapen = r"'model.norm.weight'.*\(65,\) does not match parameter shape \(64,\)"
    with pytest.raises(ValueError, match=misshapen):
        model.load_weights(bad.items())


# ---- tensor-parallel weight loaders (tp_size > 1 shards, loaded on one process) ----


def test_qkv_loader_shards_by_heads_and_replicates_kv():
    q, k, v = torch.randn(8 * 4, 16), torch.randn(2 * 4, 16), torch.randn(2 * 4, 16)
    layer = QKVParallelLinear(16, head_dim=4, num_heads=8, num_kv_heads=2, tp_rank=3, tp_size=4)
    for shard, t in (("q", q), ("k", k), ("v", v)):
        layer.weight.weight_loader(layer.weight, t, shard)
    # rank 3 of 4: q heads 6,7; kv heads shared by ranks 2,3 -> kv head 1.
    assert torch.equal(layer.weight, torch.cat([q[24:32], k[4:8], v[4:8]]))
    with pytest.raises(ValueError, match="shard_id 'q', 'k' or 'v'"):
        layer.weight.weight_loader(layer.weight, q, 0)


def test_merged_row_and_vocab_loaders_take_their_slice():
    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    merged = MergedColumnParallelLinear(6, [8, 8], tp_rank=1, tp_size=2)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    assert torch.equal(merged.weight, torch.cat([gate[4:], up[4:]]))
    down = torch.randn(6, 8)
    row = RowParallelLinear(8, 6, tp_rank=1, tp_size=2)
    row.weight.weight_loader(row.weight, down)
    assert torch.equal(row.weight, down[:, 4:])
    with pytest.raises(RuntimeError, match="init_distributed"):  # no group joined
        row(torch.randn(2, 4))
    table = torch.randn(5, 3)
    emb = VocabParallelEmbedding(5, 3, tp_rank=1, tp_size=2)
    emb.weight.weight_loader(emb.weight, table)
    assert torch.equal(emb.weight, torch.cat([table[3:], torch.zeros(1, 3)]))  # padded row
    with pytest.raises(ValueError, match="not divisible by tp_size"):
        RowParallelLinear(7, 6, tp_size=2)


# ---- GGUF name mapping and Q/K permutation ----


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written from its description)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)])
def test_unpermute_inverts_llama_cpp_permutation(shape):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head=3)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, n_head=3), w)


def test_gguf_names_map_to_hf():
    assert hf_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight' has no known"):
        hf_name("blk.0.ffn_gate_exps.weight")
