"""DraftPlanner + SpecBudget probes in the scheduler, on the fake verifying worker of
test_spec_scheduling: at 0 % acceptance a request is asked for one draft per probe,
verifies it once, and is not asked again while the probe is verified."""

from __future__ import annotations

import pytest
from helpers.scheduler_harness import VOCAB, make_request, make_scheduler, next_token
from test_spec_scheduling import VerifyingRunner, check_outputs, run

from pagoda.spec_decode.planning.budget import SpecBudget
from pagoda.spec_decode.planning.planner import DraftPlanner

# The arithmetic of these trajectories (comments below) takes drafts down to a gain of
# .25: pinned here, independent of spec_budget.MIN_GAIN's default.
PROBE_TEST_MIN_GAIN = 0.25


class WrongProposer:
    """Drafts that are never accepted; records each call's (request, drafts asked)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, tokens: list[int], k: int) -> list[int]:
        self.calls.append((tokens[0], k))
        return [(next_token(tokens) + 1) % VOCAB] * k


@pytest.mark.parametrize("pipelined", [False, True])
def test_zero_acceptance_stops_drafting_and_probes_one_draft_at_a_time(pipelined):
    proposer = WrongProposer()
    budget = SpecBudget(4, 64, min_gain=PROBE_TEST_MIN_GAIN, drafting_holds=pipelined)
    sched = make_scheduler(
        num_blocks=80, async_scheduling=pipelined, draft_planner=DraftPlanner(budget, 256, proposer)
    )
    requests = [make_request(f"r{i}", [i + 1, 9, 8, 7], max_tokens=130) for i in range(2)]
    for r in requests:
        sched.add_request(r)
    scheduled = []
    schedule = sched.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append(sorted(out.num_scheduled_tokens))
        return out

    sched.schedule = recording_schedule
    runner = VerifyingRunner()
    tokens, reasons = run(sched, runner, pipelined)
    check_outputs(sched, requests, tokens, reasons)
    assert sched.num_preemptions_total == 0  # both run to the end side by side
    asks = {first: [k for f, k in proposer.calls if f == first] for first in (1, 2)}
    stats = sched.draft_planner.stats
    # Asked for 2 drafts at steps 2 and 3 (step 3 asks before the rejection it verifies
    # is known), then 1 as alpha falls (.424 ... .258); the last ask is trimmed (alpha
    # .234 < min_gain .25). Then one probe step after 64 steps without drafts: each asked
    # for one draft, verified once, not asked again in the step that verifies it.
    assert asks == {1: [2, 2, 1, 1, 1, 1, 1, 1], 2: [2, 2, 1, 1, 1, 1, 1, 1]}
    # Per request: verifies at 6 steps (2 drafts, then 1 each), then the probe.
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (14, 16, 0)
    assert runner.verify_steps == stats.num_drafts
    # Async: a step is never scheduled for one request while the other waits for its
    # drafts' outcome: the scheduler holds the batch (an empty step) instead.
    assert all(ids in ([], ["r0", "r1"]) for ids in scheduled)
    # Held: after each of the 8 steps that ask for drafts, and after the 2 that verify
    # drafts and ask for none (the trimmed ask's step, the probe's verification).
    held = sum(ids == [] for ids in scheduled[1:])
    assert held == (10 if pipelined else 0)
