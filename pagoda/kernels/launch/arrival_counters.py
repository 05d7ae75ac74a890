"""Per-device int32 counters for kernels whose last-arriving program finishes the work
of the others (the split-K GEMV's reduction, the greedy argmax's reduction of its
chunks): each program takes a ticket with
an atomic add, the one that draws the last ticket completes the result and stores 0
back.

Invariant of every buffer handed out here: all entries are 0 whenever no kernel using
them is running. Kernels of one owner that share a buffer must run in stream order (the
engine's forward runs on one stream; with programmatic dependent launch a kernel still
waits for its predecessor to complete before touching memory).

Each owner (a kernel family) has its own buffer per device, so two families never
share an entry. Buffers are allocated or grown only outside CUDA-graph capture: a
graph keeps the address it captured, and the graph runner's eager warm-up forwards
reach every size first.
"""

from __future__ import annotations

import torch

# The fewest counters a buffer starts with (growing later is refused during capture).
MIN_COUNTERS = 4096

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(owner: str, device: torch.device, count: int) -> torch.Tensor:
    """owner's zeroed counters on device, at least count of them."""
    key = (owner, device)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{owner}: its arrival counters must be allocated before "
                "CUDA-graph capture; run the same shapes once eagerly first "
                "(warm-up)"
            )
        buf = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
        _BUFFERS[key] = buf
    return buf
