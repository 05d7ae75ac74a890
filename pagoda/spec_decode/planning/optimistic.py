"""Optimistic scheduling of speculating requests under async scheduling (no torch).

With async scheduling the engine schedules step N+1 before step N's tokens reach the
scheduler. A request whose step N verifies drafts or proposes them on the worker
(layer_skip, draft_model, mtp) is scheduled for step N+1 anyway, optimistically, as if
step N accepted every draft it verified:

- schedule(N+1): its drafts are PLACEHOLDER_DRAFT ids, as many as step N asked the
  worker for (cut to this step's budget); it is scheduled 1 + k tokens from
  num_computed_tokens, which counts step N's drafts as computed. Slots are allocated
  for that count, the worst case. Request.num_output_placeholders counts the tokens
  the steps in flight yield if every draft is accepted (1 + k per sampling step).
- The worker (worker/input_batch.py) knows step N's kept tokens and new drafts
  already: it read them on its host to draft. It feeds step N's last kept token
  and its own drafts at the true positions, num_computed_tokens minus step N's
  rejected drafts, and computes no row for a draft it did not propose.
- update_from_output(N) (`roll_back` here): num_computed_tokens goes back by step N's
  rejected drafts as in the synchronous schedule; when step N+1 is in flight, the
  blocks it was given for the rejected drafts' positions are freed (never written:
  the worker computed step N+1 at the true positions) and the worker is told to cut
  its block table to what remains (SchedulerOutput.trimmed_block_tables, sent with
  the next schedule). Afterwards num_computed_tokens, the block count and the block
  table are what the synchronous schedule would hold.

A request that finishes in step N (eos, stop token or string, max_tokens) wastes the
step N+1 already launched: its blocks are freed when it finishes; its step N+1 output
is dropped by update_from_output (the request is gone), so neither the output
processor nor the prefix cache ever sees those tokens (step N+1 writes only at
positions past the request's real tokens, in blocks never registered).

Where the optimistic path does not apply the batch is held instead (DraftPlanner.
must_wait): the host proposer (n-gram) needs step N's tokens on the host to draft.
"""

from __future__ import annotations

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request

# A draft id the scheduler does not know yet: the worker proposes it after the step in
# flight and fills it in itself.
PLACEHOLDER_DRAFT = -1


def is_placeholder(drafts: list[int]) -> bool:
    """True for a step's drafts that the worker fills in (all placeholders or none:
    a step's drafts are all known to the host or all proposed on the worker)."""
    return bool(drafts) and drafts[0] == PLACEHOLDER_DRAFT


class DraftRollback:
    """Takes back a step's rejected drafts: num_computed_tokens, and the blocks an
    optimistic later step took for them."""

    def __init__(
        self, kv_cache_manager: KVCacheManager, num_lookahead_tokens: int, max_model_len: int
    ) -> None:
        """num_lookahead_tokens, max_model_len: the scheduler's (the synchronous
        schedule reserves that many slots past its tokens, none past max_model_len)."""
        self.kv_cache_manager = kv_cache_manager
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        # req_id -> block ids the worker keeps; sent with the next schedule().
        self._trims: dict[str, int] = {}

    def roll_back(self, request: Request, drafts: list[int], sampled: list[int]) -> None:
        """After a sampling step of a running request: sampled holds the accepted drafts
        and one bonus token, the rest of drafts was rejected."""
        rejected = len(drafts) + 1 - len(sampled)
        if rejected <= 0:
            return
        request.num_computed_tokens -= rejected
        if request.num_output_placeholders:  # a later step in flight took worst-case slots
            # What the synchronous schedule holds: its tokens and lookahead slots.
            needed = min(
                request.num_computed_tokens + self.num_lookahead_tokens,
                max(self.max_model_len, request.num_computed_tokens),
            )
            kept = self.kv_cache_manager.trim(request, needed)
            if kept is not None:
                self._trims[request.request_id] = kept

    def take_trims(self) -> dict[str, int]:
        """req_id -> block ids the worker keeps, for the trims since the last call."""
        trims, self._trims = self._trims, {}
        return trims

    def forget(self, req_id: str) -> int | None:
        """Drops a pending trim (the worker drops the request's table itself)."""
        return self._trims.pop(req_id, None)
