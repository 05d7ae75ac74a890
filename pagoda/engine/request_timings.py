"""What one request served by the AsyncEngine looked like, for metrics.

Owns `RequestTimings` (what `AsyncEngine.timings_listener` receives for every finished,
aborted or failed request) and `TimingTracker`, which builds it on the asyncio side
from the delta outputs the request's stream sees, with the facts it reads off the
prompt (`prompt_len`) and the last output (`overall_finish_reason`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pagoda.outputs import RequestOutput


@dataclasses.dataclass
class RequestTimings:
    """What one finished (or aborted/failed) request looked like, for metrics."""

    request_id: str
    arrival_time: float
    first_token_time: float | None
    finished_time: float
    queue_time: float | None  # arrival -> first scheduled, when the engine told us
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    inter_token_latencies: list[float]


def prompt_len(prompt: Any) -> int:
    """The prompt's token count where it is given as token ids; 0 for text."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return len(prompt["prompt_token_ids"])
    if isinstance(prompt, list):
        return len(prompt)
    return 0


def overall_finish_reason(output: RequestOutput) -> str:
    """The finished request's reason: "length" if any choice hit its limit, else "stop"."""
    reasons = {c.finish_reason for c in output.outputs if c.finish_reason}
    return "length" if "length" in reasons else "stop"


class TimingTracker:
    """Builds a request's RequestTimings from the delta outputs it sees."""

    def __init__(self, request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generation_tokens = 0
        self.inter_token_latencies: list[float] = []

    def observe(self, output: RequestOutput) -> None:
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        if not new_tokens:
            return
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            # One gap per step; several tokens in one step share it evenly.
            self.inter_token_latencies.extend(
                [(now - self.last_token_time) / new_tokens] * new_tokens
            )
        self.last_token_time = now
        self.num_generation_tokens += new_tokens

    def finish(self, finish_reason: str, first_scheduled_time: float | None) -> RequestTimings:
        queue_time = (
            None if first_scheduled_time is None else max(0.0, first_scheduled_time - self.arrival)
        )
        return RequestTimings(
            request_id=self.request_id,
            arrival_time=self.arrival,
            first_token_time=self.first_token_time,
            finished_time=time.monotonic(),
            queue_time=queue_time,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            finish_reason=finish_reason,
            inter_token_latencies=self.inter_token_latencies,
        )
