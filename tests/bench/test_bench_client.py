"""The streaming client and the load generator against a local fake OpenAI server:
recorded SSE streams, every failure cause, time limits, concurrency caps, /metrics."""

import asyncio
import math
import socket
import time

import aiohttp
import numpy as np
import pytest

from pagoda.bench import metrics as m
from pagoda.bench.client import Target, build_payload, stream_request
from pagoda.bench.datasets import SampleRequest
from pagoda.bench.serve import LoadPlan, arrival_offsets, resolve_url, run_load
from pagoda.bench.server_metrics import MetricsWatcher, parse_prometheus
from pagoda.bench.tokenizers import ServerTokenizer, build_exact_prompt, corpus_token_pool


def target_for(server, model, backend="openai", timeout=10.0, **kw):
    path = "/v1/completions" if backend == "openai" else "/v1/chat/completions"
    return Target(server.url + path, backend, model, request_timeout=timeout, **kw)


def send_one(target, sample=None):
    sample = sample or SampleRequest("the river", 2, 5)
    result = m.RequestResult(sample.prompt_len, sample.expected_output_len)

    async def go():
        start = time.perf_counter()
        async with aiohttp.ClientSession() as session:
            await stream_request(
                session, target, sample, result, lambda: time.perf_counter() - start
            )

    asyncio.run(go())
    return result


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_recorded_stream_is_timed_chunk_by_chunk(fake_server, backend):
    r = send_one(target_for(fake_server, "ok", backend), SampleRequest("the river", 2, 5))
    assert r.success and r.error_kind is None and r.status == 200
    assert r.generated_text == "Once upon a time there"
    assert r.output_tokens == 5
    assert r.prompt_len == len(fake_server.tokenizer.encode("the river")) + 1  # from usage
    # The chat stream's first chunk (role, empty content) is not a content chunk.
    assert len(r.chunk_times) == 5
    assert r.chunk_times == sorted(r.chunk_times)
    assert 0 <= r.start <= r.chunk_times[0] <= r.chunk_times[-1] <= r.end
    assert m.ttft(r) == r.chunk_times[0] - r.start


def test_a_completion_chunk_with_empty_text_still_carries_a_token(fake_server):
    """The first token's text is held back: the completion chunk still times the first
    token (vLLM's rule); the chat stream counts content chunks only."""
    r = send_one(target_for(fake_server, "heldback"), SampleRequest("the river", 2, 5))
    assert r.success and r.generated_text == " upon a time there"
    assert len(r.chunk_times) == 5 and m.ttft(r) == r.chunk_times[0] - r.start
    chat = send_one(
        target_for(fake_server, "heldback", "openai-chat"), SampleRequest("the river", 2, 5)
    )
    assert chat.success and len(chat.chunk_times) == 4


def test_payload_is_openai_shaped_and_streams_usage(fake_server):
    target = target_for(
        fake_server, "ok", ignore_eos=True, sampling={"temperature": 0.0, "top_k": 5}
    )
    body = build_payload(target, SampleRequest("hello", 1, 7))
    assert body == {
        "model": "ok",
        "prompt": "hello",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
        "top_k": 5,
    }
    chat = build_payload(target_for(fake_server, "ok", "openai-chat"), SampleRequest("hi", 1, 3))
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    assert chat["max_completion_tokens"] == 3 and "ignore_eos" not in chat
    with pytest.raises(ValueError, match="backend must be one of"):
        build_payload(Target("http://x/v1", "tgi", "m"), SampleRequest("hi", 1, 3))


def test_usage_counts_tokens_not_chunks(fake_server):
    r = send_one(target_for(fake_server, "multi"), SampleRequest("abc", 3, 6))
    assert r.success and r.output_tokens == 6 and len(r.chunk_times) == 3
    missing = send_one(target_for(fake_server, "nousage"), SampleRequest("abc", 3, 4))
    assert missing.success and missing.output_tokens is None
    assert m.output_token_count(missing) == 4


@pytest.mark.parametrize(
    "model,kind,status",
    [
        ("429", "http_429", 429),
        ("bad", "http_400", 400),
        ("oom", m.SERVER_OOM, 500),
        ("close", m.CONNECTION_ERROR, 200),
        ("nodone", m.INCOMPLETE_STREAM, 200),
        ("streamerr", m.STREAM_ERROR, 200),
        ("badjson", m.PROTOCOL_ERROR, 200),
    ],
)
def test_each_failure_has_its_cause(fake_server, model, kind, status):
    r = send_one(target_for(fake_server, model))
    assert not r.success
    assert r.error_kind == kind, r.error
    assert r.status == status
    assert r.end is not None and r.end >= r.start
    assert r.error


def test_timeout_and_refused_connection(fake_server):
    r = send_one(target_for(fake_server, "hang", timeout=0.3))
    assert (r.success, r.error_kind) == (False, m.TIMEOUT)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = send_one(
        Target(f"http://127.0.0.1:{port}/v1/completions", "openai", "ok", request_timeout=5)
    )
    assert (r.success, r.error_kind) == (False, m.CONNECTION_ERROR)


def samples(n, out=3):
    return [SampleRequest(f"prompt number {i}", 3, out) for i in range(n)]


def test_load_counts_every_failure_by_cause(fake_server):
    plan = LoadPlan(num_warmups=2, show_progress=False, metrics_interval=0)
    outcome = asyncio.run(
        run_load(target_for(fake_server, "flaky"), samples(12), plan, fake_server.url)
    )
    s = m.summarize(outcome.results, outcome.duration)
    # 2 warmups (requests 1, 2) then 12 measured (3..14); requests 3, 6, 9, 12 answer 429.
    assert fake_server.requests_by_model["flaky"] == 14
    assert outcome.warmup_failures == {}
    assert s["failures"] == {"http_429": 4}
    assert (s["completed"], s["failed"], s["cancelled"], s["not_sent"]) == (8, 4, 0, 0)
    assert s["total_output_tokens"] == 24
    assert outcome.stopped_by_time_limit is False


def test_time_limit_cancels_in_flight_and_stops(fake_server):
    plan = LoadPlan(max_duration=0.5, show_progress=False, metrics_interval=0)
    start = time.perf_counter()
    outcome = asyncio.run(
        run_load(target_for(fake_server, "hang", timeout=60), samples(5), plan, fake_server.url)
    )
    assert time.perf_counter() - start < 10
    assert outcome.stopped_by_time_limit
    s = m.summarize(outcome.results, outcome.duration)
    assert (s["completed"], s["cancelled"], s["not_sent"]) == (0, 5, 0)
    assert all(r.error_kind == m.CANCELLED and r.end is not None for r in outcome.results)


def test_time_limit_leaves_late_arrivals_unsent(fake_server):
    plan = LoadPlan(
        request_rate=4.0, max_duration=0.6, seed=1, show_progress=False, metrics_interval=0
    )
    outcome = asyncio.run(
        run_load(target_for(fake_server, "ok"), samples(200), plan, fake_server.url)
    )
    s = m.summarize(outcome.results, outcome.duration)
    assert outcome.stopped_by_time_limit
    assert s["not_sent"] > 150 and s["completed"] >= 1
    assert s["completed"] + s["failed"] + s["cancelled"] + s["not_sent"] == 200
    offsets = arrival_offsets(200, 4.0, 1.0, 1)
    sent = s["completed"] + s["cancelled"]  # only the arrivals due before the limit went out
    assert sum(1 for t in offsets if t < 0.4) <= sent <= sum(1 for t in offsets if t < 0.6)


def test_max_concurrency_is_respected(slow_server):
    plan = LoadPlan(max_concurrency=2, show_progress=False, metrics_interval=0)
    outcome = asyncio.run(
        run_load(target_for(slow_server, "ok"), samples(6, out=4), plan, slow_server.url)
    )
    assert all(r.success for r in outcome.results)
    assert m.peak_concurrency(outcome.results) == 2


def test_arrival_offsets():
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0, 0.0, 0.0, 0.0]
    offsets = arrival_offsets(20000, 5.0, 1.0, seed=7)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps > 0).all()
    assert abs(gaps.mean() - 0.2) < 0.01  # mean gap 1/rate
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # Poisson: coefficient of variation 1
    bursty = np.diff(arrival_offsets(20000, 5.0, 0.25, seed=7))
    assert abs(bursty.mean() - 0.2) < 0.02
    assert abs(bursty.std() / bursty.mean() - 2) < 0.1  # gamma shape k: CV = 1/sqrt(k)
    assert arrival_offsets(50, 5.0, 1.0, seed=3) == arrival_offsets(50, 5.0, 1.0, seed=3)


def test_only_the_given_url_is_targeted():
    assert (
        resolve_url("http://127.0.0.1:8000/", "/v1/completions")
        == "http://127.0.0.1:8000/v1/completions"
    )
    for endpoint in ("http://elsewhere/v1/completions", "//elsewhere/v1", "v1/completions"):
        with pytest.raises(ValueError, match="endpoint must be a path"):
            resolve_url("http://127.0.0.1:8000", endpoint)
    for base in ("127.0.0.1:8000", "ftp://host", "http://"):
        with pytest.raises(ValueError, match="base_url must be"):
            resolve_url(base, "/v1/completions")
    with pytest.raises(ValueError, match="request_rate"):
        LoadPlan(request_rate=0)
    with pytest.raises(ValueError, match="max_duration"):
        LoadPlan(max_duration=-1)


def test_server_metrics_deltas_and_peaks(fake_server):
    async def go():
        async with aiohttp.ClientSession() as session:
            watcher = MetricsWatcher(session, fake_server.url, {}, interval=0)
            await watcher.start()  # scrape 1
            watcher._samples.append(await _scrape(session, fake_server.url))  # scrape 2
            return await watcher.stop()  # scrape 3

    summary = asyncio.run(go())
    assert summary["available"]
    assert summary["preemptions"] == 6 - 2
    assert (summary["prefix_cache_queries"], summary["prefix_cache_hits"]) == (200, 50)
    assert summary["prefix_cache_hit_rate"] == 0.25
    assert summary["spec_decode_acceptance_rate"] == 60 / 80
    # 40 verify steps accepted 60 drafts: 1.5 + the bonus token per step.
    assert (summary["spec_decode_num_drafts"], summary["spec_decode_mean_accepted_length"]) == (
        40,
        2.5,
    )
    assert summary["peak_kv_cache_usage"] == 0.5
    assert summary["peak_memory_bytes"] == {"process_resident_memory_bytes": 1500.0}


async def _scrape(session, url):
    from pagoda.bench.server_metrics import scrape

    return await scrape(session, url + "/metrics", {})


def test_server_without_metrics_is_reported_not_fatal(bare_server):
    plan = LoadPlan(show_progress=False, metrics_interval=0.05)
    outcome = asyncio.run(
        run_load(target_for(bare_server, "ok"), samples(3), plan, bare_server.url)
    )
    assert all(r.success for r in outcome.results)
    assert outcome.server_metrics["available"] is False
    assert "404" in outcome.server_metrics["reason"]


def test_parse_prometheus_sums_label_sets():
    text = (
        '# HELP x\nvllm:num_preemptions_total{a="1"} 3\nvllm:num_preemptions_total{a="2"} 4\n'
        "bad line\nname_with_timestamp 2.5 1700000000\n"
    )
    assert parse_prometheus(text) == {"vllm:num_preemptions_total": 7.0, "name_with_timestamp": 2.5}


def test_server_tokenizer_strips_bos_and_builds_exact_prompts(fake_server):
    tok = ServerTokenizer(fake_server.url, "ok")
    toy = fake_server.tokenizer
    assert tok.encode("the river") == toy.encode("the river")  # BOS stripped
    assert tok.decode(toy.encode("a boat")) == "a boat"
    assert tok.max_model_len == 2048
    pool = corpus_token_pool(tok)
    text, count = build_exact_prompt(tok, pool, 37, np.random.default_rng(0))
    assert count == 37 and len(toy.encode(text)) == 37


def test_server_tokenizer_missing_routes(bare_server):
    with pytest.raises(RuntimeError, match="/tokenize .* HTTP 404"):
        ServerTokenizer(bare_server.url, "ok")
