"""InputStream: a CUDA-graph step's input uploads on a side stream, overlapping the
previous step's LM head and sampling.

At batch 1 the device runs, between two decode graphs, the LM head, the argmax and
then some twenty small copies and index kernels that build the next step's inputs
(uploads of ids, positions and attention metadata, the block-table gather, copies into
the graph's static buffers), one after another, each a launch of its own. None of them
but the last token's fill depends on the sampling. So a graph step's inputs are built
inside ``staging()``, on this stream: it starts once the previous step's forward has
been launched and its graph has read its buffers (``release()``, recorded on the main
stream right after that launch), so it runs beside the LM head; the main stream waits
for it only where the next graph replays, after filling in the sampled tokens.

Invariants:
- every write to what a forward reads (the graph's static buffers, the device block
  table, the staging ring's pinned buffers) happens on this stream only after the
  release event of the last forward launched, and the main stream waits for the
  staging before it launches anything that reads them;
- a tensor made inside staging() and read on the main stream afterwards is marked
  with ``record_stream`` (``hand_over``) so the caching allocator does not reuse its
  memory for this stream's next allocations before the main stream is done with it.

Measured: the LM head's end to the next graph 67 -> 28 us at batch 1 (H200;
docs/performance.md, "Measured reasons: Launch").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class InputStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._staged = torch.cuda.Event()
        self._released: torch.cuda.Event | None = None

    @contextmanager
    def staging(self) -> Iterator[None]:
        """Work queued inside runs on the input stream, after the last release(); the
        current (main) stream waits for all of it at the end of the block."""
        main = torch.cuda.current_stream(self.device)
        if self._released is not None:
            self.stream.wait_event(self._released)
        with torch.cuda.stream(self.stream):
            yield
        self._staged.record(self.stream)
        main.wait_event(self._staged)

    def release(self) -> None:
        """On the main stream, right after a forward's launch: the inputs it reads may
        be rewritten once the device gets past this point."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._released = event

    def hand_over(self, tensor: torch.Tensor) -> torch.Tensor:
        """tensor, made on the input stream, marked as used by the main stream too."""
        tensor.record_stream(torch.cuda.current_stream(self.device))
        return tensor


def make_input_stream(device: torch.device, has_graphs: bool) -> InputStream | None:
    """An InputStream where graph steps run (CUDA with CUDA graphs), else None."""
    if not has_graphs or device.type != "cuda":
        return None
    return InputStream(device)
