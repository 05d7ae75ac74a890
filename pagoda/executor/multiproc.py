"""MultiprocExecutor: one worker process per tensor-parallel rank (vLLM's "mp" backend).

Owns the engine-process side of the worker processes: spawning them, the request /
reply traffic with them (`mp_protocol`), noticing that one failed or died, and
stopping them. `mp_worker.py` is the other side.

How a step flows: `execute_model` sends the SchedulerOutput to every rank and returns
(no reply unless it fails); `sample_tokens` sends StepExtras to every rank and returns
a future; its `.result()` waits for rank 0's ModelRunnerOutput (the other ranks send
acks). Each rank replies in request order; replies are matched to calls by seq.

Invariants:
- Replies are read only by the thread that waits for one (no reader thread): it waits
  on every rank's reply pipe and every process's sentinel together
  (`multiprocessing.connection.wait`), so a death wakes it as a reply would. One
  thread at a time receives (`_recv_lock`); the engine drives the executor from one
  thread anyway.
- Any failure is terminal: a worker's exception (reported with its traceback), a
  worker process that exits, a pipe that breaks, a reply that does not come within
  the limit (`timeouts`: a rank stuck in a collective or on its device would otherwise
  hang the engine forever). The executor is then dead: waiting
  calls and every later call raise ExecutorDeadError naming the rank, and so does
  `check_health()`. The ranks of a tensor-parallel group cannot go on without one
  of them.
- No worker process outlives the executor: `shutdown()` (also run by a finalizer when
  the executor is collected, and at interpreter exit) asks them to exit, then
  terminates and kills what remains; and each worker exits by itself when the engine
  process dies (the lifeline pipe closes).
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput, StepExtras
from pagoda.executor.base import Executor, ExecutorDeadError
from pagoda.executor.mp_protocol import FAILED, PROTOCOL_VERSION, SHUTDOWN, STARTUP_SEQ, Reply
from pagoda.executor.mp_worker import worker_main
from pagoda.executor.timeouts import ExecutorTimeouts, remaining
from pagoda.executor.worker_setup import WorkerFactory, WorkerSpec, choose_workers

# How long shutdown() waits for workers to exit by themselves, then after SIGTERM.
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
TERMINATE_GRACE_S = 2.0
# How long to wait for a process whose pipe broke to be reaped, for its exit code.
REAP_TIMEOUT_S = 5.0


class WorkerStartupError(RuntimeError):
    """A worker process could not start (its rank and error are in the message)."""


@dataclass
class _Rank:
    """The engine's handles on one worker process."""

    rank: int
    process: multiprocessing.process.BaseProcess
    requests: Connection  # engine -> worker (write end)
    replies: Connection  # worker -> engine (read end)
    open: bool = True  # False once the replies pipe reached EOF


@dataclass
class _Call:
    """A request whose replies are awaited: by rank, and the ranks that still owe one."""

    method: str
    results: list
    owed: set[int] = field(default_factory=set)
    deadline: float = math.inf  # time.monotonic() by which every reply is due
    limit: str = ""  # the limit that set the deadline, for the error message


class _WorkerProcesses:
    """The spawned processes and their pipes; `stop()` ends them (idempotent). Kept
    apart from the executor so that the executor's finalizer can hold it."""

    def __init__(self, shutdown_timeout_s: float) -> None:
        self.ranks: list[_Rank] = []
        self.lifeline: Connection | None = None  # write end; never written
        self.shutdown_timeout_s = shutdown_timeout_s

    def stop(self) -> None:
        for r in self.ranks:
            _send_shutdown(r.requests)
        deadline = time.monotonic() + self.shutdown_timeout_s
        for r in self.ranks:
            r.process.join(max(0.0, deadline - time.monotonic()))
        for r in self.ranks:
            if r.process.is_alive():
                r.process.terminate()
                r.process.join(TERMINATE_GRACE_S)
            if r.process.is_alive():
                r.process.kill()
                r.process.join()
        if self.lifeline is not None:
            self.lifeline.close()
            self.lifeline = None
        for r in self.ranks:  # the processes stay listed, for their exit codes
            r.requests.close()
            r.replies.close()


def _send_shutdown(conn: Connection) -> None:
    """Asks a worker to exit, without ever blocking (its pipe may be full or broken)."""
    try:
        os.set_blocking(conn.fileno(), False)
        conn.send_bytes(pickle.dumps((PROTOCOL_VERSION, -1, SHUTDOWN, (), {}, Reply.ERRORS_ONLY)))
    except (OSError, ValueError):
        pass  # gone, closed or full: terminate() takes over


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "its pipe closed while the process is still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _ranks_text(ranks) -> str:
    """'rank 1' or 'ranks 0, 1'."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class _StepFuture:
    """One step's output: rank 0's reply to sample_tokens (a RunnerOutputFuture)."""

    def __init__(self, executor: MultiprocExecutor, call: _Call) -> None:
        self._executor = executor
        self._call = call

    def result(self) -> ModelRunnerOutput:
        output = self._executor._wait_for(self._call, ranks=(0,))[0]
        self._executor._warm = True  # a step completed: later replies get the step limit
        return output


class MultiprocExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        worker_factory: WorkerFactory | None = None,
        world_size: int | None = None,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        """worker_factory(config, model_path, rank) builds each rank's worker in its
        process (default: ModelRunner); it must pickle (a module-level callable).
        world_size: the number of processes (default: tensor_parallel_size; tests
        set it to run fake workers)."""
        super().__init__(config, model_path)
        worker_factory, self.world_size = choose_workers(
            config, model_path, worker_factory, world_size
        )
        self.timeouts = ExecutorTimeouts.from_env()
        self._warm = False  # True once a step's output arrived (timeouts.limit)
        self._dead_reasons: list[str] = []
        self._failed_ranks: set[int] = set()  # ranks whose failure is recorded
        self._shut_down = False
        self._seq = itertools.count()
        self._calls: dict[int, _Call] = {}
        self._recv_lock = threading.Lock()
        self._procs = _WorkerProcesses(shutdown_timeout_s)
        self._finalizer = weakref.finalize(self, self._procs.stop)
        try:
            self._spawn(worker_factory)
            self._await_ready()
        except BaseException:
            self.shutdown()
            raise

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The worker processes by rank (for tests and diagnostics)."""
        return [r.process for r in self._procs.ranks]

    # ---- start-up ---------------------------------------------------------------------
    def _spawn(self, worker_factory: WorkerFactory) -> None:
        # Every process keeps NVLink multicast off from its first instruction: set in
        # this process's environment, which the spawned workers inherit.
        from pagoda.distributed.parallel_state import keep_multicast_off

        keep_multicast_off()
        ctx = multiprocessing.get_context("spawn")
        backend = "nccl" if self.config.device.device == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        lifeline_read, self._procs.lifeline = ctx.Pipe(duplex=False)
        try:
            self._spawn_ranks(ctx, worker_factory, init_method, backend, lifeline_read)
        finally:
            lifeline_read.close()  # only the workers hold the read end: EOF = engine gone

    def _spawn_ranks(
        self,
        ctx,
        worker_factory: WorkerFactory,
        init_method: str,
        backend: str,
        lifeline_read: Connection,
    ) -> None:
        for rank in range(self.world_size):
            spec = WorkerSpec(
                rank,
                self.world_size,
                self.config,
                self.model_path,
                init_method,
                backend,
                worker_factory,
            )
            req_read, req_write = ctx.Pipe(duplex=False)
            rep_read, rep_write = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=worker_main,
                name=f"pagoda-tp-worker-{rank}",
                args=(spec, req_read, rep_write, lifeline_read),
            )
            try:
                process.start()
            except BaseException:
                req_write.close()
                rep_read.close()
                raise
            finally:
                # The child holds its own copies now: closing ours makes EOF mean
                # "that process is gone" on either side.
                req_read.close()
                rep_write.close()
            self._procs.ranks.append(_Rank(rank, process, req_write, rep_read))

    def _await_ready(self) -> None:
        """Waits until every rank reported ready; raises WorkerStartupError for the
        first (lowest) rank that failed or died instead."""
        waiting = {r.rank: r for r in self._procs.ranks}
        deadline = time.monotonic() + self.timeouts.startup_s
        while waiting:
            by_object = {r.replies: r for r in waiting.values()}
            by_object.update({r.process.sentinel: r for r in waiting.values()})
            failures: dict[int, str] = {}
            ready = wait(list(by_object), remaining(deadline, time.monotonic()))
            if not ready:
                raise WorkerStartupError(
                    f"tensor-parallel worker {_ranks_text(waiting)} (of {self.world_size}) "
                    f"not ready within {self.timeouts.describe(False)}: still loading, or "
                    f"stuck joining the group?"
                )
            for obj in ready:
                r = by_object[obj]
                if r.rank in failures or r.rank not in waiting:
                    continue
                try:
                    _, seq, status, payload = pickle.loads(r.replies.recv_bytes())
                except EOFError:
                    r.process.join(REAP_TIMEOUT_S)
                    failures[r.rank] = (
                        f"the process {_describe_exit(r.process)} before it was ready"
                    )
                    continue
                if seq != STARTUP_SEQ:
                    failures[r.rank] = f"sent {seq=} before its start-up report"
                elif status == FAILED:
                    failures[r.rank] = payload[1]
                else:
                    del waiting[r.rank]
            if failures:
                rank = min(failures)
                raise WorkerStartupError(
                    f"tensor-parallel worker rank {rank} (of {self.world_size}) failed to "
                    f"start:\n{failures[rank]}"
                )

    # ---- sending ----------------------------------------------------------------------
    def _send(self, method: str, args: Sequence[Any], kwargs: dict | None, reply: str) -> _Call:
        """Sends one request to every rank; returns the call its replies fill in
        (registered before sending, so that every reply finds it)."""
        self._raise_if_dead()
        seq = next(self._seq)
        data = pickle.dumps(
            (PROTOCOL_VERSION, seq, method, tuple(args), kwargs or {}, reply),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        owed = set() if reply == Reply.ERRORS_ONLY else {r.rank for r in self._procs.ranks}
        call = _Call(
            method,
            [None] * self.world_size,
            owed,
            time.monotonic() + self.timeouts.limit(self._warm),
            self.timeouts.describe(self._warm),
        )
        if owed:
            self._calls[seq] = call
        for r in self._procs.ranks:
            try:
                r.requests.send_bytes(data)
            except OSError as exc:  # the process is gone (or closed its end)
                with self._recv_lock:
                    self._drain(r)
                    self._note_exit(r, f"could not send {method!r} ({exc!r})")
                self._raise_if_dead()
        return call

    # ---- receiving --------------------------------------------------------------------
    def _wait_for(self, call: _Call, ranks: Sequence[int]) -> list[Any]:
        """Waits until `ranks` replied to `call`; returns its results by rank. Raises
        ExecutorDeadError if the executor dies first, or the call's deadline passes."""
        while any(rank in call.owed for rank in ranks):
            self._raise_if_dead()
            with self._recv_lock:
                if any(rank in call.owed for rank in ranks):
                    self._receive(timeout=remaining(call.deadline, time.monotonic()))
                    if call.owed and time.monotonic() >= call.deadline:
                        self._note_overdue(call)
        return call.results

    def _note_overdue(self, call: _Call) -> None:
        """The call's deadline passed with replies still owed: the executor is dead
        (the ranks may be stuck in a collective or on their device; shutdown kills them)."""
        self._set_dead(
            f"tensor-parallel worker {_ranks_text(call.owed)} (of "
            f"{self.world_size}) sent no reply to {call.method!r} within "
            f"{call.limit}: stuck in a collective or on its device?"
        )

    def _receive(self, timeout: float | None) -> None:
        """Reads every reply that is ready (waiting up to `timeout` for one) and notes
        dead processes. Holds _recv_lock."""
        if self._shut_down:
            return  # the pipes are closed
        pipes = {r.replies: r for r in self._procs.ranks if r.open}
        sentinels = {r.process.sentinel: r for r in self._procs.ranks}
        ready = wait([*pipes, *sentinels], timeout)
        # Replies first: a worker that failed sent its reason before it exited.
        for obj in ready:
            if obj in pipes:
                self._drain(pipes[obj])
        for obj in ready:
            if obj in sentinels:
                self._drain(sentinels[obj])
                self._note_exit(sentinels[obj], "")

    def _drain(self, r: _Rank) -> None:
        """Takes every reply already in rank r's pipe."""
        while r.open and r.replies.poll():
            try:
                message = pickle.loads(r.replies.recv_bytes())
            except EOFError:
                r.open = False
                self._note_exit(r, "")
                return
            self._take_reply(r.rank, message)

    def _take_reply(self, rank: int, message: tuple) -> None:
        version, seq, status, payload = message
        call = self._calls.get(seq)
        if status == FAILED:
            method, text = payload
            self._failed_ranks.add(rank)
            self._set_dead(f"tensor-parallel worker rank {rank} failed in {method!r}:\n{text}")
        elif version != PROTOCOL_VERSION or call is None or rank not in call.owed:
            self._set_dead(
                f"tensor-parallel worker rank {rank} sent an unexpected reply "
                f"(version {version}, seq {seq})"
            )
        else:
            call.results[rank] = payload
            call.owed.discard(rank)
            if not call.owed:
                del self._calls[seq]

    def _note_exit(self, r: _Rank, detail: str) -> None:
        """Rank r's process ended or its pipe broke: the executor is dead."""
        if r.rank in self._failed_ranks or self._shut_down:
            return  # its failure was reported; or it was asked to exit
        self._failed_ranks.add(r.rank)
        r.process.join(REAP_TIMEOUT_S)  # it is exiting: this reads its exit code
        why = _describe_exit(r.process) + (f"; {detail}" if detail else "")
        self._set_dead(f"tensor-parallel worker rank {r.rank} (pid {r.process.pid}) died: {why}")

    def _set_dead(self, reason: str) -> None:
        """Records a failure. Every one noticed before shutdown is kept, in the order
        noticed: when one rank fails, its peers often fail too (a collective lost its
        peer), and which came first cannot always be told apart."""
        self._dead_reasons.append(reason)

    @property
    def _dead_reason(self) -> str | None:
        return "\n".join(self._dead_reasons) if self._dead_reasons else None

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)

    # ---- the Executor interface -------------------------------------------------------
    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> list[Any]:
        call = self._send(method, args, kwargs, Reply.ALL)
        return list(self._wait_for(call, ranks=range(self.world_size)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Sends the step to every rank; a failure surfaces at the next wait."""
        self._send("execute_model", (scheduler_output,), None, Reply.ERRORS_ONLY)

    def sample_tokens(self, step_extras: StepExtras | None = None) -> _StepFuture:
        call = self._send("sample_tokens", (step_extras or StepExtras(),), None, Reply.RANK0_FUTURE)
        return _StepFuture(self, call)

    def check_health(self) -> None:
        """Raises ExecutorDeadError if a worker failed or died (noticed without
        waiting: the pipes and sentinels are checked with a zero timeout)."""
        if self._recv_lock.acquire(blocking=False):  # else a waiter is watching them
            try:
                self._receive(timeout=0)
            finally:
                self._recv_lock.release()
        self._raise_if_dead()

    def shutdown(self) -> None:
        """Stops every worker process (idempotent; the finalizer runs once)."""
        if not self._dead_reasons:
            self._set_dead("the executor was shut down")
        self._shut_down = True
        self._finalizer()
