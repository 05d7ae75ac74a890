"""Speculative decoding on the real engine (embedded SmolLM2, CPU): n-gram drafts on
the host, layer-skip drafts on the worker (in the target's own KV cache), draft-model
drafts (in the draft's own layers of the same blocks).

Greedy and seeded outputs are token-identical to speculation off - drafts change how
many tokens a step yields, never which - under chunked prefill, preemption, prefix
cache hits and n > 1, with the synchronous loop and with async scheduling; logprobs of
accepted tokens match too. The prompts ask the model to copy text, so drafts are
accepted (checked), and every KV block is free afterwards.
"""

from __future__ import annotations

import pytest
from helpers.engine_checks import assert_all_blocks_free, make_prompts

from pagoda import LLM, SamplingParams
from pagoda.model.tokenizer import apply_chat_template

# Not adaptive: every step drafts (the budget would skip drafts in these busy batches).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
# 29 of SmolLM2's 30 layers: the only depth whose drafts this model accepts often.
LAYER_SKIP = {
    "method": "layer_skip",
    "num_layers": 29,
    "num_speculative_tokens": 2,
    "adaptive": False,
}
PASSAGE = (
    "Pagoda keeps the KV cache in blocks of sixteen tokens. A request that "
    "finishes frees its blocks, and a prompt that starts like an earlier one "
    "reuses the blocks of that prefix."
)


def make_llm(speculative_config=None, async_scheduling=False) -> LLM:
    # 9 blocks of 16 tokens and 64 tokens a step: chunked prefill and preemption.
    return LLM(
        max_model_len=256,
        max_num_batched_tokens=64,
        max_num_seqs=32,
        num_gpu_blocks_override=9,
        async_scheduling=async_scheduling,
        speculative_config=speculative_config,
    )


@pytest.fixture(scope="module")
def llms():
    llms = {"off": make_llm(), "sync": make_llm(NGRAM), "async": make_llm(NGRAM, True)}
    yield llms
    for llm in llms.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def expected(llms):
    prompts, params = workload(llms["off"].get_tokenizer())
    return results(llms["off"].generate(prompts, params, use_tqdm=False))


def grounded_prompts(tokenizer) -> list[list[int]]:
    """Copy tasks (drafts get accepted) sharing a long prefix (prefix cache hits)."""
    prompts = []
    for task in (
        "Repeat the passage word for word.",
        "Copy the passage exactly, then stop.",
        "Write the passage again.",
    ):
        messages = [{"role": "user", "content": f"{PASSAGE}\n\n{task}"}]
        prompts.append(apply_chat_template(tokenizer, messages, True, None, None))
    return prompts


def workload(tokenizer):
    prompts = grounded_prompts(tokenizer) + make_prompts(tokenizer, 2)
    params = []
    for i in range(len(prompts)):
        if i % 4 == 0:
            params.append(
                SamplingParams(
                    max_tokens=16, temperature=0.8, seed=i, top_p=0.9, ignore_eos=True, logprobs=2
                )
            )
        elif i % 4 == 1:
            params.append(
                SamplingParams(
                    max_tokens=16,
                    temperature=0.7,
                    seed=i,
                    n=2,
                    repetition_penalty=1.2,
                    top_k=30,
                    ignore_eos=True,
                )
            )
        else:
            params.append(
                SamplingParams(
                    max_tokens=16, temperature=0, ignore_eos=True, logprobs=1 if i % 2 else None
                )
            )
    return prompts, params


def results(outputs):
    rows = []
    for out in outputs:
        for comp in out.outputs:
            lps = (
                None
                if comp.logprobs is None
                else [{t: round(lp.logprob, 3) for t, lp in pos.items()} for pos in comp.logprobs]
            )
            rows.append((out.request_id, comp.index, comp.token_ids, lps))
    return rows


def check_equal_to_off(llm, mode, expected, min_accepted):
    """llm's outputs on the workload equal speculation off's; preemption, prefix hits
    and accepted drafts happened."""
    prompts, params = workload(llm.get_tokenizer())
    engine = llm.llm_engine
    before = engine.get_stats()
    got = results(llm.generate(prompts, params, use_tqdm=False))
    for want, have in zip(expected, got):
        assert want[1:3] == have[1:3], (mode, want[0])
        if want[3] is not None:
            assert [sorted(p) for p in want[3]] == [sorted(p) for p in have[3]]
            for a, b in zip(want[3], have[3]):
                assert all(abs(a[t] - b[t]) <= 2e-3 for t in a), (mode, want[0])
    stats = engine.get_stats()
    assert stats.num_preemptions > before.num_preemptions, mode
    assert stats.prefix_cache_hits > before.prefix_cache_hits, mode
    spec = stats.spec_decode
    assert spec.num_accepted_tokens > min_accepted, (mode, spec)
    assert spec.num_draft_tokens > spec.num_accepted_tokens, (mode, spec)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ngram_outputs_equal_speculation_off(llms, expected, mode):
    check_equal_to_off(llms[mode], mode, expected, min_accepted=12)


def test_layer_skip_outputs_equal_speculation_off(expected):
    # Async scheduling: the drafter also starts from tokens the host did not know when
    # the step was built (the previous step's, fed on the device). The synchronous
    # loop runs the same drafter code.
    llm = make_llm(LAYER_SKIP, async_scheduling=True)
    check_equal_to_off(llm, "layer_skip", expected, min_accepted=5)


def test_layer_skip_confidence_threshold_withholds_unsure_drafts(expected):
    """With a threshold, a verify step carries fewer than k drafts whenever the drafter
    doubts its next guess (k = 2 always: without one every step carries 2); the
    outputs stay those of speculation off."""
    llm = make_llm({**LAYER_SKIP, "draft_confidence_threshold": 0.6})
    check_equal_to_off(llm, "layer_skip confident", expected, min_accepted=5)
    spec = llm.llm_engine.get_stats().spec_decode
    assert 0 < spec.num_draft_tokens < 2 * spec.num_drafts, spec


def test_draft_model_outputs_equal_speculation_off(expected):
    # The embedded model drafting for itself: its greedy drafts match the greedy rows
    # and are rejected by sampled rows as often as the sampling disagrees.
    from pagoda.model.tokenizer import embedded_model_path

    draft = {"model": str(embedded_model_path()), "num_speculative_tokens": 3, "adaptive": False}
    llm = make_llm(draft, async_scheduling=True)
    check_equal_to_off(llm, "draft_model", expected, min_accepted=12)


def test_ngram_copy_task_takes_fewer_steps(llms):
    tokenizer = llms["off"].get_tokenizer()
    prompt = grounded_prompts(tokenizer)[0]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    steps = {}
    for mode in ("off", "sync"):
        engine = llms[mode].llm_engine
        engine.add_request("copy", {"prompt_token_ids": prompt}, params)
        count, text = 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].token_ids
            count += 1
        steps[mode] = (count, text)
    assert steps["sync"][1] == steps["off"][1]
    assert steps["sync"][0] * 2 <= steps["off"][0], steps


def test_constrained_requests_never_draft_and_keep_their_grammar(llms):
    """A request with an output grammar takes no drafts (its masks follow kept tokens
    only): on a copy task that drafts a lot unconstrained, the constrained run verifies
    none, and its text is what speculation off produces, a valid choice."""
    from pagoda.sampling_params import StructuredOutputsParams

    prompt = grounded_prompts(llms["off"].get_tokenizer())[0]
    choices = ["Pagoda keeps the KV cache", "blocks of sixteen tokens"]
    params = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    want = llms["off"].generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    engine = llms["sync"].llm_engine
    before = engine.get_stats().spec_decode.num_draft_tokens
    got = llms["sync"].generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert got == want and got in choices
    assert engine.get_stats().spec_decode.num_draft_tokens == before
    assert_all_blocks_free(llms["sync"])
