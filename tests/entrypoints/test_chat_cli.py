"""`pagoda chat` driven through a pseudo-terminal, as a person at a keyboard would:
Ctrl-C during a reply stops it and keeps the conversation, the next message gets a
reply, and Ctrl-C at the prompt exits 0, with no traceback anywhere."""

from __future__ import annotations

import fcntl
import os
import platform
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest

from pagoda.entrypoints.chat import BANNER, STOPPED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOAD_DEADLINE_S = 240.0  # loading the model on a busy 2-core machine
STEP_DEADLINE_S = 60.0
CTRL_C = b"\x03"
# x86-64 syscall numbers a terminal read blocks in: read, poll, select, pselect6, ppoll.
_READ_SYSCALLS = {"0", "7", "23", "270", "271"}

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() != "x86_64",
    reason="reads the child's state from /proc with x86-64 syscall numbers",
)


def _own_terminal() -> None:
    # In the child: a new session whose controlling terminal is the pty, so the
    # terminal turns Ctrl-C into SIGINT for it, as a shell's terminal would; and
    # SIGINT's default disposition, as a shell gives it (a test process may have
    # SIGINT ignored, which a child would inherit, and Python keeps an ignored SIGINT).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()
        # A new pty is 0x0; a terminal a person uses has a size (tqdm draws to its width).
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_own_terminal,
        )
        os.close(slave)
        self.output = b""

    def read_until(self, needle: bytes, start: int, deadline_s: float) -> int:
        """Reads until `needle` appears after offset `start`; returns the offset after it."""
        deadline = time.monotonic() + deadline_s
        while True:
            found = self.output.find(needle, start)
            if found >= 0:
                return found + len(needle)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {needle!r} within {deadline_s}s:\n{self.text()}")
            ready, _, _ = select.select([self.master], [], [], remaining)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise EOFError(f"the chat exited before {needle!r}:\n{self.text()}")
                self.output += chunk

    def drain(self) -> None:
        """After the child exited: reads what it left in the terminal."""
        while select.select([self.master], [], [], 0)[0]:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: every writer is gone
                return
            if not chunk:
                return
            self.output += chunk

    def wait_blocked_on_input(self, deadline_s: float) -> None:
        """Polls until the child sleeps in a read of the terminal (x86-64 Linux syscalls).

        CPython checks for signals only between bytecodes or when a blocking call
        returns EINTR: a Ctrl-C that lands after input() printed its prompt but before
        it blocks is noticed only at the next keystroke. A person cannot type that
        fast; a test can, so it waits for the blocking read first.
        """
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{self.proc.pid}/syscall") as f:
                call = f.read().split()
            if state == "S" and call and call[0] in _READ_SYSCALLS:
                return
            time.sleep(0.01)  # polling another process's state
        raise TimeoutError(f"the chat never waited for input:\n{self.text()}")

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def text(self) -> str:
        return self.output.decode("utf-8", "replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        os.close(self.master)


@pytest.fixture
def chat():
    term = Terminal(
        [
            sys.executable,
            "-m",
            "pagoda.entrypoints.cli",
            "chat",
            "--device",
            "cpu",
            "--max-model-len",
            "512",
            "--temperature",
            "0",
            "--ignore-eos",
            "--max-tokens",
            "400",
        ]
    )
    yield term
    term.close()


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_keeps_the_chat_and_exits_at_the_prompt(chat):
    at = chat.read_until(BANNER.encode() + b"\r\n> ", 0, LOAD_DEADLINE_S)
    assert "loading weights" in chat.text()  # a progress bar: this is a terminal
    chat.send(b"Tell me a long story about a dragon.\n")
    at = chat.read_until(b"\n", at, STEP_DEADLINE_S)  # the echoed message
    # 400 tokens with --ignore-eos take far longer than this: the reply is mid-stream.
    chat.read_until(b" ", at, STEP_DEADLINE_S)
    chat.send(CTRL_C)
    at = chat.read_until(STOPPED.encode() + b"\r\n> ", at, STEP_DEADLINE_S)
    assert chat.proc.poll() is None  # still chatting

    chat.send(b"/reset\n")  # the next reply must not take 400 tokens of history
    at = chat.read_until(b"> ", at, STEP_DEADLINE_S)
    chat.wait_blocked_on_input(STEP_DEADLINE_S)
    chat.send(CTRL_C)  # at the prompt: exit
    try:
        code = chat.proc.wait(STEP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the chat did not exit on Ctrl-C at the prompt:\n{chat.text()}")
    assert code == 0
    chat.drain()
    assert "Traceback" not in chat.text() and "KeyboardInterrupt" not in chat.text()
