"""The web UI and its statistics stream, without a browser (tests/server/test_web_ui_browser.py
drives a real one): pages and files public with a strict CSP and no inline code, data
routes behind the key, --disable-web-ui, the stream's events and rates, its clients
and the drain, the package data that ships the files; and on the real server, a stream
whose counters move under load.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
import threading
import time
import tomllib
from pathlib import Path

import httpx
from fastapi.testclient import TestClient
from helpers.server_harness import API_KEY

from pagoda.engine.async_engine import AsyncEngine, RequestTimings
from pagoda.engine.llm_engine import EngineStats
from pagoda.entrypoints import cli
from pagoda.entrypoints.openai import web_ui
from pagoda.entrypoints.openai.api_server import build_app, settings_from_args
from pagoda.entrypoints.openai.serving_common import ServerSettings
from pagoda.entrypoints.openai.stats_stream import STREAM_PATH, StatsHub, derive
from pagoda.metrics.recent import RequestLog

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEB_DIR = Path(web_ui.__file__).parent / "web"
REPO = Path(__file__).resolve().parents[2]


class _MovingEngine:
    """An LLMEngine stand-in whose counters advance by fixed amounts per get_stats()."""

    max_model_len = 512
    tokenizer = None

    def __init__(self) -> None:
        self.calls = 0

    def has_unfinished_requests(self) -> bool:
        return False

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def get_stats(self) -> EngineStats:
        n = self.calls
        self.calls += 1
        return EngineStats(
            num_running=2,
            num_waiting=1,
            kv_cache_usage=0.25,
            num_blocks=8,
            prefix_cache_queries=10 * n,
            prefix_cache_hits=4 * n,
            num_preemptions=0,
            prompt_tokens=20 * n,
            generation_tokens=10 * n,
            num_preempted=1,
            num_steps=3 * n,
            scheduled_tokens=30 * n,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            block_size=16,
        )


def _app(enable_web_ui: bool = True, api_key: str = API_KEY):
    settings = ServerSettings(
        served_model_names=["m"], api_key=api_key, enable_web_ui=enable_web_ui
    )
    return build_app(AsyncEngine(_MovingEngine), settings)


def _events(lines, count: int) -> list[tuple[str, dict]]:
    """The first `count` SSE events (name, parsed data) of an iterator of lines."""
    events, name = [], "message"
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
            if len(events) == count:
                break
    return events


# ---------------------------------------------------------------- pages and files


def test_pages_and_files_are_public_with_a_strict_csp():
    paths = web_ui.public_paths()
    assert {
        "/",
        "/dashboard",
        "/web/chat.js",
        "/web/dashboard.js",
        "/web/common.js",
        "/web/markdown.js",
        "/web/style.css",
        "/web/favicon.svg",
    } <= paths
    with TestClient(_app()) as client:
        for path in paths:
            r = client.get(path)  # no key
            assert r.status_code == 200, path
            csp = r.headers["content-security-policy"]
            assert csp == web_ui.CONTENT_SECURITY_POLICY
            assert "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp
            assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
            assert r.headers["x-content-type-options"] == "nosniff"
        assert client.get("/").headers["content-type"].startswith("text/html")
        assert client.get("/web/chat.js").headers["content-type"].startswith("text/javascript")
        assert client.get("/web/style.css").headers["content-type"].startswith("text/css")


def test_pages_carry_no_inline_code_and_reference_only_served_files():
    paths = web_ui.public_paths()
    for page in web_ui.PAGES.values():
        html = (WEB_DIR / page).read_text()
        scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
        assert scripts and all(
            'src="/web/' in attrs and not body.strip() for attrs, body in scripts
        )
        assert "<style" not in html and not re.search(r"\sstyle\s*=", html)
        assert not re.search(r"\son[a-z]+\s*=", html), "inline event handler"
        assert "javascript:" not in html
        for ref in re.findall(r'(?:src|href)="(/[^"]*)"', html):
            assert ref in paths, (page, ref)
    for script in WEB_DIR.glob("*.js"):
        source = script.read_text()
        assert "eval(" not in source and "new Function" not in source, script.name
        assert 'setAttribute("style"' not in source, script.name


def test_data_routes_need_the_key_and_the_pages_ask_for_it():
    with TestClient(_app()) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for path in (STREAM_PATH, "/v1/models"):
                r = client.get(path, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with client.stream("GET", STREAM_PATH, headers=AUTH) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
        # Neither the pages nor the endless stream are API operations (a client generator
        # or the schema fuzz test must not call them).
        paths = client.get("/openapi.json", headers=AUTH).json()["paths"]
        assert not {"/", "/dashboard", STREAM_PATH} & set(paths) and "/v1/models" in paths
    # The page's key dialog, and the script that opens it on a 401.
    assert 'id="key-dialog"' in (WEB_DIR / "chat.html").read_text()
    common = (WEB_DIR / "common.js").read_text()
    assert "response.status !== 401" in common and "askForKey" in common


def test_disable_web_ui_removes_the_pages_but_not_the_stream():
    with TestClient(_app(enable_web_ui=False)) as client:
        for path in ("/", "/dashboard", "/web/chat.js"):
            assert client.get(path, headers=AUTH).status_code == 404
            assert client.get(path).status_code == 401  # no longer public
        with client.stream("GET", STREAM_PATH, headers=AUTH) as r:
            assert r.status_code == 200
    with TestClient(_app(enable_web_ui=False, api_key=None)) as client:
        assert client.get("/").status_code == 404


def test_the_cli_flag_reaches_the_settings():
    on = settings_from_args(cli.build_parser().parse_args(["serve"]))
    off = settings_from_args(cli.build_parser().parse_args(["serve", "--disable-web-ui"]))
    assert on.enable_web_ui and not off.enable_web_ui


def test_package_data_ships_every_web_file():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["pagoda.entrypoints.openai"]
    for path in WEB_DIR.iterdir():
        assert any(fnmatch.fnmatch(f"web/{path.name}", p) for p in patterns), path.name


# ---------------------------------------------------------------- the stream


def test_derive_rates_from_two_samples():
    engine = _MovingEngine()
    first, second = engine.get_stats(), engine.get_stats()
    alone = derive(first, None, now=100.0)
    assert alone["output_tok_s"] is None and alone["tokens_per_step"] is None
    assert (alone["running"], alone["waiting"], alone["preempted"]) == (2, 1, 1)
    assert (alone["token_budget"], alone["max_num_seqs"], alone["block_size"]) == (64, 4, 16)
    view = derive(second, (98.0, first), now=100.0)
    assert view["output_tok_s"] == 5.0 and view["prompt_tok_s"] == 10.0
    assert view["steps_per_s"] == 1.5 and view["tokens_per_step"] == 10.0
    assert view["prefix_hit_rate"] == 0.4 and view["prefix_hit_rate_total"] == 0.4
    assert view["spec"] is None


def test_spec_acceptance_shows_when_the_stats_carry_it():
    class Spec:
        def __init__(self, drafted, accepted):
            self.num_draft_tokens, self.num_accepted_tokens = drafted, accepted

    old, new = _MovingEngine().get_stats(), _MovingEngine().get_stats()
    old.spec_decode, new.spec_decode = Spec(10, 5), Spec(30, 20)
    spec = derive(new, (0.0, old), now=1.0)["spec"]
    assert spec == {
        "draft_tokens_total": 30,
        "accepted_tokens_total": 20,
        "acceptance_rate_total": 20 / 30,
        "acceptance_rate": 0.75,
    }


def test_stream_sends_info_stats_and_requests():
    app = _app()
    log: RequestLog = app.state.stats_hub.request_log
    now = time.monotonic()
    log.observe(
        RequestTimings(
            request_id="done-before",
            arrival_time=now - 1.0,
            first_token_time=now - 0.5,
            finished_time=now,
            queue_time=0.1,
            num_prompt_tokens=3,
            num_generation_tokens=2,
            finish_reason="stop",
            inter_token_latencies=[0.5],
        )
    )
    with TestClient(app) as client:
        with client.stream("GET", STREAM_PATH, headers=AUTH) as r:
            events = _events(r.iter_lines(), 4)
    names = [name for name, _ in events]
    assert names == ["info", "stats", "requests", "stats"]
    info, first, recent, second = (data for _, data in events)
    assert info["model"] == "m" and info["max_model_len"] == 512
    assert first["state"] == "ready" and first["running"] == 2 and first["output_tok_s"] is None
    assert [r["id"] for r in recent] == ["done-before"] and recent[0]["ttft_s"] == 0.5
    assert second["tokens_per_step"] == 10.0 and second["output_tok_s"] > 0
    assert second["finished_total"] == 1 and second["latency"]["ttft"]["n"] == 1


class _HubEngine:
    """What StatsHub reads of an AsyncEngine."""

    is_ready, is_running, load_error, num_in_flight = True, True, None, 0
    engine = _MovingEngine()

    async def get_stats(self):
        return self.engine.get_stats()


def test_clients_share_one_sampler_which_stops_with_the_last_and_on_a_drain():
    async def scenario():
        draining = False
        hub = StatsHub(
            _HubEngine(), RequestLog(), "m", is_draining=lambda: draining, interval_s=0.01
        )
        (body_a, close_a), (body_b, close_b) = await hub.stream(), await hub.stream()
        assert hub.num_clients == 2
        for body in (body_a, body_b):
            assert (await anext(body)).startswith("event: info")
            assert (await anext(body)).startswith("event: stats")
        close_b()
        await body_b.aclose()
        assert hub.num_clients == 1
        draining = True  # the server starts draining: the open stream ends
        rest = [chunk async for chunk in body_a]
        assert all(chunk.startswith("event: stats") for chunk in rest)
        close_a()
        assert hub.num_clients == 0
        await asyncio.wait_for(hub._task, timeout=5)  # the sampler stopped
        samples = hub.num_samples
        await asyncio.sleep(0.05)  # nobody listens: no sampling goes on
        assert hub.num_samples == samples

    asyncio.run(scenario())


# ---------------------------------------------------------------- the real server


def test_stats_stream_moves_under_load_on_the_real_server(main_server):
    """A dashboard's stream sees requests run and finish while a parallel client loads
    the server: in-flight count, tokens generated, finished requests with their ids."""
    ids: list[str] = []
    done = threading.Event()

    def load():
        with httpx.Client(base_url=main_server.url, headers=main_server.headers, timeout=120) as c:
            for i in range(3):
                body = {
                    "prompt": f"Count to ten, take {i}:",
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                ids.append(c.post("/v1/completions", json=body).json()["id"])
        done.set()

    seen = {"in_flight": 0, "requests": set()}
    deadline = time.monotonic() + 90
    with httpx.Client(base_url=main_server.url, headers=main_server.headers, timeout=30) as client:
        with client.stream("GET", STREAM_PATH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            _, info = _events(lines, 1)[0]
            assert info["max_model_len"] == 512
            _, start = _events(lines, 1)[0]
            worker = threading.Thread(target=load, daemon=True)
            worker.start()
            name = None
            for line in lines:
                assert time.monotonic() < deadline, seen
                if line.startswith("event: "):
                    name = line[7:]
                    continue
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                if name == "requests":
                    seen["requests"].update(item["id"] for item in data)
                elif name == "stats":
                    seen["in_flight"] = max(seen["in_flight"], data["in_flight"])
                    last = data
                    # Percentiles are recomputed at most once a second, so they may
                    # trail the finished requests by one period: read on until they
                    # count the three as well.
                    if (
                        done.is_set()
                        and set(ids) <= seen["requests"]
                        and data["latency"]["ttft"]["n"] >= 3
                    ):
                        break
    worker.join()
    assert seen["in_flight"] >= 1
    assert last["finished_total"] >= start["finished_total"] + 3
    assert last["generation_tokens_total"] >= start["generation_tokens_total"] + 24
    assert last["max_num_seqs"] == 64 and last["num_blocks"] == 40 and last["token_budget"] > 0
    assert last["latency"]["ttft"]["n"] >= 3
