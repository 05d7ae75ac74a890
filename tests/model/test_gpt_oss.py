"""gpt-oss (GptOssForCausalLM) against transformers, in float32, on a tiny random
checkpoint saved as safetensors: alternating sliding (window 5) / full layers,
attention sinks, q/k/v/o biases, YaRN rotary, a biased top-k router and experts with
biases and the clamped SwiGLU (a limit small enough to clamp). Logits through chunked
prefill across the window, decodes past it, a batch mixing both, and greedy
generation through the LLM engine; also the config parsing and what it refuses."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_compare import PagedRunner, hf_greedy_recomputed, hf_logits, randomize
from transformers import GptOssConfig
from transformers import GptOssForCausalLM as HFGptOss

from pagoda import LLM, SamplingParams
from pagoda.model.arch_config import ArchConfig
from pagoda.model.loader import load_model

torch.set_num_threads(1)

WINDOW = 5
TOKENS = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=256,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}


def make_gpt_oss(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    fields = dict(sliding_window=WINDOW, swiglu_limit=0.5, rope_parameters=dict(YARN))
    config = GptOssConfig(**SHAPE, **{**fields, **overrides})
    config._attn_implementation = "eager"
    model = HFGptOss(config)
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks of the scores' size: they matter
            layer.self_attn.sinks.copy_(torch.randn(4, generator=gen) * 1.5)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = make_gpt_oss()
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


def run_chunks(model, arch, sizes: list[int], tokens=TOKENS) -> torch.Tensor:
    runner, out, start = PagedRunner(model, arch), [], 0
    for size in sizes:
        out.append(runner.step({"r": tokens[start : start + size]})["r"])
        start += size
    assert start == len(tokens)
    return torch.cat(out)


def test_config_parsing():
    hf = make_gpt_oss().config.to_dict()
    arch = ArchConfig.from_hf_config(hf)
    assert arch.architecture == "GptOssForCausalLM"
    assert [arch.layer_sliding_window(i) for i in range(4)] == [WINDOW, None] * 2
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_scaling["factor"] == 4.0
    assert arch.attention_bias and arch.quantization_config is None
    experts = arch.gpt_oss
    assert (experts.num_experts, experts.num_experts_per_tok) == (4, 2)
    assert (experts.swiglu_alpha, experts.swiglu_limit, experts.mxfp4) == (1.702, 0.5, False)
    # Without layer_types: sliding and full alternate, sliding first (transformers' default).
    arch = ArchConfig.from_hf_config({**hf, "layer_types": None})
    assert arch.layer_types == ("sliding_attention", "full_attention") * 2
    mx = {**hf, "quantization_config": {"quant_method": "mxfp4"}}
    arch = ArchConfig.from_hf_config(mx)
    assert arch.gpt_oss.mxfp4 and arch.quantization_config is None


@pytest.mark.parametrize(
    "change,message",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "not supported for gpt-oss"),
        ({"attention_bias": False}, "attention_bias=false"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must name 4"),
    ],
)
def test_config_refuses_what_is_not_implemented(change, message):
    hf = {**make_gpt_oss().config.to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        ArchConfig.from_hf_config(hf)


def test_logits_match_hf_through_chunks_and_decodes(checkpoint):
    path, hf = checkpoint
    model, arch = load_model(path, dtype="float32")
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [WINDOW, None] * 2
    sinks = model.model.layers[1].self_attn.attn.sinks
    assert sinks.dtype == torch.float32
    assert torch.equal(sinks, hf.model.layers[1].self_attn.sinks)
    expected = hf_logits(hf, TOKENS)
    wide = hf_logits(make_gpt_oss(sliding_window=64), TOKENS)
    assert (expected[WINDOW:] - wide[WINDOW:]).abs().max() > 1e-2  # the window matters
    for sizes in ([30], [4, 7, 19], [6] * 4 + [1] * 6, [8] + [1] * 22):
        got = run_chunks(model, arch, sizes)
        assert (got - expected).abs().max().item() < 1e-4, sizes


def test_sinks_and_clamp_matter(checkpoint):
    """The checkpoint's sinks and clamp change the logits: a check that both are on."""
    _, hf = checkpoint
    expected = hf_logits(hf, TOKENS)
    no_clamp = hf_logits(make_gpt_oss(swiglu_limit=100.0), TOKENS)
    assert (expected - no_clamp).abs().max() > 1e-2
    other = make_gpt_oss()
    with torch.no_grad():
        for layer in other.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no sink
    assert (expected - hf_logits(other, TOKENS)).abs().max() > 1e-2


def test_batch_of_chunk_and_decodes_matches_hf(checkpoint):
    path, hf = checkpoint
    model, arch = load_model(path, dtype="float32")
    a, b = TOKENS, TOKENS[::-1][:12]
    runner = PagedRunner(model, arch)
    steps = [(a[:9], b[:7])] + [(a[9 + 3 * i : 12 + 3 * i], b[7 + i : 8 + i]) for i in range(5)]
    got = runner.run([{"a": chunk_a, "b": chunk_b} for chunk_a, chunk_b in steps])
    assert (got["a"] - hf_logits(hf, a[:24])).abs().max().item() < 1e-4
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
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy_recomputed(hf, prompt, 10)
    finally:
        llm.shutdown()


def test_dense_experts_match_sparse(checkpoint):
    """The graph-safe path (every expert, weighted) sums what the sparse one does."""
    path, _ = checkpoint
    model, _ = load_model(path, dtype="float32")
    moe = model.model.layers[0].mlp
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(8))
    weights, ids = moe.router(x)
    sparse = moe.experts.forward_sparse(x, weights, ids)
    dense = moe.experts.forward_dense(x, weights, ids)
    torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5)
