"""A worker of a real `pagoda serve --tensor-parallel-size 2 --device cpu` (two worker
processes of the "mp" backend, gloo) killed with SIGKILL in the middle of a streaming
request: the request ends with an error event that names the rank and the signal (not
a hang, not a cut connection), /health answers 503 saying why, the server still
answers HTTP (new requests get a 503 at once), and once the server is terminated no
worker process remains.
"""

from __future__ import annotations

import json
import re
import signal

import httpx
import psutil
from helpers.server_harness import launch_server
from helpers.tiny_models import save_tiny_servable_model

WORKERS_GONE_TIMEOUT_S = 60.0


def worker_processes(server) -> list[psutil.Process]:
    """The server's tensor-parallel worker processes (spawned multiprocessing children,
    not its resource tracker)."""
    children = psutil.Process(server.proc.pid).children()
    return [p for p in children if "spawn_main" in " ".join(p.cmdline())]


def test_a_killed_worker_fails_the_stream_and_health_and_leaves_no_process(tmp_path):
    save_tiny_servable_model(tmp_path)
    server = launch_server(
        str(tmp_path),
        "--tensor-parallel-size",
        "2",
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        str(1 << 22),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    )
    workers: list[psutil.Process] = []
    try:
        workers = worker_processes(server)
        assert len(workers) == 2, [p.cmdline() for p in workers]
        victim = workers[1]
        # Far more tokens than can be generated before the kill lands: a stream that
        # ends normally fails the assertions below (the client's read timeout bounds a hang).
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 480,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: {"))  # generating now
                victim.send_signal(signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2][len("data: ") :])["error"]
            assert error["code"] == "engine_step_failed"
            died = rf"rank [01] \(pid {victim.pid}\) died: killed by SIGKILL"
            assert re.search(died, error["message"]), error

            health = client.get("/health")
            assert health.status_code == 503
            assert health.json()["error"]["code"] == "engine_dead"
            assert re.search(died, health.json()["error"]["message"]), health.json()
            # Still serving HTTP: facts answer, generation is refused at once.
            assert client.get("/version").status_code == 200
            refused = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503
            assert "the engine loop has stopped" in refused.json()["error"]["message"]
            assert server.proc.poll() is None
    finally:
        code = server.stop()
    assert code == 0, server.log_text()
    _, alive = psutil.wait_procs(workers, timeout=WORKERS_GONE_TIMEOUT_S)
    assert alive == []
