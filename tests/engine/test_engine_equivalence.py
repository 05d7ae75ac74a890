"""Greedy equivalence with Hugging Face transformers (its reference, not Pagoda's code).

Same weights, fp32 on CPU, EOS ignored: the generated token ids must be identical.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_compare import hf_greedy

from pagoda import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "请用中文介绍一下长城的历史。",
    "Emoji story: 🐍🐍 the snake met a 🦊 and said",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away,",
    "SELECT name, COUNT(*) FROM users GROUP BY",
    "Les trois mousquetaires sont",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2_llm():
    with LLM(max_model_len=512, kv_cache_memory=64 << 20) as llm:
        yield llm


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2_llm, smollm2_gguf):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = smollm2_llm.get_tokenizer()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt).input_ids
        assert out.prompt_token_ids == ids
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, NEW_TOKENS), prompt


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_safetensors_greedy_matches_transformers(tiny_hf_models, arch):
    path, hf = tiny_hf_models[arch]
    llm = LLM(path, skip_tokenizer_init=True, kv_cache_memory=8 << 20, max_model_len=256)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
