"""Tests of the scheduler and the waiting-queue policies, on the real KVCacheManager,
driven by scheduler_harness.FakeRunner (a worker stand-in that checks, before sampling,
that each request's KV blocks hold exactly its tokens, and whose sampled token depends on
the whole sequence only, so a request's output is what `alone` computes for it).
"""

from __future__ import annotations

import random
import time

import pytest
from helpers.scheduler_harness import (  # tests/core/
    BLOCK_SIZE,
    VOCAB,
    FakeRunner,
    alone,
    collect,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

from pagoda.core.outputs import ModelRunnerOutput, TokenLogprobs
from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)

# ------------------------------------------------------------------ queues


def test_fcfs_queue_order_prepend_and_remove():
    q = create_request_queue("fcfs")
    a, b, c, d = (make_request(x, 2) for x in "abcd")
    for r in (a, b, c):
        q.add(r)
    q.prepend(d)
    assert [r.request_id for r in q] == ["d", "a", "b", "c"]
    assert q.peek() is d and q.pop() is d and len(q) == 3
    q.remove(b)
    q.prepend_many([b, d])
    assert [r.request_id for r in q] == ["b", "d", "a", "c"]
    q.remove_many([a, c, make_request("zz", 2)])
    assert [r.request_id for r in q] == ["b", "d"]
    with pytest.raises(ValueError):
        q.remove(a)


def test_priority_queue_orders_by_priority_then_arrival():
    q = create_request_queue("priority")
    reqs = [
        make_request("low", 2, priority=5, arrival=0.0),
        make_request("late", 2, priority=0, arrival=3.0),
        make_request("early", 2, priority=0, arrival=1.0),
        make_request("tie", 2, priority=0, arrival=1.0),
    ]
    for r in reqs:
        q.add(r)
    assert [r.request_id for r in q] == ["early", "tie", "late", "low"]
    early = q.pop()
    q.prepend(early)  # a preempted request keeps its place
    assert q.peek() is early
    q.remove(reqs[1])
    assert [r.request_id for r in q] == ["early", "tie", "low"]
    q.remove_many([reqs[0]])
    assert [q.pop().request_id for _ in range(len(q))] == ["early", "tie"]
    with pytest.raises(IndexError):
        q.peek()


def test_unknown_policy_lists_allowed():
    with pytest.raises(ValueError, match="fcfs, priority.*'lifo'"):
        create_request_queue("lifo")
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)


# --------------------------------------------------------- schedule(): budget


def test_token_budget_and_chunked_prefill_exact_counts():
    sched = make_scheduler(budget=10)
    for rid, n in (("A", 4), ("B", 7), ("C", 15)):
        sched.add_request(make_request(rid, n))
    runner = FakeRunner()
    counts = [step(sched, runner)[0].num_scheduled_tokens for _ in range(4)]
    assert counts == [
        {"A": 4, "B": 6},  # B is chunked to the 6 tokens left
        {"A": 1, "B": 1, "C": 8},  # running first: A decodes, B finishes its prompt
        {"A": 1, "B": 1, "C": 7},
        {"A": 1, "B": 1, "C": 1},
    ]


def test_diffs_new_then_cached_data():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("A", 4))
    sched.add_request(make_request("B", 7))
    runner = FakeRunner()
    out1, outputs1 = step(sched, runner)
    assert [(n.req_id, n.num_computed_tokens, n.block_ids) for n in out1.scheduled_new_reqs] == [
        ("A", 0, [0]),
        ("B", 0, [1, 2]),
    ]
    assert [o.req_id for o in outputs1] == ["A"]  # B's chunk did not reach its end
    a_token = outputs1[0].new_token_ids
    out2 = sched.schedule()
    assert out2.scheduled_new_reqs == []
    cached = {c.req_id: c for c in out2.scheduled_cached_reqs}
    # A's 5th token needs a second block; B's 7 prompt tokens fit in its two.
    assert (
        cached["A"].new_token_ids,
        cached["A"].new_block_ids,
        cached["A"].num_computed_tokens,
    ) == (a_token, [3], 4)
    assert cached["B"].new_block_ids == []
    assert (cached["B"].new_token_ids, cached["B"].num_computed_tokens) == ([], 6)
    assert sched.get_request("B").num_computed_tokens == 7


def test_outputs_carry_the_first_admission_time():
    sched = make_scheduler(budget=4)
    sched.add_request(make_request("A", 10, max_tokens=2))
    runner = FakeRunner()
    before = time.monotonic()
    _, outputs = step(sched, runner)  # a 4-token chunk: no output yet
    after = time.monotonic()
    assert outputs == []
    admitted = sched.get_request("A").first_scheduled_time
    assert before <= admitted <= after
    firsts = []
    while sched.has_unfinished_requests():
        firsts += [o.first_scheduled_time for o in step(sched, runner)[1]]
    assert firsts == [admitted, admitted]  # later steps do not move it
    sched.add_request(make_request("B", 3))
    out = sched.schedule()
    (failed,) = sched.update_from_output(out, ModelRunnerOutput(["B"], [[1]], errors={"B": "NaN"}))
    assert failed.error == "NaN" and failed.first_scheduled_time >= after


def test_chunked_prefill_disabled_waits_for_room():
    sched = make_scheduler(budget=10, max_model_len=10, enable_chunked_prefill=False)
    sched.add_request(make_request("A", 4))
    sched.add_request(make_request("B", 7))
    sched.add_request(make_request("C", 2))
    runner = FakeRunner()
    counts = [step(sched, runner)[0].num_scheduled_tokens for _ in range(2)]
    # B does not fit in the 6 tokens left and, unchunked, blocks the queue behind it.
    assert counts == [{"A": 4}, {"A": 1, "B": 7, "C": 2}]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(budget=10, max_model_len=11, enable_chunked_prefill=False)


def test_long_prefill_token_threshold():
    sched = make_scheduler(long_prefill_token_threshold=3)
    sched.add_request(make_request("A", 7))
    runner = FakeRunner()
    assert [step(sched, runner)[0].num_scheduled_tokens for _ in range(4)] == [
        {"A": 3},
        {"A": 3},
        {"A": 1},
        {"A": 1},
    ]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "ABC":
        sched.add_request(make_request(rid, 3, max_tokens=2))
    runner = FakeRunner()
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"A": 3, "B": 3}
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"A": 1, "B": 1}
    assert {o.req_id for o in outputs if o.finished} == {"A", "B"}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"C": 3}
    assert out.finished_req_ids == {"A", "B"}


def test_fcfs_and_priority_admission_order():
    for policy, expected in (("fcfs", ["p2", "p0", "p1"]), ("priority", ["p0", "p1", "p2"])):
        sched = make_scheduler(max_num_seqs=1, policy=policy)
        for rid, prio, arrival in (("p2", 2, 0.0), ("p0", 0, 1.0), ("p1", 1, 2.0)):
            sched.add_request(make_request(rid, 3, max_tokens=1, priority=prio, arrival=arrival))
        _, _, history = run_to_completion(sched, FakeRunner())
        assert [list(out.num_scheduled_tokens) for out in history] == [[r] for r in expected]


def test_prompt_too_long_and_bad_config():
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="8 tokens.*max_model_len is 8"):
        sched.add_request(make_request("A", 8))
    sched.add_request(make_request("B", 7))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("B", 3))
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=0)
    with pytest.raises(ValueError, match="policy must be one of fcfs, priority"):
        make_scheduler(policy="random")


# --------------------------------------------------------------- preemption


def test_preemption_of_latest_request_then_it_completes():
    # 4 blocks of 4: two 6-token prompts take 2 blocks each; the first to need a
    # third block (for its 9th token) evicts the later request.
    sched = make_scheduler(num_blocks=4)
    requests = {rid: make_request(rid, 6, max_tokens=6) for rid in "AB"}
    for request in requests.values():
        sched.add_request(request)
    runner = FakeRunner()
    tokens, reasons = {}, {}
    for _ in range(3):
        out, outputs = step(sched, runner)
        collect(outputs, tokens, reasons)
        assert out.preempted_req_ids == set()
    out, outputs = step(sched, runner)
    collect(outputs, tokens, reasons)
    b = requests["B"]
    solo_b = alone(b.prompt_token_ids, 6)
    assert out.preempted_req_ids == {"B"} and out.num_scheduled_tokens == {"A": 1}
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == solo_b[:3]
    assert [r.request_id for r in sched.waiting] == ["B"]
    _, reasons, history = run_to_completion(sched, runner, tokens)
    resumed = [n for out in history for n in out.scheduled_new_reqs if n.req_id == "B"]
    assert len(resumed) == 1 and resumed[0].output_token_ids == solo_b[:3]
    assert resumed[0].num_computed_tokens % BLOCK_SIZE == 0  # starts after its prefix hit
    assert sched.num_preemptions_total == 1
    assert tokens == {"A": alone(requests["A"].prompt_token_ids, 6), "B": solo_b}
    assert reasons == {"A": "length", "B": "length"}
    audit = sched.kv_cache_manager.audit()
    assert audit.in_use == 0 and audit.free + audit.cached == 4


def test_priority_preempts_lowest_priority_not_latest():
    sched = make_scheduler(num_blocks=4, policy="priority")
    low = make_request("low", 6, max_tokens=6, priority=1, arrival=0.0)
    high = make_request("high", 6, max_tokens=6, priority=0, arrival=1.0)
    sched.add_request(low)
    runner = FakeRunner()
    tokens = {}
    collect(step(sched, runner)[1], tokens, {})
    sched.add_request(high)
    preempted = []
    for _ in range(4):
        out, outputs = step(sched, runner)
        collect(outputs, tokens, {})
        preempted.append(out.preempted_req_ids)
    # "low" comes first in the running list, yet it is the one to go (at its 9th token).
    assert preempted == [set(), set(), {"low"}, set()]
    assert low.status == RequestStatus.PREEMPTED
    run_to_completion(sched, runner, tokens)
    assert sched.num_preemptions_total == 1
    assert tokens == {
        "low": alone(low.prompt_token_ids, 6),
        "high": alone(high.prompt_token_ids, 6),
    }


def test_priority_waiting_request_preempts_lower_priority_running():
    sched = make_scheduler(num_blocks=3, policy="priority")
    low = make_request("low", 9, max_tokens=3, priority=5, arrival=0.0)
    high = make_request("high", 5, max_tokens=2, priority=0, arrival=1.0)
    sched.add_request(low)
    runner = FakeRunner()
    tokens = {}
    collect(step(sched, runner)[1], tokens, {})  # "low" holds all 3 blocks
    sched.add_request(high)
    small = make_request("small", 2, max_tokens=1, priority=1, arrival=2.0)
    sched.add_request(small)
    out, outputs = step(sched, runner)
    collect(outputs, tokens, {})
    assert out.preempted_req_ids == {"low"}
    # "low" was scheduled first in this step, then unscheduled when preempted; after a
    # preemption nobody else is admitted in the step, though "small" would fit.
    assert out.num_scheduled_tokens == {"high": 5}
    assert [r.request_id for r in sched.waiting] == ["small", "low"]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["high"]
    assert [o.req_id for o in outputs] == ["high"]
    run_to_completion(sched, runner, tokens)
    assert tokens == {
        "low": alone(low.prompt_token_ids, 3),
        "high": alone(high.prompt_token_ids, 2),
        "small": alone(small.prompt_token_ids, 1),
    }
    assert sched.kv_cache_manager.audit().in_use == 0


# ------------------------------------------------------------------- abort


def test_abort_in_every_state_frees_blocks():
    sched = make_scheduler(num_blocks=5, budget=8, max_num_seqs=2)
    for rid, n in (("run", 4), ("chunk", 8), ("wait", 4)):
        sched.add_request(make_request(rid, n, max_tokens=30))
    runner = FakeRunner()
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"run": 4, "chunk": 4}
    for _ in range(5):
        step(sched, runner)
    states = {r.request_id: r.status for r in sched.requests.values()}
    assert states == {
        "run": RequestStatus.RUNNING,
        "chunk": RequestStatus.PREEMPTED,
        "wait": RequestStatus.WAITING,
    }
    aborted = sched.abort_requests(["wait", "chunk", "nope"])
    assert [(r.request_id, r.status) for r in aborted] == [
        ("wait", RequestStatus.FINISHED_ABORTED),
        ("chunk", RequestStatus.FINISHED_ABORTED),
    ]
    assert sched.num_waiting == 0
    out = sched.schedule()
    assert out.finished_req_ids == {"wait", "chunk"}
    sched.update_from_output(out, runner.execute(out))
    run_req = sched.get_request("run")
    assert (
        sched.abort_requests("run") == [run_req]
        and run_req.status == RequestStatus.FINISHED_ABORTED
    )
    assert sched.abort_requests("run") == []
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    audit = sched.kv_cache_manager.audit()
    assert audit.in_use == 0 and sched.kv_cache_manager.num_free_blocks == 5
    assert sched.schedule().finished_req_ids == {"run"}
    assert not sched.has_finished_requests()


def test_abort_mid_chunked_prefill():
    sched = make_scheduler(num_blocks=8, budget=4)
    sched.add_request(make_request("A", 12))
    runner = FakeRunner()
    step(sched, runner)
    assert sched.kv_cache_manager.num_free_blocks == 7
    sched.abort_requests(["A"])
    assert sched.kv_cache_manager.num_free_blocks == 8 and sched.num_running == 0
    out = sched.schedule()
    assert (out.total_num_scheduled_tokens, out.finished_req_ids) == (0, {"A"})


def test_abort_between_schedule_and_update_is_ignored():
    sched = make_scheduler()
    sched.add_request(make_request("A", 3))
    sched.add_request(make_request("B", 3))
    runner = FakeRunner()
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.abort_requests(["A"])
    outputs = sched.update_from_output(out, runner_out)
    assert [o.req_id for o in outputs] == ["B"]
    assert sched.kv_cache_manager.get_block_ids("A") == []


# ------------------------------------------------------------------- stops


def run_one(request: Request, sampled_script: list[list[int]], max_model_len=256):
    """Feeds a scripted list of sampled tokens per step; returns the outputs."""
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(request)
    outputs = []
    for sampled in sampled_script:
        out = sched.schedule()
        if not out.num_scheduled_tokens:
            break
        rid = request.request_id
        outputs += sched.update_from_output(out, ModelRunnerOutput([rid], [sampled]))
    return sched, outputs


def test_stop_on_eos_with_stop_reason_none():
    req = make_request("A", 3, eos=9)
    sched, outs = run_one(req, [[5], [9], [4]])
    assert [o.new_token_ids for o in outs] == [[5], [9]]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", None)
    assert (
        req.status == RequestStatus.FINISHED_STOPPED
        and sched.kv_cache_manager.num_free_blocks == 64
    )


def test_stop_token_ids_report_the_token():
    req = make_request("A", 3, eos=9, stop_token_ids=[7, 8])
    _, outs = run_one(req, [[5], [8], [4]])
    assert (outs[-1].new_token_ids, outs[-1].finish_reason, outs[-1].stop_reason) == (
        [8],
        "stop",
        8,
    )


def test_max_tokens_and_max_model_len_cap_length():
    req = make_request("A", 3, max_tokens=2, eos=9)
    _, outs = run_one(req, [[5], [6], [7]])
    assert [o.new_token_ids for o in outs] == [[5], [6]] and outs[-1].finish_reason == "length"
    req = make_request("B", 3, max_tokens=None)
    _, outs = run_one(req, [[5], [6], [7]], max_model_len=5)
    assert req.num_tokens == 5 and outs[-1].finish_reason == "length"


def test_min_tokens_defers_eos_and_stop_ids():
    req = make_request("A", 3, eos=9, min_tokens=3, stop_token_ids=[8])
    _, outs = run_one(req, [[9], [8], [9], [4]])
    assert [o.new_token_ids for o in outs] == [[9], [8], [9]]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None


def test_ignore_eos():
    req = make_request("A", 3, max_tokens=3, eos=9, ignore_eos=True)
    _, outs = run_one(req, [[9], [9], [9], [9]])
    assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].finish_reason == "length"


def test_runner_error_finishes_only_that_request():
    sched = make_scheduler()
    sched.add_request(make_request("A", 3))
    sched.add_request(make_request("B", 3))
    out = sched.schedule()
    outputs = sched.update_from_output(
        out, ModelRunnerOutput(["A", "B"], [[1], [2]], errors={"A": "NaN in logits"})
    )
    by_id = {o.req_id: o for o in outputs}
    assert (by_id["A"].finish_reason, by_id["A"].error, by_id["A"].new_token_ids) == (
        "error",
        "NaN in logits",
        [],
    )
    assert by_id["B"].new_token_ids == [2] and not by_id["B"].finished
    assert sched.get_request("A") is None and sched.num_running == 1


# ------------------------------------------------------------- spec decode


def test_spec_decode_drafts_scheduled_and_rejections_rolled_back():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("A", 4, max_tokens=20))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["A"], [[11]], spec_token_ids={"A": [1, 2, 3]}))
    req = sched.get_request("A")
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 4} and out.scheduled_spec_decode_tokens == {
        "A": [1, 2, 3]
    }
    # One draft accepted, then the bonus token: two drafts rejected.
    outs = sched.update_from_output(
        out, ModelRunnerOutput(["A"], [[1, 12]], spec_token_ids={"A": [5, 6]})
    )
    assert outs[0].new_token_ids == [1, 12]
    assert (req.num_tokens, req.num_computed_tokens, req.spec_token_ids) == (7, 6, [5, 6])
    # With a budget of 2, only one draft fits.
    sched.max_num_batched_tokens = 2
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"A": 2} and out.scheduled_spec_decode_tokens == {"A": [5]}
    assert out.scheduled_cached_reqs[0].new_token_ids == [1, 12]
    # Tokens after a stop token are dropped.
    req.sampling_params.stop_token_ids.append(5)
    logprobs = [TokenLogprobs([5], [-0.5], 1), TokenLogprobs([13], [-0.7], 1)]
    outs = sched.update_from_output(out, ModelRunnerOutput(["A"], [[5, 13]], logprobs=[logprobs]))
    assert outs[0].new_token_ids == [5] and outs[0].stop_reason == 5
    assert outs[0].new_logprobs == logprobs[:1]


# ---------------------------------------------------------------- n > 1


def test_siblings_wait_for_sample_zero_prefill_then_hit_its_blocks():
    sched = make_scheduler(long_prefill_token_threshold=4)
    prompt = make_request("x", 10).prompt_token_ids
    for i in range(3):
        sched.add_request(make_request(f"g-{i}", prompt, group_id="g", sample_index=i))
    sched.add_request(make_request("other", 3))
    runner = FakeRunner()
    tokens, counts = {}, []
    for _ in range(4):
        out, outputs = step(sched, runner)
        counts.append(out.num_scheduled_tokens)
        collect(outputs, tokens, {})
        last_outputs = {o.req_id: o for o in outputs}
        if len(counts) == 1:  # skipped siblings keep their place in the queue
            assert [r.request_id for r in sched.waiting] == ["g-1", "g-2"]
    assert counts[:3] == [{"g-0": 4, "other": 3}, {"g-0": 4, "other": 1}, {"g-0": 2, "other": 1}]
    assert counts[3] == {"g-0": 1, "other": 1, "g-1": 2, "g-2": 2}
    leader_blocks = sched.kv_cache_manager.get_block_ids("g-0")
    pool = sched.kv_cache_manager.block_pool
    for i in (1, 2):
        sib = sched.get_request(f"g-{i}")
        assert sib.num_cached_tokens == 8 and last_outputs[f"g-{i}"].num_cached_tokens == 8
        assert sched.kv_cache_manager.get_block_ids(f"g-{i}")[:2] == leader_blocks[:2]
    assert [pool.blocks[b].ref_cnt for b in leader_blocks] == [3, 3, 1]
    run_to_completion(sched, runner, tokens)
    assert tokens["g-0"] == tokens["g-1"] == tokens["g-2"] == alone(prompt)
    assert sched.kv_cache_manager.audit().in_use == 0


# --------------------------------------------------------- full simulation


def _workload(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    specs = []
    for i in range(30):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 40))]
        if i % 4 == 0:
            prompt = shared + prompt[:10]
        specs.append(
            dict(
                rid=f"r{i}",
                prompt=prompt,
                max_tokens=rng.randrange(1, 30),
                eos=0 if i % 3 == 0 else None,
                priority=rng.randrange(3),
                arrival=float(i),
                prompt_logprobs=1 if i % 7 == 0 else None,
            )
        )
    return specs


def _expected(spec) -> tuple[list[int], str]:
    tokens = alone(spec["prompt"], spec["max_tokens"])
    if spec["eos"] is not None and spec["eos"] in tokens:
        return tokens[: tokens.index(spec["eos"]) + 1], "stop"
    return tokens, "length"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_simulation_all_finish_with_solo_outputs(policy):
    specs = _workload(seed=3)
    sched = make_scheduler(
        num_blocks=24, budget=32, max_num_seqs=8, max_model_len=128, policy=policy
    )
    for spec in specs:
        sched.add_request(
            make_request(
                spec["rid"],
                spec["prompt"],
                spec["max_tokens"],
                eos=spec["eos"],
                priority=spec["priority"],
                arrival=spec["arrival"],
                prompt_logprobs=spec["prompt_logprobs"],
            )
        )
    prompt_lp = {}
    runner = FakeRunner()
    tokens, reasons = {}, {}
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        out, outputs = step(sched, runner)
        for o in outputs:
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            prompt_lp.setdefault(o.req_id, []).extend(o.prompt_logprobs or [])
            if o.finished:
                reasons[o.req_id] = o.finish_reason
    assert len(reasons) == 30
    for spec in specs:
        expected_tokens, expected_reason = _expected(spec)
        assert (tokens[spec["rid"]], reasons[spec["rid"]]) == (expected_tokens, expected_reason), (
            spec["rid"]
        )
        if spec["prompt_logprobs"] is not None:
            # Every prompt position but the first, once, even across preemptions.
            assert [e.token_ids[0] for e in prompt_lp[spec["rid"]]] == spec["prompt"][1:]
    assert sched.num_preemptions_total > 0
    assert sched.kv_cache_manager.prefix_cache_stats.hits > 0
    audit = sched.kv_cache_manager.audit()
    assert audit.in_use == 0 and audit.free + audit.cached == 24
