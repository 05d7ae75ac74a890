"""KV offload tier metrics: the server's `pagoda:kv_offload_*` exposition and what
`pagoda bench serve` reads back from it (per-tier deltas, bandwidth, peak usage)."""

import pytest

from pagoda.bench.server_metrics import parse_prometheus, summarize_server_metrics
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.engine.llm_engine import EngineStats
from pagoda.kv_offload.planning.manager import KVOffloadManager
from pagoda.kv_offload.planning.tiers import KVTransferReport, TierIndex, TierIOStats, TierStack
from pagoda.metrics.prometheus import ServerMetrics


def engine_stats(tiers) -> EngineStats:
    return EngineStats(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_blocks=8,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        prompt_tokens=0,
        generation_tokens=0,
        kv_offload=tiers,
    )


def test_tier_metrics_round_trip_through_the_exposition():
    tiers = TierStack([TierIndex("cpu", 4, slotted=True), TierIndex("disk", 10, slotted=False)])
    offload = KVOffloadManager(KVCacheManager(8, 4), tiers, max_blocks_per_step=8)
    metrics = ServerMetrics("m")
    before = parse_prometheus(metrics.render(engine_stats(offload.stats())).decode())

    tiers.tiers[1].add_ready([bytes([n]) * 32 for n in range(3)])
    tiers.lookup([bytes([0]) * 32, bytes([1]) * 32, bytes([9]) * 32])
    tiers.tiers[1].counters.skipped = 1
    offload.apply_report(
        KVTransferReport(
            io=TierIOStats(
                bytes_loaded={"disk": 4_000_000_000},
                load_seconds={"disk": [0.5, 1.5]},
                bytes_stored={"cpu": 100},
                store_seconds={"cpu": [0.001]},
                invalid_files={"disk": 2},
            )
        )
    )
    text = metrics.render(engine_stats(offload.stats())).decode()
    assert 'pagoda:kv_offload_hits_total{model_name="m",tier="disk"} 2.0' in text
    assert 'pagoda:kv_offload_queries_total{model_name="m",tier="cpu"} 3.0' in text
    assert 'pagoda:kv_offload_usage_perc{model_name="m",tier="disk"} 0.3' in text
    assert 'pagoda:kv_offload_load_seconds_bucket{le="1.0",model_name="m",tier="disk"} 1.0' in text
    assert 'pagoda:kv_offload_load_seconds_count{model_name="m",tier="disk"} 2.0' in text
    assert 'pagoda:kv_offload_skipped_blocks_total{model_name="m",tier="disk"} 1.0' in text
    assert "est_load_bytes_per_second{" not in text  # no cost model, no estimates
    after = parse_prometheus(text)

    summary = summarize_server_metrics(before, after, [after])["kv_offload"]
    assert summary["disk"]["hits"] == 2 and summary["disk"]["queries"] == 3
    assert summary["disk"]["skipped_blocks"] == 1
    assert summary["disk"]["hit_rate"] == pytest.approx(2 / 3)
    assert summary["disk"]["load_gb_per_s"] == pytest.approx(2.0)  # 4 GB in 2 s
    assert summary["disk"]["invalid_files"] == 2 and summary["disk"]["peak_usage"] == 0.3
    assert summary["cpu"]["bytes_stored"] == 100 and summary["cpu"]["hits"] == 0


def test_no_tiers_no_offload_summary():
    metrics = ServerMetrics("m")
    values = parse_prometheus(metrics.render(engine_stats(None)).decode())
    assert summarize_server_metrics(values, values, [])["kv_offload"] is None
    assert not any(name.startswith("pagoda:kv_offload") for name in values)


def test_cost_model_estimates_are_exposed():
    from pagoda.kv_offload.planning.cost import LoadCostModel

    tiers = TierStack([TierIndex("cpu", 4, slotted=True), TierIndex("disk", 10, slotted=False)])
    cost = LoadCostModel(
        ["cpu", "disk"], 1 << 20, 16, (4000, 0.5), {"cpu": (20_000_000_000, 1.0)}, {"disk": 2e9}
    )
    offload = KVOffloadManager(KVCacheManager(8, 4), tiers, 8, cost)
    text = ServerMetrics("m").render(engine_stats(offload.stats())).decode()
    assert 'pagoda:kv_offload_est_load_bytes_per_second{model_name="m",tier="cpu"} 2e+10' in text
    assert 'pagoda:kv_offload_est_load_bytes_per_second{model_name="m",tier="disk"} 2e+09' in text
    assert 'pagoda:kv_offload_est_prefill_tokens_per_second{model_name="m"} 8000.0' in text
