"""Counters of structured output for the metrics endpoint (stdlib only).

Owns `StructuredOutputStats`: requests by constraint kind, grammar compile times and
per-step bitmask times as cumulative histograms. Written from the engine loop and the
compile pool (a lock guards it); `snapshot()` hands the metrics collector a copy.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BITMASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass
class HistogramData:
    """Prometheus-style: counts[i] observations <= buckets[i] (not cumulative), plus +Inf."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """[(upper bound as text, observations <= it)], ending with +Inf."""
        result, running = [], 0
        for bound, count in zip(list(self.buckets) + [float("inf")], self.counts):
            running += count
            result.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return result

    def copy(self) -> HistogramData:
        return HistogramData(self.buckets, list(self.counts), self.total)


@dataclass
class StructuredStatsSnapshot:
    requests_by_kind: dict[str, int]
    compile_seconds: HistogramData
    bitmask_seconds: HistogramData


class StructuredOutputStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, int] = {}
        self._compile = HistogramData(COMPILE_BUCKETS)
        self._bitmask = HistogramData(BITMASK_BUCKETS)

    def count_request(self, kind: str) -> None:
        with self._lock:
            self._requests[kind] = self._requests.get(kind, 0) + 1

    def observe_compile(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._compile.observe(seconds)

    def observe_bitmask(self, seconds: float) -> None:
        with self._lock:
            self._bitmask.observe(seconds)

    def snapshot(self) -> StructuredStatsSnapshot:
        with self._lock:
            return StructuredStatsSnapshot(
                dict(self._requests), self._compile.copy(), self._bitmask.copy()
            )
