"""Stage-timed trace of a request's way to its first token, off by default.

Set `PAGODA_TTFT_TRACE` before the server starts: a file path appends one JSON line
per traced request to that file; `log` writes the same object as a log line. Unset
(the default), every hook below is one module-global check and records nothing.

A trace is a dict stage -> `time.monotonic()`; each stage keeps its first time.
The HTTP layer opens a trace when a request arrives (`open_trace`, kept in a context
variable so the handler and the response body see it), `AsyncEngine.generate` files
it under the engine request id (`register`), and the engine-loop thread marks stages
by id (`mark_id`). The trace is written once the response ends (`finish`).

Stages, in the order a request meets them (a stage a path does not take is absent):
arrival, body_read, parsed, tokenized, prepared, posted, picked_up, added,
step_schedule_start, step_scheduled, step_forward_launched, step_launched (its sampling),
next_step_launched (the next step's forward),
step_result_ready, step_updated, step_processed, delivered, consumed, headers_sent,
first_body, first_text. The step_* stages describe the step that produced the first token;
next_step_launched is when the following step was launched before that first step's
output was processed (async scheduling only). first_body is the first response body
bytes handed to the server's transport (for a completion stream: the first token);
first_text the first chunk with non-empty text, which is what a client's TTFT counts.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)

ENV_VAR = "PAGODA_TTFT_TRACE"
_target = os.environ.get(ENV_VAR) or None
ENABLED = _target is not None

STAGES = (
    "arrival",
    "body_read",
    "parsed",
    "tokenized",
    "prepared",
    "posted",
    "picked_up",
    "added",
    "step_schedule_start",
    "step_scheduled",
    "step_forward_launched",
    "step_launched",
    "next_step_launched",
    "step_result_ready",
    "step_updated",
    "step_processed",
    "delivered",
    "consumed",
    "headers_sent",
    "first_body",
    "first_text",
)

_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "pagoda_ttft_trace", default=None
)
_by_id: dict[str, RequestTrace] = {}  # engine request id -> trace, while in flight
_write_lock = threading.Lock()


class RequestTrace:
    """Monotonic stage times of one HTTP request."""

    __slots__ = ("times", "request_ids", "path", "first_token_done")

    def __init__(self, path: str = "") -> None:
        self.times: dict[str, float] = {"arrival": time.monotonic()}
        self.request_ids: list[str] = []
        self.path = path
        self.first_token_done = False

    def mark(self, stage: str, at: float | None = None) -> None:
        if stage not in self.times:
            self.times[stage] = time.monotonic() if at is None else at

    def to_json(self) -> dict:
        arrival = self.times["arrival"]
        ordered = sorted(self.times.items(), key=lambda kv: kv[1])
        return {
            "request_ids": self.request_ids,
            "path": self.path,
            "arrival": arrival,
            "ms": {stage: round((t - arrival) * 1e3, 3) for stage, t in ordered},
        }


def set_enabled(target: str | None) -> None:
    """Turns tracing on (a file path or "log") or off; for tests and benchmarks in-process."""
    global _target, ENABLED
    _target = target or None
    ENABLED = _target is not None


def open_trace(path: str = "") -> RequestTrace | None:
    """Starts the trace of an arriving HTTP request (None when tracing is off)."""
    if not ENABLED:
        return None
    trace = RequestTrace(path)
    _current.set(trace)
    return trace


def current() -> RequestTrace | None:
    return _current.get() if ENABLED else None


def mark(stage: str) -> None:
    """Marks a stage of the request being handled in this context (no-op when off)."""
    if ENABLED:
        trace = _current.get()
        if trace is not None:
            trace.mark(stage)


def register(request_id: str) -> RequestTrace | None:
    """Files the current context's trace under an engine request id; returns it."""
    if not ENABLED:
        return None
    trace = _current.get()
    if trace is not None:
        trace.request_ids.append(request_id)
        _by_id[request_id] = trace
    return trace


def lookup(request_id: str) -> RequestTrace | None:
    return _by_id.get(request_id) if ENABLED else None


def mark_id(request_id: str, stage: str, at: float | None = None) -> None:
    """Marks a stage by engine request id, from any thread."""
    if ENABLED:
        trace = _by_id.get(request_id)
        if trace is not None:
            trace.mark(stage, at)


def mark_first_token(request_ids: Iterable[str], step_times: dict[str, float]) -> None:
    """Copies the times of the step that produced these requests' first tokens."""
    if not ENABLED:
        return
    for request_id in request_ids:
        trace = _by_id.get(request_id)
        if trace is not None and not trace.first_token_done:
            trace.first_token_done = True
            for stage, at in step_times.items():
                trace.mark(stage, at)


def finish(trace: RequestTrace | None) -> None:
    """Writes the trace (JSON line or log line) and forgets its request ids."""
    if trace is None:
        return
    for request_id in trace.request_ids:
        _by_id.pop(request_id, None)
    if "first_body" not in trace.times and not trace.first_token_done:
        return  # nothing reached the client (an error or a non-generating route)
    line = json.dumps(trace.to_json(), separators=(",", ":"))
    target = _target
    if target is None:
        return
    if target == "log":
        logger.info("ttft trace %s", line)
        return
    with _write_lock, open(target, "a", encoding="utf-8") as f:
        f.write(line + "\n")


class StepClock:
    """Stage times of one engine step; `NULL_CLOCK` (which keeps nothing) when tracing is off."""

    __slots__ = ("times",)

    def __init__(self) -> None:
        self.times: dict[str, float] = {"step_schedule_start": time.monotonic()}

    @staticmethod
    def start() -> StepClock:
        return StepClock() if ENABLED else NULL_CLOCK

    def lap(self, stage: str) -> None:
        self.times[stage] = time.monotonic()

    def first_tokens(self, request_outputs) -> None:
        """Hands this step's times to the traces of requests that got their first token."""
        mark_first_token(
            (out.request_id for out in request_outputs if any(c.token_ids for c in out.outputs)),
            self.times,
        )


class _NullClock(StepClock):
    __slots__ = ()

    def __init__(self) -> None:  # noqa: D401 - keeps no times
        pass

    def lap(self, stage: str) -> None:
        pass

    def first_tokens(self, request_outputs) -> None:
        pass


NULL_CLOCK = _NullClock()
