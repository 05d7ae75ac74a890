"""Adaptive speculative token budget: how many drafts each request verifies per step.

Pure bookkeeping (no torch), owned by the scheduler. Inputs:

- per request, a running estimate of alpha, the chance that its next draft is accepted
  given the ones before it were. Observations are (drafts verified, drafts accepted):
  a accepted of d means a successes and, when a < d, one failure (the first rejected
  draft); later drafts tell nothing. Counts decay by `decay` per observation, so the
  estimate follows the text being generated; alpha = (S + 1) / (S + F + 2). A new
  request's prior is the engine-wide estimate (every request's observations, same
  rule), worth PRIOR_WEIGHT observations: a short request gets a sensible k from its
  first step instead of learning from scratch. Steps without drafts leave the estimate
  as it is (they carry no evidence).
- the step's load: `base_tokens`, the tokens the step computes without drafts. A
  forward costs about the same for any token count up to the point where it becomes
  compute-bound (`compute_bound_tokens`); drafts beyond it cost as much as real tokens
  and at an acceptance below one they only slow the step down.
- whether a drafting step holds the batch (`drafting_holds`: async scheduling with
  the host proposer, n-gram) and how many requests run: that sets what a drafting
  step costs (below).

The choice. Draft i of request r (i = 1..max_k) gains alpha_r ** i expected tokens.
Drafts whose gain is below MIN_GAIN are never worth their proposer's work and their
verification row: each request wants the prefix 1..k_r of drafts above it. Of the
wanted drafts, the ones with the largest gain are taken while base_tokens + drafts
stays within compute_bound_tokens. When the step is compute-bound already, every k_r
is 0.

A held step adds a price per step. Under async scheduling with the host proposer
(n-gram), a request that drafts cannot have its next step scheduled before this
one's tokens are known (DraftPlanner.must_wait), and the scheduler then holds the
whole batch for that step (Scheduler: a synchronous step): were the others scheduled
ahead, each drafting request would lose a whole step (measured on an H200 at 80 %
acceptance and 8-128 requests: 0.79-0.94x of off), while a held step costs every
request only the overlap, the host's gap between steps: from HOLD_COST_ALONE of a
token alone to HOLD_COST_BUSY in a batch of HOLD_COST_BUSY_FROM (measured; see the
constants). So a step drafts only when its drafts' expected tokens, summed over the
batch, cover hold_cost(running requests); otherwise nobody drafts. Synchronous
scheduling pays nothing, and neither do proposers on the worker (layer_skip,
draft_model) under async scheduling: their requests are scheduled optimistically
(core/optimistic_drafts.py), nothing is held.

Probes. With no drafts the estimates learn nothing, so after `probe_interval` steps in
a row without drafts, one probe step gives every request one draft (where drafting holds,
one held step for the whole batch, not one per request). A probe step where no draft is accepted doubles
the interval (up to `max_probe_interval`); an accepted probe is taken as a sign that
the text changed: that request's old counts are dropped (alpha 2/3 after the
success) and the interval starts over. Probes take spare room like any draft.

The arithmetic at 0 % acceptance, held steps: probe steps after 64, 128, 256, ... idle
steps, each costing at most a token a request: a 128-token request sees at most 2
(1.6 % of its steps); at the cap, one per 1,024 steps. An engine's first requests
start from alpha 1/2 (2 drafts worth 0.75): alone or in small batches they draft until
about 6 rejections bring alpha below MIN_GAIN, then later requests inherit the low
engine-wide estimate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A draft expected to be accepted less often than this is not proposed: what one more
# verification row (and its proposer work) costs, in tokens, where the step is not
# compute-bound. Measured at batch 1: on an H200 with an 8B model a verify step of 5 rows
# cost 1.355 decode steps and one of 7 rows 1.395, about 0.02 of a token per extra row
# (most of the 0.355 is the held step); on the 2-core CPU with SmolLM2 ~0.09 (a 5-row
# step 53.6 ms, one row 38-40 ms). 0.25 left drafts 5 and 6 unproposed at 80 %
# acceptance on the H200 (adaptive 1.95 ms/token vs k=6 always 1.65).
MIN_GAIN = 0.1
DEFAULT_DECAY = 0.9
PRIOR_WEIGHT = 4.0
# What a held (synchronous) step costs each running request under async scheduling, in
# tokens: the host's gap between steps, when the GPU idles. Measured on an H200 with an
# 8B model: alone about 0.2 of a step (batch-1 steps of 4.8 ms async, 5.8 ms held with 4
# verify rows); in a batch of 64 one draft each at 80 % acceptance (0.8 expected tokens
# a request) still lost (0.86x of off), so a held step costs a request about a whole
# token there. In between, linear in the batch size (the host's work per step grows
# with it while the forward's time hardly does).
HOLD_COST_ALONE = 0.2
HOLD_COST_BUSY = 1.0
HOLD_COST_BUSY_FROM = 64  # running requests from which a held step costs HOLD_COST_BUSY
# Idle steps before the first probe step, and the most its doubling may reach (the
# module docstring gives the arithmetic).
PROBE_INTERVAL = 64
MAX_PROBE_INTERVAL = 1024


@dataclass
class _Estimate:
    successes: float = 0.0
    failures: float = 0.0

    @property
    def alpha(self) -> float:
        return (self.successes + 1.0) / (self.successes + self.failures + 2.0)


@dataclass
class _RequestState:
    estimate: _Estimate
    # A probe was chosen for it and its verification is not observed yet: it keeps one
    # draft a step until then (async, a request verifies it one or two steps later).
    probing: bool = False


def _gain(alpha: float, k: int) -> float:
    """Expected extra tokens of drafts 1..k: alpha + ... + alpha ** k."""
    return sum(alpha**i for i in range(1, k + 1))


class SpecBudget:
    def __init__(
        self,
        max_k: int,
        compute_bound_tokens: int,
        adaptive: bool = True,
        decay: float = DEFAULT_DECAY,
        min_gain: float = MIN_GAIN,
        prior_weight: float = PRIOR_WEIGHT,
        drafting_holds: bool = False,
        probe_interval: int = PROBE_INTERVAL,
        max_probe_interval: int = MAX_PROBE_INTERVAL,
    ) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if compute_bound_tokens < 1:
            raise ValueError(f"compute_bound_tokens must be >= 1, got {compute_bound_tokens}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 1 <= probe_interval <= max_probe_interval:
            raise ValueError(
                f"need 1 <= probe_interval <= max_probe_interval, got "
                f"{probe_interval} and {max_probe_interval}"
            )
        self.max_k = max_k
        self.compute_bound_tokens = compute_bound_tokens
        self.adaptive = adaptive
        self.decay = decay
        self.min_gain = min_gain
        self.prior_weight = prior_weight
        # Async scheduling with a host proposer: a drafting step holds the batch.
        self.drafting_holds = drafting_holds
        self.base_probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_interval = probe_interval  # steps without drafts before a probe step
        self._idle_steps = 0  # steps in a row without drafts
        self._requests: dict[str, _RequestState] = {}
        self._global = _Estimate()  # every request's observations

    def alpha(self, req_id: str) -> float:
        """The request's estimated per-draft acceptance (its prior before any
        observation of its own)."""
        return self._state(req_id).estimate.alpha

    def is_probing(self, req_id: str) -> bool:
        """True while the request's probe is chosen and its verification not observed."""
        state = self._requests.get(req_id)
        return state is not None and state.probing

    def hold_cost(self, num_running: int) -> float:
        """Tokens a drafting step costs the batch: where drafting holds, a held step for
        everyone; nothing otherwise."""
        if not self.drafting_holds:
            return 0.0
        share = min(1.0, (num_running - 1) / (HOLD_COST_BUSY_FROM - 1))
        return num_running * (HOLD_COST_ALONE + (HOLD_COST_BUSY - HOLD_COST_ALONE) * share)

    def _state(self, req_id: str) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            prior = self._global.alpha
            estimate = _Estimate(prior * self.prior_weight, (1.0 - prior) * self.prior_weight)
            state = _RequestState(estimate)
            self._requests[req_id] = state
        return state

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verify step's outcome. num_drafts 0: the proposer was asked and found
        nothing, counted as a rejection of the first draft."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        state = self._state(req_id)
        if state.probing:
            state.probing = False
            if num_accepted:  # the text changed: the old evidence is stale
                state.estimate = _Estimate()
                self.probe_interval = self.base_probe_interval
        failed = num_accepted < num_drafts or num_drafts == 0
        for estimate in (state.estimate, self._global):
            estimate.successes = estimate.successes * self.decay + num_accepted
            estimate.failures = estimate.failures * self.decay + failed

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def choose(
        self, req_ids: Iterable[str], base_tokens: int, num_running: int | None = None
    ) -> dict[str, int]:
        """Each request's draft count for this step (every request gets an entry).
        num_running: the requests running in the step (default: len(req_ids))."""
        req_ids = list(req_ids)
        if not self.adaptive:
            return {rid: self.max_k for rid in req_ids}
        spare = max(self.compute_bound_tokens - base_tokens, 0)
        alphas = {rid: self._state(rid).estimate.alpha for rid in req_ids}
        wanted = {rid: self._worthwhile(alphas[rid]) for rid in req_ids}
        for rid in req_ids:  # a probe chosen earlier holds until its outcome is known
            if self._requests[rid].probing:
                wanted[rid] = max(wanted[rid], 1)
        chosen = self._fit(wanted, alphas, spare)
        running = len(req_ids) if num_running is None else num_running
        probing = any(self._requests[rid].probing for rid in req_ids)
        gain = sum(_gain(alphas[rid], k) for rid, k in chosen.items())
        if not probing and gain < self.hold_cost(running):
            chosen = {rid: 0 for rid in req_ids}
        if req_ids and not any(chosen.values()):
            self._idle_steps += 1
            if self._idle_steps >= self.probe_interval and spare > 0:
                chosen = self._probe_step(req_ids, spare)
        else:
            self._idle_steps = 0
        return chosen

    def _probe_step(self, req_ids: list[str], spare: int) -> dict[str, int]:
        """One draft for each request (within spare); the next probe step comes after
        twice the interval unless a probe is accepted."""
        chosen = {rid: int(i < spare) for i, rid in enumerate(req_ids)}
        for rid, k in chosen.items():
            if k:
                self._requests[rid].probing = True
        self._idle_steps = 0
        self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
        return chosen

    def _worthwhile(self, alpha: float) -> int:
        """The most drafts whose every gain alpha ** i is at least min_gain."""
        k, gain = 0, 1.0
        while k < self.max_k and gain * alpha >= self.min_gain:
            gain *= alpha
            k += 1
        return k

    @staticmethod
    def _fit(wanted: dict[str, int], alphas: dict[str, float], spare: int) -> dict[str, int]:
        """The `spare` drafts of largest gain among the wanted ones (ties: the earlier
        request, then the earlier draft), as a count per request."""
        if sum(wanted.values()) <= spare:
            return dict(wanted)
        gains: list[tuple[float, int, int, str]] = []
        for order, (rid, k) in enumerate(wanted.items()):
            gains.extend((-(alphas[rid] ** i), order, i, rid) for i in range(1, k + 1))
        gains.sort()
        chosen = {rid: 0 for rid in wanted}
        for _, _, _, rid in gains[:spare]:
            chosen[rid] += 1
        return chosen
