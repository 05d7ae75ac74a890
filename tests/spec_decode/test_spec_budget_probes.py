"""SpecBudget's price of a drafting step under async scheduling (a held step for the
whole batch) and its probe steps, asserted exactly: the schedules below follow from
the rules in pagoda/spec_decode/planning/budget.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagoda.spec_decode.planning.budget import SpecBudget

# The arithmetic of these trajectories (comments below) takes drafts down to a gain of
# .25: pinned here, independent of spec_budget.MIN_GAIN's default.
PROBE_TEST_MIN_GAIN = 0.25


def simulate(
    budget: SpecBudget,
    req_ids: list[str],
    steps: range,
    accepted: Callable[[str, int, int], int] = lambda rid, step, k: 0,
    base_tokens: int = 0,
) -> dict[str, dict[int, int]]:
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


# At 0 % acceptance from a fresh engine: alpha .5 -> 2 drafts, then .424 ... .258 -> 1,
# then .234 < min_gain .25: no drafts from step 7. Probe steps after 64, 128, ..., 1024
# steps without drafts, all requests at once.
ZERO_ACCEPTANCE = {
    1: 2,
    2: 1,
    3: 1,
    4: 1,
    5: 1,
    6: 1,
    70: 1,
    198: 1,
    454: 1,
    966: 1,
    1990: 1,
    3014: 1,
}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_zero_acceptance_stops_then_probes_the_batch_on_a_doubling_schedule(async_scheduling):
    budget = SpecBudget(4, 1000, min_gain=PROBE_TEST_MIN_GAIN, drafting_holds=async_scheduling)
    drafted = simulate(budget, ["r", "s"], range(1, 3100))
    # Async, the two requests' drafts (2 x .75, then 2 x .42 ... 2 x .26) cover the held
    # step's cost (2 x .213) until they stop on their own.
    assert drafted == {"r": ZERO_ACCEPTANCE, "s": ZERO_ACCEPTANCE}
    assert budget.probe_interval == 1024
    # A later 128-step request inherits the low estimate: at most 2 probe steps, each
    # a held step (at most a token a request): under 2 % of its steps.
    if async_scheduling:
        assert budget.hold_cost(64) == 64.0 and 2 * budget.hold_cost(1) < budget.hold_cost(2)


def test_high_acceptance_keeps_max_k():
    budget = SpecBudget(4, 1000, min_gain=PROBE_TEST_MIN_GAIN, drafting_holds=True)
    simulate(budget, ["warm"], range(3), accepted=lambda rid, step, k: k)
    # A new request starts from the engine-wide estimate: max_k at once.
    drafted = simulate(budget, ["a", "b"], range(300), accepted=lambda rid, step, k: k)
    assert drafted == {"a": {s: 4 for s in range(300)}, "b": {s: 4 for s in range(300)}}


def budget_with(
    alphas: dict[str, tuple[int, int]], async_scheduling: bool, compute_bound_tokens: int = 1000
) -> SpecBudget:
    budget = SpecBudget(
        4,
        compute_bound_tokens,
        min_gain=PROBE_TEST_MIN_GAIN,
        decay=1.0,
        prior_weight=0,
        drafting_holds=async_scheduling,
    )
    for rid, (successes, failures) in alphas.items():
        set_alpha(budget, rid, successes, failures)
    return budget


def test_async_drafts_only_when_the_batch_gain_covers_the_held_step():
    # alpha .45 (9 / 20): one draft worth .45 each (.2025 < min_gain .25).
    assert budget_with({"r": (8, 10)}, True).alpha("r") == 0.45
    assert budget_with({"r": (8, 10)}, True).choose(["r"], 1) == {"r": 1}  # .45 >= .2
    # Told the step runs 3 requests (two admitted beside it): .45 < 3 x .225.
    assert budget_with({"r": (8, 10)}, True).hold_cost(3) == pytest.approx(3 * (0.2 + 0.8 / 31.5))
    assert budget_with({"r": (8, 10)}, True).choose(["r"], 1, num_running=3) == {"r": 0}
    assert budget_with({"r": (8, 10)}, False).choose(["r"], 1, num_running=3) == {"r": 1}
    # One good request carries the batch: alpha .9 (gains .9 .81 .729 .656 = 3.1) over
    # three hopeless ones (alpha .1: no draft) pays for 4 x .238.
    mixed = {"good": (8, 0), "x": (0, 8), "y": (0, 8), "z": (0, 8)}
    assert budget_with(mixed, True).choose(list(mixed), 4) == {"good": 4, "x": 0, "y": 0, "z": 0}
    # Thirteen hopeless ones beside it: 3.1 < 14 x .365, nobody drafts.
    many = {"good": (8, 0), **{f"h{i}": (0, 8) for i in range(13)}}
    assert set(budget_with(many, True).choose(list(many), 14).values()) == {0}
    assert budget_with(many, False).choose(list(many), 14)["good"] == 4


def test_room_goes_to_the_largest_gains():
    budget = budget_with({"a": (6, 2), "b": (8, 0)}, True, 10)  # alpha .7 and .9
    assert budget.choose(["a", "b"], 0) == {"a": 3, "b": 4}  # room for all
    # Spare 4: the 4 best gains, b's first three (.9 .81 .729) and a's first (.7).
    assert budget.choose(["a", "b"], 6) == {"a": 1, "b": 3}


def test_accepted_probe_resumes_drafting_and_restarts_the_interval():
    budget = SpecBudget(4, 1000, min_gain=PROBE_TEST_MIN_GAIN, drafting_holds=True)
    predictable = range(400, 500)
    drafted = simulate(
        budget,
        ["r", "s"],
        range(1, 1000),
        accepted=lambda rid, step, k: k if rid == "r" and step in predictable else 0,
    )
    r = drafted["r"]
    assert {s: k for s, k in r.items() if s < 454} == {
        s: k for s, k in ZERO_ACCEPTANCE.items() if s < 454
    }
    # The probe at 454 is accepted: r's old counts dropped, alpha 2/3 -> 3 drafts, then 4.
    assert r[454] == 1 and r[455] == 3 and all(r[s] == 4 for s in range(456, 509))
    # From 500 nothing is accepted: the decayed successes keep it drafting (3, 2, then 1)
    # until 517; the interval restarted with the accepted probe: probe steps at 517 +
    # 64, then 128 and 256 later, for both requests.
    assert [r[s] for s in range(509, 518)] == [3, 3, 3, 2, 2, 2, 2, 1, 1] and 518 not in r
    probes = {581: 1, 709: 1, 965: 1}
    assert {s: k for s, k in r.items() if s > 517} == probes
    assert {s: k for s, k in drafted["s"].items() if s > 453} == {454: 1, **probes}


def test_probe_step_takes_spare_room_and_holds_until_its_outcome():
    budget = SpecBudget(
        4,
        8,
        min_gain=PROBE_TEST_MIN_GAIN,
        drafting_holds=True,
        probe_interval=2,
        decay=1.0,
        prior_weight=0,
    )
    set_alpha(budget, "r", 0, 8)
    set_alpha(budget, "s", 0, 8)
    assert budget.choose(["r", "s"], 2) == {"r": 0, "s": 0}
    # The second idle step is due, but compute-bound: no room, no probe yet.
    assert budget.choose(["r", "s"], 8) == {"r": 0, "s": 0}
    assert budget.choose(["r", "s"], 7) == {"r": 1, "s": 0}  # room for one probe
    assert budget.is_probing("r") and not budget.is_probing("s")
    assert budget.probe_interval == 4
    # Async: r verifies its probe two steps later; it keeps its one draft until then
    # (a probe is not held back by the batch's gain).
    assert budget.choose(["r", "s"], 2) == {"r": 1, "s": 0}
    budget.observe("r", 1, 0)
    assert not budget.is_probing("r")
    assert budget.choose(["r", "s"], 2) == {"r": 0, "s": 0}
    budget.forget("r")
    assert not budget.is_probing("r")


def test_not_adaptive_and_compute_bound_are_unchanged_by_async():
    budget = SpecBudget(3, 4, min_gain=PROBE_TEST_MIN_GAIN, adaptive=False, drafting_holds=True)
    for _ in range(5):
        budget.observe("r", 3, 0)
    assert budget.choose(["r", "s"], 100) == {"r": 3, "s": 3}
    budget = SpecBudget(3, 4, min_gain=PROBE_TEST_MIN_GAIN, drafting_holds=True)
    simulate(budget, ["w"], range(20), accepted=lambda rid, step, k: k)
    assert budget.choose(["a", "b"], 4) == {"a": 0, "b": 0}  # compute-bound: none
    assert budget.choose(["a", "b"], 0) == {"a": 2, "b": 2}  # room for 4: the best gains
