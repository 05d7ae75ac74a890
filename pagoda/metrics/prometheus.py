"""Prometheus metrics of the server, named like vLLM's under the `pagoda:` prefix.

Owns `ServerMetrics`: one CollectorRegistry per app (no process globals, so two
apps in one process - as in tests - never clash). Two kinds of metric:

- per-request histograms and counters (TTFT, inter-token latency, e2e latency,
  queue time, prompt/generation lengths, successes by finish reason), fed by
  `observe_request()` from the AsyncEngine's timings listener;
- engine state (running/waiting requests, KV cache usage, token counters,
  preemptions, prefix cache queries/hits, speculative decoding drafts and accepted
  tokens, per position too, structured output: requests by constraint kind, grammar
  compile and per-step bitmask times) and process peak memory, read at scrape time from
  the latest EngineStats snapshot by a custom collector;
- with KV offloading, per tier (label `tier`: cpu, disk, a plugin's name): lookups
  and hits in blocks, hits skipped (recomputed: faster than loading), bytes stored and
  loaded, evicted/dropped blocks, failed reads, invalid files, usage, load/store latency
  histograms, and the cost model's estimates of each tier's load bandwidth and of the
  prefill throughput it compares them with (`pagoda:kv_offload_*`).

`ServerMetrics.recent` (a RequestLog, pagoda/metrics/recent.py) keeps the same
finished requests for the live dashboard: the latest ones and a latency window.

vLLM name -> Pagoda name: `vllm:X` -> `pagoda:X` (e.g. pagoda:num_requests_running,
pagoda:kv_cache_usage_perc, pagoda:time_to_first_token_seconds).
"""

from __future__ import annotations

import resource
import sys
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pagoda.metrics.recent import RequestLog

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _EngineStatsCollector:
    """Yields engine gauges/counters from the last EngineStats snapshot at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Any | None = None

    def describe(self):
        return []  # registered without description: collect() runs only at scrape time

    def collect(self):
        labels = [self.model_name]
        yield from self._engine_metrics(labels)
        peak = GaugeMetricFamily(
            "pagoda:process_peak_memory_bytes",
            "peak resident memory of the server process",
            labels=["model_name"],
        )
        peak.add_metric(labels, float(_process_peak_rss_bytes()))
        yield peak
        gpu_peak = _gpu_peak_memory_bytes()
        if gpu_peak is not None:
            gpu = GaugeMetricFamily(
                "pagoda:gpu_peak_memory_bytes",
                "peak GPU memory allocated by torch",
                labels=["model_name"],
            )
            gpu.add_metric(labels, float(gpu_peak))
            yield gpu

    def _engine_metrics(self, labels: list[str]):
        stats = self.stats
        if stats is None:
            return
        gauges = [
            ("pagoda:num_requests_running", "requests in the running batch", stats.num_running),
            ("pagoda:num_requests_waiting", "requests waiting to be scheduled", stats.num_waiting),
            (
                "pagoda:kv_cache_usage_perc",
                "fraction of KV cache blocks in use (0-1)",
                stats.kv_cache_usage,
            ),
            ("pagoda:num_gpu_blocks", "KV cache blocks in the pool", stats.num_blocks),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family
        counters = [
            ("pagoda:prompt_tokens", "prompt tokens received", stats.prompt_tokens),
            ("pagoda:generation_tokens", "tokens generated", stats.generation_tokens),
            (
                "pagoda:num_preemptions",
                "requests preempted (KV blocks freed, recomputed later)",
                stats.num_preemptions,
            ),
            (
                "pagoda:prefix_cache_queries",
                "tokens looked up in the prefix cache",
                stats.prefix_cache_queries,
            ),
            (
                "pagoda:prefix_cache_hits",
                "tokens found in the prefix cache",
                stats.prefix_cache_hits,
            ),
        ]
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family
        yield from _spec_decode_metrics(getattr(stats, "spec_decode", None), labels)
        structured = getattr(stats, "structured", None)
        if structured is not None:
            yield from _structured_metrics(structured, labels)
        tiers = getattr(stats, "kv_offload", None)
        if tiers:
            yield from _kv_offload_metrics(self.model_name, tiers)


def _spec_decode_metrics(spec, labels: list[str]):
    """Speculative decoding counters (vLLM's names), when speculation is on."""
    if spec is None:
        return
    for name, doc, value in (
        ("pagoda:spec_decode_num_drafts", "verify steps of a request with drafts", spec.num_drafts),
        ("pagoda:spec_decode_num_draft_tokens", "draft tokens verified", spec.num_draft_tokens),
        (
            "pagoda:spec_decode_num_accepted_tokens",
            "draft tokens accepted",
            spec.num_accepted_tokens,
        ),
    ):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(labels, float(value))
        yield family
    per_pos = CounterMetricFamily(
        "pagoda:spec_decode_num_accepted_tokens_per_pos",
        "draft tokens accepted at each position of their step",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(spec.accepted_per_pos):
        per_pos.add_metric(labels + [str(position)], float(value))
    yield per_pos


def _structured_metrics(snapshot, labels: list[str]):
    """pagoda.structured.stats.StructuredStatsSnapshot as Prometheus families."""
    requests = CounterMetricFamily(
        "pagoda:structured_output_requests",
        "requests with an output constraint, by kind",
        labels=["model_name", "kind"],
    )
    for kind, count in sorted(snapshot.requests_by_kind.items()):
        requests.add_metric(labels + [kind], float(count))
    yield requests
    for name, doc, data in (
        (
            "pagoda:grammar_compile_seconds",
            "time to compile one grammar (off the step loop)",
            snapshot.compile_seconds,
        ),
        (
            "pagoda:grammar_bitmask_seconds",
            "time to fill one step's grammar bitmasks (CPU)",
            snapshot.bitmask_seconds,
        ),
    ):
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(labels, buckets=data.cumulative(), sum_value=data.total)
        yield family


_TIER_COUNTERS = (
    ("queries", "pagoda:kv_offload_queries", "KV blocks looked up in the tier (missed above it)"),
    ("hits", "pagoda:kv_offload_hits", "KV blocks found in the tier"),
    (
        "skipped_blocks",
        "pagoda:kv_offload_skipped_blocks",
        "KV blocks found in the tier but recomputed: recomputing was expected to be faster",
    ),
    ("bytes_stored", "pagoda:kv_offload_stored_bytes", "bytes of KV blocks stored into the tier"),
    ("bytes_loaded", "pagoda:kv_offload_loaded_bytes", "bytes of KV blocks loaded out of the tier"),
    ("evicted_blocks", "pagoda:kv_offload_evicted_blocks", "KV blocks evicted from the tier (LRU)"),
    (
        "dropped_blocks",
        "pagoda:kv_offload_dropped_blocks",
        "KV blocks not stored: no unpinned room or the per-step cap",
    ),
    ("failed_reads", "pagoda:kv_offload_failed_reads", "reads that found a block corrupt or gone"),
    (
        "invalid_files",
        "pagoda:kv_offload_invalid_files",
        "files found corrupt, truncated or foreign (disk tier)",
    ),
)
_TIER_GAUGES = (
    ("usage", "pagoda:kv_offload_usage_perc", "fraction of the tier's blocks held (0-1)"),
    ("blocks", "pagoda:kv_offload_blocks", "KV blocks held by the tier"),
    ("capacity_blocks", "pagoda:kv_offload_capacity_blocks", "KV blocks the tier can hold"),
    (
        "est_load_bytes_per_s",
        "pagoda:kv_offload_est_load_bytes_per_second",
        "the cost model's estimate of the tier's load bandwidth",
    ),
)
_TIER_HISTOGRAMS = (
    ("load_seconds", "pagoda:kv_offload_load_seconds", "time of one load batch out of the tier"),
    ("store_seconds", "pagoda:kv_offload_store_seconds", "time of one store batch into the tier"),
)


def _kv_offload_metrics(model_name: str, tiers: list[dict]):
    names = ["model_name", "tier"]
    for key, name, doc in _TIER_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=names)
        for tier in tiers:
            family.add_metric([model_name, tier["tier"]], float(tier[key]))
        yield family
    for key, name, doc in _TIER_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=names)
        for tier in tiers:
            if tier.get(key) is not None:  # the estimates exist only with a cost model
                family.add_metric([model_name, tier["tier"]], float(tier[key]))
        yield family
    prefill = tiers[0].get("est_prefill_tokens_per_s")
    if prefill is not None:
        family = GaugeMetricFamily(
            "pagoda:kv_offload_est_prefill_tokens_per_second",
            "the cost model's estimate of the prefill throughput that "
            "tier loads are weighed against",
            labels=["model_name"],
        )
        family.add_metric([model_name], float(prefill))
        yield family
    for key, name, doc in _TIER_HISTOGRAMS:
        family = HistogramMetricFamily(name, doc, labels=names)
        for tier in tiers:
            hist = tier[key]
            buckets = [
                (repr(float(bound)), float(count))
                for bound, count in zip(hist["buckets"], hist["cumulative_counts"])
            ]
            buckets.append(("+Inf", float(hist["count"])))
            family.add_metric([model_name, tier["tier"]], buckets, hist["sum"])
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

        self.ttft = hist(
            "pagoda:time_to_first_token_seconds", "time to first token", _LATENCY_BUCKETS
        )
        self.itl = hist(
            "pagoda:inter_token_latency_seconds", "time between output tokens", _LATENCY_BUCKETS
        )
        self.e2e = hist(
            "pagoda:e2e_request_latency_seconds",
            "request latency, arrival to finish",
            _LATENCY_BUCKETS,
        )
        self.queue_time = hist(
            "pagoda:request_queue_time_seconds",
            "time from arrival to first scheduled",
            _LATENCY_BUCKETS,
        )
        self.prompt_len = hist(
            "pagoda:request_prompt_tokens", "prompt length per request", _TOKEN_BUCKETS
        )
        self.generation_len = hist(
            "pagoda:request_generation_tokens", "tokens generated per request", _TOKEN_BUCKETS
        )
        success = Counter(
            "pagoda:request_success",
            "finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.http_rejections = Counter(
            "pagoda:http_rejected_requests",
            "requests refused before reaching the engine, by status",
            ["model_name", "status"],
            registry=reg,
        )

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

    def render(self, engine_stats: Any | None) -> bytes:
        """The exposition text, with engine state from `engine_stats` (None: not loaded yet)."""
        self._engine_collector.stats = engine_stats
        return generate_latest(self.registry)


def _process_peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _gpu_peak_memory_bytes() -> int | None:
    torch = sys.modules.get("torch")  # never import torch just for a metric
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())
