"""The `pagoda serve` subprocess of benchmarks/soak.py: started in its own session on a
free 127.0.0.1 port (SIGTERM to it if the soak dies), polled for readiness, its resident
memory summed over its descendants, stopped by SIGTERM then SIGKILL, its log scanned
for tracebacks. benchmarks/serve_process.py is the plain form the other serving
benchmarks use."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import aiohttp
from serve_process import REPO_ROOT, free_port  # noqa: E402  (benchmarks/)

HOST = "127.0.0.1"
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=30)  # /health and /debug/kv_audit calls


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the soak dies (even by SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """One `pagoda serve` subprocess: start, readiness, RSS, stop."""

    def __init__(self, server_args: list[str], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.args = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--host", HOST,
                     "--port", str(self.port), *server_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
        env.pop("PAGODA_API_KEY", None)
        with open(log_path, "w") as log:
            # Own session: a Ctrl-C in the terminal reaches the soak only, which stops the server.
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO_ROOT, start_new_session=True,
                                         preexec_fn=_die_with_parent)

    async def wait_ready(self, session: aiohttp.ClientSession, deadline_s: float) -> float:
        """Polls /health until 200; returns the seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < deadline_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                async with session.get(f"{self.url}/health", timeout=PROBE_TIMEOUT) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)  # readiness poll interval
        raise TimeoutError(f"the server was not ready within {deadline_s:.0f} s:\n{self.log_tail()}")

    def rss_bytes(self) -> Optional[int]:
        """VmRSS of the server and all its descendants (None once it exited)."""
        pids, total = _descendants(self.proc.pid), 0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            except (FileNotFoundError, ProcessLookupError):
                if pid == self.proc.pid:
                    return None
        return total

    def stop(self, timeout_s: float = 60.0) -> dict:
        """SIGTERM (drain), SIGKILL after `timeout_s`; the exit code and whether it was killed."""
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                killed = True
                self.proc.kill()
                self.proc.wait()
        return {"exit_code": self.proc.returncode, "killed": killed}

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def log_problems(self) -> dict:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        return {"tracebacks": sum("Traceback" in line for line in lines),
                "error_lines": [line for line in lines if "ERROR" in line or "Exception" in line][:20]}


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found
