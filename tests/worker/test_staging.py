"""StagingRing (pagoda/worker/staging.py): the step inputs' uploads through reused pinned
buffers. CPU: a pass-through; CUDA: the same buffers every NUM_SETS steps, grown when
too small, exact data, and no host sync under torch's sync debug mode."""

from __future__ import annotations

import pytest
import torch

from pagoda.attention.metadata import build_attention_metadata
from pagoda.worker.staging import NUM_SETS, StagingRing


def test_cpu_uploads_are_the_host_tensors():
    ring = StagingRing("cpu")
    host = torch.arange(5)
    with ring.step() as upload:
        assert upload(host) is host
    md = build_attention_metadata([2, 1], [3, 4], [[0], [1]], 4, "cpu", upload=lambda t: t)
    assert md.slot_mapping.tolist() == [1, 2, 7] and md.query_start_loc.tolist() == [0, 2, 3]


@pytest.mark.gpu
def test_cuda_ring_reuses_buffers_exactly():
    ring = StagingRing("cuda")
    pointers = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2 * NUM_SETS + 1):
            size = 10 if step < 2 * NUM_SETS else 100_000  # the last step grows a buffer
            ids = torch.arange(size, dtype=torch.long) + step
            lens = torch.tensor([step, step + 1], dtype=torch.int32)
            with ring.step() as upload:
                got = (upload(ids), upload(lens))
            staging = ring._sets[step % NUM_SETS]
            pointers.append([b.data_ptr() for b in staging.buffers])
            torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(got[0].cpu(), ids) and torch.equal(got[1].cpu(), lens)
            torch.cuda.set_sync_debug_mode("error")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pointers[0] == pointers[NUM_SETS] and pointers[0] != pointers[1]
    assert pointers[-1][0] != pointers[0][0] and pointers[-1][1] == pointers[0][1]


@pytest.mark.gpu
def test_cuda_ring_misuse_is_refused():
    ring = StagingRing("cuda")
    with ring.step() as upload:
        with pytest.raises(RuntimeError, match="not reentrant"):
            with ring.step():
                pass
    with pytest.raises(RuntimeError, match="outside"):
        upload(torch.zeros(2))
    with pytest.raises(ValueError, match="at least 2 sets"):
        StagingRing("cuda", num_sets=1)
