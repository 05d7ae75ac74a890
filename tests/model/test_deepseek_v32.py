"""DeepSeek V3.2 (MLA with DeepSeek Sparse Attention) against Hugging Face transformers.

A tiny random DeepseekV32ForCausalLM (tests/helpers/tiny_models.py: an indexer of 8
heads keeping the 8 best tokens, so a 70-token sequence attends sparsely from its 9th
token on) is saved as safetensors and loaded by Pagoda; the reference is transformers'
own model in float32 with eager attention, whose indexer masks everything but each
query's top-k. Pagoda runs through the paged latent cache and the indexer keys' pool
layers: logits step by step (chunked prefill with a cached prefix, decodes, a decode
beside a prefill chunk), and greedy generation through the engine with prefix-cache hits
and preemption. The indexer matters in these tests: a model that attended densely
instead gives other logits (checked).
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_compare import (
    PagedRunner,
    assert_engine_greedy_with_hits_and_preemption,
    hf_greedy,
    hf_logits,
    randomize,
)
from helpers.tiny_models import tiny_deepseek_config

from pagoda import LLM, SamplingParams
from pagoda.attention.mla_backend import MLATorchBackend
from pagoda.core.kv_cache_spec import IndexerKeySpec, MLAAttentionSpec
from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.attention import kv_cache_specs
from pagoda.model.loader import load_model
from pagoda.model.mla_config import SparseIndexerConfig, mla_softmax_scale

torch.set_num_threads(1)

TOKENS = torch.randint(3, 384, (70,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model) of the tiny V3.2, saved once."""
    config, cls = tiny_deepseek_config("deepseek_v32")
    torch.manual_seed(0)
    hf = cls(config).eval()
    randomize(hf, 0)
    gen = torch.Generator().manual_seed(1)
    for name, param in hf.named_parameters():
        # randomize() gives norms' biases 0.5..1.5: every indexer key would then share
        # one large direction, each head's scores one sign for all tokens of a row, and
        # rows would tie at zero where top-k has no single answer.
        if name.endswith("indexer.k_norm.bias"):
            param.data.copy_(0.1 * torch.randn(param.shape, generator=gen))
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.1 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(0)))
    path = tmp_path_factory.mktemp("deepseek-v32")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


class SparseRunner(PagedRunner):
    """PagedRunner with the MLA reference backend planning every row latent."""

    def __init__(self, model, arch: ArchConfig):
        super().__init__(model, arch)
        self.backend = MLATorchBackend(
            arch.num_attention_heads,
            arch.mla.kv_lora_rank,
            arch.mla.qk_rope_head_dim,
            mla_softmax_scale(arch.mla, arch.rope_scaling),
            "all",
        )


def test_config_and_pool_layers(checkpoint):
    path, _ = checkpoint
    model, arch = load_model(path, dtype="float32")
    assert arch.architecture == "DeepseekV32ForCausalLM"
    assert arch.mla.indexer == SparseIndexerConfig(num_heads=8, head_dim=16, topk=8)
    assert arch.mla.rope_interleave
    assert arch.attention_shape().sparse
    specs = kv_cache_specs(model, 16, torch.float32)
    # Two decoder layers: their latents, then their indexer keys.
    assert [type(s) for s in specs] == [MLAAttentionSpec] * 2 + [IndexerKeySpec] * 2
    assert specs[2].page_size_bytes == 16 * 16 * 4


def test_logits_match_transformers_through_the_paged_caches(checkpoint):
    path, hf = checkpoint
    model, arch = load_model(path, dtype="float32")
    expected = hf_logits(hf, TOKENS)
    other = TOKENS[::-1][:12]
    expected_other = hf_logits(hf, other)
    # A chunk boundary inside the first 8 tokens and past them, a 2nd chunk scoring 40
    # cached tokens, decodes, then a decode beside the other request's prefill chunk.
    steps = [
        {"r": TOKENS[:5]},
        {"r": TOKENS[5:40]},
        {"r": TOKENS[40:60]},
        {"r": TOKENS[60:61]},
        {"r": TOKENS[61:62]},
        {"r": TOKENS[62:63], "o": other[:7]},
        {"r": TOKENS[63:], "o": other[7:]},
    ]
    logits = SparseRunner(model, arch).run(steps)
    got, got_other = logits["r"], logits["o"]
    assert (got - expected).abs().max().item() < 1e-4
    assert (got_other - expected_other).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_indexer_selects_what_is_attended(checkpoint, tmp_path):
    """The same weights with every token kept (index_topk 128: dense) give the sparse
    model's logits on the first 8 tokens and other logits past them."""
    import json
    import shutil

    path, _ = checkpoint
    dense_path = shutil.copytree(path, tmp_path / "dense")
    config = json.loads((dense_path / "config.json").read_text())
    (dense_path / "config.json").write_text(json.dumps({**config, "index_topk": 128}))
    model, arch = load_model(path, dtype="float32")
    dense_model, dense_arch = load_model(str(dense_path), dtype="float32")
    assert dense_arch.mla.indexer.topk == 128
    sparse = SparseRunner(model, arch).step({"r": TOKENS[:30]})["r"]
    dense = SparseRunner(dense_model, dense_arch).step({"r": TOKENS[:30]})["r"]
    assert (sparse[:8] - dense[:8]).abs().max().item() < 1e-5
    assert (sparse[8:] - dense[8:]).abs().amax(-1).min().item() > 1e-3


def test_engine_greedy_matches_transformers_with_prefix_hits_and_preemption(checkpoint):
    path, hf = checkpoint
    # The prefix-cache hits bring back the indexer keys of the cached blocks with the
    # latents.
    assert_engine_greedy_with_hits_and_preemption(path, hf)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_engine_greedy_matches_transformers(checkpoint, enforce_eager):
    """On CUDA in float32: the Triton MLA backend with the indexer's scoring kernel and
    the sparse latent kernel gives transformers' greedy tokens (chunked prefill past
    the 8 selected tokens, decodes beside prefills), eagerly and on CUDA graphs."""
    path, hf = checkpoint
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        kv_cache_memory=64 << 20,
        enforce_eager=enforce_eager,
    )
    runner = llm.llm_engine.executor.runner
    assert runner.backend.name == "triton"
    assert (runner.graph_runner is not None) == (not enforce_eager)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
    llm.shutdown()


def test_offload_tiers_carry_the_indexer_keys(checkpoint):
    """A GPU pool too small for the working set: revisited prompts come back from the CPU
    tier (latents and indexer keys, one block format) and give the outputs of a pool
    that holds everything."""
    path, _ = checkpoint
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 384, (40,), generator=gen).tolist() for _ in range(5)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    common = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", max_model_len=64)

    def one_by_one(llm):
        return [
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
            for p in prompts + prompts
        ]

    roomy = LLM(path, **common)
    try:
        expected = [out.outputs[0].token_ids for out in one_by_one(roomy)]
    finally:
        roomy.shutdown()
    # 6 blocks of 16 tokens: each prompt takes 3, so every revisit finds its blocks gone
    # from the GPU pool and in the CPU tier.
    tiered = LLM(path, block_size=16, num_gpu_blocks_override=6, kv_offloading_size=0.01, **common)
    try:
        outs = one_by_one(tiered)
        assert [out.outputs[0].token_ids for out in outs] == expected
        cpu = next(t for t in tiered.llm_engine.get_stats().kv_offload if t["tier"] == "cpu")
        assert cpu["hits"] >= 5 * 2
        assert sum(out.num_cached_tokens for out in outs[5:]) == 5 * 32
    finally:
        tiered.shutdown()
