"""The Ray actor of the "ray" executor: one per tensor-parallel rank.

Owns what runs inside a rank's actor around the shared start-up (`worker_setup`):
the order of the engine's calls, keeping each step's output future until the engine
asks for it, and the call that only returns when the actor dies (the executor's way
to notice a death while it waits for another rank).

`RayWorker` is a plain class; the executor makes it an actor with
`ray.remote(concurrency_groups={WATCH_GROUP: 1})`, so this module imports no Ray at
import time. Its calls and why they are safe:
- Every call but `watch` runs in the actor's default group: one thread, one call at a
  time. Each carries its number in this actor's sequence (`seq`, from 0 up); Ray
  delivers a caller's calls in order, and a call that arrives out of order fails the
  worker instead of running in the wrong order.
- `call(sample_tokens)` launches the step's sampling and keeps its future; the
  engine's later `result(seq)` waits for it. Between the two, the engine sends the next
  step's `execute_model` and `sample_tokens` (async scheduling), which run first: the
  actor never waits for the device before it launched what the engine sent.
- `watch` runs in its own group (its own thread) and never returns: when the actor's
  process dies, Ray fails it at once, whatever the default group is doing.
- Any failure is terminal: the actor answers every later call with an error.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import traceback
from typing import Any

from pagoda.distributed.parallel_state import MULTICAST_OFF_ENV
from pagoda.executor.mp_protocol import Reply
from pagoda.executor.worker_setup import WorkerSpec, build_worker, reply_payload

WATCH_GROUP = "watch"


class RayWorker:
    def __init__(self) -> None:
        # What the process's environment held before anything ran (set by the actor's
        # runtime_env): the test that NVLink multicast is off from the first instruction.
        self._env_at_start = {name: os.environ.get(name) for name in MULTICAST_OFF_ENV}
        self._worker: Any = None
        self._rank = -1
        self._next_seq = 0
        self._futures: dict[int, Any] = {}  # seq of a sample_tokens call -> its future
        self._failure: str | None = None

    # ---- the default group: in order, one at a time ------------------------------------
    def rendezvous_address(self, seq: int) -> tuple[str, int]:
        """This node's IP and a TCP port free on it: the group's rendezvous (rank 0)."""
        self._in_order(seq)
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def node_and_gpus(self, seq: int) -> tuple[str, list[str]]:
        """The Ray node this actor runs on and the ids of the GPUs Ray gave it."""
        self._in_order(seq)
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), [str(i) for i in context.get_accelerator_ids().get("GPU", [])]

    def start(self, seq: int, spec: WorkerSpec) -> int:
        """Joins the group and builds this rank's worker; returns the process id."""
        self._in_order(seq)
        self._rank = spec.rank
        self._worker = self._run(lambda: build_worker(spec), "start")
        return os.getpid()

    def call(self, seq: int, request: bytes, reply: str) -> Any:
        """Runs the pickled (method, args, kwargs) on the worker. Reply.ALL: returns its
        result; ERRORS_ONLY: None; RANK0_FUTURE: keeps the future for `result(seq)`."""
        self._in_order(seq)
        method, args, kwargs = pickle.loads(request)
        result = self._run(lambda: getattr(self._worker, method)(*args, **kwargs), method)
        if reply == Reply.RANK0_FUTURE:
            self._futures[seq] = result
            return None
        return None if reply == Reply.ERRORS_ONLY else result

    def result(self, seq: int, of_seq: int) -> Any:
        """Waits for the output of the sample_tokens call numbered of_seq: rank 0's
        ModelRunnerOutput, None on the other ranks."""
        self._in_order(seq)
        future = self._futures.pop(of_seq)
        return self._run(
            lambda: reply_payload(self._rank, Reply.RANK0_FUTURE, future), "sample_tokens"
        )

    def multicast_env_at_start(self) -> dict[str, str | None]:
        """The NVLink multicast variables as the process started (any time, no seq)."""
        return dict(self._env_at_start)

    # ---- the watch group ---------------------------------------------------------------
    def watch(self) -> None:
        """Never returns: Ray fails this call when the actor's process dies."""
        threading.Event().wait()

    # ---- helpers -----------------------------------------------------------------------
    def _in_order(self, seq: int) -> None:
        if self._failure is not None:
            raise RuntimeError(
                f"this worker failed earlier and serves no more calls: {self._failure}"
            )
        if seq != self._next_seq:
            self._failure = f"call {seq} arrived when call {self._next_seq} was due"
            raise RuntimeError(f"calls out of order: {self._failure}")
        self._next_seq += 1

    def _run(self, fn, what: str) -> Any:
        """fn(); a failure is terminal (recorded, then raised to the engine, which
        receives it with its traceback)."""
        try:
            return fn()
        except BaseException:  # noqa: BLE001 - reported to the engine
            self._failure = f"{what!r} failed:\n{traceback.format_exc()}"
            raise
