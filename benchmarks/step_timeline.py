"""Where a served decode step's wall time goes when the device is not the whole of it.

    python3 benchmarks/step_timeline.py --preset qwen3-30b-a3b
    python3 benchmarks/step_timeline.py --preset llama-3.1-8b --quantization fp8
    python3 benchmarks/step_timeline.py --smoke          # CPU, tiny model (runs the script)

One request (or --batch requests) decodes with CUDA graphs and async scheduling, as
served. First the median gap between tokens without a profiler (the figure benchmarks
report); then --steps steps under torch.profiler (CPU ops, CUDA runtime calls, kernels
and copies; no Python stacks, which would slow the host and widen the gaps measured).
From the profile:

- the device's busy time per step (the union of kernel, copy and memset intervals) and
  its idle time, which is what a step costs beyond its kernels;
- the largest idle gaps, each with the CPU work in progress around it: the runtime
  calls and torch ops that ended just before the device went idle and the one whose
  launch ended the gap (the host work the device waited on);
- per CPU op / runtime call: count and host time per step (the host's share);
- per kernel after a given predecessor: its increment, how much later it ends than the
  activity before it (with PDL a kernel starts before its predecessor ends, so its own
  duration overstates what it adds to the step; the increments of a step add up to its
  span), its duration and how early it started.

The chrome trace is written too (--trace, gzip) for a closer look. A diagnostic: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
from collections import defaultdict

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)
from gpu_compare import random_prompts, token_arrival_times  # noqa: E402
from kernel_switches import add_kernel_switches, apply_kernel_switches  # noqa: E402
from result_file import write_json  # noqa: E402

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_intervals(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) of every device activity in a chrome trace, by start (us)."""
    spans = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in trace["traceEvents"]
             if e.get("cat") in DEVICE_KINDS and e.get("ph") == "X"]
    return sorted(spans)


def host_events(trace: dict) -> list[tuple[float, float, str, str]]:
    """(start, end, name, category) of CPU ops and CUDA runtime calls, by start (us)."""
    spans = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("cat", ""))
             for e in trace["traceEvents"]
             if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
             and e.get("ph") == "X"]
    return sorted(spans)


def idle_gaps(spans: list[tuple[float, float, str]]) -> tuple[float, list[tuple]]:
    """Busy time (union of spans) and the idle gaps between them: (start, end, before, after)."""
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = spans[0]
    for start, end, name in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((cur_end, start, cur_name, name))
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
        cur_name = name if end >= cur_end else cur_name
    busy += cur_end - cur_start
    return busy, gaps


def describe_gap(gap: tuple, hosts: list[tuple]) -> dict:
    """A gap with the host work around it: what ended within 20 us before the device went
    idle, what ran through the gap, and what started in it (the launch that ended it)."""
    start, end, before, after = gap
    ended_before = [h[2] for h in hosts if start - 20 <= h[1] <= start + 2][-6:]
    spanning = sorted({h[2] for h in hosts if h[0] < start and h[1] > end})
    started = [h[2] for h in hosts if start <= h[0] < end][:12]
    return {"us": round(end - start, 2), "device_before": before[:80], "device_after": after[:80],
            "host_ended_before": ended_before, "host_spanning": spanning[:8],
            "host_started_in_gap": started}


def host_table(hosts: list[tuple], steps: int) -> list[dict]:
    """Per name: calls and host us per step, largest first."""
    total, count = defaultdict(float), defaultdict(int)
    for start, end, name, cat in hosts:
        total[(name, cat)] += end - start
        count[(name, cat)] += 1
    rows = [{"name": n, "cat": c, "per_step": count[(n, c)] / steps,
             "us_per_step": total[(n, c)] / steps} for (n, c) in total]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def increments(spans: list[tuple[float, float, str]], steps: int, name_width: int = 40
               ) -> list[dict]:
    """Per (predecessor, activity) pair in device order: how often per step, and the
    medians of the activity's increment (end minus the predecessor's end), duration and
    head start (the predecessor's end minus its start), largest total increment first."""
    pairs = defaultdict(list)
    for (s0, e0, before), (s1, e1, name) in zip(spans, spans[1:]):
        pairs[(before[:name_width], name[:name_width])].append((e1 - e0, e1 - s1, e0 - s1))
    rows = []
    for (before, name), values in pairs.items():
        incr, dur, early = (statistics.median(v) for v in zip(*values))
        rows.append({"after": before, "kernel": name, "per_step": len(values) / steps,
                     "increment_us": incr, "duration_us": dur, "head_start_us": early,
                     "increment_us_per_step": sum(v[0] for v in values) / steps})
    return sorted(rows, key=lambda r: -r["increment_us_per_step"])


def profile_steps(engine, steps: int, trace_path: str) -> dict:
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    raw = trace_path + ".raw.json"
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    with open(raw, "rb") as src, gzip.open(trace_path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    return trace


def analyse(trace: dict, steps: int) -> dict:
    spans, hosts = device_intervals(trace), host_events(trace)
    if not spans:
        return {"device_spans": 0, "host_table": host_table(hosts, steps)[:30]}
    window = spans[-1][1] - spans[0][0]
    busy, gaps = idle_gaps(spans)
    big = sorted(gaps, key=lambda g: g[0] - g[1])[:8]
    return {"device_spans": len(spans), "window_us": window, "busy_us_per_step": busy / steps,
            "idle_us_per_step": (window - busy) / steps,
            "gaps_over_5us_per_step": sum(1 for g in gaps if g[1] - g[0] > 5) / steps,
            "largest_gaps": [describe_gap(g, hosts) for g in big],
            "host_table": host_table(hosts, steps)[:30],
            "increments": increments(spans, steps)[:30]}


def print_report(result: dict) -> None:
    print(f"\ntokens: median gap {result['ms_per_token']:.3f} ms "
          f"(batch {result['batch']}, {result['preset']})")
    a = result["profile"]
    if a.get("device_spans"):
        print(f"profiled {result['steps']} steps: device busy {a['busy_us_per_step']:.1f} us "
              f"a step, idle {a['idle_us_per_step']:.1f} us, "
              f"{a['gaps_over_5us_per_step']:.1f} gaps > 5 us a step")
        for g in a["largest_gaps"]:
            print(f"  gap {g['us']:8.1f} us  {g['device_before'][:40]} -> {g['device_after'][:40]}")
            print(f"      host ended before: {g['host_ended_before']}")
            print(f"      host spanning:     {g['host_spanning']}")
            print(f"      host started in:   {g['host_started_in_gap'][:6]}")
        print(f"\n{'kernel':<42}{'after':<42}{'n/step':>7}{'incr us':>8}{'dur us':>8}"
              f"{'early us':>9}")
        for r in a["increments"][:20]:
            print(f"{r['kernel']:<42}{r['after']:<42}{r['per_step']:>7.1f}"
                  f"{r['increment_us']:>8.2f}{r['duration_us']:>8.2f}{r['head_start_us']:>9.2f}")
    print(f"\n{'host op / runtime call':<70}{'cat':>14}{'calls':>7}{'us/step':>10}")
    for r in a["host_table"][:25]:
        print(f"{r['name'][:69]:<70}{r['cat'][:13]:>14}{r['per_step']:>7.1f}"
              f"{r['us_per_step']:>10.1f}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens of the timed run")
    p.add_argument("--steps", type=int, default=12, help="decode steps profiled")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--trace", default="benchmarks/results/step_timeline.trace.json.gz")
    p.add_argument("--out", default="benchmarks/results/step_timeline.json")
    add_kernel_switches(p)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-llama, float32")
    return p.parse_args()


def main() -> None:
    import numpy as np
    args = parse_args()
    apply_kernel_switches(args)
    from pagoda import LLM, SamplingParams
    if args.smoke:
        args.max_model_len, args.prompt, args.tokens, args.steps = 256, 16, 8, 4
    extra = dict(device="cpu", dtype="float32", kv_cache_memory=1 << 24) if args.smoke \
        else dict(dtype="bfloat16")
    preset = "tiny-llama" if args.smoke else args.preset
    llm = LLM(preset, load_format="dummy", max_model_len=args.max_model_len,
              max_num_seqs=args.batch, skip_tokenizer_init=True,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, **extra)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [args.prompt] * args.batch, engine.model_info.vocab_size)
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=8, **greedy), use_tqdm=False)  # warm
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, SamplingParams(max_tokens=args.tokens, **greedy),
                           output_kind="delta")
    arrivals = token_arrival_times(engine)
    per_token = [b - a for a, b in zip(arrivals[::args.batch], arrivals[args.batch::args.batch])]
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=args.steps + 16, **greedy))
    for _ in range(6):  # prefill and the first decode steps: not profiled
        engine.step()
    trace = profile_steps(engine, args.steps, args.trace)
    while engine.has_unfinished_requests():
        engine.step()
    result = {"preset": preset, "batch": args.batch, "steps": args.steps,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "pdl": args.pdl, "ms_per_token": statistics.median(per_token) * 1e3,
              "profile": analyse(trace, args.steps), "trace": args.trace}
    print_report(result)
    write_json(args.out, {"benchmark": "step_timeline", "args": vars(args), **result})
    engine.shutdown()


if __name__ == "__main__":
    main()
