"""Tensor parallelism end to end: the real engine at tensor_parallel_size 2 (two worker
processes of the multi-process executor, each a real ModelRunner with its share of the
heads, joined through gloo on the CPU) generates exactly the greedy tokens of the same
checkpoint at tensor_parallel_size 1, through chunked prefill, prefix-cache hits and
async scheduling; a model whose heads do not split is refused before any process starts.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import save_tiny_hf_model

from pagoda import LLM, SamplingParams

PROMPTS = [[(5 * i + 3 * j) % 300 + 3 for j in range(9 + 7 * i)] for i in range(5)]
PROMPTS.append(PROMPTS[4][:30] + [7, 8, 9])  # shares a cached prefix with prompt 4


def generate(
    path: str, tp: int, async_scheduling: bool, device: str = "cpu", **engine_kwargs
) -> list[list[int]]:
    memory = {"kv_cache_memory": 1 << 22} if device == "cpu" else {"gpu_memory_utilization": 0.3}
    llm = LLM(
        path,
        device=device,
        dtype="float32",
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_batched_tokens=32,
        **memory,
        block_size=8,
        async_scheduling=async_scheduling,
        **engine_kwargs,
    )
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert llm.llm_engine.audit_kv_cache().in_use == 0
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-engine-llama")
    save_tiny_hf_model(path, "llama")  # 4 heads / 2 KV heads: one KV head per rank
    return str(path)


def test_tp2_engine_generates_the_tp1_greedy_tokens(tiny_llama):
    reference = generate(tiny_llama, 1, async_scheduling=False)
    assert generate(tiny_llama, 2, async_scheduling=True) == reference


@pytest.mark.gpu(2)
def test_tp2_on_two_gpus_generates_the_tp1_greedy_tokens(tiny_llama):
    """NCCL, CUDA graphs capturing the collectives, async scheduling: float32 weights so
    the two reduction orders cannot flip a greedy choice."""
    import gc

    reference = generate(tiny_llama, 1, async_scheduling=True, device="cuda")
    gc.collect()  # the tp 1 engine's memory on GPU 0 would shrink rank 0's KV budget
    torch.cuda.empty_cache()
    assert generate(tiny_llama, 2, async_scheduling=True, device="cuda") == reference


def test_heads_that_do_not_split_are_refused_before_workers_start(tmp_path):
    save_tiny_hf_model(
        tmp_path, "llama", num_attention_heads=4, num_key_value_heads=4, intermediate_size=130
    )
    with pytest.raises(ValueError, match="intermediate|tensor_parallel_size|split|divis"):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=4, kv_cache_memory=1 << 22)
