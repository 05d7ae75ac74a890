"""The one-shot all-reduce path (pagoda/distributed/fast_all_reduce.py): on two GPUs it
sums exactly like NCCL, eagerly and replayed from a CUDA graph, and tp_all_reduce routes
by size; on any machine it stays off where it must."""

from __future__ import annotations

import pytest
import torch
from helpers.tp_helpers import free_port, run_ranks

from pagoda.distributed import fast_all_reduce
from pagoda.distributed.fast_all_reduce import SymmMemAllReduce


def test_a_zero_size_limit_turns_the_path_off(monkeypatch):
    monkeypatch.setenv(fast_all_reduce.MAX_BYTES_ENV, "0")
    assert SymmMemAllReduce.create(None, torch.device("cpu"), torch.bfloat16) is None


def test_float16_models_keep_nccl(monkeypatch):
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert SymmMemAllReduce.create(None, torch.device("cpu"), torch.float16) is None


def test_multicast_must_be_off_before_the_path_is_built(monkeypatch):
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    with pytest.raises(RuntimeError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST=1"):
        SymmMemAllReduce.create(None, torch.device("cpu"), torch.bfloat16)


def test_cpu_tensors_never_take_the_path():
    fast = SymmMemAllReduce(
        torch.zeros(64, dtype=torch.bfloat16),
        "g",
        max_bytes=128,
        reduce_into=lambda staged, x, out: None,
    )
    assert not fast.can_reduce(torch.zeros(8, dtype=torch.bfloat16))


def _two_gpu_rank(rank: int, port: int) -> None:
    import torch.distributed as dist

    from pagoda.distributed import parallel_state as ps

    torch.cuda.set_device(rank)
    ps.init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "nccl", dtype=torch.bfloat16)
    fast = ps._fast_all_reduce
    assert fast is not None, "the one-shot path was not set up on two GPUs"
    for tokens in (1, 3, 64):
        x = torch.randn(
            tokens,
            4096,
            device="cuda",
            generator=torch.Generator("cuda").manual_seed(rank * 100 + tokens),
        ).to(torch.bfloat16)
        expected = x.clone()
        dist.all_reduce(expected)
        assert fast.can_reduce(x)
        assert torch.equal(ps.tp_all_reduce(x.clone()), expected)  # 2 ranks: one add, exact
        static_in, graph = x.clone(), torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ps.tp_all_reduce(static_in)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static_out = ps.tp_all_reduce(static_in)
        for scale in (1.0, -2.0):
            static_in.copy_(x * scale)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, expected * scale)
    big = torch.ones(fast.max_bytes // 2 + 8, device="cuda", dtype=torch.bfloat16)
    assert not fast.can_reduce(big)
    assert torch.equal(ps.tp_all_reduce(big), torch.full_like(big, 2.0))  # NCCL, in place
    ps.destroy_distributed()


@pytest.mark.gpu(2)
def test_one_shot_sums_like_nccl_on_two_gpus_eager_and_in_graphs():
    run_ranks(_two_gpu_rank, 2, (free_port(),), timeout_s=240)
