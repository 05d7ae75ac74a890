"""Draft-model speculation on tiny random checkpoints (CPU): the draft's own KV layers
in the target's blocks, its lazy catch-up (chunked when long), and the checks at start.

A draft with the target's own weights must have every greedy draft accepted: any
slip in what the draft's cache holds (a position fed twice or never, a stale block
after preemption, a missed pending token under async scheduling) would show up as a
rejected draft. A draft with other weights leaves outputs equal to speculation off.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engine_checks import assert_all_blocks_free
from helpers.tiny_models import save_tiny_hf_model, save_tiny_servable_model

from pagoda import LLM, SamplingParams

# A random model over 49152 ids is never sure of its argmax: its top probability is a
# few percent, so a threshold of 1% withholds some of its drafts and keeps others.
THRESHOLD = 0.01


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    # Tied embeddings over the embedded SmolLM2 tokenizer's 49152 ids.
    save_tiny_servable_model(root / "target", seed=0, num_hidden_layers=3)
    save_tiny_servable_model(
        root / "other",
        seed=1,
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    save_tiny_servable_model(root / "short", seed=2, max_position_embeddings=64)
    save_tiny_hf_model(root / "vocab", "llama", seed=3, vocab_size=256)
    return {name: str(root / name) for name in ("target", "other", "short", "vocab")}


def make_llm(target, speculative_config=None, async_scheduling=False) -> LLM:
    # 12 blocks of 16 tokens, 32 tokens a step: chunked prefill, chunked draft
    # catch-ups (up to 32 rows a forward) and preemption.
    return LLM(
        target,
        max_model_len=256,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        num_gpu_blocks_override=12,
        async_scheduling=async_scheduling,
        speculative_config=speculative_config,
        dtype="float32",
    )


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 49152, size=48).tolist()
    out = [shared + rng.integers(3, 49152, size=n).tolist() for n in (9, 30)]  # prefix hits
    out += [rng.integers(3, 49152, size=n).tolist() for n in (70, 5, 41)]
    return [{"prompt_token_ids": p} for p in out]


def run(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(checkpoints):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    return run(make_llm(checkpoints["target"]), greedy)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_draft_with_the_targets_weights_has_every_greedy_draft_accepted(
    checkpoints, expected, async_scheduling
):
    spec = {"model": checkpoints["target"], "num_speculative_tokens": 3, "adaptive": False}
    llm = make_llm(checkpoints["target"], spec, async_scheduling)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert run(llm, greedy) == expected
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    spec_stats = stats.spec_decode
    assert spec_stats.num_draft_tokens > 30
    assert spec_stats.num_accepted_tokens == spec_stats.num_draft_tokens
    assert_all_blocks_free(llm)


def test_draft_with_other_weights_leaves_outputs_unchanged(checkpoints, expected):
    spec = {"model": checkpoints["other"], "num_speculative_tokens": 2, "adaptive": False}
    llm = make_llm(checkpoints["target"], spec, async_scheduling=True)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert run(llm, greedy) == expected
    spec_stats = llm.llm_engine.get_stats().spec_decode
    assert spec_stats.num_draft_tokens > spec_stats.num_accepted_tokens
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_confidence_threshold_withholds_unsure_drafts(checkpoints, expected, async_scheduling):
    # Async, optimistic steps count 3 drafts; the worker computes rows only for those
    # its drafter proposed.
    drafted = {}
    for threshold in (None, THRESHOLD):
        spec = {
            "model": checkpoints["target"],
            "num_speculative_tokens": 3,
            "adaptive": False,
            "draft_confidence_threshold": threshold,
        }
        if threshold is None:
            del spec["draft_confidence_threshold"]
        llm = make_llm(checkpoints["target"], spec, async_scheduling)
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        assert run(llm, greedy) == expected
        drafted[threshold] = llm.llm_engine.get_stats().spec_decode.num_draft_tokens
    assert 0 < drafted[THRESHOLD] < drafted[None], drafted


def test_draft_needs_the_targets_vocabulary_and_context(checkpoints):
    with pytest.raises(ValueError, match="vocabulary of 256 tokens, the target 49152"):
        make_llm(
            checkpoints["target"], {"model": checkpoints["vocab"], "num_speculative_tokens": 2}
        )
    with pytest.raises(ValueError, match="holds 64 positions, fewer than max_model_len"):
        make_llm(
            checkpoints["target"], {"model": checkpoints["short"], "num_speculative_tokens": 2}
        )


def watch_schedules(llm) -> dict:
    """Counts, from here on, the steps scheduled with placeholder drafts (optimistic)
    and the schedule() calls that held the batch for drafts."""
    from pagoda.spec_decode.planning.optimistic import is_placeholder

    scheduler = llm.llm_engine.scheduler
    planner = scheduler.draft_planner
    counts = {"optimistic": 0, "held": 0}
    schedule, holds = scheduler.schedule, planner.holds_batch

    def counting_schedule():
        out = schedule()
        counts["optimistic"] += any(map(is_placeholder, out.scheduled_spec_decode_tokens.values()))
        return out

    def counting_holds(running):
        held = holds(running)
        counts["held"] += held
        return held

    scheduler.schedule, planner.holds_batch = counting_schedule, counting_holds
    return counts


@pytest.mark.parametrize("draft", ["target", "other"])
def test_async_speculation_keeps_the_overlap_through_stops_and_seeds(checkpoints, draft):
    """Async scheduling with a worker drafter never holds the batch: steps are scheduled
    optimistically, and outputs still equal speculation off's when requests stop on a
    stop token or max_tokens in the middle of their drafts (the step launched after
    the stop is dropped), and with seeded sampling (its randomness per output index)."""
    off = make_llm(checkpoints["target"])
    spec = {"model": checkpoints[draft], "num_speculative_tokens": 3, "adaptive": False}
    llm = make_llm(checkpoints["target"], spec, async_scheduling=True)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reference = run(off, greedy)
    stops = [tokens[9] for tokens in reference]  # mid-generation: mid-draft for some
    params = [
        SamplingParams(max_tokens=24 - i, temperature=0, stop_token_ids=[stop])
        for i, stop in enumerate(stops)
    ]
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    want = (
        [o.outputs[0].token_ids for o in off.generate(prompts(), params, use_tqdm=False)],
        run(off, seeded),
    )
    counts = watch_schedules(llm)
    stopped = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    spec_stats = llm.llm_engine.get_stats().spec_decode
    accepted = (spec_stats.num_accepted_tokens, spec_stats.num_draft_tokens)
    assert (stopped, run(llm, seeded)) == want
    for tokens, stop, param in zip(stopped, stops, params):
        assert tokens[-1] == stop or len(tokens) == param.max_tokens
    assert counts["held"] == 0 and counts["optimistic"] > 10, counts
    assert llm.llm_engine.get_stats().num_preemptions > 0
    if draft == "target":  # greedy drafts of the target itself: all accepted
        assert accepted[0] == accepted[1] > 30
    assert_all_blocks_free(llm)
