"""profile_step decode: per batch size, the kernel table of one eager decode step (launches,
device us, share, coarse groups) and the step as served (step wall time with CUDA graphs,
the decode graph's bare replay). On the CPU: CPU operators by self time."""

from __future__ import annotations

import statistics
import time

from benchmarks.harness.timing import engine_step_timing
from benchmarks.harness.traces import group_of
from benchmarks.harness.workloads import decode_ready
from benchmarks.profile_bench.common import device_sync, profiler_activities


def kernel_rows(prof, steps: int, on_cuda: bool) -> list[dict]:
    """The profiler's events -> one row per kernel name, per step (sorted by time)."""
    from collections import defaultdict

    import torch

    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if on_cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = evt.time_range.elapsed_us()
        else:  # CPU: operators by self time (children excluded, so no double count)
            if not evt.name.startswith("aten::"):
                continue
            us = evt.self_cpu_time_total
        total[evt.name] += us
        count[evt.name] += 1
    step_us = sum(total.values()) / steps or 1.0
    rows = [
        {
            "name": name,
            "count": count[name] / steps,
            "us": us / steps,
            "share": us / steps / step_us,
            "group": group_of(name),
        }
        for name, us in total.items()
    ]
    return sorted(rows, key=lambda r: -r["us"])


def group_rows(rows: list[dict]) -> list[dict]:
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(
            r["group"], {"group": r["group"], "count": 0, "us": 0.0, "share": 0.0}
        )
        g["count"] += r["count"]
        g["us"] += r["us"]
        g["share"] += r["share"]
    return sorted(groups.values(), key=lambda g: -g["us"])


def profile_eager(engine, runner, steps: int, sync, on_cuda: bool) -> dict:
    import torch

    graphs, runner.graph_runner = runner.graph_runner, None
    walls = []
    try:
        engine.step()  # one eager step outside the profile: lazy eager-only caches
        with torch.profiler.profile(activities=profiler_activities(on_cuda)) as prof:
            for _ in range(steps):
                sync()
                start = time.perf_counter()
                engine.step()
                sync()
                walls.append((time.perf_counter() - start) * 1e3)
    finally:
        runner.graph_runner = graphs
    rows = kernel_rows(prof, steps, on_cuda)
    return {
        "step_ms": walls,
        "kernels": rows,
        "groups": group_rows(rows),
        "kernel_us_per_step": sum(r["us"] for r in rows),
        "launches_per_step": sum(r["count"] for r in rows),
    }


def decode_point(llm, batch: int, context: int, steps: int, sync, on_cuda: bool) -> dict:
    import numpy as np

    from pagoda import SamplingParams

    engine = llm.llm_engine
    runner = engine.executor.runner
    rng = np.random.default_rng(batch)
    vocab = engine.model_info.vocab_size
    params = SamplingParams(max_tokens=3 * steps + 40, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", rng.integers(0, vocab, context).tolist(), params)
    while not decode_ready(engine):
        engine.step()
    for _ in range(4):  # settle: the first decode steps may compile
        engine.step()
    point = {"batch": batch, "context": context}
    point["graph"] = engine_step_timing(engine, runner, batch, steps, sync)
    point["eager"] = profile_eager(engine, runner, steps, sync, on_cuda)
    while engine.has_unfinished_requests():
        engine.step()
    return point


def print_decode_point(point: dict, row_limit: int) -> None:
    eager, graph = point["eager"], point["graph"]
    print(f"\n=== batch {point['batch']}, context {point['context']} ===")
    print(
        f"step with CUDA graphs: median {statistics.median(graph['step_ms']):.3f} ms; "
        f"graph replay: {graph.get('replay_ms', float('nan')):.3f} ms; eager step: "
        f"median {statistics.median(eager['step_ms']):.3f} ms; kernels per eager step: "
        f"{eager['launches_per_step']:.0f}, {eager['kernel_us_per_step']:.1f} us"
    )
    print(f"{'group':<24}{'count':>8}{'us':>11}{'share':>8}")
    for g in eager["groups"]:
        print(f"{g['group']:<24}{g['count']:>8.0f}{g['us']:>11.1f}{g['share']:>8.1%}")
    print(f"\n{'kernel (one eager step)':<80}{'count':>7}{'us':>10}{'share':>8}")
    for r in eager["kernels"][:row_limit]:
        print(f"{r['name'][:79]:<80}{r['count']:>7.0f}{r['us']:>10.1f}{r['share']:>8.1%}")


def run_decode(args) -> dict:
    from pagoda import LLM

    batches = [int(b) for b in args.batches.split(",")]
    on_cuda = args.device == "cuda"
    llm = LLM(
        args.preset,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=max(batches),
        kv_cache_memory=args.kv_cache_memory,
        skip_tokenizer_init=True,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
    )
    points = []
    for batch in batches:
        context = args.batch1_context if batch == 1 else args.context
        points.append(
            decode_point(llm, batch, context, args.steps, device_sync(args.device), on_cuda)
        )
        print_decode_point(points[-1], args.rows)
    llm.llm_engine.shutdown()
    return {"points": points}
