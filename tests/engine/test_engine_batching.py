"""Engine behaviour on the embedded SmolLM2: batch invariance under chunked prefill and
preemption, prefix caching, seeded sampling, n > 1, aborts and the KV audit."""

from __future__ import annotations

import pytest
from helpers.engine_checks import GREEDY, assert_all_blocks_free, make_prompts

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def small_pool_llm():
    # 24 blocks of 16 tokens: 16 requests of up to ~71 tokens cannot all fit -> preemption.
    with LLM(
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=32,
        num_gpu_blocks_override=24,
        enable_prefix_caching=False,
    ) as llm:
        yield llm


@pytest.mark.slow
def test_batch_invariance_with_chunking_and_preemption(small_pool_llm):
    """Greedy and seeded requests: the same tokens alone and in a batch whose
    preemptions restart them with a fresh worker state (seeded draws included)."""
    llm = small_pool_llm
    prompts = make_prompts(llm.get_tokenizer(), 16)
    params = [
        GREEDY if i % 2 else SamplingParams(max_tokens=24, temperature=0.9, seed=i, ignore_eos=True)
        for i in range(16)
    ]
    alone = [
        llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params)
    ]
    preemptions_before = llm.llm_engine.get_stats().num_preemptions
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > preemptions_before
    for i, out in enumerate(batched):
        assert out.outputs[0].token_ids == alone[i], f"request {i} differs"
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def llm():
    with LLM(max_model_len=512, kv_cache_memory=32 << 20) as llm:
        yield llm


def test_prefix_cache_hit_gives_identical_output(llm):
    prompt = (
        "You are a helpful assistant. Answer briefly and precisely. "
        "Question: what is the tallest mountain on Earth?"
    )
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    stats = llm.llm_engine.get_stats()
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    after = llm.llm_engine.get_stats()
    n = len(first.prompt_token_ids)
    assert after.prefix_cache_hits - stats.prefix_cache_hits == (n - 1) // 16 * 16 > 0
    assert second.num_cached_tokens == (n - 1) // 16 * 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_seeded_sampling_same_alone_and_in_batch(llm):
    prompts = make_prompts(llm.get_tokenizer(), 6)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(
        [prompts[3], prompts[0], prompts[5]], [other, seeded, other], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_n_samples_share_prompt_blocks(llm):
    prompt = "Write a short poem about the sea and the stars above the quiet harbor tonight."
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_all_blocks_free(llm)


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    ids = [engine.add_request(None, f"Tell me a long story number {i}.", GREEDY) for i in range(4)]
    engine.step()
    engine.step()
    assert engine.audit_kv_cache().in_use > 0
    engine.abort_request(ids)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


def test_prompt_too_long_names_both_lengths(llm):
    with pytest.raises(ValueError, match=r"600 tokens.*max_model_len is 512"):
        llm.generate([[5] * 600], GREEDY, use_tqdm=False)


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_bad_engine_arguments_name_the_field():
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=7)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(gpu_memory_utilization=1.5)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(not_a_flag=1)


def test_stop_strings_logprobs_and_token_inputs(llm):
    tok = llm.get_tokenizer()
    ids = tok("Count: 1, 2, 3, 4,").input_ids
    out = llm.generate(
        [ids], SamplingParams(max_tokens=20, temperature=0, stop=[" 7"], logprobs=3), use_tqdm=False
    )[0]
    comp = out.outputs[0]
    assert out.prompt_token_ids == ids
    assert comp.finish_reason == "stop" and comp.stop_reason == " 7"
    assert " 7" not in comp.text and comp.text.startswith(" 5, 6,")
    assert len(comp.logprobs) == len(comp.token_ids)
    assert all(len(lp) in (3, 4) for lp in comp.logprobs)
    assert all(comp.token_ids[i] in lp for i, lp in enumerate(comp.logprobs))
