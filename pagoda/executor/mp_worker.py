"""The worker-process side of the multi-process executor: one process per rank.

Owns what runs inside a spawned worker process around the shared start-up
(`worker_setup`: multicast off, device, group, worker object): the loop that serves
the engine's requests (`mp_protocol`), the thread that sends the replies, and the
watch on the engine process.

Threads in a worker process and why:
- main: receives a request, calls the worker's method, queues the result. It never
  waits for the device, so it can receive and launch step N+1 while step N runs.
- sender: takes queued results in order, waits for a future's `.result()` where the
  request says so (the device's step N), and sends the reply. Replies therefore leave
  in request order.
- watcher: blocks on the lifeline pipe, whose write end only the engine process holds;
  EOF means the engine process is gone, and the worker exits at once (its main thread
  may be stuck in a collective that will never complete).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pagoda.executor.mp_protocol import FAILED, OK, PROTOCOL_VERSION, SHUTDOWN, STARTUP_SEQ, Reply
from pagoda.executor.worker_setup import WorkerSpec, build_worker, leave_group, reply_payload


def worker_main(
    spec: WorkerSpec, requests: Connection, replies: Connection, lifeline: Connection
) -> None:
    """The process's target: start, report readiness, serve until told to stop."""
    # Ctrl-C reaches the whole process group: the engine process handles it and stops
    # the workers itself, so a worker must not die of it mid-step first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_engine_process(lifeline)
    sender = _ReplySender(spec.rank, replies)
    try:
        worker = build_worker(spec)
    except BaseException:  # noqa: BLE001 - reported to the engine, then exit
        sender.send_now((PROTOCOL_VERSION, STARTUP_SEQ, FAILED, (None, traceback.format_exc())))
        sys.exit(1)
    sender.send_now((PROTOCOL_VERSION, STARTUP_SEQ, OK, None))
    sender.start()
    failed = _serve(worker, requests, sender)
    leave_group()
    # A worker that failed exits non-zero; its sender thread is a daemon and is left
    # behind if it is still waiting for a device result nobody needs any more.
    sys.exit(1 if failed else 0)


def _serve(worker: Any, requests: Connection, sender: _ReplySender) -> bool:
    """Serves requests until SHUTDOWN, the engine's pipe closes, or a failure;
    returns True after a failure."""
    while True:
        try:
            message = pickle.loads(requests.recv_bytes())
        except EOFError:
            return sender.failed  # the engine process closed its end: nobody to serve
        version, seq, method = message[0], message[1], message[2]
        if sender.failed:
            return True  # a failed future was reported; this worker's state is unknown
        if version != PROTOCOL_VERSION:
            sender.send_failure(
                seq,
                method,
                f"protocol version {version!r} received, this worker speaks {PROTOCOL_VERSION}",
            )
            return True
        if method == SHUTDOWN:
            return False
        _, _, _, args, kwargs, reply = message
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - reported to the engine
            sender.send_failure(seq, method, traceback.format_exc())
            return True
        if reply != Reply.ERRORS_ONLY:
            sender.put(seq, method, reply, result)


class _ReplySender:
    """Sends replies in request order from its own thread; failures go out at once."""

    def __init__(self, rank: int, replies: Connection) -> None:
        self.rank = rank
        self._conn = replies
        self._send_lock = threading.Lock()  # the sender thread and failures share the pipe
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self.failed = False
        self._thread = threading.Thread(
            target=self._run, name=f"pagoda-tp{rank}-replies", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def put(self, seq: int, method: str, reply: str, result: Any) -> None:
        self._queue.put((seq, method, reply, result))

    def send_now(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)

    def send_failure(self, seq: int, method: str | None, text: str) -> None:
        """Reports a failure (terminal: the main loop stops at its next request)."""
        self.failed = True
        try:
            self.send_now((PROTOCOL_VERSION, seq, FAILED, (method, text)))
        except OSError:
            pass  # the engine process is gone: nobody to tell

    def _run(self) -> None:
        while True:
            seq, method, reply, result = self._queue.get()
            try:
                # A future's .result() waits for this step's device results.
                payload = reply_payload(self.rank, reply, result)
                self.send_now((PROTOCOL_VERSION, seq, OK, payload))
            except OSError:
                return  # the engine process is gone; the main loop sees EOF
            except BaseException:  # noqa: BLE001 - the step failed (or did not pickle)
                self.send_failure(seq, method, traceback.format_exc())
                return


def _watch_engine_process(lifeline: Connection) -> None:
    def watch() -> None:
        try:
            lifeline.recv_bytes()  # nothing is ever sent: this returns only at EOF
        except (EOFError, OSError):
            pass
        os._exit(1)  # the engine is gone; do not wait for threads stuck in collectives

    threading.Thread(target=watch, name="pagoda-engine-watch", daemon=True).start()
