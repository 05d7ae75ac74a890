"""SpecBudget: acceptance estimates and per-step draft counts, asserted exactly (the
held-step price and probes: test_spec_budget_probes.py)."""

from __future__ import annotations

import pytest

from pagoda.spec_decode.planning.budget import SpecBudget


def test_estimate_counts_successes_and_the_first_failure():
    budget = SpecBudget(4, 100, decay=1.0, prior_weight=0)
    assert budget.alpha("a") == 0.5
    budget.observe("a", 4, 4)  # 4 successes, no failure
    assert budget.alpha("a") == pytest.approx(5 / 6)
    budget.observe("a", 3, 1)  # 1 success, then a failure
    assert budget.alpha("a") == pytest.approx(6 / 8)
    budget.observe("a", 0, 0)  # asked, nothing proposed: a failure
    assert budget.alpha("a") == pytest.approx(6 / 9)
    with pytest.raises(ValueError, match="accepted 3 of 2 drafts"):
        budget.observe("a", 2, 3)
    budget.forget("a")
    assert budget.alpha("a") == 0.5


def test_new_requests_start_from_the_engine_wide_estimate():
    budget = SpecBudget(4, 100, decay=1.0, prior_weight=4.0)
    assert budget.alpha("a") == 0.5  # nothing seen anywhere: S 2, F 2
    budget.observe("a", 4, 4)  # a: S 6, F 2; engine-wide: S 4, F 0 -> 5/6
    assert budget.alpha("a") == pytest.approx(7 / 10)
    assert budget.alpha("b") == pytest.approx((4 * 5 / 6 + 1) / 6)


def test_decay_weights_recent_steps():
    budget = SpecBudget(4, 100, decay=0.5, prior_weight=0)
    budget.observe("a", 2, 0)  # S 0, F 1
    budget.observe("a", 2, 2)  # S 2, F 0.5
    assert budget.alpha("a") == pytest.approx(3 / 4.5)


def test_worthwhile_drafts_follow_the_acceptance():
    budget = SpecBudget(5, 1000, decay=1.0, min_gain=0.25, prior_weight=0)
    assert budget.choose(["new"], 0) == {"new": 2}  # 0.5, 0.25
    for _ in range(8):
        budget.observe("good", 5, 5)  # alpha 41/42
    for _ in range(3):
        budget.observe("bad", 1, 0)  # alpha 1/5
    assert budget.choose(["good", "bad"], 2) == {"good": 5, "bad": 0}


def test_compute_bound_step_gets_no_drafts_and_spare_goes_to_the_best():
    budget = SpecBudget(4, 10, decay=1.0, min_gain=0.1, prior_weight=0)
    for _ in range(4):
        budget.observe("hi", 4, 4)  # alpha 17/18
    budget.observe("mid", 2, 1)  # alpha 2/4
    assert budget.choose(["hi", "mid"], 10) == {"hi": 0, "mid": 0}
    assert budget.choose(["hi", "mid"], 50) == {"hi": 0, "mid": 0}
    # Spare 5: hi's gains .94 .89 .84 .80, mid's .5 .25 .125 (.0625 < min) -> hi 4, mid 1.
    assert budget.choose(["hi", "mid"], 5) == {"hi": 4, "mid": 1}
    # Everything wanted fits: no cut.
    assert budget.choose(["hi", "mid"], 0) == {"hi": 4, "mid": 3}


def test_ties_go_to_the_earlier_request():
    budget = SpecBudget(2, 3, decay=1.0, min_gain=0.1, prior_weight=0)
    assert budget.choose(["x", "y"], 0) == {"x": 2, "y": 1}
    assert budget.choose(["y", "x"], 0) == {"y": 2, "x": 1}


def test_not_adaptive_always_gives_k():
    budget = SpecBudget(3, 1, adaptive=False)
    budget.observe("r", 3, 0)
    assert budget.choose(["r", "s"], 10_000) == {"r": 3, "s": 3}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_k": 0}, "max_k must be >= 1"),
        ({"compute_bound_tokens": 0}, "compute_bound_tokens"),
        ({"decay": 0.0}, "decay must be in"),
        ({"probe_interval": 0}, "probe_interval"),
        ({"probe_interval": 64, "max_probe_interval": 32}, "probe_interval <= max_probe_interval"),
    ],
)
def test_bad_arguments_refused(kwargs, message):
    args = {"max_k": 2, "compute_bound_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        SpecBudget(**args)
