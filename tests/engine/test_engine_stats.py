"""EngineStats' dashboard fields on a tiny random Llama: steps and scheduled tokens
counted exactly, capacities reported, and preempted requests seen while they wait."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_hf_models):
    # 6 blocks of 16 tokens; a step schedules at most 32 tokens.
    llm = LLM(
        tiny_hf_models["llama"][0],
        skip_tokenizer_init=True,
        max_model_len=64,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        num_gpu_blocks_override=6,
        enable_prefix_caching=False,
    )
    yield llm.llm_engine
    llm.shutdown()


def test_steps_and_scheduled_tokens_are_counted_exactly(engine):
    before = engine.get_stats()
    assert (before.max_num_batched_tokens, before.max_num_seqs, before.block_size) == (32, 4, 16)
    # 40 prompt tokens in chunks of 32 + 8 (the second samples token 1), then 4 decode
    # steps of one token each.
    engine.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats.num_steps - before.num_steps == 6
    assert stats.scheduled_tokens - before.scheduled_tokens == 44
    assert stats.num_preempted == 0


def test_preempted_requests_are_counted_while_they_wait(engine):
    # Two requests growing to 60 tokens (4 blocks) each: 8 blocks, the pool has 6.
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"r{i}", list(range(200 + 20 * i, 220 + 20 * i)), params)
    seen = []
    while engine.has_unfinished_requests():
        preemptions = engine.get_stats().num_preemptions
        engine.step()
        stats = engine.get_stats()
        if stats.num_preemptions > preemptions:  # preempted in this step: it waits now
            seen.append(stats.num_preempted)
    assert seen and all(n >= 1 for n in seen)
    assert engine.get_stats().num_preempted == 0
