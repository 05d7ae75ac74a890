"""The server harness itself: a process it starts does not outlive the test process
(die_with_parent), so a pytest killed mid-run leaves no `pagoda serve` behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_started_process_ends_with_its_parent():
    # The parent starts a long sleeper the way the harness starts a server, says its pid
    # and exits without stopping it.
    parent = textwrap.dedent(f"""
        import subprocess, sys
        sys.path.insert(0, {TESTS_DIR!r})
        from helpers.server_harness import die_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent)
        print(child.pid, flush=True)
    """)
    out = subprocess.run(
        [sys.executable, "-c", parent], capture_output=True, text=True, timeout=60, check=True
    )
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # the signal is asynchronous; poll its effect with a deadline
    assert not _alive(pid)
