"""Async scheduling in the scheduler: step N+1 is scheduled before step N's update.

A fake worker in the style of test_scheduler's FakeRunner learns tokens only from the
SchedulerOutput diffs, except the token the previous step sampled, which it takes
from its own record of that step (as the real worker takes it from the device).
Outputs must equal the synchronous loop's and the directly computed ones, under
chunked prefill, preemption, eos stops and max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers.scheduler_harness import (
    BLOCK_SIZE,
    FakeRunner,
    alone,
    collect,
    make_request,
    make_scheduler,
    next_token,
    run_to_completion,
)

from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.core.request import RequestStatus


@dataclass
class PipelinedRunner(FakeRunner):
    """Worker stand-in for async scheduling: knows the last step's sampled ids itself
    (diffs are applied by FakeRunner._apply_diff)."""

    last_sampled: dict = field(default_factory=dict)  # req_id -> token, previous step only
    num_device_fed: int = 0  # tokens taken from the previous step rather than a diff

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(out)
        sampled_now, req_ids, sampled = {}, [], []
        for rid, num_tokens in out.num_scheduled_tokens.items():
            seq = self.seqs[rid]
            start, end = seq.num_computed, seq.num_computed + num_tokens
            tokens = list(seq.tokens)
            if end == len(tokens) + 1:  # its last token is the previous step's sample
                tokens.append(self.last_sampled[rid])
                self.num_device_fed += 1
            assert end <= len(tokens), (rid, end, len(tokens))
            assert len(seq.blocks) * BLOCK_SIZE >= end
            for pos in range(start, end):
                self.kv[(seq.blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE)] = tokens[pos]
            held = [self.kv.get((seq.blocks[p // BLOCK_SIZE], p % BLOCK_SIZE)) for p in range(end)]
            assert held == tokens[:end], f"{rid}: KV blocks do not hold the request's tokens"
            seq.num_computed = end
            req_ids.append(rid)
            if end == len(tokens):
                sampled_now[rid] = next_token(tokens)
            assert (rid in sampled_now) == (rid in out.sampling_req_ids)
            sampled.append([sampled_now[rid]] if rid in sampled_now else [])
        self.last_sampled = sampled_now
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def run_pipelined(sched, runner, max_steps=2000):
    """The engine's async loop: schedule + launch N, then update N-1."""
    tokens, reasons, in_flight, steps = {}, {}, None, 0
    while sched.has_unfinished_requests():
        steps += 1
        assert steps < max_steps, "requests did not finish"
        out = sched.schedule()
        launched = (out, runner.execute(out))
        previous, in_flight = in_flight, launched
        if previous is not None:
            collect(sched.update_from_output(*previous), tokens, reasons)
        sched.kv_cache_manager.audit()
        for request in sched.requests.values():
            assert 0 <= request.num_output_placeholders <= 2
    return tokens, reasons, steps


def make_workload(eos=None):
    specs = [(3, 5), (9, 12), (17, 1), (5, 20), (30, 8), (2, 2), (12, 16), (25, 3)]
    return [make_request(f"r{i}", n, max_tokens=m, eos=eos) for i, (n, m) in enumerate(specs)]


def test_pipelined_outputs_equal_sync_under_chunking_and_preemption():
    results = []
    for pipelined in (False, True):
        sched = make_scheduler(num_blocks=14, budget=16, max_num_seqs=6, async_scheduling=pipelined)
        requests = make_workload()
        for r in requests:
            sched.add_request(r)
        if pipelined:
            runner = PipelinedRunner()
            tokens, reasons, _ = run_pipelined(sched, runner)
            assert runner.num_device_fed > 0
        else:
            tokens, reasons, _ = run_to_completion(sched, FakeRunner())
        assert sched.num_preemptions_total > 0
        for r in requests:
            assert tokens[r.request_id] == alone(r.prompt_token_ids, r.max_tokens), r.request_id
            assert reasons[r.request_id] == "length"
        audit = sched.kv_cache_manager.audit()
        assert audit.in_use == 0
        results.append(tokens)
    assert results[0] == results[1]


def test_placeholder_accounting_and_max_tokens_guard():
    sched = make_scheduler(async_scheduling=True)
    r = make_request("A", [1, 2, 3, 4], max_tokens=3)
    sched.add_request(r)
    runner = PipelinedRunner()
    out1 = sched.schedule()
    assert out1.num_scheduled_tokens == {"A": 4} and out1.sampling_req_ids == {"A"}
    res1 = runner.execute(out1)
    assert (r.num_computed_tokens, r.num_output_placeholders) == (4, 1)
    out2 = sched.schedule()  # before step 1's update: computes the placeholder's position
    assert out2.num_scheduled_tokens == {"A": 1}
    res2 = runner.execute(out2)
    assert (r.num_computed_tokens, r.num_output_placeholders) == (5, 2)
    sched.update_from_output(out1, res1)
    assert (r.output_token_ids, r.num_output_placeholders) == ([next_token([1, 2, 3, 4])], 1)
    out3 = sched.schedule()
    assert out3.num_scheduled_tokens == {"A": 1}
    assert out3.scheduled_cached_reqs[0].new_token_ids == r.output_token_ids
    runner.execute(out3)
    # 1 output + 2 placeholders = max_tokens: the steps in flight finish it.
    assert sched.schedule().num_scheduled_tokens == {}
    sched.update_from_output(out2, res2)
    assert r.num_output_tokens == 2 and not r.is_finished


def test_eos_stop_wastes_one_step_and_drops_its_token():
    prompt = [5, 11, 2, 8]
    expected = alone(prompt, 12)
    stop_at = next(i for i in range(3, 12) if expected[i] not in expected[:i])
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("A", prompt, max_tokens=12, eos=expected[stop_at]))
    tokens, reasons, steps = run_pipelined(sched, PipelinedRunner())
    assert tokens["A"] == expected[: stop_at + 1] and reasons["A"] == "stop"
    # One step per token, then one wasted step launched before the eos was seen.
    assert steps == stop_at + 2
    assert sched.kv_cache_manager.audit().in_use == 0


def test_request_preempted_while_in_flight_receives_its_token():
    sched = make_scheduler(num_blocks=3, budget=64, async_scheduling=True)
    a = make_request("A", 4, max_tokens=6)
    b = make_request("B", 4, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    runner = PipelinedRunner()
    out1 = sched.schedule()  # A and B: one block each
    res1 = runner.execute(out1)
    out2 = sched.schedule()  # both need a second block: only one is free, B is preempted
    assert out2.preempted_req_ids == {"B"} and b.status == RequestStatus.PREEMPTED
    res2 = runner.execute(out2)
    sched.update_from_output(out1, res1)
    assert b.output_token_ids == [next_token(b.prompt_token_ids)]
    assert b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    tokens, reasons = {}, {}
    collect(sched.update_from_output(out2, res2), tokens, reasons)
    rest, reasons, _ = run_pipelined(sched, runner)
    assert a.output_token_ids == alone(a.prompt_token_ids, 6)
    assert b.output_token_ids == alone(b.prompt_token_ids, 6)
