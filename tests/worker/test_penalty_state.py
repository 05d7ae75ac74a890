"""The penalties' history kept on the device between steps (pagoda/worker/penalty_state.py)
equals the history counted from scratch from the host's token lists, exactly.

- A randomized simulation drives PenaltyState directly: requests entering, leaving,
  preempted and resumed with their outputs, single-row steps counted on the device,
  verify steps (drafts, kept tokens caught up from the host), tokens still pending
  on the device (async scheduling), and table growth.
- Engine runs (tiny dummy model, CPU) with frequency / presence / repetition
  penalties mixed with plain rows, async scheduling on and off, a KV pool small
  enough to preempt, and verify-shaped steps: at every step the runner's penalty
  tensors are compared with build_sampling_metadata's from-scratch ones, and the
  outputs with those of an engine whose history is rebuilt every step.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers.drafting_helpers import DraftingExecutor

from pagoda import LLM, SamplingParams
from pagoda.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.sample.metadata import (
    PendingOutputs,
    SamplingRow,
    build_sampling_metadata,
    uses_penalties,
)
from pagoda.spec_decode.verify import accept_draft_tokens
from pagoda.worker.input_batch import apply_scheduler_output
from pagoda.worker.penalty_state import PenaltyState

VOCAB = 23
KINDS = [
    SamplingParams(),
    SamplingParams(frequency_penalty=0.5),
    SamplingParams(presence_penalty=-0.25),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(repetition_penalty=0.75, frequency_penalty=0.25, presence_penalty=0.5),
]


def assert_same_penalties(rows, incremental, reference) -> int:
    """Compares the penalty rows (rows without penalties may differ: neutral values
    make them irrelevant); returns how many rows were compared."""
    assert (incremental is None) == (reference is None)
    if reference is None:
        return 0
    compared = 0
    for i, row in enumerate(rows):
        if not uses_penalties(row.params):
            continue
        assert torch.equal(incremental.output_token_counts[i], reference.output_token_counts[i]), i
        if row.params.repetition_penalty != 1.0:
            assert torch.equal(incremental.prompt_mask[i], reference.prompt_mask[i]), i
        compared += 1
    for name in ("repetition", "frequency", "presence"):
        a, b = getattr(incremental, name), getattr(reference, name)
        assert (a is None and b is None) or torch.equal(a, b)
    return compared


class Simulation:
    """A scheduler and a sampler in miniature around a real PenaltyState.

    Tokens sampled at step s reach the worker's host lists at step s + 1 (sync) or
    s + 2 (async: the step in between sees them as pending on the device); a request
    that verified drafts waits for its kept tokens before running again, as the
    worker requires."""

    def __init__(self, seed: int, async_scheduling: bool) -> None:
        self.rng = random.Random(seed)
        self.lag = 2 if async_scheduling else 1
        self.penalties = PenaltyState(VOCAB, "cpu", initial_rows=2)
        self.states = {}
        self.params, self.prompt, self.truth = {}, {}, {}
        self.deliveries: dict[str, list[tuple[int, list[int]]]] = {}
        self.sent: dict[str, int] = {}
        self.running: set[str] = set()
        self.preempted: dict[str, int] = {}  # req_id -> step preempted
        self.blocked_until: dict[str, int] = {}
        self.prev = None  # (sampled ids, req_id -> row) of the last step
        self.prev_single: set[str] = set()
        self.next_id = 0
        self.stats = {"compared": 0, "pending": 0, "verify": 0, "resumed": 0}

    def run(self, steps: int) -> None:
        for step in range(steps):
            self.step(step)

    def _leave(self, step: int, out: SchedulerOutput) -> None:
        for rid in sorted(self.running):
            roll = self.rng.random()
            if roll < 0.08:
                self.running.discard(rid)
                out.finished_req_ids.add(rid)
            elif roll < 0.16:  # its tokens in flight reach the scheduler (truth) before it resumes
                self.running.discard(rid)
                self.preempted[rid] = step
                self.deliveries[rid] = []
                self.blocked_until.pop(rid, None)
                out.preempted_req_ids.add(rid)

    def _enter(self, step: int, out: SchedulerOutput) -> None:
        for rid, when in sorted(self.preempted.items()):
            if when < step and self.rng.random() < 0.5:
                del self.preempted[rid]
                self._send_new(rid, out)
                self.stats["resumed"] += 1
        while len(self.running) < 6 and self.rng.random() < 0.7:
            rid = str(self.next_id)
            self.next_id += 1
            self.params[rid] = self.rng.choice(KINDS)
            self.prompt[rid] = [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(1, 9))]
            self.truth[rid] = [self.rng.randrange(4) for _ in range(self.rng.randrange(3))]
            self.deliveries[rid] = []
            self._send_new(rid, out)

    def _send_new(self, rid: str, out: SchedulerOutput) -> None:
        self.running.add(rid)
        self.sent[rid] = len(self.truth[rid])
        out.scheduled_new_reqs.append(
            NewRequestData(
                rid, list(self.prompt[rid]), list(self.truth[rid]), self.params[rid], [0], 0
            )
        )

    def step(self, step: int) -> None:
        out = SchedulerOutput([], [], {}, 0)
        self._leave(step, out)
        self._enter(step, out)
        new_ids = {n.req_id for n in out.scheduled_new_reqs}
        scheduled = [
            rid
            for rid in sorted(self.running)
            if rid in new_ids or self.blocked_until.get(rid, 0) <= step
        ]
        for rid in scheduled:
            delivered = [t for s, tokens in self.deliveries[rid] if s <= step for t in tokens]
            self.deliveries[rid] = [(s, t) for s, t in self.deliveries[rid] if s > step]
            if rid not in new_ids:
                out.scheduled_cached_reqs.append(CachedRequestData(rid, delivered, [], 0))
            pending = rid in self.prev_single and bool(self.deliveries[rid])
            num_drafts = 0 if self.rng.random() < 0.6 else self.rng.randrange(1, 4)
            out.num_scheduled_tokens[rid] = 1 + num_drafts
            if num_drafts:
                out.scheduled_spec_decode_tokens[rid] = [
                    self.rng.randrange(VOCAB) for _ in range(num_drafts)
                ]
            self.stats["pending"] += pending
        apply_scheduler_output(self.states, out, lambda seed: None)
        self.penalties.apply(out, self.states)
        self._sample(step, scheduled)

    def _sample(self, step: int, scheduled: list[str]) -> None:
        sample_req_ids, rows, drafts, pending_rows, sources, num_known = [], [], {}, [], [], {}
        for rid in scheduled:
            state = self.states[rid]
            pending = rid in self.prev_single and bool(self.deliveries[rid])
            drafts[rid] = list(state.spec_token_ids)
            num_known[rid] = len(state.output_token_ids) + pending
            for j in range(len(drafts[rid]) + 1):
                if pending:
                    pending_rows.append(len(rows))
                    sources.append(self.prev[1][rid])
                sample_req_ids.append(rid)
                rows.append(
                    SamplingRow(
                        state.params,
                        state.prompt_token_ids,
                        state.output_token_ids + drafts[rid][:j],
                        num_pending_outputs=int(pending),
                    )
                )
        if not rows:
            self.prev, self.prev_single = None, set()
            return
        step_penalties = self.penalties.begin_step(
            sample_req_ids,
            {r: d for r, d in drafts.items() if d},
            {r: n for r, n in num_known.items() if r in self.penalties},
        )
        reference = build_sampling_metadata(
            rows,
            VOCAB,
            "cpu",
            pending_outputs=PendingOutputs(
                pending_rows,
                sources,
                self.prev[0] if self.prev else torch.zeros(0, dtype=torch.long),
            ),
        )
        incremental = build_sampling_metadata(rows, VOCAB, "cpu", penalty_history=step_penalties)
        self.stats["compared"] += assert_same_penalties(
            rows, incremental.penalties, reference.penalties
        )
        sampled = self._draw(sample_req_ids, drafts)
        if step_penalties is not None:
            step_penalties.record_sampled(sampled)
        self._keep(step, sample_req_ids, drafts, sampled.tolist())

    def _draw(self, sample_req_ids: list[str], drafts: dict[str, list[int]]) -> torch.Tensor:
        """Random tokens (few distinct: counts above 1); a verify row matches its draft
        often, so some steps keep several tokens."""
        tokens, offset = [], 0
        for i, rid in enumerate(sample_req_ids):
            offset = offset + 1 if i and sample_req_ids[i - 1] == rid else 0
            if offset < len(drafts[rid]) and self.rng.random() < 0.7:
                tokens.append(drafts[rid][offset])
            else:
                tokens.append(self.rng.randrange(6))
        return torch.tensor(tokens, dtype=torch.long)

    def _keep(self, step: int, sample_req_ids: list[str], drafts, sampled: list[int]) -> None:
        index_of, by_request = {}, {}
        for row, (rid, token) in enumerate(zip(sample_req_ids, sampled)):
            by_request.setdefault(rid, []).append(token)
            index_of[rid] = row
        self.prev_single = set()
        for rid, tokens in by_request.items():
            kept = accept_draft_tokens(tokens, drafts[rid]) if drafts[rid] else tokens
            self.truth[rid].extend(kept)
            self.deliveries[rid].append((step + self.lag, kept))
            if drafts[rid]:
                self.blocked_until[rid] = step + self.lag
                self.stats["verify"] += 1
            else:
                self.prev_single.add(rid)
        self.prev = (torch.tensor(sampled, dtype=torch.long), index_of)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_history_equals_from_scratch(seed, async_scheduling):
    sim = Simulation(seed, async_scheduling)
    sim.run(120)
    stats = sim.stats
    assert stats["compared"] > 200 and stats["verify"] > 20 and stats["resumed"] > 5
    assert sim.penalties.capacity > 2  # grown from initial_rows=2 at least once
    assert (stats["pending"] > 50) == async_scheduling
    # Rows of requests that left are free again: only running penalty requests hold one.
    held = {rid for rid in sim.running if uses_penalties(sim.params[rid])}
    assert set(sim.penalties.row_of) == held


def test_no_penalty_request_allocates_nothing():
    state = PenaltyState(VOCAB, "cpu")
    out = SchedulerOutput(
        [NewRequestData("a", [1, 2], [3], SamplingParams(), [0], 0)], [], {"a": 1}, 1
    )
    states = {}
    apply_scheduler_output(states, out, lambda seed: None)
    state.apply(out, states)
    assert state.counts is None and state.prompt_mask is None
    assert state.begin_step(["a"], {}, {}) is None


def test_prompt_mask_only_with_the_repetition_penalty():
    state = PenaltyState(VOCAB, "cpu")
    out = SchedulerOutput(
        [NewRequestData("f", [1, 2], [3, 3], SamplingParams(frequency_penalty=1.0), [0], 0)],
        [],
        {"f": 1},
        1,
    )
    states = {}
    apply_scheduler_output(states, out, lambda seed: None)
    state.apply(out, states)
    assert state.prompt_mask is None and state.counts[state.row_of["f"], 3] == 2.0
    with pytest.raises(ValueError, match=r"output_token_ids must hold token ids in \[0, 23\)"):
        bad = SchedulerOutput(
            [NewRequestData("b", [1], [99], SamplingParams(presence_penalty=1.0), [0], 0)],
            [],
            {"b": 1},
            1,
        )
        apply_scheduler_output(states, bad, lambda seed: None)
        state.apply(bad, states)


# ------------------------------------------------------------------ engine runs


def make_llm(async_scheduling: bool, incremental: bool, blocks: int = 12) -> LLM:
    llm = LLM(
        "tiny-llama",
        load_format="dummy",
        device="cpu",
        max_model_len=128,
        block_size=8,
        num_gpu_blocks_override=blocks,
        max_num_batched_tokens=48,
        max_num_seqs=16,
        seed=1,
        async_scheduling=async_scheduling,
        enable_prefix_caching=False,
    )
    if not incremental:
        llm.llm_engine.executor.runner.penalty_state = None
    return llm


def engine_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, frequency_penalty=0.4, ignore_eos=True),
        SamplingParams(
            max_tokens=18, temperature=0.9, seed=4, repetition_penalty=1.3, ignore_eos=True
        ),
        SamplingParams(
            max_tokens=16,
            temperature=0,
            presence_penalty=0.6,
            repetition_penalty=1.1,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=22, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(
            max_tokens=14,
            temperature=0.7,
            seed=9,
            frequency_penalty=-0.3,
            min_tokens=5,
            ignore_eos=True,
        ),
    ]


def prompts(count: int) -> list[list[int]]:
    return [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + (7 * i) % 23)] for i in range(count)]


class PenaltyCheck:
    """Wraps the runner's _sample: each step's penalty tensors against the ones
    build_sampling_metadata counts from the host's lists (and pending tokens)."""

    def __init__(self, runner, monkeypatch) -> None:
        import pagoda.worker.model_runner as model_runner

        self.runner, self.compared, self.pending_rows = runner, 0, 0
        self.captured = []
        inner_build, inner_sample = model_runner.build_sampling_metadata, runner._sample

        def build(*args, **kwargs):
            self.captured.append(inner_build(*args, **kwargs))
            return self.captured[-1]

        def sample(hidden, inputs, compacted, extras):
            reference = None
            if inputs.sample_rows:
                rows = runner._sampling_rows(inputs)
                pending = runner._pending_outputs(inputs)
                self.pending_rows += 0 if pending is None else len(pending.rows)
                reference = build_sampling_metadata(
                    rows, runner.vocab_size, runner.device, pending_outputs=pending
                )
            self.captured.clear()
            result = inner_sample(hidden, inputs, compacted, extras)
            if reference is not None:
                self.compared += assert_same_penalties(
                    rows, self.captured[-1].penalties, reference.penalties
                )
            return result

        monkeypatch.setattr(model_runner, "build_sampling_metadata", build)
        monkeypatch.setattr(runner, "_sample", sample)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_incremental_equals_rebuilt_with_preemption(async_scheduling, monkeypatch):
    params = engine_params() * 3
    reference_llm = make_llm(async_scheduling, incremental=False)
    reference = token_ids(reference_llm.generate(prompts(18), params, use_tqdm=False))
    llm = make_llm(async_scheduling, incremental=True)
    engine = llm.llm_engine
    check = PenaltyCheck(engine.executor.runner, monkeypatch)
    outputs = token_ids(llm.generate(prompts(18), params, use_tqdm=False))
    assert engine.get_stats().num_preemptions > 0
    assert check.compared > 100
    assert (check.pending_rows > 0) == async_scheduling
    assert outputs == reference
    assert engine.executor.runner.penalty_state.row_of == {}
    assert engine.audit_kv_cache().in_use == 0


def test_engine_verify_steps_incremental_equals_rebuilt(monkeypatch):
    params = [p for p in engine_params() if p.temperature == 0] * 2
    plain = token_ids(
        make_llm(False, True, blocks=64).generate(prompts(len(params)), params, use_tqdm=False)
    )
    results = []
    for incremental in (False, True):
        llm = make_llm(False, incremental, blocks=64)
        engine = llm.llm_engine
        engine._ids = iter(range(100))  # request ids "0", "1", ...
        drafting = DraftingExecutor(
            engine.executor,
            {str(i): r for i, r in enumerate(plain)},
            monkeypatch,
            num_drafts=3,
            wrong=lambda rid: int(rid) % 2 == 1,
            vocab_size=512,
        )
        if incremental:
            check = PenaltyCheck(engine.executor.runner, monkeypatch)
        results.append(token_ids(llm.generate(prompts(len(params)), params, use_tqdm=False)))
        assert drafting.kept_several > 5
    assert check.compared > 20
    assert results[0] == results[1]
