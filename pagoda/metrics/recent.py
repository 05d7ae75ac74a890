"""Recent finished requests for the live dashboard: a bounded log and windowed percentiles.

Owns `RequestLog`. The server feeds it one `RequestTimings` per finished request
(aborted and failed ones included) from the AsyncEngine's timings listener, and the
dashboard's sampler reads it. Both run on the server's event loop thread, so there is
no lock. It keeps:

- the last `max_requests` request summaries, each with a sequence number, so that a
  reader can ask for "those after the last one I saw";
- the time to first token, end-to-end latency and inter-token latencies of the
  requests finished within the last `window_s` seconds (at most the newest
  `max_window_requests` of them, so a percentile costs a bounded sort). Inter-token latencies are
  kept per request (one list reference per request, no per-token work on insert) and
  capped at `max_itl_samples` samples (only the newest request may exceed it alone): at high throughput a long window would
  otherwise hold one float per generated token.

Percentiles are nearest-rank (the smallest value with at least p% of the samples at
or below it), computed on demand and cached until a request arrives or one expires.
The module imports nothing outside the standard library.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class RequestSummary:
    """One finished request as the dashboard lists it (times in seconds)."""

    seq: int
    request_id: str
    finished_at: float  # time.monotonic() when it finished
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    output_tokens: int
    queue_s: float | None  # arrival -> first scheduled
    ttft_s: float | None  # None: no token was generated
    itl_mean_s: float | None  # None: fewer than two tokens
    e2e_s: float

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "id": self.request_id,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "queue_s": self.queue_s,
            "ttft_s": self.ttft_s,
            "itl_mean_s": self.itl_mean_s,
            "e2e_s": self.e2e_s,
            "finished_ago_s": max(0.0, now - self.finished_at),
        }


def nearest_rank(sorted_values: list[float], percentile: float) -> float:
    """The nearest-rank percentile of a non-empty ascending list."""
    rank = math.ceil(percentile / 100.0 * len(sorted_values))
    return sorted_values[min(len(sorted_values) - 1, max(rank - 1, 0))]


def summarize(values: Iterable[float]) -> dict[str, float] | None:
    """{"n", "p50", "p90", "p99"} of the values; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    summary: dict[str, float] = {"n": len(ordered)}
    for p in PERCENTILES:
        summary[f"p{p}"] = nearest_rank(ordered, p)
    return summary


class RequestLog:
    def __init__(
        self,
        window_s: float = 120.0,
        max_requests: int = 200,
        max_window_requests: int = 4000,
        max_itl_samples: int = 10000,
    ) -> None:
        if window_s <= 0 or min(max_requests, max_window_requests, max_itl_samples) < 1:
            raise ValueError(
                "window_s must be > 0; max_requests, max_window_requests and max_itl_samples >= 1"
            )
        self.window_s = window_s
        self.max_itl_samples = max_itl_samples
        self._summaries: collections.deque[RequestSummary] = collections.deque(maxlen=max_requests)
        # Within the window, oldest first: (finished_at, ttft or None, e2e) per request,
        # and (finished_at, inter-token latencies) per request that has some.
        self._window: collections.deque[tuple[float, float | None, float]] = collections.deque(
            maxlen=max_window_requests
        )
        self._itl_chunks: collections.deque[tuple[float, list[float]]] = collections.deque()
        self._num_itl = 0
        self._seq = 0
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self._cache: dict[str, Any] | None = None

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def num_finished(self) -> int:
        return self._seq

    def observe(self, timings: Any) -> None:
        """Records one finished request (an AsyncEngine RequestTimings)."""
        self._seq += 1
        finished = timings.finished_time
        ttft = (
            None
            if timings.first_token_time is None
            else timings.first_token_time - timings.arrival_time
        )
        itls = timings.inter_token_latencies
        summary = RequestSummary(
            seq=self._seq,
            request_id=timings.request_id,
            finished_at=finished,
            finish_reason=timings.finish_reason,
            prompt_tokens=timings.num_prompt_tokens,
            output_tokens=timings.num_generation_tokens,
            queue_s=timings.queue_time,
            ttft_s=ttft,
            itl_mean_s=sum(itls) / len(itls) if itls else None,
            e2e_s=finished - timings.arrival_time,
        )
        self._summaries.append(summary)
        self.finished_by_reason[timings.finish_reason] += 1
        self._window.append((finished, ttft, summary.e2e_s))
        if itls:
            self._itl_chunks.append((finished, itls))
            self._num_itl += len(itls)
            # Over the cap, the oldest requests' samples go first; the newest request
            # stays whole however many tokens it had.
            while self._num_itl > self.max_itl_samples and len(self._itl_chunks) > 1:
                self._num_itl -= len(self._itl_chunks.popleft()[1])
        self._cache = None

    def since(self, seq: int, limit: int) -> list[RequestSummary]:
        """The summaries newer than `seq`, oldest first, at most the `limit` newest."""
        newer: list[RequestSummary] = []
        for summary in reversed(self._summaries):
            if summary.seq <= seq or len(newer) == limit:
                break
            newer.append(summary)
        newer.reverse()
        return newer

    def percentiles(self, now: float) -> dict[str, Any]:
        """TTFT, ITL and e2e percentiles over the requests finished in the last window_s."""
        self._expire(now)
        if self._cache is None:
            self._cache = {
                "window_s": self.window_s,
                "ttft": summarize(t for _, t, _ in self._window if t is not None),
                "e2e": summarize(e for _, _, e in self._window),
                "itl": summarize(v for _, itls in self._itl_chunks for v in itls),
            }
        return self._cache

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._window and self._window[0][0] < horizon:
            self._window.popleft()
            self._cache = None
        while self._itl_chunks and self._itl_chunks[0][0] < horizon:
            self._num_itl -= len(self._itl_chunks.popleft()[1])
            self._cache = None
