"""StagingRing: reused pinned host buffers for the uploads of each step's inputs.

A host-to-device copy that does not make the host wait must read pinned memory
(pagoda/kernels/launch/host_copy.py). Pinning a fresh tensor per upload costs a pinned allocation
per call; the ring keeps a few sets of pinned buffers instead and each step's
uploads (token ids and positions, the attention metadata's slot mapping,
query_start_loc and seq_lens) are staged in one set, in call order.

Safety: a set's buffers are written by the host while copies queued from them may
still be running (under async scheduling step N+1's inputs are built while step N
runs). So each set records an event after its step's copies and is written again
only once that event has completed. The ring holds NUM_SETS >= 2 sets: by the time
a set comes round again, the host has waited for a later step's results (queued
after these copies on the same stream), so the event has always completed and the
wait costs nothing; it is there so that reuse can never be wrong.

On CPU nothing is staged: uploads return the host tensors themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from pagoda.kernels.launch.host_copy import tensor_to_device

NUM_SETS = 2
_MIN_BYTES = 4096


class _StagingSet:
    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # pinned uint8, one per upload of a step
        self.event: torch.cuda.Event | None = None  # after the last step's copies
        self.used = 0

    def wait_until_free(self) -> None:
        # query() first: it never blocks (and never counts as a sync); the event has
        # completed by now (see the module docstring).
        if self.event is not None and not self.event.query():
            self.event.synchronize()


class StagingRing:
    def __init__(self, device, num_sets: int = NUM_SETS) -> None:
        if num_sets < 2:
            raise ValueError(f"a staging ring needs at least 2 sets, got {num_sets}")
        self.device = torch.device(device)
        self._sets = [_StagingSet() for _ in range(num_sets)] if self.device.type == "cuda" else []
        self._next = 0
        self._current: _StagingSet | None = None

    @contextmanager
    def step(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """Yields this step's upload function (host tensor -> device tensor); every
        upload must happen inside the block (the event is recorded at its end)."""
        if not self._sets:
            yield lambda tensor: tensor_to_device(tensor, self.device)
            return
        if self._current is not None:
            raise RuntimeError("StagingRing.step() is not reentrant")
        staging = self._current = self._sets[self._next]
        self._next = (self._next + 1) % len(self._sets)
        staging.wait_until_free()
        staging.used = 0
        try:
            yield self._upload
        finally:
            if staging.event is None:
                staging.event = torch.cuda.Event()
            staging.event.record()
            self._current = None

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        staging = self._current
        if staging is None:
            raise RuntimeError("upload outside StagingRing.step()")
        nbytes = tensor.numel() * tensor.element_size()
        if staging.used == len(staging.buffers):
            staging.buffers.append(_pinned_bytes(nbytes))
        elif staging.buffers[staging.used].numel() < nbytes:
            # The old buffer's copies are done (wait_until_free): it may go.
            staging.buffers[staging.used] = _pinned_bytes(nbytes)
        buffer = staging.buffers[staging.used]
        staging.used += 1
        staged = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        return staged.to(self.device, non_blocking=True)


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    """A pinned byte buffer of at least nbytes, rounded up to a power of two so a
    buffer grows only a few times over a run."""
    size = max(_MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)
