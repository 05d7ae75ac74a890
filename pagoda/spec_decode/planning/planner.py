"""DraftPlanner: the scheduler's side of speculative decoding (no torch).

Owns, per step: how many drafts each running request may verify (the SpecBudget's
choice, cut to what max_tokens and max_model_len leave), which requests must propose
drafts after the step and how many (`SchedulerOutput.num_drafts_to_propose`, for a
proposer on the worker), and, once the step's tokens are known, the drafts each
request carries into the next step: the worker's (ModelRunnerOutput.spec_token_ids)
or, for a host proposer (n-gram), its own call. Also the acceptance counters the
metrics report.

Async scheduling (step N+1 is scheduled before step N's tokens are known):
- A proposer on the worker (layer_skip, draft_model, mtp): a request whose step in flight
  verifies drafts or proposes some is scheduled for step N+1 optimistically, as if
  every draft of step N were accepted, with placeholder drafts that the worker fills
  in with its proposals (core/optimistic_drafts.py). Every such step is in
  num_drafts_to_propose (0 drafts for one that only verifies), so that the worker
  reads its kept tokens on its host. Nothing is held: the overlap stays.
- The host proposer (n-gram) needs step N's tokens on the host to draft, so a
  request whose step in flight verifies drafts, or will draft after it, must wait for
  that step's update; while any request waits so, the scheduler holds the whole batch
  for a step (holds_batch) rather than run the others ahead of it;
  SpecBudget prices that held step (SpecBudget.hold_cost, drafting_holds) when it
  decides whether a step drafts at all. A request that does not speculate this step
  (k = 0: the budget says drafts do not pay) keeps the overlap.
A probe (one draft for a request the budget keeps idle) is asked for once: the step
that verifies it does not ask again (held, it costs one verification and two waits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagoda.core.request import Request, RequestStatus
from pagoda.spec_decode.planning.budget import SpecBudget
from pagoda.spec_decode.planning.optimistic import PLACEHOLDER_DRAFT, is_placeholder

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
    def __init__(
        self,
        budget: SpecBudget,
        max_model_len: int,
        host_proposer: HostProposer | None = None,
        async_scheduling: bool = False,
    ) -> None:
        """host_proposer: drafts proposed on the host after each step (None: the
        worker proposes them, asked through SchedulerOutput.num_drafts_to_propose).
        async_scheduling: the scheduler's (set by it)."""
        self.budget = budget
        self.async_scheduling = async_scheduling
        self.max_model_len = max_model_len
        self.host_proposer = host_proposer
        # Requests that never draft (the engine: those with an output grammar or a
        # thinking budget, whose masks and forced tokens follow the kept tokens only).
        self.never_drafts: Callable[[Request], bool] = lambda request: False
        self.stats = SpecDecodingStats()
        self._k: dict[str, int] = {}  # this step's budget per running request
        self._base = 0  # this step's load without drafts (plan_step)
        # req_id -> per sampling step in flight, oldest first: the drafts asked of the
        # proposer after it (None: not in num_drafts_to_propose); popped by its update.
        self._asked: dict[str, list[int | None]] = {}
        # req_id -> the worker's drafts that its optimistic step in flight verifies
        # (its scheduled drafts are placeholders), set by the previous step's update.
        self._verifying: dict[str, list[int]] = {}

    # ---- schedule() -------------------------------------------------------------------
    def plan_step(
        self, running: Iterable[Request], admits_waiting: bool, max_num_batched_tokens: int
    ) -> None:
        """Chooses this step's draft counts. The load is the running requests' tokens
        other than drafts, plus a full budget of prefill when waiting requests will be
        admitted (a prefill step is compute-bound already)."""
        running = list(running)
        base = sum(
            max(0, r.num_tokens + r.num_output_placeholders - r.num_computed_tokens)
            for r in running
        )
        if admits_waiting:
            base += max_num_batched_tokens
        self._base = base
        self._k = self.budget.choose([r.request_id for r in running], base)

    def optimistic(self, request: Request) -> bool:
        """True for a request whose step in flight was asked for drafts (or to report
        its kept tokens) on the worker: its next step is scheduled before that step's
        update, with placeholder drafts (core/optimistic_drafts.py)."""
        asked = self._asked.get(request.request_id)
        return bool(
            self.async_scheduling
            and self.host_proposer is None
            and request.num_output_placeholders
            and asked
            and asked[-1] is not None
        )

    def must_wait(self, request: Request) -> bool:
        """True for a request whose step in flight verifies drafts or will propose some
        on the host: its next step needs that step's tokens first (module docstring)."""
        if not request.num_output_placeholders or self.optimistic(request):
            return False
        asked = self._asked.get(request.request_id)
        return bool(request.spec_token_ids or (asked and asked[-1]))

    def holds_batch(self, running: Iterable[Request]) -> bool:
        """Async scheduling with the host proposer: while a request's step in flight
        verifies or proposes drafts, nobody is scheduled ahead of its tokens (an empty
        step). Were the others scheduled, that request would sit out a whole step;
        held, every request loses only the host's gap between steps (the price
        SpecBudget.hold_cost weighs). Worker proposers never hold (optimistic)."""
        return self.async_scheduling and any(self.must_wait(r) for r in running)

    def prepare(self, request: Request) -> None:
        """Sets an optimistic request's placeholder drafts, then drops the drafts beyond
        this step's budget and beyond what the request may still produce once its
        steps in flight are done; called before the request's tokens are counted."""
        if self.optimistic(request):
            request.spec_token_ids = [PLACEHOLDER_DRAFT] * (
                self._asked[request.request_id][-1] or 0
            )
        k = min(
            self._k.get(request.request_id, 0), self._room(request, request.num_output_placeholders)
        )
        if len(request.spec_token_ids) > k:
            del request.spec_token_ids[max(k, 0) :]

    def unprepare(self, request: Request) -> None:
        """Drops the placeholder drafts of a request prepare() set up and the step did
        not schedule (they are valid for that step only)."""
        if is_placeholder(request.spec_token_ids):
            request.spec_token_ids = []

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
        it (the step yields at least one token each). Async with a worker proposer, a
        step that verifies drafts is always listed (0: report the kept tokens only)."""
        asked, sampling = {}, list(sampling)
        num_running = len(self._k) + sum(r.request_id not in self._k for r in sampling)
        report = self.async_scheduling and self.host_proposer is None
        for request in sampling:
            rid = request.request_id
            k = self._k.get(rid)
            if k is None:  # admitted this step: not running when the step was planned
                k = self.budget.choose([rid], self._base, num_running)[rid]
            if request.spec_token_ids and self.budget.is_probing(rid):
                k = 0  # this step verifies its probe: one draft, then the outcome
            # Optimistic, the steps in flight may yield all their placeholders' tokens.
            k = min(k, self._room(request, request.num_output_placeholders if report else 1))
            if k > 0 or (report and request.spec_token_ids):
                asked[rid] = max(k, 0)
            self._asked.setdefault(rid, []).append(asked.get(rid))
        return asked

    # ---- update_from_output() -----------------------------------------------------------
    def observe(self, request: Request, drafts: list[int], sampled: list[int]) -> None:
        """Records a step's acceptance (finished requests included); placeholder
        drafts stand for the worker's drafts the step verified."""
        if is_placeholder(drafts):
            drafts = self._verifying.pop(request.request_id, [])
        if drafts and sampled:
            accepted = len(sampled) - 1
            self.stats.record(len(drafts), accepted)
            self.budget.observe(request.request_id, len(drafts), accepted)

    def next_drafts(self, request: Request, worker_drafts: list[int] | None) -> list[int]:
        """The drafts an unfinished request carries into its next step, after a step
        that sampled (none while another step of it is in flight: that step was
        scheduled with placeholders for the worker's drafts, or asked for none)."""
        rid = request.request_id
        pending = self._asked.get(rid)
        asked = pending.pop(0) if pending else None
        if request.num_output_placeholders:
            if asked is not None and self.host_proposer is None:
                # The later step verifies the first of these (as many as it scheduled).
                self._verifying[rid] = list(worker_drafts or ())[: len(request.spec_token_ids)]
            return []
        if not asked or request.status != RequestStatus.RUNNING:
            return []
        asked = min(asked, self._room(request, 0))
        if self.host_proposer is not None:
            proposal = self.host_proposer(request.all_token_ids, asked) if asked > 0 else []
        else:
            proposal = list(worker_drafts or ())[: max(asked, 0)]
        if asked > 0 and not proposal and self.budget.drafting_holds:
            # Asked and found nothing: held for it, a failed draft; otherwise the ask
            # cost nothing and says nothing of acceptance.
            self.budget.observe(rid, 0, 0)
        return proposal

    def forget(self, req_id: str) -> None:
        self._asked.pop(req_id, None)
        self._verifying.pop(req_id, None)
        self._k.pop(req_id, None)
        self.budget.forget(req_id)
