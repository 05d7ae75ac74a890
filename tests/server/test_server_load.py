"""Concurrency on the real server: 64 streams over a small KV pool (so requests are
preempted) all finish with their solo greedy text; clients that disconnect, streaming
or not, have their requests aborted and every KV block returns to the pool."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from helpers.server_harness import metric_value

PROMPTS = [
    f"Write a short note about {topic}."
    for topic in ("rivers", "mountains", "bread", "clocks", "violins", "comets", "ants", "lanterns")
]
MAX_TOKENS = 16


def _body(prompt: str, **extra) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def _stream_text(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
    pieces, finish = [], None
    async with client.stream("POST", "/v1/completions", json=_body(prompt, stream=True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                pieces.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return "".join(pieces), finish


def _metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text


def test_64_concurrent_streams_with_preemption_match_solo_text(main_server):
    with httpx.Client(base_url=main_server.url, headers=main_server.headers, timeout=120) as client:
        solo = {
            p: client.post("/v1/completions", json=_body(p)).json()["choices"][0]["text"]
            for p in PROMPTS
        }
    preemptions_before = metric_value(_metrics(main_server), "pagoda:num_preemptions_total")

    async def burst():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(
            base_url=main_server.url, headers=main_server.headers, timeout=300, limits=limits
        ) as client:
            requests = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
            return requests, await asyncio.gather(*(_stream_text(client, p) for p in requests))

    requests, results = asyncio.run(burst())
    assert len(results) == 64
    for prompt, (text, finish) in zip(requests, results):
        assert finish == "length"
        assert text == solo[prompt], prompt
    assert metric_value(_metrics(main_server), "pagoda:num_preemptions_total") > preemptions_before


def _wait_for_all_blocks_free(http: httpx.Client, deadline_s: float = 60.0) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        audit = http.get("/debug/kv_audit").json()
        if audit["in_use"] == 0 and audit["num_in_flight"] == 0 and audit["num_running"] == 0:
            return audit
        assert time.monotonic() < deadline, f"blocks still in use: {audit}"
        time.sleep(0.1)  # poll the audit endpoint


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_every_block(main_server, stream):
    abort_label = 'finished_reason="abort"'
    with httpx.Client(base_url=main_server.url, headers=main_server.headers, timeout=60) as http:
        aborts_before = metric_value(
            _metrics(main_server), "pagoda:request_success_total", abort_label
        )
        # Long enough (480 tokens) that it cannot finish on its own before the checks below.
        body = {
            "prompt": "Tell me a long story.",
            "max_tokens": 480,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            with httpx.Client(
                base_url=main_server.url, headers=main_server.headers, timeout=60
            ) as c:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    assert next(line for line in lines if line.startswith("data: "))
                    assert http.get("/debug/kv_audit").json()["in_use"] > 0
            # leaving the blocks closes the connection mid-stream
        else:
            with httpx.Client(
                base_url=main_server.url,
                headers=main_server.headers,
                timeout=httpx.Timeout(60, read=1.0),
            ) as c:
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/v1/completions", json=body)
        audit = _wait_for_all_blocks_free(http)
        assert audit["free"] + audit["cached"] == audit["total"]
        text = _metrics(main_server)
        assert metric_value(text, "pagoda:request_success_total", abort_label) == aborts_before + 1
