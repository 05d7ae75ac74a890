"""Running a benchmark module in a child process of its own (one engine per process, so
one configuration's GPU memory never crowds the next one's)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env_with_repo(extra: dict | None = None) -> dict:
    """The environment with this checkout first on PYTHONPATH (before what the caller's
    PYTHONPATH holds), plus `extra`."""
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def module_command(module: str, argv: list[str]) -> list[str]:
    """`python -m module argv...` with this interpreter."""
    return [sys.executable, "-m", module, *argv]


def run_json_child(module: str, argv: list[str], timeout: float | None = None) -> dict:
    """Runs `python -m module argv... --child-out FILE` and returns the JSON the child
    wrote to FILE, or {"error": ..., "stderr_tail": ...} when it failed or ran past
    `timeout` seconds. The child's output passes through as it comes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "child.json")
        proc = subprocess.Popen(
            module_command(module, [*argv, "--child-out", out]),
            env=env_with_repo(),
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        tail: collections.deque[str] = collections.deque(maxlen=60)

        def pump() -> None:
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            reader.join()
            return {
                "error": f"timed out after {timeout:.0f} s",
                "stderr_tail": "".join(tail)[-3000:],
            }
        reader.join()
        if proc.returncode != 0 or not os.path.exists(out):
            return {"error": f"exit code {proc.returncode}", "stderr_tail": "".join(tail)[-3000:]}
        with open(out) as f:
            return json.load(f)


def write_child_result(path: str, data: dict) -> None:
    """The child's side of run_json_child."""
    with open(path, "w") as f:
        json.dump(data, f)
