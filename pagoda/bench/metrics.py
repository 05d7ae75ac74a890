"""Benchmark metrics: pure functions over recorded request timestamps.

Owns the definitions every figure in a `pagoda bench serve` report is computed from
(they follow vLLM's `bench serve` so numbers are comparable across tools):

- TTFT: from sending the request to the first streamed chunk that carries content.
- ITL: the gaps between consecutive content chunks (a chunk may hold several tokens).
- E2EL: from sending the request to the end of its response stream.
- TPOT per request: (E2EL - TTFT) / (output_tokens - 1), defined when output_tokens > 1.
- Output tokens: the server's `usage.completion_tokens`; only when a server sends no
  usage is the number of content chunks used instead (counted in `usage_missing`).
- Throughputs use completed requests over the run's duration; peak output tok/s uses
  1-second buckets of the run clock; peak concurrency sweeps send/finish events.

All times here are seconds on one run clock (0 = start of the measured run); the
report converts latencies to milliseconds. No I/O, no aiohttp: everything is testable
from hand-written timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")

# Error kinds a request can end with. "http_<status>" is built from the status code.
TIMEOUT = "timeout"
CONNECTION_ERROR = "connection_error"
SERVER_OOM = "server_oom"
STREAM_ERROR = "stream_error"
INCOMPLETE_STREAM = "incomplete_stream"
PROTOCOL_ERROR = "protocol_error"
CLIENT_ERROR = "client_error"
CANCELLED = "cancelled"  # still in flight when --max-duration ran out


@dataclass
class RequestResult:
    """What one request did, as seen by the client.

    `start` is None for a request that was never sent (the time limit came first).
    """

    prompt_len: int | None  # from the dataset; replaced by usage.prompt_tokens when sent
    expected_output_len: int
    start: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # content chunks only
    output_tokens: int | None = None  # usage.completion_tokens
    success: bool = False
    error_kind: str | None = None
    error: str = ""
    status: int | None = None
    generated_text: str = ""

    @property
    def sent(self) -> bool:
        return self.start is not None

    @property
    def finished(self) -> bool:
        return self.end is not None


def ttft(r: RequestResult) -> float | None:
    if not r.chunk_times or r.start is None:
        return None
    return r.chunk_times[0] - r.start


def itls(r: RequestResult) -> list[float]:
    t = r.chunk_times
    return [t[i + 1] - t[i] for i in range(len(t) - 1)]


def e2el(r: RequestResult) -> float | None:
    if r.start is None or r.end is None:
        return None
    return r.end - r.start


def output_token_count(r: RequestResult) -> int:
    """usage.completion_tokens; the number of content chunks only if usage was absent."""
    return r.output_tokens if r.output_tokens is not None else len(r.chunk_times)


def tpot(r: RequestResult) -> float | None:
    first, total, out = ttft(r), e2el(r), output_token_count(r)
    if first is None or total is None or out <= 1:
        return None
    return (total - first) / (out - 1)


def percentile_key(p: float) -> str:
    """vLLM's key spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def distribution(values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float | None]:
    """mean, median, std and the requested percentiles (numpy's linear interpolation).

    Every value is None when there is nothing to summarize: an absent figure is
    reported as absent, never as zero.
    """
    ps = list(percentiles)
    keys = ["mean", "median", "std"] + [percentile_key(p) for p in ps]
    if len(values) == 0:
        return {k: None for k in keys}
    arr = np.asarray(values, dtype=np.float64)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in ps:
        out[percentile_key(p)] = float(np.percentile(arr, p))
    return out


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A completed request is "good" when every given SLO holds.

    TPOT is only defined for two or more output tokens, so a one-token response
    cannot violate it; a response with no content chunk has no TTFT and fails a
    TTFT SLO.
    """
    if not r.success:
        return False
    values = {"ttft": ttft(r), "tpot": tpot(r), "e2el": e2el(r)}
    for name, limit_ms in slos_ms.items():
        if name not in GOODPUT_METRICS:
            raise ValueError(
                f"goodput metric must be one of {', '.join(GOODPUT_METRICS)}, got {name!r}"
            )
        value = values[name]
        if value is None:
            if name == "tpot":
                continue
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


def peak_output_tokens_per_second(results: Iterable[RequestResult]) -> float:
    """The most output tokens that arrived within one 1-second bucket of the run clock.

    Each completed request's usage count is spread evenly over its content chunks
    (exact when the server streams one token per chunk).
    """
    buckets: dict[int, float] = {}
    for r in results:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = output_token_count(r) / len(r.chunk_times)
        for t in r.chunk_times:
            second = math.floor(t)
            buckets[second] = buckets.get(second, 0.0) + per_chunk
    return max(buckets.values(), default=0.0)


def peak_concurrency(results: Iterable[RequestResult]) -> int:
    """The most requests in flight at once (sent, not yet finished), failures included.

    A request that ends at the same instant another starts does not overlap it.
    """
    events: list[tuple[float, int]] = []
    for r in results:
        if r.start is None:
            continue
        events.append((r.start, 1))
        if r.end is not None:
            events.append((r.end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # -1 sorts before +1 at equal times
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def failure_counts(results: Iterable[RequestResult]) -> dict[str, int]:
    """Sent requests that did not succeed, by cause (cancelled ones included)."""
    counts: dict[str, int] = {}
    for r in results:
        if r.sent and not r.success:
            kind = r.error_kind or CLIENT_ERROR
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    selected: Iterable[str] = LATENCY_METRICS,
    percentiles: Iterable[float] = (50, 90, 95, 99),
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict:
    """Every figure of the run, as a flat dict (vLLM's key names plus Pagoda's).

    Latencies are in milliseconds; throughputs count completed requests only.

    Accounting invariant: completed + failed + cancelled + not_sent == len(results).
    """
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    selected = list(selected)
    for name in selected:
        if name not in LATENCY_METRICS:
            raise ValueError(
                f"percentile metric must be one of {', '.join(LATENCY_METRICS)}, got {name!r}"
            )
    ps = list(percentiles)
    done = [r for r in results if r.success]
    failures = failure_counts(results)
    cancelled = failures.get(CANCELLED, 0)
    out_tokens = sum(output_token_count(r) for r in done)
    in_tokens = sum(r.prompt_len or 0 for r in done)
    v: dict = {
        "num_requests": len(results),
        "completed": len(done),
        "failed": sum(n for k, n in failures.items() if k != CANCELLED),
        "cancelled": cancelled,
        "not_sent": sum(1 for r in results if not r.sent),
        "failures": failures,
        "usage_missing": sum(1 for r in done if r.output_tokens is None),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_output_tokens_per_s": peak_output_tokens_per_second(done),
        "max_concurrent_requests": peak_concurrency(results),
    }
    if goodput_slos_ms:
        v["request_goodput"] = sum(1 for r in done if meets_slos(r, goodput_slos_ms)) / duration
    else:
        v["request_goodput"] = None
    series = {
        "ttft": [x for x in map(ttft, done) if x is not None],
        "tpot": [x for x in map(tpot, done) if x is not None],
        "itl": [x for r in done for x in itls(r)],
        "e2el": [x for x in map(e2el, done) if x is not None],
    }
    for name in selected:
        stats = distribution([x * 1000.0 for x in series[name]], ps)
        for stat, value in stats.items():
            v[f"{stat}_{name}_ms"] = value
    return v
