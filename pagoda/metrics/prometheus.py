"""Prometheus metrics of the server, named like vLLM's under the `pagoda:` prefix.

Owns `ServerMetrics`: one CollectorRegistry per app (no process globals, so two
apps in one process - as in tests - never clash). Two kinds of metric:

- per-request histograms and counters (TTFT, inter-token latency, e2e latency,
  queue time, prompt/generation lengths, successes by finish reason), fed by
  `observe_request()` from the AsyncEngine's timings listener;
- engine state (running/waiting requests, KV cache usage, token counters,
  preemptions, prefix cache queries/hits) and process peak memory, read at scrape
  time from the latest EngineStats snapshot by a custom collector.

`ServerMetrics.recent` (a RequestLog, pagoda/metrics/recent.py) keeps the same
finished requests for the live dashboard: the latest ones and a latency window.

vLLM name -> Pagoda name: `vllm:X` -> `pagoda:X` (e.g. pagoda:num_requests_running,
pagoda:kv_cache_usage_perc, pagoda:time_to_first_token_seconds).
"""

from __future__ import annotations

import resource
import sys
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagoda.metrics.recent import RequestLog

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _EngineStatsCollector:
    """Yields engine gauges/counters from the last EngineStats snapshot at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Optional[Any] = None

    def describe(self):
        return []  # registered without description: collect() runs only at scrape time

    def collect(self):
        labels = [self.model_name]
        yield from self._engine_metrics(labels)
        peak = GaugeMetricFamily("pagoda:process_peak_memory_bytes",
                                 "peak resident memory of the server process", labels=["model_name"])
        peak.add_metric(labels, float(_process_peak_rss_bytes()))
        yield peak
        gpu_peak = _gpu_peak_memory_bytes()
        if gpu_peak is not None:
            gpu = GaugeMetricFamily("pagoda:gpu_peak_memory_bytes",
                                    "peak GPU memory allocated by torch", labels=["model_name"])
            gpu.add_metric(labels, float(gpu_peak))
            yield gpu

    def _engine_metrics(self, labels: list[str]):
        stats = self.stats
        if stats is None:
            return
        gauges = [
            ("pagoda:num_requests_running", "requests in the running batch", stats.num_running),
            ("pagoda:num_requests_waiting", "requests waiting to be scheduled", stats.num_waiting),
            ("pagoda:kv_cache_usage_perc", "fraction of KV cache blocks in use (0-1)",
             stats.kv_cache_usage),
            ("pagoda:num_gpu_blocks", "KV cache blocks in the pool", stats.num_blocks),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family
        counters = [
            ("pagoda:prompt_tokens", "prompt tokens received", stats.prompt_tokens),
            ("pagoda:generation_tokens", "tokens generated", stats.generation_tokens),
            ("pagoda:num_preemptions", "requests preempted (KV blocks freed, recomputed later)",
             stats.num_preemptions),
            ("pagoda:prefix_cache_queries", "tokens looked up in the prefix cache",
             stats.prefix_cache_queries),
            ("pagoda:prefix_cache_hits", "tokens found in the prefix cache", stats.prefix_cache_hits),
        ]
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family


class ServerMetrics:
    """All metrics of one server app, on the app's own registry."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.recent = RequestLog()  # the dashboard's recent requests and latency window
        self.registry = CollectorRegistry()
        self._engine_collector = _EngineStatsCollector(model_name)
        self.registry.register(self._engine_collector)
        labels = ["model_name"]
        reg = self.registry

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(model_name)

        self.ttft = hist("pagoda:time_to_first_token_seconds", "time to first token", _LATENCY_BUCKETS)
        self.itl = hist("pagoda:inter_token_latency_seconds", "time between output tokens",
                        _LATENCY_BUCKETS)
        self.e2e = hist("pagoda:e2e_request_latency_seconds", "request latency, arrival to finish",
                        _LATENCY_BUCKETS)
        self.queue_time = hist("pagoda:request_queue_time_seconds",
                               "time from arrival to first scheduled", _LATENCY_BUCKETS)
        self.prompt_len = hist("pagoda:request_prompt_tokens", "prompt length per request",
                               _TOKEN_BUCKETS)
        self.generation_len = hist("pagoda:request_generation_tokens",
                                   "tokens generated per request", _TOKEN_BUCKETS)
        success = Counter("pagoda:request_success", "finished requests by finish reason",
                          ["model_name", "finished_reason"], registry=reg)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.http_rejections = Counter("pagoda:http_rejected_requests",
                                       "requests refused before reaching the engine, by status",
                                       ["model_name", "status"], registry=reg)

    def observe_request(self, timings) -> None:
        """Records one finished request (an AsyncEngine RequestTimings)."""
        self.recent.observe(timings)
        if timings.first_token_time is not None:
            self.ttft.observe(timings.first_token_time - timings.arrival_time)
        for gap in timings.inter_token_latencies:
            self.itl.observe(gap)
        self.e2e.observe(timings.finished_time - timings.arrival_time)
        if timings.queue_time is not None:
            self.queue_time.observe(timings.queue_time)
        self.prompt_len.observe(timings.num_prompt_tokens)
        self.generation_len.observe(timings.num_generation_tokens)
        counter = self.success.get(timings.finish_reason)
        if counter is not None:
            counter.inc()

    def observe_rejection(self, status_code: int) -> None:
        self.http_rejections.labels(self.model_name, str(status_code)).inc()

    def render(self, engine_stats: Optional[Any]) -> bytes:
        """The exposition text, with engine state from `engine_stats` (None: not loaded yet)."""
        self._engine_collector.stats = engine_stats
        return generate_latest(self.registry)


def _process_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _gpu_peak_memory_bytes() -> Optional[int]:
    torch = sys.modules.get("torch")  # never import torch just for a metric
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())
