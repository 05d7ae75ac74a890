"""Gemma 3 text (Gemma3ForCausalLM) against transformers, in float32, on a tiny random
checkpoint saved as safetensors: 5 local (window 5) : 1 global layers, two rotary bases
with linear scaling on the global layers, query_pre_attn_scalar, final logit
soft-capping, zero-centred norms. Logits through chunked prefill across the window,
decodes past it, a batch mixing both, and greedy generation through the LLM engine;
also the config parsing and what it refuses."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_compare import PagedRunner, hf_greedy_recomputed, hf_logits, randomize
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from pagoda import LLM, SamplingParams
from pagoda.model.arch_config import ArchConfig
from pagoda.model.loader import load_model

torch.set_num_threads(1)

WINDOW = 5
TOKENS = torch.randint(3, 512, (36,), generator=torch.Generator().manual_seed(5)).tolist()
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=512,
    max_position_embeddings=256,
)


def make_gemma(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    fields = dict(
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0},
        },
    )
    config = Gemma3TextConfig(**SHAPE, **{**fields, **overrides})
    config._attn_implementation = "eager"
    model = Gemma3ForCausalLM(config)
    randomize(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    hf = make_gemma()
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


def runner_for(model, arch) -> PagedRunner:
    return PagedRunner(model, arch)  # its backend takes the shape's query_pre_attn_scalar scale


def run_chunks(model, arch, sizes: list[int], tokens=TOKENS) -> torch.Tensor:
    runner, out, start = runner_for(model, arch), [], 0
    for size in sizes:
        out.append(runner.step({"r": tokens[start : start + size]})["r"])
        start += size
    assert start == len(tokens)
    return torch.cat(out)


def test_config_parsing():
    hf = make_gemma().config.to_dict()
    arch = ArchConfig.from_hf_config(hf)
    assert arch.architecture == "Gemma3ForCausalLM"
    assert arch.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert [arch.layer_sliding_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert (arch.rope_theta, arch.local_rope_theta) == (50_000.0, 1_000.0)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert arch.attention_shape().scale == pytest.approx(24**-0.5)
    assert arch.final_logit_softcapping == 3.0 and arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.tie_word_embeddings
    # The Hub's older fields: rope_theta, rope_local_base_freq, rope_scaling, a pattern.
    old = {k: v for k, v in hf.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=3,
    )
    arch = ArchConfig.from_hf_config(old)
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert [arch.layer_sliding_window(i) for i in range(6)] == [WINDOW, WINDOW, None] * 2


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types must name 6"),
        ({"layer_types": ["chunked_attention"] * 6}, "layer_types must name 6"),
        ({"hidden_activation": "silu"}, "unsupported hidden_act"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
            "unsupported rope_scaling",
        ),
    ],
)
def test_config_refuses_what_is_not_implemented(change, message):
    hf = {**make_gemma().config.to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config(hf)


def test_linear_rope_is_refused_for_llama():
    hf = make_gemma().config.to_dict()
    llama = {
        k: hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "num_key_value_heads", "intermediate_size", "vocab_size")
    }  # fmt: skip
    llama.update(architectures=["LlamaForCausalLM"], rope_scaling={"type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="linear is not supported for LlamaForCausalLM"):
        ArchConfig.from_hf_config(llama)


def test_logits_match_hf_through_chunks_and_decodes(checkpoint):
    path, hf = checkpoint
    model, arch = load_model(path, dtype="float32")
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [WINDOW] * 5 + [None]
    expected = hf_logits(hf, TOKENS)
    assert expected.abs().max() <= 3.0  # soft-capped
    wide = hf_logits(make_gemma(sliding_window=64), TOKENS)
    assert (expected[WINDOW:] - wide[WINDOW:]).abs().max() > 1e-2  # the window matters
    for sizes in ([36], [4, 7, 25], [6] * 5 + [1] * 6, [8] + [1] * 28):
        got = run_chunks(model, arch, sizes)
        assert (got - expected).abs().max().item() < 1e-4, sizes


def test_batch_of_chunk_and_decodes_matches_hf(checkpoint):
    path, hf = checkpoint
    model, arch = load_model(path, dtype="float32")
    a, b = TOKENS, TOKENS[::-1][:14]
    runner = runner_for(model, arch)
    steps = [(a[:9], b[:8])] + [(a[9 + 3 * i : 12 + 3 * i], b[8 + i : 9 + i]) for i in range(6)]
    got = runner.run([{"a": chunk_a, "b": chunk_b} for chunk_a, chunk_b in steps])
    assert (got["a"] - hf_logits(hf, a[:27])).abs().max().item() < 1e-4
    assert (got["b"] - hf_logits(hf, b)).abs().max().item() < 1e-4


def test_engine_greedy_matches_hf(checkpoint):
    path, hf = checkpoint
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        block_size=8,
        num_gpu_blocks_override=8,
        max_num_batched_tokens=8,
        max_num_seqs=3,
    )
    try:
        gen = torch.Generator().manual_seed(6)
        prefix = torch.randint(3, 512, (8,), generator=gen).tolist()
        prompts = [prefix + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 2, 5)]
        params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy_recomputed(hf, prompt, 14)
    finally:
        llm.shutdown()
