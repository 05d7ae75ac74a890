"""All-reduce time over tp GPUs of one process each, by message size: NCCL and
Pagoda's one-shot path (pagoda/distributed/fast_all_reduce.py), eager and inside a CUDA
graph (median per call). Prints one JSON line from rank 0; tp_compare.py calls it.

    python3 benchmarks/tp_allreduce.py --tp 2 --hidden 4096

Message sizes: 1, 4, 16, 64, 128 and 512 tokens' bf16 hidden states. NVLink multicast
stays off (pagoda.distributed.parallel_state.keep_multicast_off, inherited by the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKENS = (1, 4, 16, 64, 128, 512)
CALLS_PER_GRAPH = 20


def _median_us(fn, repeats: int, calls: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def _time_path(reduce, x: torch.Tensor) -> dict:
    """Eager and graph-replay time of reduce(x) (a function returning the sum)."""
    for _ in range(10):
        reduce(x)
    torch.cuda.synchronize()
    eager = _median_us(lambda: reduce(x), 100, 1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch asks
        for _ in range(3):
            reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            reduce(x)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    return {"eager_us": round(eager, 2),
            "graph_us": round(_median_us(graph.replay, 30, CALLS_PER_GRAPH), 2)}


def _rank(rank: int, tp: int, hidden: int, port: int) -> None:
    import torch.distributed as dist

    from pagoda.distributed import parallel_state as ps

    torch.cuda.set_device(rank)
    ps.init_distributed(rank, tp, f"tcp://127.0.0.1:{port}", "nccl")
    fast = ps._fast_all_reduce

    def nccl(x):
        dist.all_reduce(x)
        return x

    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        row = {"tokens": tokens, "bytes": x.numel() * 2}
        if fast is not None:
            saved, fast.max_bytes = fast.max_bytes, fast.buffer.numel() * 2
            if fast.can_reduce(x):
                expected = x.clone()
                dist.all_reduce(expected)
                row["one_shot_max_abs_err"] = (fast.all_reduce(x) - expected).abs().max().item()
                row["one_shot"] = _time_path(fast.all_reduce, x)
            fast.max_bytes = saved
        row["nccl"] = _time_path(nccl, x)  # last: it sums x in place, over and over
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), file=sys.stderr, flush=True)
    if rank == 0:
        print(json.dumps({"tp": tp, "hidden": hidden, "one_shot_available": fast is not None,
                          "default_one_shot_max_bytes": fast.max_bytes if fast else 0,
                          "sizes": rows}), flush=True)
    ps.destroy_distributed()


def main(tp: int, hidden: int) -> None:
    import socket

    from pagoda.distributed.parallel_state import keep_multicast_off
    keep_multicast_off()  # inherited by the spawned ranks
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(tp, hidden, port), nprocs=tp, join=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args()
    main(args.tp, args.hidden)
