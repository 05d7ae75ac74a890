"""Pagoda models against transformers on tiny random checkpoints: the tiny shape, random
weights everywhere (norms and biases included), a step-by-step paged runner over the
torch_ref backend like the model runner, and both sides' logits."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pagoda.attention.forward_context import forward_context
from pagoda.attention.kv_pool import KVCachePool
from pagoda.attention.metadata import build_attention_metadata
from pagoda.attention.torch_ref import TorchRefBackend
from pagoda.core.kv_cache_spec import KVCacheConfig
from pagoda.model.arch_config import ArchConfig
from pagoda.model.layers.attention import kv_cache_specs

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
)


class PagedRunner:
    """Drives a Pagoda model step by step through a paged KV cache, like the model runner.

    Blocks are handed out in a scrambled order so that block tables are not contiguous.
    """

    def __init__(self, model, arch: ArchConfig, num_blocks: int = 64, block_size: int = 4):
        self.model, self.block_size = model, block_size
        shape = arch.attention_shape()
        self.backend = TorchRefBackend(
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale
        )
        dtype = next(model.parameters()).dtype
        self.kv_pool = KVCachePool(
            KVCacheConfig(num_blocks, kv_cache_specs(model, block_size, dtype)), "cpu"
        )
        self.free_blocks = torch.randperm(
            num_blocks, generator=torch.Generator().manual_seed(1)
        ).tolist()
        self.block_tables: dict[str, list[int]] = {}
        self.seq_lens: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Runs one flattened forward over each request's next tokens; logits per request."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for req, tokens in chunks.items():
            start = self.seq_lens.get(req, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(req, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            ids += tokens
            positions += list(range(start, end))
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
            self.seq_lens[req] = end
        metadata = build_attention_metadata(query_lens, seq_lens, tables, self.block_size, "cpu")
        plan = self.backend.build_metadata(metadata)
        with torch.no_grad(), forward_context(self.backend, plan, self.kv_pool):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden)
        assert hidden.shape == (len(ids), self.model.arch.hidden_size)
        assert logits.dtype == torch.float32
        return dict(zip(chunks, logits.split(query_lens)))

    def run(self, steps: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        """Runs the steps in order; each request's logits over all its steps."""
        outs: dict[str, list[torch.Tensor]] = {}
        for chunks in steps:
            for req, logits in self.step(chunks).items():
                outs.setdefault(req, []).append(logits)
        return {req: torch.cat(parts) for req, parts in outs.items()}


def pagoda_logits(model, arch, tokens: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    runner = PagedRunner(model, arch)
    out, start = [], 0
    for size in chunk_sizes:
        out.append(runner.step({"r": tokens[start : start + size]})["r"])
        start += size
    assert start == len(tokens)
    return torch.cat(out)


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation through generate (its KV cache); EOS ignored by
    having none (min_new_tokens would ban EOS and change the argmax)."""
    hf_model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def hf_greedy_recomputed(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation, recomputed over the whole sequence each step
    (no cache: its attention masks are the only definition used)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def randomize(hf_model, seed: int) -> None:
    """Random weights everywhere, norms and biases included, so a mis-mapped tensor shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))


def make_hf(kind: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(**TINY, **overrides)
        model = LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = Qwen2Config(**TINY, **overrides)
        model = Qwen2ForCausalLM(config)
    else:
        config = Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True, **overrides)
        model = Qwen3ForCausalLM(config)
    config._attn_implementation = "eager"
    randomize(model, seed)
    return model.eval()


PROMPT = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(7)).tolist()


def assert_engine_greedy_with_hits_and_preemption(path: str, hf_model, vocab: int = 384) -> None:
    """Greedy tokens through LLM equal transformers' for six requests sharing a 32-token
    prefix (prefix-cache hits) in 14 blocks of 16 tokens (preemption) with a 32-token
    budget (chunked prefill); CPU, float32."""
    from pagoda import LLM, SamplingParams

    llm = LLM(
        path,
        skip_tokenizer_init=True,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        block_size=16,
        num_gpu_blocks_override=14,
        max_num_batched_tokens=32,
        max_num_seqs=6,
    )
    try:
        gen = torch.Generator().manual_seed(3)
        prefix = torch.randint(3, vocab, (32,), generator=gen).tolist()
        prompts = [
            prefix + torch.randint(3, vocab, (n,), generator=gen).tolist()
            for n in (4, 9, 1, 13, 6, 2)
        ]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits > 0
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)
    finally:
        llm.shutdown()
