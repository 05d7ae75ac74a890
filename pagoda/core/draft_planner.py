"""DraftPlanner: the scheduler's side of speculative decoding (no torch).

Owns, per step: how many drafts each running request may verify (the SpecBudget's
choice, cut to what max_tokens and max_model_len leave), which requests must propose
drafts after the step and how many (`SchedulerOutput.num_drafts_to_propose`, for a
proposer on the worker), and, once the step's tokens are known, the drafts each
request carries into the next step: the worker's (ModelRunnerOutput.spec_token_ids)
or, for a host proposer (n-gram), its own call. Also the acceptance counters the
metrics report.

Async scheduling (step N+1 is scheduled before step N's tokens are known): drafts
proposed after step N are for the positions that follow step N's tokens, so a request
that will draft must not have step N+1 scheduled before they exist. A request whose
step in flight verifies drafts, or was asked to propose, therefore waits one step (it
is not scheduled again until that step's update); a request that does not speculate
this step (k = 0: the budget says drafts do not pay) keeps the overlap. While any
request waits so, the scheduler holds the whole batch for a step (Scheduler.
_holds_for_drafts) rather than run the others ahead of it; SpecBudget prices that held
step (SpecBudget.hold_cost) when it decides whether a step drafts at all. A probe (one draft
for a request the budget keeps idle) is asked for once: the step that verifies it
does not ask again, so it costs one verification and, async, two waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from pagoda.core.request import Request, RequestStatus
from pagoda.core.spec_budget import SpecBudget

# (the request's prompt + output token ids, most drafts wanted) -> drafts
HostProposer = Callable[[list[int], int], list[int]]


@dataclass
class SpecDecodingStats:
    """Counters since start (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # verify steps of a request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts accepted at position i (0-based) of their step.
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


class DraftPlanner:
    def __init__(self, budget: SpecBudget, max_model_len: int,
                 host_proposer: Optional[HostProposer] = None) -> None:
        """host_proposer: drafts proposed on the host after each step (None: the
        worker proposes them, asked through SchedulerOutput.num_drafts_to_propose)."""
        self.budget = budget
        self.max_model_len = max_model_len
        self.host_proposer = host_proposer
        # Requests that never draft (the engine: those with an output grammar or a
        # thinking budget, whose masks and forced tokens follow the kept tokens only).
        self.never_drafts: Callable[[Request], bool] = lambda request: False
        self.stats = SpecDecodingStats()
        self._k: dict[str, int] = {}  # this step's budget per running request
        self._base = 0  # this step's load without drafts (plan_step)
        # req_id -> drafts asked of the proposer after its last sampling step; cleared
        # when that step's update hands them over.
        self._asked: dict[str, int] = {}

    # ---- schedule() -------------------------------------------------------------------
    def plan_step(self, running: Iterable[Request], admits_waiting: bool,
                  max_num_batched_tokens: int) -> None:
        """Chooses this step's draft counts. The load is the running requests' tokens
        other than drafts, plus a full budget of prefill when waiting requests will be
        admitted (a prefill step is compute-bound already)."""
        running = list(running)
        base = sum(max(0, r.num_tokens + r.num_output_placeholders - r.num_computed_tokens)
                   for r in running)
        if admits_waiting:
            base += max_num_batched_tokens
        self._base = base
        self._k = self.budget.choose([r.request_id for r in running], base)

    def must_wait(self, request: Request) -> bool:
        """True for a request whose step in flight verifies drafts or will propose some:
        its next step needs that step's tokens first (see the module docstring)."""
        return bool(request.num_output_placeholders
                    and (request.spec_token_ids or self._asked.get(request.request_id, 0)))

    def trim(self, request: Request) -> None:
        """Drops the drafts beyond this step's budget and beyond what the request may
        still produce; called before the request's tokens are counted."""
        k = min(self._k.get(request.request_id, 0), self._room(request, 0))
        if len(request.spec_token_ids) > k:
            del request.spec_token_ids[max(k, 0):]

    def _room(self, request: Request, extra: int) -> int:
        """Drafts that can still pay off once `extra` more tokens are known: a verify
        step with k drafts yields up to k + 1 tokens."""
        if self.never_drafts(request):
            return 0
        left = self.max_model_len - request.num_tokens - extra - 1
        if request.max_tokens is not None:
            left = min(left, request.max_tokens - request.num_output_tokens - extra - 1)
        return left

    def to_propose(self, sampling: Iterable[Request]) -> dict[str, int]:
        """req_id -> drafts to propose after this step, for the requests that sample in
        it (the step yields at least one token each)."""
        asked, sampling = {}, list(sampling)
        num_running = len(self._k) + sum(r.request_id not in self._k for r in sampling)
        for request in sampling:
            rid = request.request_id
            k = self._k.get(rid)
            if k is None:  # admitted this step: not running when the step was planned
                k = self.budget.choose([rid], self._base, num_running)[rid]
            if request.spec_token_ids and self.budget.is_probing(rid):
                k = 0  # this step verifies its probe: one draft, then the outcome
            k = min(k, self._room(request, 1))
            if k > 0:
                asked[request.request_id] = k
        self._asked.update(asked)
        return asked

    # ---- update_from_output() -----------------------------------------------------------
    def observe(self, request: Request, drafts: list[int], sampled: list[int]) -> None:
        """Records a step's acceptance (finished requests included)."""
        if drafts and sampled:
            accepted = len(sampled) - 1
            self.stats.record(len(drafts), accepted)
            self.budget.observe(request.request_id, len(drafts), accepted)

    def next_drafts(self, request: Request, worker_drafts: Optional[list[int]]) -> list[int]:
        """The drafts an unfinished request carries into its next step, after a step
        that sampled (none while another step of it is in flight: they would be stale)."""
        rid = request.request_id
        if request.num_output_placeholders:
            # A later step of it is in flight: this step did not ask for drafts (it
            # would have waited), the later one may have; its update answers.
            return []
        asked = self._asked.pop(rid, 0)
        if not asked or request.status != RequestStatus.RUNNING:
            return []
        asked = min(asked, self._room(request, 0))
        if self.host_proposer is not None:
            proposal = self.host_proposer(request.all_token_ids, asked) if asked > 0 else []
        else:
            proposal = list(worker_drafts or ())[:max(asked, 0)]
        if asked > 0 and not proposal and self.budget.async_scheduling:
            # Asked and found nothing: async, the request was held for it, a failed
            # draft; synchronous, the ask cost nothing and says nothing of acceptance.
            self.budget.observe(rid, 0, 0)
        return proposal

    def forget(self, req_id: str) -> None:
        self._asked.pop(req_id, None)
        self._k.pop(req_id, None)
        self.budget.forget(req_id)
