"""Progress bars show only on a terminal, at INFO or lower, on rank 0; elsewhere the
iterable passes through untouched."""

from __future__ import annotations

import io
import logging

import pytest

from pagoda import progress as progress_module


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def info_level():
    logger = logging.getLogger("pagoda")
    previous = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(previous)


def test_a_bar_on_a_terminal(monkeypatch, info_level):
    terminal = _Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", terminal)
    assert list(progress_module.progress(range(5), "loading weights", 5, "tensor")) == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert "loading weights" in terminal.getvalue()


@pytest.mark.parametrize(
    "tty, level, rank",
    [(False, logging.INFO, 0), (True, logging.WARNING, 0), (True, logging.INFO, 1)],
)
def test_no_bar_off_a_terminal_when_quiet_or_on_other_ranks(monkeypatch, tty, level, rank):
    stream = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", stream)
    logger = logging.getLogger("pagoda")
    previous = logger.level
    logger.setLevel(level)
    try:
        assert list(progress_module.progress(range(3), "x", 3, rank=rank)) == [0, 1, 2]
    finally:
        logger.setLevel(previous)
    assert stream.getvalue() == ""
