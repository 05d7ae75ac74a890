"""Request: the scheduler's view of one sequence being generated (no torch)."""

from __future__ import annotations

import enum
import time

from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence. With n > 1 the engine makes n Requests that share `group_id`.

    Invariant: num_computed_tokens <= num_tokens_with_spec + num_output_placeholders;
    the tokens in [num_computed_tokens, num_tokens) still need a forward pass.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        group_id: str | None = None,
        sample_index: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.group_id = group_id
        self.sample_index = sample_index

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens the steps in flight will sample, not yet appended
        # (1 + k for a step verifying k drafts: as if all were accepted,
        # core/optimistic_drafts.py). The next step already computes the first of them
        # (the worker feeds it on device, or from its host when it drafted).
        self.num_output_placeholders = 0
        # Draft tokens proposed by speculative decoding, scheduled after the real ones.
        self.spec_token_ids: list[int] = []
        # Prefix-cache hit length the first time the request was scheduled (-1: not yet).
        self.num_cached_tokens = -1
        # Chained hashes of the request's full blocks, extended by the KV cache manager.
        self.block_hashes: list = []
        self.num_preemptions = 0
        self.stop_reason: object = None
        self.first_scheduled_time: float | None = None
        self.max_tokens = sampling_params.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def get_finish_reason(self) -> str | None:
        return self.status.finish_reason()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
