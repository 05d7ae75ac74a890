"""Optimistic scheduling of speculating requests under async scheduling
(core/optimistic_drafts.py), on test_spec_scheduling's fake verifying worker, which
corrects an optimistic step the way the real worker does and checks its KV.

Exact comparisons with the synchronous schedule: a speculating request is scheduled
in every step (no held, empty step), and after each update its num_computed_tokens,
block count and block table are those the synchronous schedule holds at the same
point (after the update of step N and the scheduling of step N + 1).
"""

from __future__ import annotations

import test_spec_scheduling
from helpers.scheduler_harness import BLOCK_SIZE, alone, make_request, make_scheduler, next_token
from test_spec_scheduling import VerifyingRunner, run

from pagoda.core.outputs import ModelRunnerOutput
from pagoda.spec_decode.planning.budget import SpecBudget
from pagoda.spec_decode.planning.optimistic import PLACEHOLDER_DRAFT
from pagoda.spec_decode.planning.planner import DraftPlanner

K = 3


def worker_scheduler(pipelined: bool, **kwargs):
    """A scheduler whose drafts come from the worker (k = 3 every step)."""
    planner = DraftPlanner(SpecBudget(K, 64, adaptive=False), 256)
    return make_scheduler(
        async_scheduling=pipelined, draft_planner=planner, num_lookahead_tokens=K, **kwargs
    )


def truthful(tokens: list[int], k: int) -> list[int]:
    """Drafts the target always accepts."""
    tokens, drafts = list(tokens), []
    for _ in range(k):
        drafts.append(next_token(tokens))
        tokens.append(drafts[-1])
    return drafts


def trace(pipelined: bool, max_tokens: int = 100):
    """Runs one request; per loop iteration: (its scheduled tokens, and after the
    iteration's schedule and update: num_computed_tokens, block ids)."""
    sched = worker_scheduler(pipelined)
    request = make_request("A", [3, 1, 4, 1, 5], max_tokens=max_tokens)
    sched.add_request(request)
    runner = VerifyingRunner(lookahead=K)
    rows, in_flight = [], None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        launched = (out, runner.execute(out))
        if pipelined:
            launched, in_flight = in_flight, launched
        else:  # the synchronous state at the async one's point: before this update
            rows.append(state(sched, request, out))
        if launched is not None:
            sched.update_from_output(*launched)
        if pipelined:
            rows.append(state(sched, request, out))
        sched.kv_cache_manager.audit()
    return rows, request, runner


def state(sched, request, out):
    return (
        out.num_scheduled_tokens.get("A", 0),
        request.num_computed_tokens,
        sched.kv_cache_manager.get_block_ids("A"),
    )


def test_accepted_drafts_every_step_match_the_synchronous_schedule(monkeypatch):
    monkeypatch.setattr(test_spec_scheduling, "oracle", truthful)
    sync_rows, sync_req, _ = trace(False)
    async_rows, async_req, runner = trace(True)
    assert async_req.output_token_ids == sync_req.output_token_ids == alone([3, 1, 4, 1, 5], 100)
    # The prompt's step (asked for drafts), then the bonus + 3 drafts every step.
    assert [r[0] for r in sync_rows[:5]] == [5, 4, 4, 4, 4]
    assert async_rows[:20] == sync_rows[:20]
    # Every step after the prompt's is scheduled (none held), and optimistic.
    assert all(r[0] > 0 for r in async_rows[:-1])
    assert runner.optimistic_steps >= 20


def test_rejected_drafts_roll_back_to_the_synchronous_schedule():
    # The oracle gets the second draft wrong when the sequence length is 0 mod 3.
    sync_rows, sync_req, sync_runner = trace(False)
    async_rows, async_req, runner = trace(True)
    assert async_req.output_token_ids == sync_req.output_token_ids == alone([3, 1, 4, 1, 5], 100)
    assert len(set(r[0] for r in sync_rows)) > 1 and sync_runner.verify_steps > 10
    accepted = [r[1] for r in sync_rows]
    assert any(b - a < 4 for a, b in zip(accepted[2:], accepted[3:]))  # some rejections
    # Away from max_tokens (where the optimistic room is smaller) the states match.
    assert async_rows[:15] == sync_rows[:15]
    assert all(r[0] > 0 for r in async_rows[:-1])


def test_rollback_frees_the_blocks_the_optimistic_step_took():
    sched = worker_scheduler(True)
    sched.add_request(make_request("A", 6, max_tokens=50))
    kv = sched.kv_cache_manager
    out1 = sched.schedule()  # the prompt, asked for 3 drafts
    assert out1.num_drafts_to_propose == {"A": K}
    out2 = sched.schedule()  # optimistic: bonus + 3 placeholder drafts
    assert out2.scheduled_spec_decode_tokens == {"A": [PLACEHOLDER_DRAFT] * K}
    assert out2.num_scheduled_tokens == {"A": 4} and out2.num_drafts_to_propose == {"A": K}
    sched.update_from_output(
        out1, ModelRunnerOutput(["A"], [[11]], spec_token_ids={"A": [12, 13, 14]})
    )
    request = sched.get_request("A")
    assert (request.num_computed_tokens, request.num_output_placeholders) == (10, 4)
    out3 = sched.schedule()  # as if step 2 accepted all: 6 + 4 + 4 computed, + 3
    assert (request.num_computed_tokens, request.num_output_placeholders) == (14, 8)
    assert len(kv.get_block_ids("A")) == -(-(14 + K) // BLOCK_SIZE) == 5
    # Step 2 rejected its 3 drafts: one token (the bonus).
    sched.update_from_output(
        out2, ModelRunnerOutput(["A"], [[20]], spec_token_ids={"A": [21, 22, 23]})
    )
    # Synchronous: 8 tokens known, 7 computed; step 3 computes the bonus and 3 drafts
    # (to 11) and reserves 3 more slots: 4 blocks, not 5.
    assert request.output_token_ids == [11, 20]
    assert (request.num_computed_tokens, request.num_output_placeholders) == (11, 4)
    assert len(kv.get_block_ids("A")) == 4
    # The freed block heads the free list: the next allocation takes it back.
    assert (
        next(iter(kv.block_pool.free_queue)).block_id
        == out3.scheduled_cached_reqs[0].new_block_ids[-1]
    )
    assert sched.draft_planner.stats.num_draft_tokens == 3  # the worker's [12, 13, 14]
    out4 = sched.schedule()
    assert out4.trimmed_block_tables == {"A": 4}
    assert out4.scheduled_cached_reqs[0].new_token_ids == [20]
    assert sched.schedule().trimmed_block_tables == {}  # told once
    kv.audit()


def test_stop_token_mid_draft_drops_the_launched_step():
    expected = alone([2, 7, 1, 8], 40)
    stop_at = next(i for i in range(6, 40) if expected[i] not in expected[:i])
    sched = worker_scheduler(True)
    sched.add_request(make_request("A", [2, 7, 1, 8], max_tokens=40, eos=expected[stop_at]))
    runner = VerifyingRunner(lookahead=K)
    tokens, reasons = run(sched, runner, pipelined=True)
    assert tokens["A"] == expected[: stop_at + 1] and reasons["A"] == "stop"
    assert runner.optimistic_steps > 0
    check_cached_blocks(sched, runner)


def test_max_tokens_cut_mid_draft():
    for max_tokens in (6, 7, 8, 9):
        sched = worker_scheduler(True)
        sched.add_request(make_request("A", [4, 4, 2], max_tokens=max_tokens))
        runner = VerifyingRunner(lookahead=K)
        tokens, reasons = run(sched, runner, pipelined=True)
        assert tokens["A"] == alone([4, 4, 2], max_tokens) and reasons["A"] == "length"
        check_cached_blocks(sched, runner)


def test_batch_with_preemption_and_prefix_hits_equals_plain_decoding():
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]  # shared: later requests hit its blocks
    sched = worker_scheduler(True, num_blocks=20, budget=16, max_num_seqs=4)
    requests = [make_request(f"r{i}", prompt + [i + 1], max_tokens=20 + 3 * i) for i in range(5)]
    for r in requests:
        sched.add_request(r)
    runner = VerifyingRunner(lookahead=K)
    tokens, reasons = run(sched, runner, pipelined=True)
    for r in requests:
        assert tokens[r.request_id] == alone(r.prompt_token_ids, r.max_tokens)
    assert sched.num_preemptions_total > 0 and runner.optimistic_steps > 10
    assert sched.kv_cache_manager.prefix_cache_stats.hits > 0
    check_cached_blocks(sched, runner)


def check_cached_blocks(sched, runner):
    """Every block in the prefix cache holds, in the fake KV, the tokens it is cached
    under: no draft or discarded token ever reached a cached block."""
    pool = sched.kv_cache_manager.block_pool
    assert sched.kv_cache_manager.audit().in_use == 0
    for block in pool.cached_blocks.values():
        held = [runner.kv.get((block.block_id, j)) for j in range(BLOCK_SIZE)]
        assert held == list(block.token_ids), block
