"""What the server itself says during a run, from its Prometheus `/metrics` route.

Owns a small parser of the Prometheus text format and the figures the report takes
from it: peak memory (every `*memory*bytes` gauge, polled during the run), peak KV
cache usage, and the run's deltas of preemptions, prefix cache hits/queries and
speculative decoding accepted/draft tokens and verify steps (acceptance rate, mean
accepted length), and per KV offload tier (label `tier`) the run's hits, lookups, bytes
stored and loaded, load bandwidth and peak usage. Names are matched after the engine
prefix (`pagoda:`, `vllm:`, `sglang:`) and without `_total`, so the same run against
vLLM reads vLLM's counters. A server without `/metrics` gives `available: false`
and the reason; the run itself is unaffected.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp

ENGINE_PREFIXES = ("pagoda:", "vllm:", "sglang:")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
_TIER_LABEL = re.compile(r'tier="([^"]*)"')
# Per-tier series are kept apart as "<name>|tier=<tier>" besides the sum over tiers.
TIER_SEP = "|tier="
KV_OFFLOAD_DELTAS = {
    "hits": "kv_offload_hits",
    "queries": "kv_offload_queries",
    "skipped_blocks": "kv_offload_skipped_blocks",
    "bytes_stored": "kv_offload_stored_bytes",
    "bytes_loaded": "kv_offload_loaded_bytes",
    "failed_reads": "kv_offload_failed_reads",
    "invalid_files": "kv_offload_invalid_files",
    "load_seconds_sum": "kv_offload_load_seconds_sum",
    "load_count": "kv_offload_load_seconds_count",
}
PREEMPTIONS = ("num_preemptions",)
PREFIX_HITS = ("prefix_cache_hits", "gpu_prefix_cache_hits")
PREFIX_QUERIES = ("prefix_cache_queries", "gpu_prefix_cache_queries")
SPEC_ACCEPTED = ("spec_decode_num_accepted_tokens",)
SPEC_DRAFTS = ("spec_decode_num_draft_tokens",)
SPEC_NUM_DRAFTS = ("spec_decode_num_drafts",)
KV_USAGE = ("kv_cache_usage_perc", "gpu_cache_usage_perc")


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value summed over label sets (histogram series keep their suffixes)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        name = match.group(1)
        values[name] = values.get(name, 0.0) + value
        tier = _TIER_LABEL.search(match.group(2) or "")
        if tier is not None and not name.endswith("_bucket"):
            key = f"{name}{TIER_SEP}{tier.group(1)}"
            values[key] = values.get(key, 0.0) + value
    return values


def _base_name(name: str) -> str:
    for prefix in ENGINE_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return name[: -len("_total")] if name.endswith("_total") else name


def lookup(values: dict[str, float], bases: tuple[str, ...]) -> float | None:
    """The first metric whose prefix-free, `_total`-free name is one of `bases`."""
    by_base = {_base_name(k): v for k, v in values.items()}
    for base in bases:
        if base in by_base:
            return by_base[base]
    return None


def memory_gauges(values: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in values.items() if "memory" in k and k.endswith("bytes")}


def _delta(before: dict, after: dict, bases: tuple[str, ...]) -> float | None:
    a, b = lookup(after, bases), lookup(before, bases)
    if a is None:
        return None
    return a - (b or 0.0)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def summarize_server_metrics(
    before: dict[str, float], after: dict[str, float], samples: list[dict[str, float]]
) -> dict:
    """The run's server-side figures from snapshots before, during and after it."""
    snapshots = [before, *samples, after]
    peak_memory: dict[str, float] = {}
    for snap in snapshots:
        for name, value in memory_gauges(snap).items():
            peak_memory[name] = max(value, peak_memory.get(name, value))
    kv_usage = [v for v in (lookup(s, KV_USAGE) for s in snapshots) if v is not None]
    hits, queries = _delta(before, after, PREFIX_HITS), _delta(before, after, PREFIX_QUERIES)
    accepted, drafts = _delta(before, after, SPEC_ACCEPTED), _delta(before, after, SPEC_DRAFTS)
    num_drafts = _delta(before, after, SPEC_NUM_DRAFTS)
    # vLLM's mean acceptance length: tokens per verify step, the bonus token included.
    per_step = _ratio(accepted, num_drafts)
    return {
        "available": True,
        "peak_memory_bytes": peak_memory,
        "peak_kv_cache_usage": max(kv_usage) if kv_usage else None,
        "preemptions": _delta(before, after, PREEMPTIONS),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": _ratio(hits, queries),
        "spec_decode_draft_tokens": drafts,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": _ratio(accepted, drafts),
        "spec_decode_num_drafts": num_drafts,
        "spec_decode_mean_accepted_length": None if per_step is None else 1.0 + per_step,
        "kv_offload": kv_offload_summary(before, after, snapshots),
    }


def _tier_values(values: dict[str, float], base: str) -> dict[str, float]:
    """tier -> value of the per-tier series of metric `base` (prefix-free, _total-free)."""
    found: dict[str, float] = {}
    for key, value in values.items():
        name, sep, tier = key.partition(TIER_SEP)
        if sep and _base_name(name) == base:
            found[tier] = value
    return found


def kv_offload_summary(before: dict, after: dict, snapshots: list[dict]) -> dict | None:
    """Per KV offload tier: the run's deltas, hit rate, load bandwidth (bytes loaded
    over the summed load time) and peak usage; None when the server has no tiers."""
    tiers = _tier_values(after, "kv_offload_queries")
    if not tiers:
        return None
    summary = {}
    for tier in tiers:
        row = {}
        for field, base in KV_OFFLOAD_DELTAS.items():
            a, b = _tier_values(after, base).get(tier), _tier_values(before, base).get(tier)
            row[field] = None if a is None else a - (b or 0.0)
        row["hit_rate"] = _ratio(row["hits"], row["queries"])
        seconds = row.pop("load_seconds_sum")
        row["load_gb_per_s"] = (
            row["bytes_loaded"] / seconds / 1e9 if seconds and row["bytes_loaded"] else None
        )
        usage = [_tier_values(s, "kv_offload_usage_perc").get(tier) for s in snapshots]
        usage = [u for u in usage if u is not None]
        row["peak_usage"] = max(usage) if usage else None
        summary[tier] = row
    return summary


async def scrape(session: aiohttp.ClientSession, url: str, headers: dict) -> dict[str, float]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with session.get(url, headers=headers, timeout=timeout) as response:
        if response.status != 200:
            raise RuntimeError(f"GET {url} answered HTTP {response.status}")
        return parse_prometheus(await response.text(errors="replace"))


class MetricsWatcher:
    """Scrapes `/metrics` before the run, every `interval` seconds during it, and after."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, headers: dict, interval: float = 1.0
    ) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self._session, self._headers, self._interval = session, headers, interval
        self._before: dict | None = None
        self._samples: list[dict] = []
        self._task: asyncio.Task | None = None
        self.unavailable: str | None = None

    async def start(self) -> None:
        try:
            self._before = await scrape(self._session, self.url, self._headers)
        except (TimeoutError, aiohttp.ClientError, RuntimeError, OSError) as err:
            self.unavailable = f"{type(err).__name__}: {err}"
            return
        if self._interval > 0:
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                self._samples.append(await scrape(self._session, self.url, self._headers))
            except (TimeoutError, aiohttp.ClientError, RuntimeError, OSError):
                pass  # a missed sample only coarsens the peak; before/after still bound it

    async def stop(self) -> dict:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.unavailable is not None:
            return {"available": False, "reason": self.unavailable}
        try:
            after = await scrape(self._session, self.url, self._headers)
        except (TimeoutError, aiohttp.ClientError, RuntimeError, OSError) as err:
            return {"available": False, "reason": f"after the run: {type(err).__name__}: {err}"}
        return summarize_server_metrics(self._before or {}, after, self._samples)
