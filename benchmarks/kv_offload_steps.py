"""Where a revisited turn's TTFT goes with the CPU KV tier: engine steps and milliseconds
from a request's arrival to its load, to its scheduling and to its first token, with KV
offloading off (recompute), with asynchronous loads only, and with inline loads (the
default: a CPU-tier load that fits the step's budget is copied before the step's
forward and its request is admitted in that same step). In-process, one engine per
mode, the same multi-turn workload as benchmarks/kv_offload.py (conversations visited
turn by turn, a working set several times the GPU KV pool, a fixed concurrency; token
ids drawn at random, each turn = the previous prompt + a reply stand-in + new tokens).

Per mode, over the revisited turns (turn >= 2): TTFT P50/P99 (ms, arrival to the step
that hands out the first token), the steps on that path (P50, mean, histogram), and
for each request that loaded from the CPU tier the step of each milestone counted from
its arrival: load planned, ready (asynchronous loads only: the report applied and the
request back in the waiting queue), scheduled, first token. Also output tok/s and the
CPU tier's hits and load GB/s.

    # H200, Llama-3.1-8B shape (dummy bf16 weights), a 2,048-block GPU pool:
    python benchmarks/kv_offload_steps.py --output benchmarks/results/h200-<date>-kv-offload-steps.json
    # CPU smoke, embedded SmolLM2 at a small scale:
    python benchmarks/kv_offload_steps.py --smoke --output /tmp/kv-offload-steps-smoke.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing the package

GPU = dict(engine=dict(model="llama-3.1-8b", load_format="dummy", dtype="bfloat16",
                       max_model_len=8192, num_gpu_blocks_override=2048),
           cpu_gib=32.0, conversations=48, turns=4, first_len=2048, turn_len=256,
           output_len=128, concurrency=8, vocab=128000)
SMOKE = dict(engine=dict(device="cpu", max_model_len=512, num_gpu_blocks_override=48),
             cpu_gib=0.25, conversations=10, turns=3, first_len=256, turn_len=32,
             output_len=16, concurrency=2, vocab=49000)
MODES = ("off", "async", "inline")


def percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def workload(p: dict) -> list[tuple[int, list[int]]]:
    """(turn, prompt token ids) in visiting order: every conversation's turn 1, then
    every conversation's turn 2, ..."""
    rng = random.Random(0)

    def draw(n):
        return [rng.randrange(100, p["vocab"]) for _ in range(n)]

    prompts = [draw(p["first_len"]) for _ in range(p["conversations"])]
    order = [(1, list(prompt)) for prompt in prompts]
    for turn in range(2, p["turns"] + 1):
        for index in range(p["conversations"]):
            prompts[index] = prompts[index] + draw(p["output_len"]) + draw(p["turn_len"])
            order.append((turn, list(prompts[index])))
    return order


class Milestones:
    """Engine step of each milestone of each request (instrumenting the scheduler's
    offload calls; the engine's own code is unchanged)."""

    def __init__(self, engine) -> None:
        self.step = 0
        self.at: dict[str, dict[str, int]] = {}
        self.inline_jobs = self.async_jobs = 0
        offload = engine.kv_offload
        scheduler = engine.scheduler
        if offload is not None:
            start_load, take_ready, take_plan = offload.start_load, offload.take_ready, offload.take_plan

            def traced_start(request, hits):
                started = start_load(request, hits)
                if started:
                    self.mark(request.request_id, "load_planned")
                return started

            def traced_ready():
                ready = take_ready()
                for request in ready:
                    self.mark(request.request_id, "ready")
                return ready

            def traced_plan():
                plan = take_plan()
                for job in plan.loads if plan is not None else ():
                    self.inline_jobs += job.inline
                    self.async_jobs += not job.inline
                return plan

            offload.start_load, offload.take_ready, offload.take_plan = traced_start, traced_ready, traced_plan
        schedule = scheduler.schedule

        def traced_schedule():
            out = schedule()
            for rid in out.num_scheduled_tokens:
                self.mark(rid, "scheduled")
            return out

        scheduler.schedule = traced_schedule

    def mark(self, request_id: str, name: str) -> None:
        self.at.setdefault(request_id, {}).setdefault(name, self.step)


def run_mode(mode: str, p: dict) -> dict:
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams
    offload = {} if mode == "off" else {"kv_offloading_size": p["cpu_gib"]}
    llm = LLM(**p["engine"], **offload)
    engine = llm.llm_engine
    try:
        if mode == "async":
            engine.kv_offload.max_inline_blocks_per_step = 0
        trace = Milestones(engine)
        params = SamplingParams(max_tokens=p["output_len"], temperature=0.0, ignore_eos=True)
        queue = workload(p)
        turn_of, added, first = {}, {}, {}
        in_flight = next_index = num_tokens = 0
        start = time.perf_counter()
        while next_index < len(queue) or engine.has_unfinished_requests():
            while in_flight < p["concurrency"] and next_index < len(queue):
                rid = f"r{next_index}"
                turn_of[rid], prompt = queue[next_index]
                engine.add_request(rid, {"prompt_token_ids": prompt}, params, output_kind="delta")
                added[rid] = (trace.step, time.perf_counter())
                trace.mark(rid, "added")
                next_index += 1
                in_flight += 1
            trace.step += 1
            for out in engine.step():
                num_tokens += len(out.outputs[0].token_ids)
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = (trace.step, time.perf_counter())
                    trace.mark(out.request_id, "first_token")
                if out.finished:
                    in_flight -= 1
        seconds = time.perf_counter() - start
        tiers = engine.get_stats().kv_offload
        return summarize(mode, p, turn_of, added, first, trace, num_tokens / seconds, tiers)
    finally:
        engine.shutdown()


def summarize(mode, p, turn_of, added, first, trace, tokens_per_s, tiers) -> dict:
    revisits = [rid for rid, turn in turn_of.items() if turn >= 2]
    ttft = [(first[r][1] - added[r][1]) * 1e3 for r in revisits]
    steps = [first[r][0] - added[r][0] for r in revisits]
    paths = Counter()  # milestone steps after arrival, of the requests that loaded
    for rid in revisits:
        at = trace.at.get(rid, {})
        if "load_planned" in at:
            base = at["added"]
            paths[tuple((name, at[name] - base) for name in
                        ("load_planned", "ready", "scheduled", "first_token") if name in at)] += 1
    cpu = None if tiers is None else next(t for t in tiers if t["tier"] == "cpu")
    return {
        "mode": mode,
        "revisited_ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99),
                              "mean": statistics.fmean(ttft)},
        "revisited_steps_to_first_token": {"p50": percentile(steps, 50), "mean": statistics.fmean(steps),
                                           "histogram": dict(sorted(Counter(steps).items()))},
        "loaded_request_paths": [{"steps_after_arrival": dict(path), "requests": n}
                                 for path, n in paths.most_common(6)],
        "load_jobs": {"inline": trace.inline_jobs, "async": trace.async_jobs},
        "output_tokens_per_s": tokens_per_s,
        "cpu_tier": None if cpu is None else {
            "hits": cpu["hits"], "bytes_loaded": cpu["bytes_loaded"],
            # bytes over the timed copies (device events on CUDA, wall time on CPU)
            "load_gb_per_s": (cpu["bytes_loaded"] / cpu["load_seconds"]["sum"] / 1e9
                              if cpu["load_seconds"]["sum"] else None)},
    }


def run_child(mode: str, smoke: bool) -> dict:
    """One mode in its own process: each engine's GPU memory and pinned CPU tier are
    gone before the next one starts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--modes", mode,
                        "--output", out] + (["--smoke"] if smoke else []), check=True)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, embedded SmolLM2, small scale")
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    parser.add_argument("--output", default=None, help="JSON file to write")
    parser.add_argument("--child", action="store_true",
                        help="internal: run the one mode given and write its row to --output")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {MODES}")
    p = SMOKE if args.smoke else GPU
    if args.smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the children
    if args.child:
        with open(args.output, "w") as f:
            json.dump(run_mode(modes[0], p), f)
        return
    results = {}
    for mode in modes:
        results[mode] = row = run_child(mode, args.smoke)
        ttft, steps = row["revisited_ttft_ms"], row["revisited_steps_to_first_token"]
        print(f"{mode:>6}: revisited TTFT p50 {ttft['p50']:.1f} ms, p99 {ttft['p99']:.1f} ms; "
              f"steps to first token p50 {steps['p50']}, mean {steps['mean']:.2f} "
              f"{steps['histogram']}; {row['output_tokens_per_s']:.1f} output tok/s; "
              f"loads {row['load_jobs']}; CPU tier {row['cpu_tier']}", flush=True)
        for path in row["loaded_request_paths"]:
            print(f"        {path['requests']:4d} x {path['steps_after_arrival']}")
    if "off" in results:
        base = results["off"]["revisited_ttft_ms"]["p50"]
        print("revisited P50 TTFT vs recompute: " + ", ".join(
            f"{m} {base / r['revisited_ttft_ms']['p50']:.2f}x" for m, r in results.items()))
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"date": datetime.now(timezone.utc).isoformat(), "machine": platform.node(),
                       "mode": "smoke" if args.smoke else "gpu",
                       "params": {k: v for k, v in p.items()}, "results": results}, f, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
