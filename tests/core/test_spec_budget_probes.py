"""SpecBudget's wait cost (async scheduling) and its probes of idle requests, asserted
exactly: the schedules below follow from the rules in pagoda/core/spec_budget.py."""

from __future__ import annotations

from typing import Callable

import pytest

from pagoda.core.spec_budget import SpecBudget


def simulate(budget: SpecBudget, req_ids: list[str], steps: range,
             accepted: Callable[[str, int, int], int] = lambda rid, step, k: 0,
             base_tokens: int = 0) -> dict[str, dict[int, int]]:
    """choose() once per step; each verify outcome observed before the next step.
    Returns, per request, {step: k} for the steps where it drafted."""
    drafted: dict[str, dict[int, int]] = {rid: {} for rid in req_ids}
    for step in steps:
        for rid, k in budget.choose(req_ids, base_tokens).items():
            if k:
                drafted[rid][step] = k
                budget.observe(rid, k, accepted(rid, step, k))
    return drafted


def set_alpha(budget: SpecBudget, rid: str, successes: int, failures: int) -> None:
    """With decay 1 and prior weight 0: alpha = (successes + 1) / (all + 2)."""
    for _ in range(successes):
        budget.observe(rid, 1, 1)
    for _ in range(failures):
        budget.observe(rid, 1, 0)


def test_zero_acceptance_busy_async_only_probes_on_a_doubling_schedule():
    budget = SpecBudget(4, 1000, async_scheduling=True)
    drafted = simulate(budget, ["r", "s"], range(1, 3100))
    # From alpha 1/2 the wanted drafts (.5, .25) are worth 0.75 < one lost step: none.
    # Probes after 64, 128, ..., 1024 (the cap), 1024 idle steps.
    probes = {65: 1, 194: 1, 451: 1, 964: 1, 1989: 1, 3014: 1}
    assert drafted == {"r": probes, "s": probes}
    assert budget.probe_interval_of("r") == 1024
    # A 128-token request (~130 steps) probes once; a probe costs 2 steps async: < 2 %.
    assert 2 * sum(step <= 130 for step in probes) / 130 < 0.02


def test_zero_acceptance_sync_stops_drafting_then_probes():
    budget = SpecBudget(4, 1000)
    drafted = simulate(budget, ["r"], range(1, 201))
    # alpha .5 -> 2 drafts; .424, .367, .322, .287, .258 -> 1; .234 < MIN_GAIN: stops at
    # step 7, which is its first idle step; probes after 64 then 128 idle steps.
    assert drafted == {"r": {1: 2, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 71: 1, 200: 1}}


def test_high_acceptance_keeps_max_k():
    budget = SpecBudget(4, 1000, async_scheduling=True)
    simulate(budget, ["warm"], range(3), accepted=lambda rid, step, k: k)  # alone: .5 pays
    # A new request starts from the engine-wide estimate: max_k at once, busy or not.
    drafted = simulate(budget, ["a", "b"], range(300), accepted=lambda rid, step, k: k)
    assert drafted == {"a": {s: 4 for s in range(300)}, "b": {s: 4 for s in range(300)}}


@pytest.mark.parametrize("min_gain, k", [(0.04, 4), (0.25, 1)])
def test_wait_cost_stops_alpha_045_only_in_a_busy_async_batch(min_gain, k):
    def budget_at_045(async_scheduling: bool) -> SpecBudget:
        budget = SpecBudget(4, 1000, decay=1.0, min_gain=min_gain, prior_weight=0,
                            async_scheduling=async_scheduling)
        set_alpha(budget, "r", 8, 10)  # 9 / 20
        set_alpha(budget, "s", 8, 10)
        assert budget.alpha("r") == 0.45
        return budget
    # min_gain .04: gains .45 .2025 .0911 .0410, worth 0.7846; min_gain .25: .45 alone.
    assert budget_at_045(False).choose(["r", "s"], 2) == {"r": k, "s": k}  # no wait
    assert budget_at_045(True).choose(["r"], 1) == {"r": k}  # alone: covers 0.1
    assert budget_at_045(True).choose(["r", "s"], 2) == {"r": 0, "s": 0}  # < 1 step
    # Told the step's size: a request admitted beside others is in a busy batch.
    assert budget_at_045(True).choose(["r"], 1, num_running=3) == {"r": 0}
    assert budget_at_045(True).wait_cost(3) == 1.0
    assert budget_at_045(False).wait_cost(3) == 0.0


def test_with_a_wait_the_room_goes_to_whole_prefixes_of_the_best():
    def budget(async_scheduling: bool) -> SpecBudget:
        budget = SpecBudget(4, 10, decay=1.0, prior_weight=0, async_scheduling=async_scheduling)
        set_alpha(budget, "a", 6, 2)  # alpha .7: gains .7 .49 .343, worth 1.53 > 1
        set_alpha(budget, "b", 8, 0)  # alpha .9: gains .9 .81 .729 .656
        set_alpha(budget, "c", 6, 2)
        return budget
    assert budget(True).choose(["a", "b"], 0) == {"a": 3, "b": 4}  # room for all
    # Spare 4, no wait: the 4 best gains, b's first three and a's first.
    assert budget(False).choose(["a", "b"], 6) == {"a": 1, "b": 3}
    # Busy async: a's one draft (.7) would not pay for its wait; b, the best, takes all.
    assert budget(True).choose(["a", "b"], 6) == {"a": 0, "b": 4}
    # Spare 6: b 4, then a's 2 drafts (1.19) cover the wait; c gets nothing.
    assert budget(True).choose(["a", "b", "c"], 4) == {"a": 2, "b": 4, "c": 0}
    # Spare 5: a's one draft is short, c's too: b alone drafts.
    assert budget(True).choose(["a", "b", "c"], 5) == {"a": 0, "b": 4, "c": 0}


def test_equal_requests_in_a_busy_async_batch_do_not_split_the_room_into_singles():
    budget = SpecBudget(4, 16, async_scheduling=True)
    simulate(budget, ["w"], range(20), accepted=lambda rid, step, k: k)
    ids = [f"r{i}" for i in range(8)]
    # Spare 8 for 8 requests that each want 4: two of them draft 4 (in request order).
    assert budget.choose(ids, 8) == {rid: 4 if rid in ("r0", "r1") else 0 for rid in ids}
    budget.async_scheduling = False  # no wait: the 8 best gains, one draft each
    assert budget.choose(ids, 8) == {rid: 1 for rid in ids}


def test_accepted_probe_resumes_drafting_and_restarts_the_interval():
    budget = SpecBudget(4, 1000, async_scheduling=True)
    predictable = range(400, 500)
    drafted = simulate(budget, ["r", "s"], range(1, 710),
                       accepted=lambda rid, step, k: k if rid == "r" and step in predictable else 0)
    r = drafted["r"]
    assert {s: k for s, k in r.items() if s < 451} == {65: 1, 194: 1}  # failed probes
    # The probe at 451 is accepted: old counts dropped, alpha 2/3 -> 3 drafts, then 4.
    assert r[451] == 1 and r[452] == 3 and all(r[s] == 4 for s in range(453, 500))
    # From 500 nothing is accepted: the decayed successes keep it drafting for a while,
    # then it stops and probes after 64 idle steps (its interval restarted), then 128.
    last = max(s for s in r if s < 530)
    assert last == 511 and all(s in r for s in range(500, last + 1))
    assert {s: k for s, k in r.items() if s > last} == {last + 65: 1, last + 65 + 129: 1}
    assert drafted["s"] == {65: 1, 194: 1, 451: 1}


def test_probe_waits_for_room_and_holds_until_its_outcome():
    budget = SpecBudget(4, 8, async_scheduling=True, probe_interval=2)
    for _ in range(2):  # idle: alpha .5 is not worth a lost step
        assert budget.choose(["r", "s"], 2) == {"r": 0, "s": 0}
    # Both due; compute-bound steps hold the probes back.
    assert budget.choose(["r", "s"], 8) == {"r": 0, "s": 0}
    assert budget.choose(["r", "s"], 20) == {"r": 0, "s": 0}
    assert budget.choose(["r", "s"], 7) == {"r": 1, "s": 0}  # room for one probe
    assert budget.is_probing("r") and not budget.is_probing("s")
    # Async: r verifies its probe two steps later; it keeps its one draft until then.
    assert budget.choose(["r", "s"], 2) == {"r": 1, "s": 1}
    assert budget.choose(["r", "s"], 2) == {"r": 1, "s": 1}
    budget.observe("r", 1, 0)
    budget.observe("s", 0, 0)  # asked, the proposer found nothing: a failed probe
    assert not budget.is_probing("r") and not budget.is_probing("s")
    assert (budget.probe_interval_of("r"), budget.probe_interval_of("s")) == (4, 4)
    assert budget.choose(["r", "s"], 2) == {"r": 0, "s": 0}
    budget.forget("r")
    assert not budget.is_probing("r") and budget.probe_interval_of("r") == 2


def test_not_adaptive_and_compute_bound_are_unchanged_by_async():
    budget = SpecBudget(3, 4, adaptive=False, async_scheduling=True)
    for _ in range(5):
        budget.observe("r", 3, 0)
    assert budget.choose(["r", "s"], 100) == {"r": 3, "s": 3}
    budget = SpecBudget(3, 4, async_scheduling=True)
    simulate(budget, ["w"], range(20), accepted=lambda rid, step, k: k)
    assert budget.choose(["a", "b"], 4) == {"a": 0, "b": 0}  # compute-bound: none
    # Room for 4 drafts, equal estimates: a takes its 3; b's one left would not pay
    # for its wait.
    assert budget.choose(["a", "b"], 0) == {"a": 3, "b": 0}
