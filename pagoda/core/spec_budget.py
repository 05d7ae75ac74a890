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
- whether the scheduler runs async (step N+1 scheduled before step N's tokens are
  known) and how many requests run: that sets what waiting costs (below).

The choice. Draft i of request r (i = 1..max_k) gains alpha_r ** i expected tokens.
Drafts whose gain is below MIN_GAIN are never worth their proposer's work and their
verification row: each request wants the prefix 1..k_r of drafts above it. Drafting
also has a fixed price per step, the wait: under async scheduling a request that
drafts skips the step after (DraftPlanner.must_wait). When other requests keep that
step busy the request loses a whole step, one token (WAIT_COST_BUSY); alone, the
engine just runs that step synchronously and loses the host's gap (WAIT_COST_ALONE);
with synchronous scheduling nothing is lost. So a request drafts only when its
drafts' expected tokens, alpha + ... + alpha ** k_r, cover the wait. Of the wanted
drafts, the ones with the largest gain are taken while base_tokens + drafts stays
within compute_bound_tokens; with a wait to pay, whole prefixes go to the requests of
best alpha first instead (a request cut to a draft or two would pay the wait for
little), and a request left below its wait gets none. When the step is compute-bound
already, every k_r is 0.

Probes. A request whose estimate gives it no drafts learns nothing more by itself, so
after `probe_interval` such idle steps it gets one probe: a single draft. A rejected
probe doubles its interval (up to `max_probe_interval`); an accepted one is taken as
a sign that the text changed: the request's old counts are dropped (alpha 2/3 after
the success, which drafts even in a busy async batch) and its interval starts over.
Probes take spare room like any draft: none in a compute-bound step.

What a probe costs. Synchronous: a verification row and the proposer's work. Async, in
a busy batch: two of the request's steps, since it waits after the step that asks for
the draft (the draft is not there yet) and after the one that verifies it (how many
tokens it keeps is not known yet). Continuous drafting pays one wait per verify step
(it verifies and asks in the same step): that is the WAIT_COST_BUSY of the choice.

The arithmetic at 0 % acceptance, busy async batch, a 128-token request (~130 steps)
that starts idle: its first probe comes after PROBE_INTERVAL = 64 idle steps (step
65), the next one after 128 more (step ~195, past its end). One probe, two lost steps:
2 / 130 = 1.5 % (< 2 %). An interval of 32 would probe at steps 33 and 98: 4 lost
steps, 3 %. Longer requests lose less: 2 probes in 260 steps, 3 in 520, ... (1.5 %,
1.2 %, falling); the interval stops doubling at MAX_PROBE_INTERVAL = 1024, a probe
per ~1,000 steps: 0.2 %. An engine's first requests start from alpha 1/2: with
MIN_GAIN 0.25 they want 2 drafts worth 0.75 < WAIT_COST_BUSY, so they do not draft in
a busy async batch; alone (or synchronous) they draft until about 6 rejections bring
alpha below MIN_GAIN, and later requests inherit the low engine-wide estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

# A draft expected to be accepted less often than this is not proposed: it would cost
# a verification row and proposer work for little. A conservative guess, not a
# measurement yet: the "adaptive" columns of benchmarks/spec_decode_gpu.py are where to
# tune it.
MIN_GAIN = 0.25
DEFAULT_DECAY = 0.9
PRIOR_WEIGHT = 4.0
# What a drafting request loses by waiting one step (async scheduling), in tokens.
# Busy: other requests keep the step it skips on the GPU, so it loses that step's token.
# Alone: the engine waits for the step in flight and schedules synchronously; the GPU
# idles for the host's gap (scheduling, update, launch: a few hundred microseconds
# against a ~5 ms batch-1 decode step of an 8B model on an H200), about a tenth of a
# step.
WAIT_COST_BUSY = 1.0
WAIT_COST_ALONE = 0.1
# Idle steps before a request's first probe, and the most its doubling may reach (the
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
    interval: int  # idle steps before its next probe
    idle: int = 0  # steps in a row its estimate gave it no drafts
    # A probe was chosen for it and its verification is not observed yet: it keeps one
    # draft a step until then (an async request verifies it two steps later).
    probing: bool = False


@dataclass
class _Wanted:
    """choose()'s working set: drafts wanted per request, each request's alpha (read
    once per step), and which requests are probes."""
    k: dict[str, int] = field(default_factory=dict)
    alpha: dict[str, float] = field(default_factory=dict)
    probes: set[str] = field(default_factory=set)


def _gain(alpha: float, k: int) -> float:
    """Expected extra tokens of drafts 1..k: alpha + ... + alpha ** k."""
    return sum(alpha ** i for i in range(1, k + 1))


class SpecBudget:
    def __init__(self, max_k: int, compute_bound_tokens: int, adaptive: bool = True,
                 decay: float = DEFAULT_DECAY, min_gain: float = MIN_GAIN,
                 prior_weight: float = PRIOR_WEIGHT, async_scheduling: bool = False,
                 probe_interval: int = PROBE_INTERVAL,
                 max_probe_interval: int = MAX_PROBE_INTERVAL) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if compute_bound_tokens < 1:
            raise ValueError(f"compute_bound_tokens must be >= 1, got {compute_bound_tokens}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 1 <= probe_interval <= max_probe_interval:
            raise ValueError(f"need 1 <= probe_interval <= max_probe_interval, got "
                             f"{probe_interval} and {max_probe_interval}")
        self.max_k = max_k
        self.compute_bound_tokens = compute_bound_tokens
        self.adaptive = adaptive
        self.decay = decay
        self.min_gain = min_gain
        self.prior_weight = prior_weight
        self.async_scheduling = async_scheduling
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
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

    def probe_interval_of(self, req_id: str) -> int:
        """Idle steps before the request's next probe."""
        return self._state(req_id).interval

    def wait_cost(self, num_running: int) -> float:
        """Tokens a request loses by drafting in a step of num_running requests."""
        if not self.async_scheduling:
            return 0.0
        return WAIT_COST_BUSY if num_running > 1 else WAIT_COST_ALONE

    def _state(self, req_id: str) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            prior = self._global.alpha
            estimate = _Estimate(prior * self.prior_weight, (1.0 - prior) * self.prior_weight)
            state = _RequestState(estimate, self.probe_interval)
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
                state.interval = self.probe_interval
            else:
                state.interval = min(2 * state.interval, self.max_probe_interval)
        failed = num_accepted < num_drafts or num_drafts == 0
        for estimate in (state.estimate, self._global):
            estimate.successes = estimate.successes * self.decay + num_accepted
            estimate.failures = estimate.failures * self.decay + failed

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def choose(self, req_ids: Iterable[str], base_tokens: int,
               num_running: Optional[int] = None) -> dict[str, int]:
        """Each request's draft count for this step (every request gets an entry).
        num_running: the requests running in the step (default: len(req_ids))."""
        req_ids = list(req_ids)
        if not self.adaptive:
            return {rid: self.max_k for rid in req_ids}
        wait = self.wait_cost(len(req_ids) if num_running is None else num_running)
        wanted = _Wanted()
        for rid in req_ids:
            state = self._state(rid)
            alpha = wanted.alpha[rid] = state.estimate.alpha
            k = self._worthwhile(alpha, wait)
            if k == 0 and (state.probing or state.idle >= state.interval):
                k = 1
                wanted.probes.add(rid)
            wanted.k[rid] = k
        chosen = self._fit(wanted, max(self.compute_bound_tokens - base_tokens, 0), wait)
        for rid, k in chosen.items():
            self._account(rid, wanted.k[rid], k, rid in wanted.probes)
        return chosen

    def _worthwhile(self, alpha: float, wait: float) -> int:
        """The most drafts whose every gain alpha ** i is at least min_gain, or 0 when
        together they do not cover the wait."""
        k, gain = 0, 1.0
        while k < self.max_k and gain * alpha >= self.min_gain:
            gain *= alpha
            k += 1
        return k if k and _gain(alpha, k) >= wait else 0

    def _fit(self, wanted: _Wanted, spare: int, wait: float) -> dict[str, int]:
        """The wanted drafts within `spare`. Without a wait, the drafts of largest gain
        (spread over the requests); with one, whole prefixes for the requests of best
        alpha first: a request cut below its wait would pay the wait for little."""
        if sum(wanted.k.values()) <= spare:
            return dict(wanted.k)
        if wait == 0.0:
            return self._best_within(wanted, spare)
        chosen = {rid: 0 for rid in wanted.k}
        # Best alpha first, ties in request order (sorted is stable).
        for rid in sorted((rid for rid, k in wanted.k.items() if k),
                          key=lambda rid: -wanted.alpha[rid]):
            k = min(wanted.k[rid], spare)
            if k and (rid in wanted.probes or _gain(wanted.alpha[rid], k) >= wait):
                chosen[rid] = k
                spare -= k
        return chosen

    @staticmethod
    def _best_within(wanted: _Wanted, spare: int) -> dict[str, int]:
        """The `spare` drafts of largest gain among the wanted ones (ties: the earlier
        request, then the earlier draft), as a count per request."""
        gains = []
        for order, (rid, k) in enumerate(wanted.k.items()):
            alpha = wanted.alpha[rid]
            gains.extend((-alpha ** i, order, i, rid) for i in range(1, k + 1))
        gains.sort()
        chosen = {rid: 0 for rid in wanted.k}
        for _, _, _, rid in gains[:spare]:
            chosen[rid] += 1
        return chosen

    def _account(self, req_id: str, wanted: int, chosen: int, probe: bool) -> None:
        """Idle steps and probe state after a choice. A probe or a request cut by the
        compute bound keeps its count: the probe stays due until there is room."""
        state = self._requests[req_id]
        if chosen:
            state.idle = 0
            state.probing = state.probing or probe
        elif wanted == 0:  # its estimate (with the wait) gives it nothing
            state.idle += 1
