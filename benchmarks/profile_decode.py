"""Where a decode step's GPU time goes: the per-kernel table of one decode step.

    python benchmarks/profile_decode.py --preset qwen3-30b-a3b
    python benchmarks/profile_decode.py --preset deepseek-v2-lite --batches 1,64
    python benchmarks/profile_decode.py --preset llama-3.1-8b
    python benchmarks/profile_decode.py --smoke        # CPU, tiny-qwen3-moe, CPU op table

For a preset (dummy weights, bf16, one GPU) and each batch size: fill the batch with
requests of `--context` random prompt tokens (`--batch1-context` at batch 1), step until
every request decodes, then

- profile `--steps` decode steps eagerly (CUDA graphs off, so every kernel is seen)
  under torch.profiler and print the kernel table of one step: name, launches per step,
  device us per step, share of the step's kernel time; plus coarse groups (GEMM, MoE,
  attention, norm, rotary, routing, elementwise, ...) so the big buckets stand out;
- time the step as served: the engine's step wall time with CUDA graphs, and the bare
  replay of the captured decode graph for that batch (CUDA events, median), which is
  the device time of the forward without any host work.

Prints the tables; writes everything as JSON (`--out`). A diagnostic program: it
asserts nothing. On the CPU (--smoke) the table lists CPU operators by self time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernel_switches import add_kernel_switches, apply_kernel_switches  # noqa: E402  (benchmarks/)

# Kernel name patterns -> coarse group, first match wins (Triton kernels keep their
# Python names; cuBLAS / CUTLASS GEMMs carry gemm / cutlass / sm90 in theirs).
GROUPS: list[tuple[str, str]] = [
    (r"moe_gemm|fused_moe|align_small|moe_align", "moe experts"),
    (r"route|topk|sort|softmax|sigmoid", "routing / top-k"),
    (r"mla|paged|attention|attn|flash|decode_kernel|store_kv|reshape_and_cache", "attention"),
    (r"rms_norm|layer_norm|norm", "norm"),
    (r"rotary|rope", "rotary"),
    (r"silu|act_and_mul|gelu", "activation"),
    (r"gemm|gemv|cutlass|sm90|sm80|cublas|nvjet|matmul|splitK|dot_kernel", "gemm (dense)"),
    (r"all_reduce|nccl", "communication"),
    (r"copy|memcpy|memset|fill|cat|index|gather|scatter", "copy / index"),
    (r"elementwise|vectorized|reduce|unrolled", "elementwise / reduce"),
]


def group_of(name: str) -> str:
    low = name.lower()
    for pattern, group in GROUPS:
        if re.search(pattern, low):
            return group
    return "other"


def decode_ready(engine) -> bool:
    sched = engine.scheduler
    return not sched.num_waiting and all(
        r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)


def kernel_rows(prof, steps: int, on_cuda: bool) -> list[dict]:
    """The profiler's events -> one row per kernel name, per step (sorted by time)."""
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
    rows = [{"name": name, "count": count[name] / steps, "us": us / steps,
             "share": us / steps / step_us, "group": group_of(name)}
            for name, us in total.items()]
    return sorted(rows, key=lambda r: -r["us"])


def group_rows(rows: list[dict]) -> list[dict]:
    groups: dict[str, dict] = {}
    for r in rows:
        g = groups.setdefault(r["group"], {"group": r["group"], "count": 0, "us": 0.0,
                                           "share": 0.0})
        g["count"] += r["count"]
        g["us"] += r["us"]
        g["share"] += r["share"]
    return sorted(groups.values(), key=lambda g: -g["us"])


def profile_eager(engine, runner, steps: int, sync, on_cuda: bool) -> dict:
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    graphs, runner.graph_runner = runner.graph_runner, None
    walls = []
    try:
        engine.step()  # one eager step outside the profile: lazy eager-only caches
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                sync(); start = time.perf_counter()
                engine.step()
                sync(); walls.append((time.perf_counter() - start) * 1e3)
    finally:
        runner.graph_runner = graphs
    rows = kernel_rows(prof, steps, on_cuda)
    return {"step_ms": walls, "kernels": rows, "groups": group_rows(rows),
            "kernel_us_per_step": sum(r["us"] for r in rows),
            "launches_per_step": sum(r["count"] for r in rows)}


def time_graph(engine, runner, batch: int, steps: int, sync) -> dict:
    """Engine step wall time with CUDA graphs, and the bare replay of the decode graph."""
    import torch
    walls = []
    for _ in range(steps):
        sync(); start = time.perf_counter()
        engine.step()
        sync(); walls.append((time.perf_counter() - start) * 1e3)
    out = {"step_ms": walls}
    graphs = runner.graph_runner
    key = graphs.graph_for(batch, batch) if graphs is not None else None
    if key is not None:
        # The buffers hold the last step's inputs: a replay recomputes that step (it
        # rewrites the same KV slots with the same values).
        graph, times = graphs.graphs[key], []
        for _ in range(3):
            graph.replay()
        for _ in range(max(steps, 20)):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); graph.replay(); e.record(); e.synchronize()
            times.append(s.elapsed_time(e))
        out["graph_key"] = list(key)
        out["replay_ms"] = statistics.median(times)
    return out


def run_point(llm, batch: int, context: int, steps: int, sync, on_cuda: bool) -> dict:
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
    point["graph"] = time_graph(engine, runner, batch, steps, sync)
    point["eager"] = profile_eager(engine, runner, steps, sync, on_cuda)
    while engine.has_unfinished_requests():
        engine.step()
    return point


def print_point(point: dict, row_limit: int) -> None:
    eager, graph = point["eager"], point["graph"]
    print(f"\n=== batch {point['batch']}, context {point['context']} ===")
    print(f"step with CUDA graphs: median {statistics.median(graph['step_ms']):.3f} ms; "
          f"graph replay: {graph.get('replay_ms', float('nan')):.3f} ms; eager step: "
          f"median {statistics.median(eager['step_ms']):.3f} ms; kernels per eager step: "
          f"{eager['launches_per_step']:.0f}, {eager['kernel_us_per_step']:.1f} us")
    print(f"{'group':<24}{'count':>8}{'us':>11}{'share':>8}")
    for g in eager["groups"]:
        print(f"{g['group']:<24}{g['count']:>8.0f}{g['us']:>11.1f}{g['share']:>8.1%}")
    print(f"\n{'kernel (one eager step)':<80}{'count':>7}{'us':>10}{'share':>8}")
    for r in eager["kernels"][:row_limit]:
        print(f"{r['name'][:79]:<80}{r['count']:>7.0f}{r['us']:>10.1f}{r['share']:>8.1%}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch1-context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=40, help="kernel rows printed")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (an FP8 KV cache)")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (FP8 weights)")
    p.add_argument("--out", default="benchmarks/results/profile_decode.json")
    add_kernel_switches(p)
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny-qwen3-moe, float32, a few steps (checks the script runs)")
    args = p.parse_args()
    if args.smoke:
        args.preset, args.dtype, args.device = "tiny-qwen3-moe", "float32", "cpu"
        args.batches, args.context, args.batch1_context = "1,2", 8, 8
        args.steps, args.max_model_len, args.kv_cache_memory = 2, 128, 1 << 24
        args.out = os.path.join(os.path.dirname(args.out), "profile_decode_smoke.json")
    return args


def main() -> None:
    args = parse_args()
    apply_kernel_switches(args)
    import torch
    from pagoda import LLM
    batches = [int(b) for b in args.batches.split(",")]
    on_cuda = args.device == "cuda"
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=max(batches),
              kv_cache_memory=args.kv_cache_memory, skip_tokenizer_init=True,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    points = []
    for batch in batches:
        context = args.batch1_context if batch == 1 else args.context
        points.append(run_point(llm, batch, context, args.steps, sync, on_cuda))
        print_point(points[-1], args.rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    machine = {"torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if on_cuda else "cpu"}
    with open(args.out, "w") as f:
        json.dump({"benchmark": "profile_decode", "args": vars(args), "machine": machine,
                   "points": points}, f, indent=1)
    print(f"wrote {args.out}")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
