"""PenaltyState: the penalties' history of the running requests, kept on the device.

Owns one row per running request that uses a repetition, frequency or presence
penalty: its output-token counts ([V] float32) and, in a second table allocated
with the first request that uses the repetition penalty, its prompt-occurrence
mask ([V] bool). Requests without penalties have no row and cost nothing.

Life of a row:
- created when the request enters the worker (new, or resumed after a preemption:
  its NewRequestData carries the output tokens so far), from the host's token lists;
- after a step in which the request sampled one row, the sampled token is added on
  the device (`StepPenalties.record_sampled`): the host never waits for it, so under
  async scheduling a token the host does not know yet is already counted;
- a verify step (several rows for one request) adds nothing: which of its tokens
  are kept is decided on the host after the step (pagoda.spec_decode.verify). The kept
  tokens reach the worker's host list with a later step's diff, and `apply` adds
  the tokens the row has not counted yet from there (an upload, no sync);
- dropped when the request finishes or is preempted.

Invariants:
- counted[req] is how many of the request's output tokens its row holds: always
  its first counted[req] output tokens (device adds are only ever made to a row
  that holds every token before the sampled one; `begin_step` checks this).
- When a request samples, counted[req] == its host output tokens + the one token
  of the previous step still on the device, if any (the `pending` token).
- Row 0 is never given to a request and stays zero: the rows of a batch that use
  no penalty read it.
- Every update is queued on the current stream behind earlier steps, so a row
  reused by a new request is cleared only after every step that read or wrote it
  for the previous one has run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.core.outputs import SchedulerOutput
from pagoda.kernels.launch.host_copy import host_to_device
from pagoda.sample.metadata import uses_penalties
from pagoda.worker.input_batch import CachedRequestState

_ZERO_ROW = 0


def _checked(token_ids: list[int], vocab_size: int, field_name: str) -> list[int]:
    if token_ids and not (0 <= min(token_ids) and max(token_ids) < vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"{field_name} must hold token ids in [0, {vocab_size}), got {bad}")
    return token_ids


class PenaltyState:
    def __init__(self, vocab_size: int, device, initial_rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._initial_rows = max(2, initial_rows)  # row 0 is the zero row
        self.counts: torch.Tensor | None = None  # [capacity, V] float32
        self.prompt_mask: torch.Tensor | None = None  # [capacity, V] bool
        self.row_of: dict[str, int] = {}
        self.counted: dict[str, int] = {}
        self._free_rows: list[int] = []
        # Host work queued by apply(), sent in one upload: rows to clear, and the
        # (row, token) pairs to count / to mark in the prompt mask.
        self._clear: list[int] = []
        self._count_pairs: tuple[list[int], list[int]] = ([], [])
        self._mask_pairs: tuple[list[int], list[int]] = ([], [])

    @property
    def capacity(self) -> int:
        return 0 if self.counts is None else self.counts.shape[0]

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    # ---- the scheduler's diff ---------------------------------------------------
    def apply(self, out: SchedulerOutput, states: dict[str, CachedRequestState]) -> None:
        """Follows the diff that apply_scheduler_output just applied to `states`:
        drops the rows of requests that left, creates rows for the penalty-using
        requests that entered, and counts the tokens the host has and a row lacks."""
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self._drop(req_id)
        for new in out.scheduled_new_reqs:
            self._drop(new.req_id)  # its state was just rebuilt from the full data
            state = states[new.req_id]
            if uses_penalties(state.params):
                self._add(state)
        for cached in out.scheduled_cached_reqs:
            if cached.req_id in self.row_of:
                self._catch_up(states[cached.req_id])
        self._flush()

    def _drop(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            del self.counted[req_id]
            self._free_rows.append(row)

    def _add(self, state: CachedRequestState) -> None:
        repetition = state.params.repetition_penalty != 1.0
        row = self._take_row(repetition)
        self.row_of[state.req_id] = row
        self.counted[state.req_id] = 0
        self._clear.append(row)
        self._catch_up(state)
        if repetition:
            prompt = _checked(state.prompt_token_ids, self.vocab_size, "prompt_token_ids")
            self._mask_pairs[0].extend([row] * len(prompt))
            self._mask_pairs[1].extend(prompt)

    def _catch_up(self, state: CachedRequestState) -> None:
        """Queues the host's output tokens past those the row holds (a verify step's
        kept tokens; a new row's whole output)."""
        counted = self.counted[state.req_id]
        missing = state.output_token_ids[counted:]
        if missing:
            _checked(missing, self.vocab_size, "output_token_ids")
            self._count_pairs[0].extend([self.row_of[state.req_id]] * len(missing))
            self._count_pairs[1].extend(missing)
            self.counted[state.req_id] = counted + len(missing)

    def _take_row(self, with_mask: bool) -> int:
        if self.counts is None:
            self.counts = torch.zeros(
                self._initial_rows, self.vocab_size, dtype=torch.float32, device=self.device
            )
            self._free_rows = list(range(self._initial_rows - 1, _ZERO_ROW, -1))
        if not self._free_rows:
            self._grow()
        if with_mask and self.prompt_mask is None:
            self.prompt_mask = torch.zeros(
                self.capacity, self.vocab_size, dtype=torch.bool, device=self.device
            )
        return self._free_rows.pop()  # the lowest free row

    def _grow(self) -> None:
        """Doubles the tables (a device copy, queued: no sync); rows keep their index."""
        old = self.capacity
        self.counts = _grown(self.counts, 2 * old)
        if self.prompt_mask is not None:
            self.prompt_mask = _grown(self.prompt_mask, 2 * old)
        self._free_rows = list(range(2 * old - 1, old - 1, -1))

    def _flush(self) -> None:
        """One upload for the queued work, then clear rows, count, mark (in this order:
        a reused row is cleared before its new request's tokens are counted)."""
        clear, (count_rows, count_ids), (mask_rows, mask_ids) = (
            self._clear,
            self._count_pairs,
            self._mask_pairs,
        )
        if not (clear or count_rows or mask_rows):
            return
        sizes = [len(clear), len(count_rows), len(count_ids), len(mask_rows), len(mask_ids)]
        host = np.fromiter(
            (x for part in (clear, count_rows, count_ids, mask_rows, mask_ids) for x in part),
            dtype=np.int64,
            count=sum(sizes),
        )
        index = host_to_device(host, torch.int64, self.device)
        rows, c_rows, c_ids, m_rows, m_ids = torch.split(index, sizes)
        if clear:
            self.counts.index_fill_(0, rows, 0.0)
            if self.prompt_mask is not None:
                self.prompt_mask.index_fill_(0, rows, False)
        if count_rows:
            self.counts.index_put_(
                (c_rows, c_ids), torch.ones(len(count_rows), device=self.device), accumulate=True
            )
        if mask_rows:
            self.prompt_mask.index_put_(
                (m_rows, m_ids), torch.ones(len(mask_rows), dtype=torch.bool, device=self.device)
            )
        self._clear, self._count_pairs, self._mask_pairs = [], ([], []), ([], [])

    # ---- one step's sampling ------------------------------------------------------
    def begin_step(
        self, sample_req_ids: list[str], drafts: dict[str, list[int]], num_known: dict[str, int]
    ) -> StepPenalties | None:
        """The history of a step's sampled rows, or None when no row has a penalty row.

        sample_req_ids: the request of each sampled row (a verifying request's rows
        consecutive; its row j sees drafts[req][:j] as outputs). num_known: per
        request with a row, its output tokens so far (host ones + a pending one)."""
        if not any(req_id in self.row_of for req_id in sample_req_ids):
            return None
        num_rows = Counter(sample_req_ids)
        rows, draft_rows, draft_ids, update_rows, update_table_rows = [], [], [], [], []
        updated: list[str] = []
        offset = 0
        for i, req_id in enumerate(sample_req_ids):
            offset = offset + 1 if i and sample_req_ids[i - 1] == req_id else 0
            row = self.row_of.get(req_id, _ZERO_ROW)
            rows.append(row)
            if row == _ZERO_ROW:
                continue
            if offset == 0 and self.counted[req_id] != num_known[req_id]:
                raise RuntimeError(
                    f"internal error: the penalty row of request {req_id!r} holds "
                    f"{self.counted[req_id]} output tokens, but it has {num_known[req_id]}"
                )
            if offset:
                draft_rows.extend([i] * offset)
                draft_ids.extend(_checked(drafts[req_id][:offset], self.vocab_size, "drafts"))
            if num_rows[req_id] == 1:
                update_rows.append(i)
                update_table_rows.append(row)
                updated.append(req_id)
        sizes = [
            len(rows),
            len(draft_rows),
            len(draft_ids),
            len(update_rows),
            len(update_table_rows),
        ]
        index = host_to_device(
            rows + draft_rows + draft_ids + update_rows + update_table_rows,
            torch.int64,
            self.device,
        )
        return StepPenalties(self, *torch.split(index, sizes), updated)


def _grown(table: torch.Tensor, rows: int) -> torch.Tensor:
    grown = torch.zeros((rows, *table.shape[1:]), dtype=table.dtype, device=table.device)
    grown[: table.shape[0]].copy_(table)
    return grown


@dataclass
class StepPenalties:
    """One step's view of the PenaltyState (a PenaltyHistory for the sampler), and
    the device update of the rows after sampling. Index tensors are on the device."""

    state: PenaltyState
    table_rows: torch.Tensor  # [B]: each sampled row's penalty row (0: none)
    draft_rows: torch.Tensor  # sampled rows that count a draft, once per draft
    draft_ids: torch.Tensor  # ... and that draft
    update_rows: torch.Tensor  # single-row requests' sampled rows
    update_table_rows: torch.Tensor  # ... and their penalty rows
    updated_req_ids: list[str]

    def tensors(self, with_prompt_mask: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        state = self.state
        counts = state.counts.index_select(0, self.table_rows)
        if self.draft_rows.shape[0]:  # a host-known shape: no sync
            counts.index_put_(
                (self.draft_rows, self.draft_ids),
                torch.ones(self.draft_rows.shape[0], device=counts.device),
                accumulate=True,
            )
        mask = None
        if with_prompt_mask:
            if state.prompt_mask is None:
                raise RuntimeError(
                    "internal error: a row uses the repetition penalty but "
                    "no request has a prompt mask"
                )
            mask = state.prompt_mask.index_select(0, self.table_rows)
        return counts, mask

    def record_sampled(self, sampled: torch.Tensor) -> None:
        """Counts each single-row request's sampled token in its row, on the device."""
        if not self.updated_req_ids:
            return
        state = self.state
        tokens = sampled.index_select(0, self.update_rows)
        state.counts.index_put_(
            (self.update_table_rows, tokens),
            torch.ones(len(self.updated_req_ids), device=state.device),
            accumulate=True,
        )
        for req_id in self.updated_req_ids:
            state.counted[req_id] += 1
