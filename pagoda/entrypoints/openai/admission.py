"""Admission control: bounds on queued work, answered with 429 + Retry-After beyond them.

A request is *queued* from the moment it is admitted until its first output
arrives (it is waiting to be scheduled or in prefill). The server counts queued
requests and their prompt tokens on the event loop (no lock needed) and refuses a
new request that would push either count past its cap (--max-num-queued-requests,
--max-queued-tokens). A prompt larger than the token cap alone is still admitted
when nothing is queued, so no request is unservable.
"""

from __future__ import annotations

from pagoda.entrypoints.openai.errors import APIError

RETRY_AFTER_SECONDS = 1


class AdmissionController:
    def __init__(self, max_num_queued_requests: int | None, max_queued_tokens: int | None) -> None:
        self.max_num_queued_requests = max_num_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.num_queued = 0
        self.num_queued_tokens = 0

    def admit(self, prompt_lens: list[int]) -> AdmissionTicket:
        """Admits one HTTP request holding len(prompt_lens) engine requests, or raises 429."""
        count, tokens = len(prompt_lens), sum(prompt_lens)
        cap = self.max_num_queued_requests
        if cap is not None and self.num_queued + count > cap:
            raise _too_many(
                f"the server has {self.num_queued} requests queued (limit {cap}, "
                f"--max-num-queued-requests); retry later"
            )
        token_cap = self.max_queued_tokens
        if (
            token_cap is not None
            and self.num_queued
            and self.num_queued_tokens + tokens > token_cap
        ):
            raise _too_many(
                f"the server has {self.num_queued_tokens} prompt tokens queued (limit "
                f"{token_cap}, --max-queued-tokens); retry later"
            )
        self.num_queued += count
        self.num_queued_tokens += tokens
        return AdmissionTicket(self, prompt_lens)


class AdmissionTicket:
    """One admitted HTTP request: `started(i)` when prompt i produced output, `release()` at the end."""

    def __init__(self, controller: AdmissionController, prompt_lens: list[int]) -> None:
        self.controller = controller
        self.pending = dict(enumerate(prompt_lens))  # prompt index -> tokens, still queued

    def started(self, prompt_index: int) -> None:
        tokens = self.pending.pop(prompt_index, None)
        if tokens is not None:
            self.controller.num_queued -= 1
            self.controller.num_queued_tokens -= tokens

    def release(self) -> None:
        for prompt_index in list(self.pending):
            self.started(prompt_index)


def _too_many(message: str) -> APIError:
    return APIError(
        429, message, code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
    )
