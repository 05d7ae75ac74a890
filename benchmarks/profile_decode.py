"""Where a decode step's GPU time goes: torch.profiler kernel tables for decode steps.

    python benchmarks/profile_decode.py --out profile.json
    python benchmarks/profile_decode.py --preset tiny-llama --device cpu --batches 1,4 --context 32

For each (batch, context) it fills the batch with requests of `context` random prompt
tokens, steps until every request decodes, then profiles `--steps` decode steps twice:
with CUDA graphs (as served) and eager (graphs off, so every kernel is attributed).
Prints the top kernels by device time and writes every table plus per-step wall times
as JSON. A diagnostic program: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def decode_ready(engine) -> bool:
    sched = engine.scheduler
    return not sched.num_waiting and all(
        r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)


def profile_steps(engine, steps: int, sync) -> tuple[str, list[float]]:
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    walls = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            sync(); start = time.perf_counter()
            engine.step()
            sync(); walls.append((time.perf_counter() - start) * 1e3)
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=30), walls


def run_point(llm, batch: int, context: int, steps: int, sync) -> dict:
    import numpy as np
    from pagoda import SamplingParams
    engine = llm.llm_engine
    runner = engine.executor.runner
    rng = np.random.default_rng(batch)
    vocab = engine.model_info.vocab_size
    params = SamplingParams(max_tokens=3 * steps + 16, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", rng.integers(0, vocab, context).tolist(), params)
    while not decode_ready(engine):
        engine.step()
    for _ in range(4):  # settle: the first decode steps may compile
        engine.step()
    point = {"batch": batch, "context": context}
    point["graph_table"], point["graph_step_ms"] = profile_steps(engine, steps, sync)
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        point["eager_table"], point["eager_step_ms"] = profile_steps(engine, steps, sync)
    finally:
        runner.graph_runner = graphs
    while engine.has_unfinished_requests():
        engine.step()
    return point


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch1-context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--out", default="bench_results/profile_decode.json")
    args = p.parse_args()
    import torch
    from pagoda import LLM
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=max(batches),
              kv_cache_memory=args.kv_cache_memory)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    points = []
    for batch in batches:
        context = args.batch1_context if batch == 1 else args.context
        point = run_point(llm, batch, context, args.steps, sync)
        points.append(point)
        for mode in ("graph", "eager"):
            walls = point[f"{mode}_step_ms"]
            print(f"\n=== batch {batch}, context {context}, {mode}: step median "
                  f"{statistics.median(walls):.2f} ms over {len(walls)} profiled steps ===")
            print(point[f"{mode}_table"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "profile_decode", "args": vars(args), "points": points}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
