"""Async scheduling on the real engine (embedded SmolLM2, CPU): the same requests give
the same outputs as the synchronous loop, for every sampling feature that looks at a
request's output so far (penalties, min_tokens, stops), under chunked prefill and
preemption, with aborts, and every KV block is free afterwards.

On CPU the device work is synchronous, but the engine still schedules step N+1
before it sees step N's tokens, so the worker feeds each sampled token to the next
step from the previous step's sampled ids: the path CUDA takes.
"""

from __future__ import annotations

import pytest
from helpers.engine_checks import GREEDY, assert_all_blocks_free, make_prompts

from pagoda import LLM, SamplingParams


def make_llm(async_scheduling: bool) -> LLM:
    # 24 blocks of 16 tokens and a budget of 64 tokens: chunked prefill and preemption.
    return LLM(
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=32,
        num_gpu_blocks_override=24,
        async_scheduling=async_scheduling,
    )


@pytest.fixture(scope="module")
def llms():
    llms = {False: make_llm(False), True: make_llm(True)}
    yield llms
    for llm in llms.values():
        llm.shutdown()


def mixed_params() -> list[SamplingParams]:
    """Seeded (so batch-independent) sampling with everything that reads the output."""
    return [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.9, seed=1, repetition_penalty=1.3),
        SamplingParams(
            max_tokens=16,
            temperature=0.8,
            seed=2,
            frequency_penalty=0.7,
            presence_penalty=0.4,
            top_k=40,
        ),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=8, logprobs=2),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=24, temperature=0, stop=[","], include_stop_str_in_output=True),
        SamplingParams(max_tokens=18, temperature=0.7, seed=3, top_p=0.9, n=2),
        SamplingParams(max_tokens=10, temperature=0, prompt_logprobs=1),
        SamplingParams(max_tokens=30, temperature=0),  # may stop on eos
    ]


def summary(outputs) -> list:
    rows = []
    for out in outputs:
        for comp in out.outputs:
            lps = None if comp.logprobs is None else [sorted(lp) for lp in comp.logprobs]
            rows.append(
                (
                    out.request_id,
                    comp.index,
                    comp.token_ids,
                    comp.text,
                    comp.finish_reason,
                    comp.stop_reason,
                    lps,
                )
            )
    return rows


@pytest.mark.slow
def test_async_equals_sync_for_every_sampling_feature(llms):
    tok = llms[False].get_tokenizer()
    prompts = make_prompts(tok, 27)
    params = mixed_params() * 3
    results = {}
    for mode, llm in llms.items():
        before = llm.llm_engine.get_stats().num_preemptions
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.get_stats().num_preemptions > before
        results[mode] = summary(outputs)
        assert_all_blocks_free(llm)
    assert results[True] == results[False]


@pytest.mark.slow
def test_async_greedy_batch_equals_alone(llms):
    llm = llms[True]
    prompts = make_prompts(llm.get_tokenizer(), 12)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert_all_blocks_free(llm)


def test_async_abort_in_flight_frees_everything(llms):
    engine = llms[True].llm_engine
    prompts = make_prompts(llms[True].get_tokenizer(), 6)
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", p, GREEDY)
    finished = {}
    for step in range(200):
        if step == 4:
            engine.abort_request(["abort-1", "abort-4"])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert sorted(finished) == ["abort-0", "abort-2", "abort-3", "abort-5"]
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in finished.values())
    assert_all_blocks_free(llms[True])


def test_async_scheduling_flag_is_validated():
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(async_scheduling="yes")


def test_async_reused_id_after_abort_gets_none_of_the_old_tokens(llms):
    """An aborted request's step may still be in flight when its id is reused: the
    engine keeps stepping until that step is taken, so the new request is clean."""
    engine = llms[True].llm_engine
    prompts = make_prompts(llms[True].get_tokenizer(), 2)
    expected = llms[True].generate([prompts[1]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("reused", prompts[0], GREEDY)
    engine.step()  # launched, not processed
    engine.abort_request("reused")
    assert engine.has_unfinished_requests()  # the launched step is still to be taken
    while engine.has_unfinished_requests():
        assert engine.step() == []
    engine.add_request("reused", prompts[1], GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.finished)
    assert outputs[0].outputs[0].token_ids == expected
    assert_all_blocks_free(llms[True])


@pytest.mark.slow
def test_device_block_table_gives_the_same_outputs():
    """The worker's persistent block table (on by default on CUDA, built per step from
    host lists on CPU) gives the same outputs, through chunking and preemption: rows
    are reused by re-admitted and new requests."""
    from pagoda.worker.block_table import DeviceBlockTable

    plain, with_table = make_llm(True), make_llm(True)
    runner = with_table.llm_engine.executor.runner
    assert runner.block_table is None  # CPU default
    runner.block_table = DeviceBlockTable(max_rows=4, max_blocks_per_req=16, device="cpu")
    tok = plain.get_tokenizer()
    prompts = make_prompts(tok, 27)
    params = mixed_params() * 3
    results = []
    for llm in (plain, with_table):
        before = llm.llm_engine.get_stats().num_preemptions
        results.append(summary(llm.generate(prompts, params, use_tqdm=False)))
        assert llm.llm_engine.get_stats().num_preemptions > before
        assert_all_blocks_free(llm)
    assert results[0] == results[1]
    # Rows mirror the worker's request states (the last finished request leaves both
    # with the next step's scheduler output, as ever).
    assert set(runner.block_table.row_of) == set(runner.states)
    assert runner.block_table.max_rows > 4  # 4 rows were too few: it grew
