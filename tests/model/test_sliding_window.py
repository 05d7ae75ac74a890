"""Mistral with a sliding window against transformers, in float32: the window on every
layer, through chunked prefill whose chunks cross the window, decode steps past it, a
batch mixing both, and greedy generation through the LLM engine (chunked prefill,
prefix-cache hits, preemption). Windows are shorter than the prompts, so the window
changes every logit past it. Also the config parsing of windows."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_compare import TINY, PagedRunner, hf_greedy_recomputed, hf_logits, randomize
from transformers import MistralConfig, MistralForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.model.arch_config import ArchConfig
from pagoda.model.loader import load_model

torch.set_num_threads(1)

WINDOW = 6
TOKENS = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(3)).tolist()


def make_mistral(seed: int = 0, window: int | None = WINDOW):
    torch.manual_seed(seed)
    config = MistralConfig(**TINY, sliding_window=window, head_dim=16)
    config._attn_implementation = "eager"
    model = MistralForCausalLM(config)
    randomize(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral_window")
    hf = make_mistral()
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


def run_chunks(model, arch, chunks: list[list[int]]) -> torch.Tensor:
    runner = PagedRunner(model, arch)
    return torch.cat([runner.step({"r": chunk})["r"] for chunk in chunks])


def split(tokens: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for size in sizes:
        out.append(tokens[start : start + size])
        start += size
    assert start == len(tokens)
    return out


def test_config_window_parsing():
    hf = make_mistral().config.to_dict()
    arch = ArchConfig.from_hf_config(hf)
    assert arch.sliding_window == WINDOW and arch.layer_types is None
    assert [arch.layer_sliding_window(i) for i in range(2)] == [WINDOW, WINDOW]
    none = ArchConfig.from_hf_config({**hf, "sliding_window": None})
    assert none.layer_sliding_window(0) is None
    qwen2 = {**hf, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ArchConfig.from_hf_config({**qwen2, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(ValueError, match="use_sliding_window is not supported"):
        ArchConfig.from_hf_config({**qwen2, "use_sliding_window": True})
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        ArchConfig.from_hf_config({**hf, "sliding_window": 0})


def test_logits_match_hf_through_chunks_and_decodes(checkpoint):
    path, hf = checkpoint
    model, arch = load_model(path, dtype="float32")
    assert all(layer.self_attn.attn.sliding_window == WINDOW for layer in model.model.layers)
    expected = hf_logits(hf, TOKENS)
    full_attention = hf_logits(make_mistral(window=None), TOKENS)
    assert (expected[WINDOW:] - full_attention[WINDOW:]).abs().max() > 1e-2  # it matters
    for sizes in ([40], [4, 9, 27], [3] * 13 + [1]):  # chunks across the window; decodes
        got = run_chunks(model, arch, split(TOKENS, sizes))
        assert (got - expected).abs().max().item() < 1e-4, sizes
    # Prefill of 10, then 30 one-token decode steps: every decode is past the window.
    got = run_chunks(model, arch, split(TOKENS, [10] + [1] * 30))
    assert (got - expected).abs().max().item() < 1e-4


def test_batch_of_chunk_and_decodes_matches_hf(checkpoint):
    path, hf = checkpoint
    model, arch = load_model(path, dtype="float32")
    a, b = TOKENS, TOKENS[::-1][:15]
    runner = PagedRunner(model, arch)
    steps = [(a[:12], b[:9])] + [(a[12 + 4 * i : 16 + 4 * i], b[9 + i : 10 + i]) for i in range(6)]
    got = runner.run([{"a": chunk_a, "b": chunk_b} for chunk_a, chunk_b in steps])
    assert (got["a"] - hf_logits(hf, a[:36])).abs().max().item() < 1e-4
    assert (got["b"] - hf_logits(hf, b)).abs().max().item() < 1e-4


def test_engine_greedy_matches_hf(checkpoint):
    path, hf = checkpoint
    # 7 blocks of 8 tokens for 3 requests of up to 33 tokens: preemption; a budget of
    # 8 tokens: prompts chunked across the window; a shared 8-token prefix: cache hits.
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        block_size=8,
        num_gpu_blocks_override=7,
        max_num_batched_tokens=8,
        max_num_seqs=3,
    )
    try:
        gen = torch.Generator().manual_seed(4)
        prefix = torch.randint(3, 512, (8,), generator=gen).tolist()
        prompts = [prefix + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 3, 6)]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy_recomputed(hf, prompt, 16)
    finally:
        llm.shutdown()
