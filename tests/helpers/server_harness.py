"""Harness for tests that run a REAL `pagoda serve` process on 127.0.0.1 (a free port).

`launch_server(*flags)` starts `python -m pagoda.entrypoints.cli serve` with the
embedded SmolLM2 on CPU and returns once GET /health answers 200 (polled with a
bounded deadline); `ServerProcess.stop()` sends SIGTERM and returns the exit code.
`MAIN_SERVER_FLAGS` configure the session-wide server of conftest.py: API key,
debug routes, max_model_len 512, async scheduling and a KV pool small enough that 64
concurrent streams preempt. On Linux a server gets SIGTERM when the test process dies
(`die_with_parent`): a pytest killed mid-run leaves no server behind to load the
machine. (A module with a unique name, so test files can import it.)
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

API_KEY = "test-key-123"
STARTUP_DEADLINE_S = 300.0  # loading the model on a busy 2-core machine can take a while
# Small KV pool: 40 blocks of 16 tokens. One max-length request (512 tokens = 32 blocks)
# still fits; 64 concurrent short streams (2 blocks each) do not, so they preempt.
# --async-scheduling: the path every CUDA server takes (the CPU default is off), so the
# load, disconnect and fuzz tests exercise it end to end.
MAIN_SERVER_FLAGS = (
    "--max-model-len",
    "512",
    "--num-gpu-blocks-override",
    "40",
    "--async-scheduling",
    "--api-key",
    API_KEY,
    "--enable-debug-routes",
    "--max-request-body-bytes",
    "65536",
    "--max-num-seqs",
    "64",
    "--disable-uvicorn-access-log",
    "--uvicorn-log-level",
    "warning",
)


# The C library, loaded before any fork (die_with_parent runs between fork and exec).
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A Popen preexec_fn: the child receives SIGTERM when the process that started it
    exits, however it exits (Linux's PR_SET_PDEATHSIG; elsewhere nothing)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, flags: tuple[str, ...], api_key: str | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="pagoda-serve-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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
                *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, deadline_s: float = STARTUP_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with {self.proc.returncode}:\n{self.log_text()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.25)  # readiness poll interval
        raise TimeoutError(f"the server was not ready within {deadline_s}s:\n{self.log_text()}")

    def log_text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-5000:]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def launch_server(*flags: str, api_key: str | None = None) -> ServerProcess:
    server = ServerProcess(tuple(flags), api_key)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus exposition text (0.0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            if series.split("{")[0] == name and labels in series:
                return float(value)
    return 0.0
