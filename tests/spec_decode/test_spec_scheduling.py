"""Speculative decoding in the scheduler (DraftPlanner + SpecBudget), on a fake worker.

The fake worker verifies drafts the way the real one does: one sampled row per draft
plus one, the kept tokens the matching prefix and the next row (pagoda.spec_decode.verify).
Its tokens are a function of the whole sequence (test_scheduler.next_token), so
outputs must equal plain decoding whatever the drafts, under chunked prefill,
preemption and async scheduling; and its KV check catches a wrong rollback. Drafts
come from an oracle that knows the true continuation and corrupts some of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from helpers.scheduler_harness import (
    BLOCK_SIZE,
    FakeRunner,
    alone,
    make_request,
    make_scheduler,
    next_token,
)

from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.spec_decode.planning.budget import SpecBudget
from pagoda.spec_decode.planning.optimistic import PLACEHOLDER_DRAFT
from pagoda.spec_decode.planning.planner import DraftPlanner
from pagoda.spec_decode.verify import accept_draft_tokens


def oracle(tokens: list[int], k: int) -> list[int]:
    """The true next k tokens, with the second one wrong when len(tokens) % 3 == 0."""
    tokens, drafts = list(tokens), []
    for _ in range(k):
        drafts.append(next_token(tokens))
        tokens.append(drafts[-1])
    if len(drafts) > 1 and len(tokens) % 3 == 0:
        drafts[1] = (drafts[1] + 1) % 50
    return drafts


@dataclass
class _Optimism:
    """What the worker knows that the scheduler does not yet, per request (the real
    worker's CachedRequestState fields of the same names)."""

    num_unsent: int = 0  # tokens at the end of seq.tokens the scheduler has not sent
    num_rejected: int = 0  # drafts its last step rejected (scheduled - accepted)
    proposed: list = field(default_factory=list)  # drafts proposed after its last step


@dataclass
class VerifyingRunner(FakeRunner):
    """FakeRunner with verify rows, the previous step's tokens fed from its own record
    (async scheduling), and drafts proposed on the worker when asked. Like the real
    worker, a request asked to propose keeps its kept tokens on the worker's host, and
    its optimistic next step (placeholder drafts) is corrected there: drafts from its
    own proposals, positions from its own count of rejected drafts."""

    last_sampled: dict = field(default_factory=dict)
    verify_steps: int = 0
    optimistic_steps: int = 0
    lookahead: int = 0
    optimism: dict = field(default_factory=dict)  # req_id -> _Optimism

    def _apply_diff(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.seqs.pop(rid, None)
            self.optimism.pop(rid, None)
        for rid, keep in out.trimmed_block_tables.items():
            if rid in self.seqs:
                assert keep < len(self.seqs[rid].blocks)
                del self.seqs[rid].blocks[keep:]
        cached = out.scheduled_cached_reqs
        super()._apply_diff(dataclasses.replace(out, scheduled_cached_reqs=[]))
        for new in out.scheduled_new_reqs:
            self.optimism[new.req_id] = _Optimism()
        for data in cached:
            seq, mine = self.seqs[data.req_id], self.optimism[data.req_id]
            known = len(seq.tokens) - mine.num_unsent
            overlap = min(mine.num_unsent, len(data.new_token_ids))
            assert seq.tokens[known : known + overlap] == data.new_token_ids[:overlap]
            seq.tokens += data.new_token_ids[overlap:]
            mine.num_unsent -= overlap
            surplus = mine.num_rejected if mine.num_unsent else 0
            assert data.num_computed_tokens - surplus == seq.num_computed, data.req_id
            seq.blocks += data.new_block_ids

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(out)
        req_ids, sampled, proposals, now = [], [], {}, {}
        for rid, num_tokens in out.num_scheduled_tokens.items():
            seq, mine = self.seqs[rid], self.optimism[rid]
            scheduled = out.scheduled_spec_decode_tokens.get(rid, [])
            drafts = scheduled
            if mine.num_unsent:  # optimistic: the worker's own drafts, at true positions
                assert all(d == PLACEHOLDER_DRAFT for d in scheduled), rid
                drafts = mine.proposed[: len(scheduled)]
                self.optimistic_steps += 1
            else:
                assert PLACEHOLDER_DRAFT not in scheduled, rid
            tokens = list(seq.tokens)
            start = seq.num_computed
            end = start + num_tokens - (len(scheduled) - len(drafts))
            pending = end == len(tokens) + len(drafts) + 1  # last step's token
            if pending:
                assert not drafts, f"{rid}: verifies drafts before its last token is known"
                tokens.append(self.last_sampled[rid])
            known = len(tokens)
            tokens += drafts
            assert end <= len(tokens)
            reserved = self.lookahead if rid in out.num_drafts_to_propose else 0
            assert len(seq.blocks) * BLOCK_SIZE >= min(end + reserved, 256), rid
            for pos in range(start, end):
                self.kv[self._slot(seq, pos)] = tokens[pos]
            held = [self.kv.get(self._slot(seq, p)) for p in range(end)]
            assert held == tokens[:end], f"{rid}: KV blocks do not hold the request's tokens"
            req_ids.append(rid)
            kept = []
            if end == len(tokens):
                rows = [next_token(tokens[: known + i]) for i in range(len(drafts) + 1)]
                kept = accept_draft_tokens(rows, drafts)
                self.verify_steps += bool(drafts)
                now[rid] = kept[-1]
                if rid in out.num_drafts_to_propose:
                    proposals[rid] = oracle(tokens[:known] + kept, out.num_drafts_to_propose[rid])
                    tail = tokens[len(seq.tokens) : known] + kept  # the pending one, if any
                    seq.tokens += tail
                    mine.num_unsent += len(tail)
                    mine.num_rejected = len(scheduled) + 1 - len(kept)
                    mine.proposed = proposals[rid]
            assert bool(kept) == (rid in out.sampling_req_ids)
            # The scheduler rolls the rejected drafts back; so does the worker.
            seq.num_computed = end - (len(drafts) + 1 - len(kept)) if kept else end
            sampled.append(kept)
        self.last_sampled = now
        return ModelRunnerOutput(req_ids, sampled, spec_token_ids=proposals)


def run(sched, runner, pipelined: bool, max_steps=3000):
    tokens, reasons, in_flight = {}, {}, None
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens, reasons
        out = sched.schedule()
        launched = (out, runner.execute(out))
        if pipelined:
            launched, in_flight = in_flight, launched
        if launched is not None:
            for o in sched.update_from_output(*launched):
                tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
                if o.finished:
                    reasons[o.req_id] = o.finish_reason
        sched.kv_cache_manager.audit()
    raise AssertionError("requests did not finish")


def workload():
    specs = [(3, 15), (9, 22), (17, 1), (5, 30), (30, 8), (2, 2), (12, 26), (25, 13)]
    return [make_request(f"r{i}", n, max_tokens=m) for i, (n, m) in enumerate(specs)]


def spec_scheduler(pipelined, host: bool, adaptive=False, bound=64, k=3, **kwargs):
    planner = DraftPlanner(SpecBudget(k, bound, adaptive=adaptive), 256, oracle if host else None)
    return make_scheduler(
        async_scheduling=pipelined,
        draft_planner=planner,
        num_lookahead_tokens=0 if host else k,
        **kwargs,
    )


def check_outputs(sched, requests, tokens, reasons):
    for r in requests:
        assert tokens[r.request_id] == alone(r.prompt_token_ids, r.max_tokens), r.request_id
        assert reasons[r.request_id] == "length"
    assert sched.kv_cache_manager.audit().in_use == 0


def test_outputs_equal_plain_decoding_under_chunking_preemption_and_async():
    for pipelined in (False, True):
        for host in (True, False):
            sched = spec_scheduler(pipelined, host, num_blocks=22, budget=16, max_num_seqs=6)
            requests = workload()
            for r in requests:
                sched.add_request(r)
            runner = VerifyingRunner(lookahead=0 if host else 3)
            tokens, reasons = run(sched, runner, pipelined)
            check_outputs(sched, requests, tokens, reasons)
            assert sched.num_preemptions_total > 0, (pipelined, host)
            assert runner.verify_steps > 10, (pipelined, host)
            # Async with the worker's proposer: scheduled optimistically, never held.
            assert (runner.optimistic_steps > 10) == (pipelined and not host)
            stats = sched.draft_planner.stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
            assert (
                stats.accepted_per_pos[0] >= stats.accepted_per_pos[1] >= stats.accepted_per_pos[2]
            )
            assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens


def test_drafts_trimmed_to_budget_and_max_tokens():
    sched = spec_scheduler(False, True, k=4)
    sched.add_request(make_request("A", [1, 2, 3], max_tokens=4))
    runner = VerifyingRunner()
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 3}
    sched.update_from_output(out, runner.execute(out))  # 1 output; 3 more allowed
    req = sched.get_request("A")
    assert req.spec_token_ids == oracle(req.all_token_ids, 2)  # room for 2 drafts + bonus
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"A": req.spec_token_ids}
    assert out.num_drafts_to_propose == {}  # the host proposes


def test_async_request_asked_for_drafts_waits_one_step_others_overlap():
    # r0 speculates (k 2 within the bound); the bound leaves nothing for r1, r2.
    planner = DraftPlanner(SpecBudget(2, 1, adaptive=True, min_gain=0.1), 256, oracle)
    sched = make_scheduler(async_scheduling=True, draft_planner=planner)
    requests = [make_request(f"r{i}", [5 + i, 6, 7], max_tokens=12) for i in range(1)]
    for r in requests:
        sched.add_request(r)
    runner = VerifyingRunner()
    out1 = sched.schedule()  # the prompt; r0 admitted this step: bound 1 - 3 tokens -> k 0
    res1 = runner.execute(out1)
    assert out1.sampling_req_ids == {"r0"}
    out2 = sched.schedule()  # running alone now: base 1 token, bound 1 -> k 0: overlaps
    assert out2.num_scheduled_tokens == {"r0": 1}
    sched.update_from_output(out1, res1)
    sched.draft_planner.budget.compute_bound_tokens = 10  # room for drafts from now on
    res2 = runner.execute(out2)
    out3 = sched.schedule()  # r0 was not asked in step 2 (k 0): it still overlaps
    assert out3.num_scheduled_tokens == {"r0": 1}
    sched.update_from_output(out2, res2)
    res3 = runner.execute(out3)
    out4 = sched.schedule()  # step 3 asked r0 for drafts: it waits for step 3's tokens
    assert out4.num_scheduled_tokens == {} and out4.is_empty
    sched.update_from_output(out3, res3)
    req = sched.get_request("r0")
    assert len(req.spec_token_ids) == 2
    out5 = sched.schedule()
    assert out5.scheduled_spec_decode_tokens == {"r0": req.spec_token_ids}
    assert out5.num_scheduled_tokens == {"r0": 3}


def test_adaptive_budget_stops_drafting_when_compute_bound():
    planner = DraftPlanner(SpecBudget(3, 6, adaptive=True, min_gain=0.1), 256, oracle)
    sched = make_scheduler(draft_planner=planner, max_num_seqs=8)
    requests = [make_request(f"r{i}", 4, max_tokens=20) for i in range(8)]
    for r in requests:
        sched.add_request(r)
    runner = VerifyingRunner()
    tokens, reasons = run(sched, runner, pipelined=False)
    check_outputs(sched, requests, tokens, reasons)
    assert runner.verify_steps == 0  # 8 decode tokens a step >= the bound of 6
    # Alone, the same requests speculate.
    planner = DraftPlanner(SpecBudget(3, 6, adaptive=True, min_gain=0.1), 256, oracle)
    sched = make_scheduler(draft_planner=planner, max_num_seqs=8)
    sched.add_request(make_request("solo", 4, max_tokens=20))
    runner = VerifyingRunner()
    run(sched, runner, pipelined=False)
    assert runner.verify_steps > 3
