"""kv_offload steps: the in-process mode of `python -m benchmarks.kv_offload`. One engine
per mode, each in a process of its own, on the multi-turn workload (token ids drawn at
random): offloading off, CPU-tier loads asynchronous only, inline (the default: a load
that fits the step's budget is copied before the step's forward and its request admitted
in that step), and evict-only (inline, with the write-through of finished requests'
blocks off: only blocks the GPU pool evicts reach the tiers). `--disk-gib` puts a disk
tier, in an empty directory per run, below the CPU tier; `--gpu-blocks` sizes the GPU
pool (a pool that holds the whole working set evicts nothing, so every block the tiers
get is written through); `--rounds` repeats the modes
interleaved (one run of each mode per round), so that a box whose speed drifts weighs on
every mode alike.

Per run: over the revisited turns, TTFT P50/P99 (arrival to the step that hands out the
first token), the steps on that path (P50, mean, histogram), and for each request that
loaded from the CPU tier the step of each milestone after its arrival (load planned,
ready, scheduled, first token); the wall time of the steps that scheduled tokens (mean,
P50, P99) and of the run, the run's CPU seconds (all the process's threads: the I/O
threads' work too); output tok/s; each tier's hits, stores and load GB/s. With inline
and evict-only both run, the median over rounds of their ratio within a round.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter

from benchmarks.harness.processes import run_json_child, write_child_result

STEPS = dict(
    engine=dict(
        model="llama-3.1-8b",
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=8192,
        num_gpu_blocks_override=2048,
    ),
    vocab=128000,
)
SMOKE_STEPS = dict(
    engine=dict(device="cpu", max_model_len=512, num_gpu_blocks_override=48), vocab=49000
)
STEP_MODES = ("off", "async", "inline", "evict-only")


def percentile(values: list[float], q: float):
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
    """Engine step of each milestone of each request, and which steps scheduled tokens
    (instrumenting the scheduler's offload calls; the engine's own code is unchanged)."""

    def __init__(self, engine) -> None:
        self.step = 0
        self.at: dict[str, dict[str, int]] = {}
        self.inline_jobs = self.async_jobs = 0
        self.busy = False  # the last schedule() scheduled tokens
        offload, scheduler = engine.kv_offload, engine.scheduler
        if offload is not None:
            start_load, take_ready, take_plan = (
                offload.start_load,
                offload.take_ready,
                offload.take_plan,
            )

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

            offload.start_load, offload.take_ready, offload.take_plan = (
                traced_start,
                traced_ready,
                traced_plan,
            )
        schedule = scheduler.schedule

        def traced_schedule():
            out = schedule()
            self.busy = out.total_num_scheduled_tokens > 0
            for rid in out.num_scheduled_tokens:
                self.mark(rid, "scheduled")
            return out

        scheduler.schedule = traced_schedule

    def mark(self, request_id: str, name: str) -> None:
        self.at.setdefault(request_id, {}).setdefault(name, self.step)


def make_engine(mode: str, p: dict, disk_dir: str | None):
    from pagoda.entrypoints.llm import LLM

    tiers = {}
    if mode != "off":
        tiers["kv_offloading_size"] = p["cpu_gib"]
        if disk_dir is not None:
            tiers.update(kv_offloading_disk_path=disk_dir, kv_offloading_disk_size=p["disk_gib"])
    engine = LLM(**p["engine"], **tiers).llm_engine
    if mode == "async":
        engine.kv_offload.max_inline_blocks_per_step = 0
    if mode == "evict-only":
        engine.kv_offload.write_through_enabled = False
    return engine


def drive(engine, p: dict, trace: Milestones) -> dict:
    """Runs the workload at p["concurrency"] requests in flight; per request its turn and
    (step, time) of arrival and of first token; the wall ms of each busy step."""
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=p["output_len"], temperature=0.0, ignore_eos=True)
    queue = workload(p)
    turn_of, added, first, busy_ms = {}, {}, {}, []
    in_flight = next_index = num_tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
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
        trace.busy = False  # set by the step's schedule(), if it has one
        began = time.perf_counter()
        outputs = engine.step()
        if trace.busy:
            busy_ms.append((time.perf_counter() - began) * 1e3)
        for out in outputs:
            num_tokens += len(out.outputs[0].token_ids)
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = (trace.step, time.perf_counter())
                trace.mark(out.request_id, "first_token")
            if out.finished:
                in_flight -= 1
    seconds = time.perf_counter() - start
    return dict(
        cpu_seconds=time.process_time() - cpu_start,
        turn_of=turn_of,
        added=added,
        first=first,
        busy_ms=busy_ms,
        seconds=seconds,
        tokens_per_s=num_tokens / seconds,
    )


def tier_row(tier: dict) -> dict:
    seconds = tier["load_seconds"]["sum"]
    return {
        "hits": tier["hits"],
        "stored_blocks": tier["stored_blocks"],
        "bytes_loaded": tier["bytes_loaded"],
        # bytes over the timed copies (device events on CUDA, wall time on CPU)
        "load_gb_per_s": tier["bytes_loaded"] / seconds / 1e9 if seconds else None,
    }


def steps_mode_row(mode: str, p: dict, disk_dir: str | None) -> dict:
    engine = make_engine(mode, p, disk_dir)
    try:
        trace = Milestones(engine)
        run = drive(engine, p, trace)
        tiers = engine.get_stats().kv_offload
    finally:
        engine.shutdown()
    first, added = run["first"], run["added"]
    revisits = [rid for rid, turn in run["turn_of"].items() if turn >= 2]
    ttft = [(first[r][1] - added[r][1]) * 1e3 for r in revisits]
    steps = [first[r][0] - added[r][0] for r in revisits]
    paths = Counter()  # milestone steps after arrival, of the requests that loaded
    for rid in revisits:
        at = trace.at.get(rid, {})
        if "load_planned" in at:
            paths[
                tuple(
                    (name, at[name] - at["added"])
                    for name in ("load_planned", "ready", "scheduled", "first_token")
                    if name in at
                )
            ] += 1
    busy = run["busy_ms"]
    return {
        "mode": mode,
        "revisited_ttft_ms": {
            "p50": percentile(ttft, 50),
            "p99": percentile(ttft, 99),
            "mean": statistics.fmean(ttft),
        },
        "revisited_steps_to_first_token": {
            "p50": percentile(steps, 50),
            "mean": statistics.fmean(steps),
            "histogram": dict(sorted(Counter(steps).items())),
        },
        "loaded_request_paths": [
            {"steps_after_arrival": dict(path), "requests": n} for path, n in paths.most_common(6)
        ],
        "load_jobs": {"inline": trace.inline_jobs, "async": trace.async_jobs},
        "busy_steps": len(busy),
        "step_ms": {
            "mean": statistics.fmean(busy),
            "p50": percentile(busy, 50),
            "p99": percentile(busy, 99),
        },
        "steps_total": trace.step,
        "run_seconds": run["seconds"],
        "run_cpu_seconds": run["cpu_seconds"],  # every thread of the engine's process
        "output_tokens_per_s": run["tokens_per_s"],
        "tiers": {t["tier"]: tier_row(t) for t in tiers or ()},
    }


def print_row(row: dict) -> None:
    ttft, steps, ms = (
        row["revisited_ttft_ms"],
        row["revisited_steps_to_first_token"],
        row["step_ms"],
    )
    print(
        f"{row['mode']:>10}: revisited TTFT p50 {ttft['p50']:.1f} ms, p99 {ttft['p99']:.1f} ms; "
        f"steps to first token p50 {steps['p50']}, mean {steps['mean']:.2f} "
        f"{steps['histogram']}; busy step {ms['mean']:.2f} ms mean, {ms['p50']:.2f} p50 "
        f"({row['busy_steps']} of {row['steps_total']} steps); run {row['run_seconds']:.2f} s, "
        f"{row['output_tokens_per_s']:.1f} output tok/s; loads {row['load_jobs']}; "
        f"tiers {row['tiers']}",
        flush=True,
    )
    for path in row["loaded_request_paths"]:
        print(f"        {path['requests']:4d} x {path['steps_after_arrival']}")


def run_child(args, mode: str, p: dict) -> dict:
    """One run of `mode` in a process of its own (its memory is gone after), on an
    empty disk directory when the run has a disk tier."""
    argv = ["steps", "--child", mode] + (["--smoke"] if args.smoke else [])
    if args.gpu_blocks:
        argv += ["--gpu-blocks", str(args.gpu_blocks)]
    disk_dir = tempfile.mkdtemp(prefix="kvo-steps-") if p["disk_gib"] else None
    try:
        if disk_dir is not None:
            argv += ["--disk-gib", str(p["disk_gib"]), "--disk-dir", disk_dir]
        row = run_json_child("benchmarks.kv_offload", argv)
    finally:
        if disk_dir is not None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    if "error" in row:
        raise SystemExit(f"mode {mode} failed: {row['error']}")
    return row


def median_of(rows: list[dict], key: str, field: str | None = None) -> float:
    return statistics.median(r[key][field] if field else r[key] for r in rows)


def paired_ratios(on: list[dict], off: list[dict]) -> dict:
    """Per figure, the median over rounds of on / off within a round (the two runs of a
    round are neighbours in time, so a drift of the box's speed cancels)."""
    figures = {
        "busy_step_ms": lambda r: r["step_ms"]["mean"],
        "run_seconds": lambda r: r["run_seconds"],
        "run_cpu_seconds": lambda r: r["run_cpu_seconds"],
    }
    return {
        name: statistics.median(get(a) / get(b) for a, b in zip(on, off))
        for name, get in figures.items()
    }


def run_steps(args, workload_params: dict) -> dict:
    base = SMOKE_STEPS if args.smoke else STEPS
    engine = dict(base["engine"])
    if args.gpu_blocks:
        engine["num_gpu_blocks_override"] = args.gpu_blocks
    p = {**workload_params, **base, "engine": engine, "disk_gib": args.disk_gib}
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in STEP_MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {STEP_MODES}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    if args.gpu_blocks < 0:
        raise SystemExit(f"--gpu-blocks must be >= 0 (0: the preset's), got {args.gpu_blocks}")
    if args.child:
        write_child_result(args.child_out, steps_mode_row(args.child, p, args.disk_dir))
        return {}
    if args.smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the children
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            runs[mode].append(run_child(args, mode, p))
            print_row(runs[mode][-1])
    summary = {
        mode: {
            "revisited_ttft_p50_ms": median_of(rows, "revisited_ttft_ms", "p50"),
            "step_ms_mean": median_of(rows, "step_ms", "mean"),
            "run_seconds": median_of(rows, "run_seconds"),
            "run_cpu_seconds": median_of(rows, "run_cpu_seconds"),
            "output_tokens_per_s": median_of(rows, "output_tokens_per_s"),
        }
        for mode, rows in runs.items()
    }
    for mode, row in summary.items():
        print(
            f"median of {args.rounds}: {mode:>10}: revisited TTFT p50 "
            f"{row['revisited_ttft_p50_ms']:.1f} ms, busy step {row['step_ms_mean']:.2f} ms, "
            f"run {row['run_seconds']:.2f} s ({row['run_cpu_seconds']:.2f} CPU s), "
            f"{row['output_tokens_per_s']:.1f} output tok/s"
        )
    if "off" in summary:
        base = summary["off"]["revisited_ttft_p50_ms"]
        print(
            "revisited P50 TTFT vs recompute: "
            + ", ".join(f"{m} {base / r['revisited_ttft_p50_ms']:.2f}x" for m, r in summary.items())
        )
    ratios = None
    if "inline" in runs and "evict-only" in runs:
        ratios = paired_ratios(runs["inline"], runs["evict-only"])
        print(
            "write-through on / off, median of the rounds' ratios: "
            + ", ".join(f"{k} {v:.3f}x" for k, v in ratios.items())
        )
    return {
        "mode": "smoke" if args.smoke else "gpu",
        "params": p,
        "summary": summary,
        "write_through_ratios": ratios,
        "results": runs,
    }
