"""AsyncEngine: the LLMEngine's step loop on a background thread, streamed to asyncio.

Owns the thread that builds and drives the LLMEngine, the per-request output
queues, cancellation and draining. The invariant that keeps it simple: **only the
loop thread touches the engine.** Callers on the asyncio side never call engine
methods; they post commands (add, abort, call) to a thread-safe inbox that the loop
thread drains between steps, and the loop thread posts outputs back onto each
request's event loop with `call_soon_threadsafe` (one call per step per event loop,
not one per token). Immutable facts fixed at load time (tokenizer, max_model_len,
vocab size, config) may be read from any thread once `is_ready`.

Failure isolation:
- a request the engine refuses (bad prompt, bad params) fails alone with its error;
- a request the engine finishes with an error (`RequestOutput.error`, or a sample's
  finish_reason "error") fails alone, with RequestFailedError;
- an exception escaping `engine.step()` fails every in-flight request (their state
  may be half-updated) and aborts them in the engine, and the loop keeps serving -
  unless `engine.check_health()` then raises (its executor's workers are gone): the
  loop stops, so `is_running` turns False and /health answers 503.
The loop shuts the engine down (`engine.shutdown()`: its threads, workers, disk lock
and memory) when it ends; a call posted after that fails with EngineNotReadyError.

The loop blocks on a Condition while it has nothing to do: no busy spin, no polling.
What each request looked like (RequestTimings, handed to `timings_listener`) is built
by engine/request_timings.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.engine import trace
from pagoda.engine.request_timings import (
    RequestTimings,
    TimingTracker,
    overall_finish_reason,
    prompt_len,
)
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The loop thread and the event loop share one interpreter. A thread that wants the
# GIL gets it when the holder blocks, or else only after the switch interval (Python's
# default: 5 ms); every hand-off on a request's path (output posted to the event loop,
# the next step starting meanwhile) can pay that wait. A short interval bounds it; the
# cost is more frequent forced switches while both threads are busy.
DEFAULT_SWITCH_INTERVAL_S = 0.0005
SWITCH_INTERVAL_ENV = "PAGODA_SWITCH_INTERVAL"  # seconds; 0 keeps the interpreter's own


class EngineNotReadyError(RuntimeError):
    """The engine is still loading (or failed to load)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class RequestFailedError(RuntimeError):
    """The engine failed this request while generating it (not the caller's fault)."""


class EngineStepError(RuntimeError):
    """A whole engine step failed; every request in flight at that moment fails with it."""


@dataclasses.dataclass
class _Stream:
    """Asyncio-side end of one request: the loop thread fills `queue` via `loop`."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int = 0
    # Set on the loop thread from the first output whose metrics carry it.
    first_scheduled_time: float | None = None
    trace: trace.RequestTrace | None = None  # only with PAGODA_TTFT_TRACE


# Inbox commands, handled on the loop thread in the order they were posted.
@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int
    arrival_time: float
    stream: _Stream


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclasses.dataclass
class _FailAll:
    message: str


class AsyncEngine:
    """Drives an LLMEngine on a background thread; `generate()` streams delta outputs.

    `engine_factory` builds the engine; it runs on the loop thread so the caller
    (e.g. the HTTP server) can come up and answer "loading" while it runs.
    """

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        timings_listener: Callable[[RequestTimings], None] | None = None,
    ) -> None:
        self._engine_factory = engine_factory
        self.timings_listener = timings_listener
        self.engine: Any = None
        self.load_error: BaseException | None = None
        # Why the loop stopped serving after a failed step (its executor's workers are
        # gone), in one line; set before the failed requests hear of it.
        self.dead_reason: str | None = None
        self._ready = threading.Event()  # set when loading ended, successfully or not
        self._cond = threading.Condition()
        self._inbox: list[Any] = []  # guarded by _cond
        self._stop_requested = False  # guarded by _cond
        self._loop_ended = False  # guarded by _cond: nothing handles the inbox any more
        self._draining = False
        self._thread: threading.Thread | None = None
        # Loop-thread state: request id -> stream, and those whose first-scheduled time
        # has not arrived yet.
        self._streams: dict[str, _Stream] = {}
        self._unscheduled: dict[str, _Stream] = {}
        self.num_in_flight = 0  # asyncio side: generate() calls not yet finished
        self._in_flight_changed = asyncio.Event()

    @classmethod
    def from_engine_args(cls, engine_args, **kwargs) -> AsyncEngine:
        from pagoda.engine.llm_engine import LLMEngine

        return cls(lambda: LLMEngine.from_engine_args(engine_args), **kwargs)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        _shorten_switch_interval()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_started(self) -> bool:
        return self._thread is not None

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Blocks until loading ended (check `load_error`); False on timeout."""
        return self._ready.wait(timeout)

    async def wait_ready(self) -> None:
        """Returns once the engine loaded; raises the load error if it failed."""
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        if self.load_error is not None:
            raise self.load_error

    def start_draining(self) -> None:
        """New generate() calls fail with EngineDrainingError from now on."""
        self._draining = True

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Drains: waits up to `timeout` s for in-flight requests, aborts the rest, stops the loop."""
        self.start_draining()
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            await self._wait_for_in_flight_change(deadline - time.monotonic())
        self._post(stop=True)
        # A thread still loading the model is not waited for: it is a daemon, and sees
        # the stop as soon as loading ends.
        if self._thread is not None and self.is_ready:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def close(self, timeout: float | None = None) -> None:
        """From a thread that runs no event loop: stops the loop now (requests in flight
        fail) and waits up to `timeout` s for the engine's shutdown. Idempotent."""
        self.start_draining()
        self._post(stop=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    async def _wait_for_in_flight_change(self, timeout: float) -> None:
        self._in_flight_changed.clear()
        try:
            await asyncio.wait_for(self._in_flight_changed.wait(), timeout=max(timeout, 0.0))
        except TimeoutError:
            pass

    def _note_in_flight(self, delta: int) -> None:
        self.num_in_flight += delta
        self._in_flight_changed.set()

    # ------------------------------------------------------------------ requests

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Streams delta RequestOutputs until the request finishes.

        Closing or cancelling the iterator before the end aborts the request, so its
        KV blocks go back to the pool (use `contextlib.aclosing` when not iterating to
        the end). Raises ValueError when the engine refuses the request,
        RequestFailedError / EngineStepError when generation fails.
        """
        self._check_accepting()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop=loop, queue=asyncio.Queue(), num_prompt_tokens=prompt_len(prompt))
        arrival = time.monotonic()
        timing = TimingTracker(request_id, arrival, stream.num_prompt_tokens)
        self._note_in_flight(+1)
        stream.trace = trace.register(request_id)
        if stream.trace is not None:
            stream.trace.mark("posted")
        self._post(_Add(request_id, prompt, params, priority, arrival, stream))
        finish_reason = "abort"
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finish_reason = "error"
                    raise item
                timing.observe(item)
                if stream.trace is not None:
                    stream.trace.mark("consumed")
                if item.finished:
                    finish_reason = overall_finish_reason(item)
                yield item
                if item.finished:
                    return
        finally:
            if finish_reason == "abort":
                self._post(_Abort(request_id))
            self._note_in_flight(-1)
            self._report(timing.finish(finish_reason, stream.first_scheduled_time))

    def fail_all_requests(self, message: str) -> None:
        """From any thread: every request in flight is aborted and its stream raises
        EngineDrainingError(message) (a server stopping before they finished)."""
        self._post(_FailAll(message))

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; unknown or finished ids are ignored."""
        self._post(_Abort(request_id))

    async def call_in_loop(self, fn: Callable[[Any], Any]) -> Any:
        """Runs fn(engine) on the loop thread between steps and returns its result."""
        if not self.is_ready or not self.is_running:
            raise EngineNotReadyError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def get_stats(self):
        return await self.call_in_loop(lambda engine: engine.get_stats())

    async def audit_kv_cache(self):
        return await self.call_in_loop(lambda engine: engine.audit_kv_cache())

    def _check_accepting(self) -> None:
        if self._draining:
            raise EngineDrainingError("the server is shutting down and accepts no new requests")
        if not self.is_ready:
            raise EngineNotReadyError(
                "the model is still loading"
                if self.load_error is None
                else f"the model failed to load: {self.load_error}"
            )
        if not self.is_running:
            raise EngineNotReadyError(
                "the engine loop has stopped"
                + (f": {self.dead_reason}" if self.dead_reason is not None else "")
            )

    def _report(self, timings: RequestTimings) -> None:
        if self.timings_listener is None:
            return
        try:
            self.timings_listener(timings)
        except Exception:  # metrics must never break a request
            logger.exception("request timings listener failed")

    # ------------------------------------------------------------------ the loop thread

    def _post(self, command: Any = None, stop: bool = False) -> None:
        with self._cond:
            if self._loop_ended:
                _refuse([command])
                return
            if command is not None:
                self._inbox.append(command)
            if stop:
                self._stop_requested = True
            self._cond.notify()

    def _run(self) -> None:
        try:
            self.engine = self._engine_factory()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter
            # A ValueError is the user's to fix (a bad path, a bad flag) and the waiter
            # reports it in one line; a traceback only helps with anything else.
            logger.log(
                logging.DEBUG if isinstance(exc, ValueError) else logging.ERROR,
                "engine failed to load",
                exc_info=True,
            )
            self.load_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        finally:
            with self._cond:
                self._loop_ended = True
                unhandled, self._inbox = self._inbox, []
            _refuse(unhandled)
            self._fail_all(EngineNotReadyError("the engine loop has stopped"))
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("shutting the engine down failed")

    def _loop(self) -> None:
        engine = self.engine
        # A request held for its grammar's compile is unfinished but gives the loop
        # nothing to do: the loop sleeps, and the compile's end wakes it. (An engine
        # without has_work, such as a test's fake, is stepped while it has requests.)
        has_work = getattr(engine, "has_work", engine.has_unfinished_requests)
        structured = getattr(engine, "structured", None)
        if structured is not None:
            structured.on_ready = self._post
        while True:
            with self._cond:
                while not self._inbox and not self._stop_requested and not has_work():
                    self._cond.wait()
                commands, self._inbox = self._inbox, []
                stop = self._stop_requested
            for command in commands:
                self._handle(command)
            if stop:
                return
            if has_work() and not self._step():
                return

    def _handle(self, command: Any) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._abort(command.request_id)
        elif isinstance(command, _FailAll):
            self._fail_all(EngineDrainingError(command.message), abort=True)
        elif isinstance(command, _Call):
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    command.future.set_exception(exc)

    def _add(self, command: _Add) -> None:
        if command.stream.trace is not None:
            command.stream.trace.mark("picked_up")
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                arrival_time=command.arrival_time,
                priority=command.priority,
                output_kind="delta",
            )
        except Exception as exc:  # the request is refused: it alone fails
            _deliver(command.stream, [exc])
            return
        self._streams[command.request_id] = command.stream
        self._unscheduled[command.request_id] = command.stream
        if command.stream.trace is not None:
            command.stream.trace.mark("added")

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._unscheduled.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting request %s failed", request_id)

    def _step(self) -> bool:
        """One engine step, its outputs delivered; False when the engine is dead (its
        executor's workers can no longer run steps) and the loop must stop."""
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing every request in flight")
            # Health first: once a client sees its request fail, /health already says why.
            healthy = self._healthy()
            self._fail_all(EngineStepError(f"the engine step failed: {_one_line(exc)}"), abort=True)
            return healthy
        self._note_scheduled(outputs)
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while this step ran
            item: Any = output
            error = _request_error(output)
            if error is not None:
                item = RequestFailedError(error)
            if output.finished or error is not None:
                self._streams.pop(output.request_id, None)
                self._unscheduled.pop(output.request_id, None)
                if error is not None and not output.finished:
                    self._abort(output.request_id)
            by_loop[stream.loop].append((stream, item))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver_many, items)
        return True

    def _healthy(self) -> bool:
        try:
            self.engine.check_health()
        except Exception as exc:
            logger.exception("the engine is dead; stopping its loop")
            self.dead_reason = _one_line(exc)
            return False
        return True

    def _note_scheduled(self, outputs: list[RequestOutput]) -> None:
        """Records when each new request was first scheduled (for the queue-time metric),
        from `metrics["first_scheduled_time"]` of the first output that carries it."""
        if not self._unscheduled:
            return
        for output in outputs:
            scheduled = output.metrics.get("first_scheduled_time")
            stream = self._unscheduled.get(output.request_id)
            if scheduled is not None and stream is not None:
                stream.first_scheduled_time = scheduled
                del self._unscheduled[output.request_id]

    def _fail_all(self, error: BaseException, abort: bool = False) -> None:
        streams, self._streams = self._streams, {}
        self._unscheduled.clear()
        if abort and self.engine is not None:
            for request_id in streams:
                try:
                    self.engine.abort_request(request_id)
                except Exception:
                    logger.exception("aborting request %s after a failed step failed", request_id)
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream in streams.values():
            by_loop[stream.loop].append((stream, error))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver_many, items)


# ---------------------------------------------------------------------- helpers


def _refuse(commands: list) -> None:
    """Answers commands the loop will never handle: calls fail, adds are refused."""
    error = EngineNotReadyError("the engine loop has stopped")
    for command in commands:
        if isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            command.future.set_exception(error)
        elif isinstance(command, _Add):
            _deliver(command.stream, [error])


def _shorten_switch_interval() -> None:
    """Lowers the GIL switch interval for the serving process (never raises it)."""
    wanted = float(os.environ.get(SWITCH_INTERVAL_ENV, DEFAULT_SWITCH_INTERVAL_S))
    if 0 < wanted < sys.getswitchinterval():
        sys.setswitchinterval(wanted)


def _one_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message (a worker's traceback
    stays in the log)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is listening any more
        pass


def _deliver(stream: _Stream, items: list) -> None:
    _call_soon(stream.loop, _deliver_many, [(stream, item) for item in items])


def _deliver_many(items: list) -> None:
    """Runs on the event loop: puts each item on its request's queue."""
    for stream, item in items:
        if stream.trace is not None:
            stream.trace.mark("delivered")
        stream.queue.put_nowait(item)


def _request_error(output: RequestOutput) -> str | None:
    if output.error is not None:
        return output.error
    if any(c.finish_reason == "error" for c in output.outputs):
        return "the engine failed this request"
    return None
