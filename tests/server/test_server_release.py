"""`pagoda serve` lets go of what its engine started: after SIGTERM or SIGINT the
process exits 0 within a bound, with no engine thread still running at its exit (the
server logs any), no child process left, and the disk tier's directory unlocked.

Two real servers on a tiny servable checkpoint: one with every tier-1 resource (CPU
and disk KV tiers, a draft model, a grammar compiled by a structured request, a
dashboard stream left open), stopped with SIGTERM; one at tensor-parallel size 2
(two worker processes), stopped with SIGINT.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal

import httpx
import psutil
import pytest
from helpers.server_harness import launch_server
from helpers.tiny_models import save_tiny_servable_model

from pagoda.kv_offload.disk_tier import LOCK_NAME

pytestmark = pytest.mark.server

EXIT_TIMEOUT_S = 30.0
QUIET = ("--max-model-len", "256", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-release")
    save_tiny_servable_model(root / "target", seed=0, num_hidden_layers=2)
    save_tiny_servable_model(
        root / "draft",
        seed=1,
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return str(root / "target"), str(root / "draft")


def lock_is_free(directory) -> bool:
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def use_every_feature(server) -> None:
    """A plain and a constrained completion, then a dashboard stream left open."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for prompt in ("Once upon a time", "The quick brown fox jumps over"):
            response = client.post(
                "/v1/completions",
                json={"prompt": prompt * 8, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert response.status_code == 200, response.text
        response = client.post(
            "/v1/completions",
            json={
                "prompt": "Yes or no?",
                "max_tokens": 8,
                "temperature": 0,
                "structured_outputs": {"choice": ["yes", "no"]},
            },
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] in ("yes", "no")


def stop_and_check(server, sig: int) -> str:
    """Sends sig with a dashboard stream open; returns the log once the process exited
    0 within the bound and every process it started is gone."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("GET", "/v1/engine/stats/stream") as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines) == "event: info"
        server.proc.send_signal(sig)
        code = server.proc.wait(EXIT_TIMEOUT_S)
    log = server.log_text()
    assert code == 0, log
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"processes left: {[p.pid for p in alive]}\n{log}"
    for bad in ("Traceback", "threads still running", "did not stop"):
        assert bad not in log, log
    return log


def test_sigterm_releases_the_tiers_draft_grammars_and_dashboard(checkpoints, tmp_path):
    target, draft = checkpoints
    disk = tmp_path / "kv-disk"
    server = launch_server(
        target,
        *QUIET,
        "--num-gpu-blocks-override",
        "10",
        "--kv-offloading-size",
        "4MiB",
        "--kv-offloading-disk-path",
        str(disk),
        "--kv-offloading-disk-size",
        "8MiB",
        "--kv-offloading-bandwidth",
        "cpu=inf,disk=inf",
        "--speculative-config",
        json.dumps({"model": draft, "num_speculative_tokens": 2}),
    )
    try:
        use_every_feature(server)
        assert not lock_is_free(disk)  # held while serving
        stop_and_check(server, signal.SIGTERM)
    finally:
        server.stop()
    assert lock_is_free(disk)


def test_sigint_ends_the_tensor_parallel_workers(checkpoints):
    target, _ = checkpoints
    server = launch_server(
        target, *QUIET, "--tensor-parallel-size", "2", "--kv-cache-memory", str(1 << 22)
    )
    try:
        workers = [
            p
            for p in psutil.Process(server.proc.pid).children()
            if "spawn_main" in " ".join(p.cmdline())
        ]
        assert len(workers) == 2
        use_every_feature(server)
        stop_and_check(server, signal.SIGINT)
        assert not any(p.is_running() for p in workers)
    finally:
        server.stop()
