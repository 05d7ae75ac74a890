"""User-facing outputs, shaped like vLLM's so users can switch without rewriting code."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated (or prompt) position: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: object | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    # Timings (time.monotonic()): arrival_time, first_scheduled_time, first_token_time,
    # last_token_time, finished_time; and num_generation_tokens.
    metrics: dict = field(default_factory=dict)
    # Why the engine failed this request (its samples then finish with "error"); None if it did not.
    error: str | None = None
