"""The messages between the multi-process executor and its worker processes.

Owns the wire format only; `multiproc.py` (engine side) and `mp_worker.py` (worker
side) both speak it. Each worker has two one-way pipes: requests (engine -> worker)
and replies (worker -> engine). A message is a pickled tuple; the engine pickles each
request once and writes the same bytes to every rank.

    request: (PROTOCOL_VERSION, seq, method, args, kwargs, reply)
    reply:   (PROTOCOL_VERSION, seq, status, payload)

- `seq` numbers requests from 0 up, per executor. A worker replies in the order it
  received requests, so each rank's replies arrive in seq order.
- `reply` says who answers (the Reply constants below). A failure is always
  answered, whatever `reply` says: (VERSION, seq, FAILED, (method, traceback text)).
  A failure is terminal: the worker stops serving after it.
- Start-up: before its first request, each worker sends (VERSION, STARTUP_SEQ, OK,
  None) once its worker object is built, or (VERSION, STARTUP_SEQ, FAILED, (None,
  traceback text)) and exits.
- `method == SHUTDOWN`: the worker leaves its loop and exits; no reply.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1

STARTUP_SEQ = -1
SHUTDOWN = "__shutdown__"

# reply statuses
OK = "ok"
FAILED = "failed"


class Reply:
    """Who answers a request (failures are always answered)."""

    ALL = "all"  # every rank sends the method's return value
    # The method returns a future (RunnerOutputFuture): every rank waits for it off its
    # main loop; rank 0 sends its .result(), the others send None (an ack).
    RANK0_FUTURE = "rank0_future"
    ERRORS_ONLY = "errors_only"  # nobody answers unless the call fails

    CHOICES = (ALL, RANK0_FUTURE, ERRORS_ONLY)
