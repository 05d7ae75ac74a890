"""NCCL all-reduce time of one decode-sized message over tp processes, eager and inside
a CUDA graph (median of 200 after warm-up), for benchmarks/tp_compare.py. Prints one
JSON line from rank 0. NVLink multicast stays off (pagoda.distributed)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, tp: int, hidden: int, port: int) -> None:
    from pagoda.distributed.parallel_state import init_distributed, destroy_distributed
    torch.cuda.set_device(rank)
    init_distributed(rank, tp, f"tcp://127.0.0.1:{port}", "nccl")
    import torch.distributed as dist
    x = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(200):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); dist.all_reduce(x); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dist.all_reduce(x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(10):
                dist.all_reduce(x)
    gtimes = []
    for _ in range(50):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); graph.replay(); e.record(); e.synchronize()
        gtimes.append(s.elapsed_time(e) * 1e3 / 10)
    if rank == 0:
        print(json.dumps({"bytes": hidden * 2, "eager_us": sorted(times)[100],
                          "graph_us": sorted(gtimes)[25]}), flush=True)
    destroy_distributed()


def main(tp: int, hidden: int) -> None:
    import socket
    from pagoda.distributed.parallel_state import keep_multicast_off
    keep_multicast_off()  # inherited by the spawned ranks
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(tp, hidden, port), nprocs=tp, join=True)
