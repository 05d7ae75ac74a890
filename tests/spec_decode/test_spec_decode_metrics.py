"""Speculative decoding in /metrics: vLLM's spec_decode_* counters under `pagoda:`,
per position too, read back by the bench's parser (acceptance rate, mean accepted
length); absent when speculation is off."""

from __future__ import annotations

from pagoda.bench.server_metrics import parse_prometheus, summarize_server_metrics
from pagoda.engine.llm_engine import EngineStats
from pagoda.metrics.prometheus import ServerMetrics
from pagoda.spec_decode.planning.planner import SpecDecodingStats


def engine_stats(spec) -> EngineStats:
    return EngineStats(
        num_running=1,
        num_waiting=0,
        kv_cache_usage=0.1,
        num_blocks=8,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        prompt_tokens=5,
        generation_tokens=9,
        spec_decode=spec,
    )


def test_counters_exposed_with_vllm_names():
    spec = SpecDecodingStats()
    spec.record(3, 2)
    spec.record(3, 0)
    spec.record(2, 2)
    text = ServerMetrics("m").render(engine_stats(spec)).decode()
    values = parse_prometheus(text)
    assert values["pagoda:spec_decode_num_drafts_total"] == 3
    assert values["pagoda:spec_decode_num_draft_tokens_total"] == 8
    assert values["pagoda:spec_decode_num_accepted_tokens_total"] == 4
    assert (
        'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0'
        in text
    )
    assert (
        'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0'
        in text
    )
    assert (
        'pagoda:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 0.0'
        in text
    )
    summary = summarize_server_metrics({}, values, [])
    assert summary["spec_decode_acceptance_rate"] == 4 / 8
    assert summary["spec_decode_mean_accepted_length"] == 1 + 4 / 3


def test_absent_when_speculation_is_off():
    text = ServerMetrics("m").render(engine_stats(None)).decode()
    assert "spec_decode" not in text
    assert (
        summarize_server_metrics({}, parse_prometheus(text), [])["spec_decode_mean_accepted_length"]
        is None
    )
