"""StepPlan (core/step_plan.py): the budget kept as requests are recorded and unscheduled,
and the SchedulerOutput diff: a request the worker holds no state for goes out whole,
then only its new tokens and blocks."""

from pagoda.core.request import Request
from pagoda.core.step_plan import StepPlan
from pagoda.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_unschedule_gives_the_budget_back():
    plan = StepPlan(10)
    a, b = req("a", [1, 2, 3]), req("b", [4, 5])
    plan.record(a, 3, [0])
    plan.record(b, 2, [1])
    plan.spec_tokens["b"] = [9]
    plan.unschedule(b)
    assert plan.token_budget == 7 and plan.scheduled == [a]
    assert plan.num_scheduled_tokens == {"a": 3} and plan.spec_tokens == {}


def test_a_request_goes_out_whole_once_then_as_a_diff():
    sent: dict[str, int] = {}
    blocks = {"a": [0, 1]}
    a = req("a", [1, 2, 3, 4, 5])
    first = StepPlan(8)
    first.record(a, 5, [0, 1])
    out = first.build_output(sent, blocks.__getitem__, {"gone"}, {})
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a"] and not out.scheduled_cached_reqs
    assert out.scheduled_new_reqs[0].block_ids == [0, 1]
    assert out.finished_req_ids == {"gone"} and out.total_num_scheduled_tokens == 5
    assert sent == {"a": 5}
    a.num_computed_tokens = 5
    a.append_output_token_ids([6])
    second = StepPlan(8)
    second.record(a, 1, [2])
    out = second.build_output(sent, blocks.__getitem__, set(), {"a": 2})
    assert not out.scheduled_new_reqs
    cached = out.scheduled_cached_reqs[0]
    assert cached.new_token_ids == [6] and cached.new_block_ids == [2]
    assert cached.num_computed_tokens == 5 and out.trimmed_block_tables == {"a": 2}
    assert sent == {"a": 6}
