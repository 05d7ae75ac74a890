"""A real `pagoda serve` for the serving benchmarks, and `pagoda bench serve` against it.

`ServerProcess` starts the server on a free 127.0.0.1 port in its own session (a Ctrl-C
in the terminal reaches the benchmark only, which stops the server; the server gets
SIGTERM if the benchmark dies, even by SIGKILL), with the checkout first on its
PYTHONPATH. `wait_ready` polls /health until 200; `stop` sends SIGTERM (a graceful
drain), then SIGKILL. `rss_bytes` sums the resident memory of the server and its
descendants; `log_problems` counts tracebacks in its log. `serve()` is the same as a
context manager, ready on entry and stopped on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from benchmarks.harness.processes import REPO_ROOT, env_with_repo

HOST = "127.0.0.1"
# Quiet logging: the benchmarks read the server's figures, not its access log.
QUIET_FLAGS = (
    "--disable-uvicorn-access-log",
    "--disable-log-requests",
    "--uvicorn-log-level",
    "warning",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the benchmark process dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """One `pagoda serve` subprocess: start (in __init__), readiness, RSS, stop."""

    def __init__(
        self, flags: list[str], log_path: str, extra_env: dict | None = None, quiet: bool = True
    ) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.args = [
            sys.executable,
            "-m",
            "pagoda.entrypoints.cli",
            "serve",
            "--host",
            HOST,
            "--port",
            str(self.port),
            *(QUIET_FLAGS if quiet else ()),
            *flags,
        ]
        env = env_with_repo({"PYTHONUNBUFFERED": "1", **(extra_env or {})})
        env.pop("PAGODA_API_KEY", None)  # the benchmarks send no key
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def wait_ready(self, timeout: float = 900.0) -> float:
        """Polls /health until it answers 200; the seconds that took. Raises if the
        server exits first or is not ready within `timeout` seconds."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode}; "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)  # readiness poll of a separate process: nothing to await
        self.stop(timeout=10)
        raise TimeoutError(
            f"the server was not ready in {timeout:.0f} s; {self.log_path}:\n{self.log_tail()}"
        )

    def rss_bytes(self) -> int | None:
        """VmRSS of the server and all its descendants (None once it exited)."""
        total = 0
        for pid in _descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(
                        (int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0
                    )
            except (FileNotFoundError, ProcessLookupError):
                if pid == self.proc.pid:
                    return None
        return total

    def stop(self, timeout: float = 120.0) -> dict:
        """SIGTERM (a graceful drain), SIGKILL after `timeout` seconds; the exit code and
        whether it had to be killed."""
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
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
        return {
            "tracebacks": sum("Traceback" in line for line in lines),
            "error_lines": [line for line in lines if "ERROR" in line or "Exception" in line][:20],
        }


@contextlib.contextmanager
def serve(
    flags: list[str], log_path: str, extra_env: dict | None = None, ready_timeout: float = 900.0
):
    """A ready ServerProcess for the with-block; stopped when it ends, however."""
    server = ServerProcess(flags, log_path, extra_env)
    try:
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()


def bench_serve(url: str, flags: list[str], result_dir: str, name: str, quiet: bool = True) -> dict:
    """One `pagoda bench serve --base-url url FLAGS` run in a child process; its saved
    report (result_dir/name)."""
    command = [
        sys.executable,
        "-m",
        "pagoda.entrypoints.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        *flags,
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        name,
    ]
    subprocess.run(
        command,
        check=True,
        cwd=REPO_ROOT,
        env=env_with_repo(),
        stdout=subprocess.DEVNULL if quiet else None,
    )
    with open(os.path.join(result_dir, name)) as f:
        return json.load(f)


def get_json(url: str, timeout: float = 30.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


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
