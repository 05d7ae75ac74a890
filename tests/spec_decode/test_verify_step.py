"""Verify-shaped steps and step extras through the real model runner on CPU.

A test-only proposer hands the scheduler draft tokens after each step (as a
speculative proposer will): the greedy reference continuation for some requests,
a continuation with a wrong token for others. The runner then samples one row per
draft plus one and keeps the matching prefix. Outputs must equal plain greedy
decoding exactly, and each step's token count must be exactly the accepted drafts
plus one. A grammar bitmask given through StepExtras restricts what is sampled.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.drafting_helpers import DraftingExecutor

from pagoda import LLM, SamplingParams
from pagoda.core.outputs import StepExtras
from pagoda.sample.token_bitmask import bitmask_words
from pagoda.spec_decode.verify import accept_draft_tokens

NUM_DRAFTS = 3
PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(5 + 4 * i)] for i in range(4)]
MAX_TOKENS = 14


def make_llm(async_scheduling=False) -> LLM:
    return LLM(
        "tiny-llama",
        load_format="dummy",
        device="cpu",
        max_model_len=128,
        kv_cache_memory=1 << 22,
        block_size=8,
        seed=1,
        async_scheduling=async_scheduling,
    )


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_verify_steps_keep_exactly_the_matching_drafts(monkeypatch):
    llm = make_llm()
    reference = greedy(llm)
    engine = llm.llm_engine
    drafting = DraftingExecutor(
        engine.executor,
        {str(i): r for i, r in enumerate(reference)},
        monkeypatch,
        NUM_DRAFTS,
        wrong=lambda rid: rid == "1",
        vocab_size=256,
    )
    # Request ids "0".."3": the engine numbers requests from its own counter.
    engine._ids = iter(range(100))
    assert greedy(llm) == reference
    verify_steps = [s for s in drafting.steps if s[1]]
    assert verify_steps, "no step verified drafts"
    for _rid, drafts, kept in drafting.steps:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == kept[accepted]:
            accepted += 1
        assert len(kept) == accepted + 1
    # Correct drafts are all kept: requests 0, 2, 3 finish in far fewer steps.
    steps_of = {rid: sum(1 for s in drafting.steps if s[0] == rid) for rid in "0123"}
    assert steps_of["0"] <= 1 + -(-(MAX_TOKENS - 1) // (NUM_DRAFTS + 1))
    assert any(len(kept) == 2 and drafts for rid, drafts, kept in drafting.steps if rid == "1")
    assert engine.audit_kv_cache().in_use == 0


def test_accept_draft_tokens():
    assert accept_draft_tokens([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]
    assert accept_draft_tokens([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
    assert accept_draft_tokens([1, 2], [3]) == [1]
    assert accept_draft_tokens([8], []) == [8]
    with pytest.raises(ValueError, match="one row per draft plus one"):
        accept_draft_tokens([1, 2], [])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grammar_bitmask_in_step_extras_restricts_sampling(monkeypatch, async_scheduling):
    llm = make_llm(async_scheduling)
    engine = llm.llm_engine
    vocab = engine.model_info.vocab_size
    allowed = {"0": 11, "1": vocab - 1}  # request 2 unmasked
    inner = engine.executor.sample_tokens

    def with_masks(extras=None):
        runner = engine.executor.runner
        launched = runner._launched.inputs
        masks = {}
        for rid, token in allowed.items():
            rows = 0 if launched is None else launched.sample_req_ids.count(rid)
            if rows:
                mask = np.zeros((rows, bitmask_words(vocab)), dtype=np.int32)
                mask[:, token // 32] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
                masks[rid] = mask
        return inner(StepExtras(grammar_bitmasks=masks))

    monkeypatch.setattr(engine.executor, "sample_tokens", with_masks)
    engine._ids = iter(range(100))
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [11] * 6
    assert outs[1].outputs[0].token_ids == [vocab - 1] * 6
    assert len(set(outs[2].outputs[0].token_ids)) > 1
