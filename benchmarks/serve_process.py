"""A `pagoda serve` subprocess for benchmarks: start it on a free 127.0.0.1 port, wait
until /health answers 200, stop it (SIGTERM, then SIGKILL). The checkout comes first on
the server's PYTHONPATH, before what the caller's PYTHONPATH holds (carried wheels)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(flags: list[str], log_path: str, extra_env: dict | None = None,
                 ready_timeout: float = 900.0) -> tuple[subprocess.Popen, str]:
    """(process, base URL) of a ready server run with `flags`; raises if it exits or is
    not ready within ready_timeout seconds (its output is in log_path)."""
    port = free_port()
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, **(extra_env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port), "--disable-uvicorn-access-log", "--disable-log-requests",
             "--uvicorn-log-level", "warning", *flags],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return proc, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)  # readiness poll of a separate process: nothing to await
    proc.kill()
    raise TimeoutError(f"the server was not ready in {ready_timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen, timeout: float = 120.0) -> int:
    """SIGTERM (a graceful drain), SIGKILL after timeout seconds; the exit code."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
