"""Giving an engine's memory back: the heap freeze engines take at start-up, and what
runs once an engine has shut down.

An engine freezes the objects alive once it has started (`gc.freeze`): its block pool
and modules then stay out of every cyclic collection, which would otherwise walk them
and stall a step. Frozen objects are never collected, so a cycle among what an engine
drops at shutdown would outlive it. `release_after_shutdown` unfreezes, collects, and
freezes again only while other engines still run; then it hands freed device memory
back to the driver (`torch.cuda.empty_cache`) and freed heap back to the OS (glibc's
`malloc_trim`), so a process that closes an engine shrinks by what the engine took.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import threading
import weakref

logger = logging.getLogger(__name__)

# Engines that froze the heap and have not shut down.
_running: weakref.WeakSet = weakref.WeakSet()
# Reentrant: a collection below may finalize another engine, which releases in turn.
_lock = threading.RLock()


def freeze_heap(engine: object) -> None:
    """Collects, then freezes everything alive (the engine's start-up is over)."""
    with _lock:
        gc.collect()
        gc.freeze()
        _running.add(engine)


def running_engines() -> list:
    """Engines started and not shut down (nor collected) in this process."""
    with _lock:
        return list(_running)


def release_after_shutdown(engine: object | None) -> None:
    """Frees what the engine dropped: cyclic garbage (the heap unfrozen), torch's cached
    device blocks and glibc's free heap pages. engine None: one that was collected."""
    with _lock:
        if engine is not None:
            _running.discard(engine)
        gc.unfreeze()
        gc.collect()
        if len(_running):  # the engines still running keep their objects out of collections
            gc.freeze()
    empty_device_cache()
    trim_heap()


def empty_device_cache() -> None:
    """Hands torch's cached device memory back to the driver where CUDA was started
    (never starts it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
        # cuBLAS keeps a workspace per handle and stream (tens of MiB on Hopper) as live
        # allocations; the next matmul, of any engine, makes a new one.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a device in a failed state frees nothing more
        logger.debug("emptying the CUDA cache failed", exc_info=True)


def trim_heap() -> None:
    """Returns glibc's free heap pages to the OS (elsewhere nothing): freed tensors and
    Python objects below the mmap threshold otherwise stay in the process's RSS."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass
