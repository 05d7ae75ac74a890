"""Route table, API-key guard, error shapes, bounded input, ops routes.

The route-table walk builds the app in-process (a fake engine, no model) to list
every route, docs and OpenAPI included, then proves each answers 401 without the
key - in-process and against the real server.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers.server_harness import API_KEY, metric_value

from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.llm_engine import EngineStats
from pagoda.entrypoints.openai.api_server import build_app
from pagoda.entrypoints.openai.serving_common import ServerSettings
from pagoda.entrypoints.openai.web_ui import public_paths

# The web UI's pages and static files hold no data: public (tests/server/test_web_ui.py).
PUBLIC_ROUTES = {"/health"} | public_paths()


class _FakeEngine:
    """Just enough of an LLMEngine for routes that never generate."""

    max_model_len = 512
    tokenizer = None

    def has_unfinished_requests(self) -> bool:
        return False

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def get_stats(self) -> EngineStats:
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
        )


def _in_process_app(api_key=API_KEY, metrics_public=False):
    settings = ServerSettings(
        served_model_names=["m"],
        api_key=api_key,
        metrics_public=metrics_public,
        enable_debug_routes=True,
    )
    return build_app(AsyncEngine(_FakeEngine), settings)


def _route_calls(app) -> list[tuple[str, str]]:
    calls = []
    for route in app.routes:
        methods = sorted(getattr(route, "methods", None) or {"GET"})
        for method in methods:
            if method != "HEAD":
                calls.append((method, route.path))
    return calls


def test_route_table_is_fully_guarded_in_process():
    app = _in_process_app()
    calls = _route_calls(app)
    paths = {path for _, path in calls}
    # The walk sees the docs and the schema too, not only the API routes.
    assert {
        "/openapi.json",
        "/docs",
        "/v1/completions",
        "/v1/chat/completions",
        "/metrics",
        "/debug/kv_audit",
        "/tokenize",
        "/detokenize",
        "/version",
        "/v1/models",
    } <= paths
    with TestClient(app) as client:
        for method, path in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                r = client.request(method, path, headers=headers)
                expected = 401 if path not in PUBLIC_ROUTES else r.status_code
                assert r.status_code == expected, (method, path, headers, r.status_code)
                if expected == 401:
                    assert r.json()["error"]["code"] == "invalid_api_key"
        ok = client.get("/version", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
        assert client.get("/no/such/route").status_code == 401  # unknown paths too


def test_metrics_public_flag_opens_only_metrics():
    with TestClient(_in_process_app(metrics_public=True)) as client:
        metrics = client.get("/metrics")
        assert metrics.status_code == 200
        assert metric_value(metrics.text, "pagoda:num_gpu_blocks") == 8
        assert client.get("/version").status_code == 401


def test_refused_api_requests_are_counted_by_status():
    with TestClient(_in_process_app(metrics_public=True)) as client:
        assert client.post("/v1/completions", json={}).status_code == 401
        assert (
            client.post(
                "/v1/completions", json={}, headers={"Authorization": "Bearer wrong"}
            ).status_code
            == 401
        )
        client.get("/version")  # not an API path: not counted
        text = client.get("/metrics").text
        name = "pagoda:http_rejected_requests_total"
        assert metric_value(text, name, 'status="401"') == 2
        assert metric_value(text, name, 'status="413"') == 0


def test_route_table_is_fully_guarded_on_real_server(main_server):
    calls = _route_calls(_in_process_app())
    with httpx.Client(base_url=main_server.url, timeout=30) as client:
        for method, path in calls:
            r = client.request(method, path)
            if path in PUBLIC_ROUTES:
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path)
                assert r.headers["www-authenticate"] == "Bearer"
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _error(r: httpx.Response, status: int, param=None) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["param"] == param
    return body["message"]


def test_ops_routes(http):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json()["version"]
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == 512


def test_tokenize_and_detokenize_shapes(http, tokenizer):
    r = http.post(
        "/tokenize", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello world"}
    ).json()
    assert r == {
        "tokens": tokenizer("Hello world").input_ids,
        "count": len(r["tokens"]),
        "max_model_len": 512,
    }
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > r["count"]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    _error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")


def test_client_errors_are_openai_shaped_4xx(http):
    cmpl = "/v1/completions"
    chat = "/v1/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    assert "frobnicate" in _error(
        http.post(cmpl, json={"prompt": "x", "frobnicate": 1}), 400, "frobnicate"
    )
    _error(http.post(chat, json={"messages": hi, "tools": [{"type": "function"}]}), 400, "tools")
    _error(http.post(cmpl, json={"prompt": "x", "suffix": "y"}), 400, "suffix")
    _error(http.post(cmpl, json={"prompt": "x", "best_of": 3}), 400, "best_of")
    _error(http.post(cmpl, json={"prompt": "x", "echo": True, "logprobs": 1}), 400, "echo")
    _error(http.post(cmpl, json={"prompt": "x", "n": 17}), 400, "n")
    _error(http.post(cmpl, json={"prompt": "x", "logprobs": 21}), 400, "logprobs")
    _error(
        http.post(chat, json={"messages": hi, "logprobs": True, "top_logprobs": 21}),
        400,
        "top_logprobs",
    )
    _error(http.post(cmpl, json={"prompt": "x", "temperature": -1}), 400, "temperature")
    _error(
        http.post(cmpl, json={"prompt": "x", "min_tokens": 9, "max_tokens": 3}), 400, "min_tokens"
    )
    _error(http.post(cmpl, json={"prompt": "x", "logit_bias": {"99999999": 1}}), 400, "logit_bias")
    _error(
        http.post(cmpl, json={"prompt": "x", "stream_options": {"include_usage": True}}),
        400,
        "stream_options",
    )
    _error(http.post(chat, json={"messages": [{"role": "tool", "content": "x"}]}), 400)
    _error(http.post(cmpl, content=b"{not json", headers={"content-type": "application/json"}), 400)
    _error(http.post(cmpl, json={"prompt": []}), 400, "prompt")
    _error(http.post(cmpl, json={"prompt": [1, 2, 10**7]}), 400, "prompt")
    _error(http.post(cmpl, json={"prompt": "x", "model": "gpt-4"}), 404, "model")
    _error(http.get(cmpl), 405)


def test_prompt_longer_than_max_model_len_names_both_numbers(http):
    message = _error(http.post("/v1/completions", json={"prompt": [1] * 600}), 400, "prompt")
    assert "600" in message and "512" in message
    message = _error(
        http.post("/v1/completions", json={"prompt": [1] * 500, "max_tokens": 20}),
        400,
        "max_tokens",
    )
    assert "512" in message and "520" in message


def test_request_body_over_limit_is_413(http):
    r = http.post("/v1/completions", json={"prompt": "x" * 70000})  # limit: 65536 bytes
    assert _error(r, 413)


def test_metrics_exposition(http, main_server):
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    text = http.get("/metrics").text
    for name in (
        "pagoda:num_requests_running",
        "pagoda:num_requests_waiting",
        "pagoda:kv_cache_usage_perc",
        "pagoda:prompt_tokens_total",
        "pagoda:generation_tokens_total",
        "pagoda:num_preemptions_total",
        "pagoda:prefix_cache_queries_total",
        "pagoda:prefix_cache_hits_total",
        "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:inter_token_latency_seconds_bucket",
        "pagoda:e2e_request_latency_seconds_bucket",
        "pagoda:request_queue_time_seconds_bucket",
        "pagoda:process_peak_memory_bytes",
    ):
        assert name in text, name
    assert metric_value(text, "pagoda:request_success_total", 'finished_reason="length"') >= 1
    assert metric_value(text, "pagoda:generation_tokens_total") >= 3
    assert httpx.get(f"{main_server.url}/metrics").status_code == 401  # not public by default


@pytest.mark.parametrize("stream", [False, True])
def test_each_request_reaches_the_queue_time_histogram(http, stream):
    count = "pagoda:request_queue_time_seconds_count"
    before = metric_value(http.get("/metrics").text, count)
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "stream": stream})
    assert r.status_code == 200
    assert metric_value(http.get("/metrics").text, count) >= before + 1
