"""Qwen3-MoE against transformers: a tiny random Qwen3MoeForCausalLM (8 experts, top 2,
renormalised, layer 1 dense through mlp_only_layers) saved as safetensors, loaded by
Pagoda; float32 logits through the paged cache in one pass and in chunks, greedy tokens
through decode, the engine's greedy tokens (chunked prefill, batching) equal to
transformers' generate, expert parallelism at tensor_parallel_size 2 (gloo) equal to
tensor_parallel_size 1, and --enable-expert-parallel refused for a dense model."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.hf_compare import PagedRunner, hf_logits, pagoda_logits
from helpers.tiny_models import save_tiny_hf_model

from pagoda import LLM, SamplingParams
from pagoda.model.layers.moe.fused_moe import FusedMoE
from pagoda.model.loader import load_model

PROMPT = torch.randint(3, 384, (21,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    save_tiny_hf_model(path, "qwen3_moe")
    # The reference is the saved checkpoint reloaded, not the in-memory object.
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    return str(path), hf


def test_layers_and_expert_weights(tiny_moe):
    path, hf = tiny_moe
    model, arch = load_model(path, dtype="float32")
    assert arch.architecture == "Qwen3MoeForCausalLM" and arch.moe.mlp_only_layers == (1,)
    layers = model.model.layers
    assert isinstance(layers[0].mlp.experts, FusedMoE)
    assert not hasattr(layers[1].mlp, "experts")  # dense
    hf_experts = hf.model.layers[0].mlp.experts
    assert torch.equal(layers[0].mlp.experts.w13_weight, hf_experts.gate_up_proj)
    assert torch.equal(layers[0].mlp.experts.w2_weight, hf_experts.down_proj)


def test_logits_match_transformers_whole_and_chunked(tiny_moe):
    path, hf = tiny_moe
    model, arch = load_model(path, dtype="float32")
    expected = hf_logits(hf, PROMPT)
    whole = pagoda_logits(model, arch, PROMPT, [21])
    assert (whole - expected).abs().max().item() < 1e-4
    chunked = pagoda_logits(model, arch, PROMPT, [8, 1, 12])
    assert (chunked - expected).abs().max().item() < 1e-4


def test_greedy_decode_matches_transformers(tiny_moe):
    path, hf = tiny_moe
    model, arch = load_model(path, dtype="float32")
    with torch.no_grad():
        hf_out = hf.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
    runner = PagedRunner(model, arch)
    logits = runner.step({"a": PROMPT[:13]})
    logits = runner.step({"a": PROMPT[13:], "b": PROMPT[:5]})  # batched with another prompt
    tokens = []
    for _ in range(8):
        tokens.append(int(logits["a"][-1].argmax()))
        logits = runner.step({"a": [tokens[-1]]})
    assert tokens == hf_out


def _engine_tokens(path: str, prompts, tp: int = 1, **kwargs) -> list[list[int]]:
    llm = LLM(
        path,
        device="cpu",
        dtype="float32",
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_batched_tokens=16,
        kv_cache_memory=1 << 22,
        block_size=8,
        **kwargs,
    )
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.llm_engine.shutdown()


PROMPTS = [PROMPT, PROMPT[5:][::-1], PROMPT[:9]]


def test_engine_greedy_tokens_match_transformers(tiny_moe):
    """Chunked prefill (a 16-token budget) and batched decode through the real engine."""
    path, hf = tiny_moe
    got = _engine_tokens(path, PROMPTS)
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, got):
            expected = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            assert tokens == expected


def test_expert_parallel_tp2_matches_tp1(tiny_moe):
    path, _ = tiny_moe
    reference = _engine_tokens(path, PROMPTS)
    assert _engine_tokens(path, PROMPTS, tp=2, enable_expert_parallel=True) == reference


def test_expert_parallel_is_refused_for_dense_models(tiny_hf_models):
    path, _ = tiny_hf_models["llama"]
    with pytest.raises(
        ValueError, match="enable_expert_parallel is set but LlamaForCausalLM has no experts"
    ):
        LLM(path, device="cpu", kv_cache_memory=1 << 22, enable_expert_parallel=True)
