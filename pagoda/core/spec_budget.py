"""Adaptive speculative token budget: how many drafts each request verifies per step.

Pure bookkeeping (no torch), owned by the scheduler. Two inputs:

- per request, a running estimate of alpha, the chance that its next draft is accepted
  given the ones before it were. Observations are (drafts verified, drafts accepted):
  a accepted of d means a successes and, when a < d, one failure (the first rejected
  draft); later drafts tell nothing. Counts decay by `decay` per observation, so the
  estimate follows the text being generated; alpha = (S + 1) / (S + F + 2). Steps where
  a request does not speculate decay its counts too, so its estimate drifts back to
  its prior and it probes again after a while instead of never speculating again.
  A new request's prior is the engine-wide estimate (every request's observations,
  same rule), worth PRIOR_WEIGHT observations: a short request gets a sensible k from
  its first step instead of learning from scratch.
- the step's load: `base_tokens`, the tokens the step computes without drafts. A
  forward costs about the same for any token count up to the point where it becomes
  compute-bound (`compute_bound_tokens`); drafts beyond it cost as much as real tokens
  and at an acceptance below one they only slow the step down.

The choice: draft i of request r (i = 1..max_k) gains alpha_r ** i expected tokens.
Drafts whose gain is below MIN_GAIN are never worth their proposer's work and their
verification row; of the rest, the ones with the largest gain are taken while
base_tokens + drafts stays within compute_bound_tokens. Because alpha ** i falls with
i, each request gets a prefix 1..k_r. When the step is compute-bound already, every
k_r is 0: speculation costs nothing then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

# A draft expected to be accepted less often than this is not proposed: it would cost
# a verification row and proposer work (and, with async scheduling, the request's
# overlap) for little. A conservative guess, not a measurement yet: the "adaptive"
# columns of benchmarks/spec_decode_gpu.py are where to tune it.
MIN_GAIN = 0.25
DEFAULT_DECAY = 0.9
PRIOR_WEIGHT = 4.0


@dataclass
class _Estimate:
    successes: float = 0.0
    failures: float = 0.0

    @property
    def alpha(self) -> float:
        return (self.successes + 1.0) / (self.successes + self.failures + 2.0)


class SpecBudget:
    def __init__(self, max_k: int, compute_bound_tokens: int, adaptive: bool = True,
                 decay: float = DEFAULT_DECAY, min_gain: float = MIN_GAIN,
                 prior_weight: float = PRIOR_WEIGHT) -> None:
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if compute_bound_tokens < 1:
            raise ValueError(f"compute_bound_tokens must be >= 1, got {compute_bound_tokens}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_k = max_k
        self.compute_bound_tokens = compute_bound_tokens
        self.adaptive = adaptive
        self.decay = decay
        self.min_gain = min_gain
        self.prior_weight = prior_weight
        self._estimates: dict[str, _Estimate] = {}
        self._global = _Estimate()  # every request's observations

    def alpha(self, req_id: str) -> float:
        """The request's estimated per-draft acceptance (its prior before any
        observation of its own)."""
        return self._estimate(req_id).alpha

    def _estimate(self, req_id: str) -> _Estimate:
        estimate = self._estimates.get(req_id)
        if estimate is None:
            prior = self._global.alpha
            estimate = _Estimate(prior * self.prior_weight, (1.0 - prior) * self.prior_weight)
            self._estimates[req_id] = estimate
        return estimate

    def observe(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verify step's outcome. num_drafts 0: the proposer was asked and found
        nothing, counted as a rejection of the first draft."""
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        failed = num_accepted < num_drafts or num_drafts == 0
        for estimate in (self._estimate(req_id), self._global):
            estimate.successes = estimate.successes * self.decay + num_accepted
            estimate.failures = estimate.failures * self.decay + failed

    def forget(self, req_id: str) -> None:
        self._estimates.pop(req_id, None)

    def choose(self, req_ids: Iterable[str], base_tokens: int) -> dict[str, int]:
        """Each request's draft count for this step (every request gets an entry)."""
        req_ids = list(req_ids)
        if not self.adaptive:
            return {rid: self.max_k for rid in req_ids}
        spare = self.compute_bound_tokens - base_tokens
        wanted = {rid: self._worthwhile(rid) for rid in req_ids}
        if sum(wanted.values()) > max(spare, 0):
            wanted = self._best_within(wanted, max(spare, 0))
        for rid, k in wanted.items():
            if k == 0:
                self._idle(rid)
        return wanted

    def _worthwhile(self, req_id: str) -> int:
        """The most drafts whose every gain alpha ** i is at least min_gain."""
        alpha, k, gain = self.alpha(req_id), 0, 1.0
        while k < self.max_k and gain * alpha >= self.min_gain:
            gain *= alpha
            k += 1
        return k

    def _best_within(self, wanted: dict[str, int], spare: int) -> dict[str, int]:
        """The `spare` drafts of largest gain among the wanted ones (ties: the earlier
        request, then the earlier draft), as a count per request."""
        gains = []
        for order, (rid, k) in enumerate(wanted.items()):
            alpha = self.alpha(rid)
            gains.extend((-alpha ** i, order, i, rid) for i in range(1, k + 1))
        gains.sort()
        chosen = {rid: 0 for rid in wanted}
        for _, _, _, rid in gains[:spare]:
            chosen[rid] += 1
        return chosen

    def _idle(self, req_id: str) -> None:
        """A step without drafts: the old evidence fades (toward the prior)."""
        estimate = self._estimates.get(req_id)
        if estimate is not None:
            estimate.successes *= self.decay
            estimate.failures *= self.decay
