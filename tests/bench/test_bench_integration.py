"""`pagoda bench serve` against a real `pagoda serve` process (embedded SmolLM2, CPU, 127.0.0.1).

Shows on the real server: token-exact prompts through /tokenize, exact usage counts,
the report and /metrics figures, 429s counted by cause under a queue cap, and a
server killed mid-run: every request accounted for and the run ending by itself.
Skipped until the OpenAI server module is importable.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

pytest.importorskip(
    "pagoda.entrypoints.openai.api_server",
    reason="bench integration tests need the OpenAI server (pagoda serve)",
)

from pagoda.bench import metrics as m  # noqa: E402
from pagoda.bench.cli import main  # noqa: E402
from pagoda.bench.client import Target  # noqa: E402
from pagoda.bench.datasets import random_requests  # noqa: E402
from pagoda.bench.report import load_report  # noqa: E402
from pagoda.bench.serve import LoadPlan, run_load  # noqa: E402
from pagoda.bench.tokenizers import ServerTokenizer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_DEADLINE_S = 300.0
API_KEY = "bench-key"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PagodaServer:
    """One `pagoda serve` process on a free port; ready once /health answers 200."""

    def __init__(self, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="bench-serve-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
        env.pop("PAGODA_API_KEY", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagoda.entrypoints.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--device",
                "cpu",
                "--api-key",
                API_KEY,
                "--max-model-len",
                "512",
                "--disable-uvicorn-access-log",
                *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )

    def wait_ready(self) -> PagodaServer:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pagoda serve exited with {self.proc.returncode}:\n{self.log_text()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)  # readiness poll interval
        self.stop()
        raise TimeoutError(
            f"pagoda serve not ready within {STARTUP_DEADLINE_S}s:\n{self.log_text()}"
        )

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server():
    # A queue cap of 2: runs with at most 2 requests in flight are never refused,
    # a burst beyond it gets 429s.
    proc = PagodaServer("--max-num-queued-requests", "2").wait_ready()
    yield proc
    proc.stop()


def _serve_args(url: str, *extra: str) -> list[str]:
    return [
        "serve",
        "--base-url",
        url,
        "--api-key",
        API_KEY,
        "--disable-tqdm",
        "--request-timeout",
        "300",
        "--max-duration",
        "600",
        *extra,
    ]


def test_bench_serve_against_pagoda(server, tmp_path):
    assert (
        main(
            _serve_args(
                server.url,
                "--num-prompts",
                "4",
                "--random-input-len",
                "24",
                "--random-output-len",
                "6",
                "--ignore-eos",
                "--max-concurrency",
                "2",
                "--num-warmups",
                "1",
                "--goodput",
                "e2el:600000",
                "--save-result",
                "--save-detailed",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "pagoda.json",
            )
        )
        == 0
    )
    report = load_report(str(tmp_path / "pagoda.json"))
    assert (report["completed"], report["failed"], report["cancelled"]) == (4, 0, 0)
    # ignore_eos + exact usage: every request produced exactly its 6 tokens.
    assert report["requests"]["output_lens"] == [6, 6, 6, 6]
    assert report["total_output_tokens"] == 24
    # Token-exact prompts: the server counts 24 prompt tokens (plus any BOS it adds).
    tok = ServerTokenizer(server.url, report["model_id"], API_KEY)
    added = len(tok._tokenize("a")) - len(tok.encode("a"))
    assert report["requests"]["input_lens"] == [24 + added] * 4
    assert report["request_goodput"] == 4 / report["duration"]
    assert report["max_concurrent_requests"] == 2
    for ttft, e2el, itls in zip(
        report["requests"]["ttft_ms"], report["requests"]["e2el_ms"], report["requests"]["itls_ms"]
    ):
        assert 0 < ttft <= e2el
        assert len(itls) <= 5  # at most one gap per token after the first
    server_metrics = report["server_metrics"]
    assert server_metrics["available"], server_metrics
    assert server_metrics["peak_memory_bytes"]  # process peak memory from /metrics
    assert server_metrics["prefix_cache_queries"] is not None


def test_chat_backend_against_pagoda(server, tmp_path):
    assert (
        main(
            _serve_args(
                server.url,
                "--backend",
                "openai-chat",
                "--num-prompts",
                "2",
                "--max-concurrency",
                "2",
                "--random-input-len",
                "16",
                "--random-output-len",
                "4",
                "--ignore-eos",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "chat.json",
            )
        )
        == 0
    )
    report = load_report(str(tmp_path / "chat.json"))
    assert report["completed"] == 2 and report["total_output_tokens"] == 8
    assert all(n > 16 for n in report["requests"]["input_lens"])  # the chat template adds tokens


def test_queue_cap_429s_are_counted(server, tmp_path):
    assert (
        main(
            _serve_args(
                server.url,
                "--num-prompts",
                "12",
                "--random-input-len",
                "16",
                "--random-output-len",
                "4",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "burst.json",
            )
        )
        == 0
    )
    report = load_report(str(tmp_path / "burst.json"))
    assert set(report["failures"]) == {"http_429"}
    assert report["failures"]["http_429"] >= 1
    assert report["completed"] >= 2
    assert report["completed"] + report["failed"] == 12


def test_server_killed_mid_run():
    proc = PagodaServer().wait_ready()
    try:
        tok = ServerTokenizer(proc.url, _model_id(proc.url), API_KEY)
        samples = random_requests(tok, num_prompts=6, input_len=16, output_len=200, seed=0)
        target = Target(
            proc.url + "/v1/completions",
            "openai",
            tok.model,
            API_KEY,
            request_timeout=300,
            ignore_eos=True,
        )
        plan = LoadPlan(max_duration=600, show_progress=False, metrics_interval=0)

        async def kill_once_generating():
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not _generating(proc.url):
                await asyncio.sleep(0.2)  # poll the server's own token counter
            proc.proc.kill()

        async def both():
            return await asyncio.gather(
                run_load(target, samples, plan, proc.url), kill_once_generating()
            )

        start = time.monotonic()
        outcome, _ = asyncio.run(both())
        assert time.monotonic() - start < 400
    finally:
        proc.stop()
    s = m.summarize(outcome.results, outcome.duration)
    assert s["num_requests"] == 6 and s["not_sent"] == 0 and s["cancelled"] == 0
    assert s["completed"] + s["failed"] == 6
    assert s["failed"] >= 1
    assert set(s["failures"]) <= {m.CONNECTION_ERROR, m.INCOMPLETE_STREAM}
    assert not outcome.stopped_by_time_limit


def _model_id(url: str) -> str:
    request = urllib.request.Request(
        url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    import json

    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def _generating(url: str) -> bool:
    request = urllib.request.Request(
        url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return False
    from pagoda.bench.server_metrics import lookup, parse_prometheus

    return (lookup(parse_prometheus(text), ("generation_tokens",)) or 0) > 0
