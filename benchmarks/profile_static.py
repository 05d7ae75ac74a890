"""Where the static workload's time goes: GPU kernel time per step, by kind, and idle gaps.

    python benchmarks/profile_static.py --out profile_static.json
    python benchmarks/profile_static.py --preset tiny-llama --device cpu --batch 8 --prompt 64 --max-model-len 512

Runs gpu_compare's static workload (batch x prompt tokens in, `--output` tokens out,
greedy) once for its wall time, then again under torch.profiler. Every engine.step()
is wrapped in a record_function range; a kernel belongs to the step whose range
launched it (the profiler's correlation id joins the kernel to its host launch, so the
attribution holds with async scheduling, where the host runs a step ahead of the
device). Per step it reports the tokens scheduled, the host wall time, the device time
of its kernels by kind (GEMM, chunk attention, decode attention, norms, ...) and its
device span; over the run, device busy time against wall time. A diagnostic program:
it asserts nothing.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from result_file import write_json  # noqa: E402  (benchmarks/)

# Kernel name fragments -> kind, first match wins (names are lower-cased).
KINDS = [
    ("_moe_gemm", "moe_gemm"), ("_gemv_gate_up", "moe_gemv"), ("_gemv_down", "moe_gemv"),
    ("fmha", "sdpa"), ("flash", "sdpa"), ("catarray", "cat"), ("_mla_prefill", "mla_prefill"),
    ("_align_small", "moe_align"), ("_align_count", "moe_align"),
    ("_align_place", "moe_align"), ("router", "moe_route"), ("_route", "moe_route"),
    ("_mla_decode", "mla_decode"), ("_mla_merge", "mla_decode"), ("_absorb", "mla_proj"),
    ("_project_v", "mla_proj"), ("_store_latent", "store_kv"), ("_norm_rope_store", "store_kv"),
    ("attention_kernel", "sdpa"), ("efficient", "sdpa"),
    ("_chunk_kernel", "attn_chunk"), ("_decode_kernel", "attn_decode"),
    ("_decode_words", "attn_decode"), ("_quant_rows", "act_quant"), ("_w8a16", "gemv"),
    ("_gemv_kernel", "gemv"), ("_w8a8_gemm", "gemm"), ("xmma", "gemm"),
    ("_merge_kernel", "attn_merge"), ("_store_kv", "store_kv"), ("rms_norm", "rms_norm"),
    ("silu", "silu_mul"), ("rotary", "rotary"), ("nvjet", "gemm"), ("gemm", "gemm"),
    ("cutlass", "gemm"), ("softmax", "sampling"), ("argmax", "sampling"),
    ("sort", "sampling"), ("topk", "sampling"), ("memcpy", "memcpy"), ("memset", "memset"),
    ("reduce", "reduce"), ("index", "index"), ("elementwise", "elementwise"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for fragment, kind in KINDS:
        if fragment in low:
            return kind
    return "other"


def run_static(engine, prompts, params, label: str, record, timer=None) -> tuple[float, list]:
    """Runs the workload to the end; per step [tokens, host ms, {stage: ms}]."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{label}{i}", p, params, output_kind="final_only")
    steps = []
    start = time.perf_counter()
    i = 0
    while engine.has_unfinished_requests():
        before = dict(timer.totals) if timer else {}
        t = time.perf_counter()
        with record(f"pagoda_step_{i}"):
            engine.step()
        stages = {k: round((v - before.get(k, 0.0)) * 1e3, 2)
                  for k, v in (timer.totals if timer else {}).items() if v != before.get(k, 0.0)}
        steps.append([engine.last_num_scheduled_tokens, (time.perf_counter() - t) * 1e3, stages])
        i += 1
    return time.perf_counter() - start, steps


def attribute_kernels(trace: dict, num_steps: int) -> tuple[list, dict]:
    """Per step: device ms by kind and the device span; plus run-wide busy/idle."""
    events = trace["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"].rsplit("_", 1)[1]))
                    for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith("pagoda_step_"))
    starts = [r[0] for r in ranges]
    launch_step = {}
    runtime = [collections.defaultdict(float) for _ in range(num_steps)]
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            k = bisect.bisect_right(starts, e["ts"]) - 1
            if k < 0 or e["ts"] > ranges[k][1]:
                continue
            step = ranges[k][2]
            if corr is not None:
                launch_step[corr] = step
            if step < num_steps:  # host time in runtime calls: long ones are waits
                runtime[step][e["name"]] += e["dur"] / 1e3
    per_step = [collections.defaultdict(float) for _ in range(num_steps)]
    spans = [[float("inf"), 0.0] for _ in range(num_steps)]
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        intervals.append((e["ts"], e["ts"] + e["dur"]))
        step = launch_step.get(e.get("args", {}).get("correlation"))
        if step is None or step >= num_steps:
            continue
        per_step[step][kind_of(e["name"])] += e["dur"] / 1e3
        spans[step][0] = min(spans[step][0], e["ts"])
        spans[step][1] = max(spans[step][1], e["ts"] + e["dur"])
    busy, end = 0.0, float("-inf")
    for s, t in sorted(intervals):  # union of device intervals
        if t > end:
            busy += t - max(s, end)
            end = t
    first = min((s for s, _ in intervals), default=0.0)
    run = {"device_busy_ms": busy / 1e3,
           "device_first_to_last_ms": (end - first) / 1e3 if intervals else 0.0}
    steps = [{"kinds": dict(k), "device_ms": sum(k.values()),
              "span_ms": (sp[1] - sp[0]) / 1e3 if sp[1] else 0.0,
              "runtime_ms": {n: round(v, 3) for n, v in sorted(rt.items(), key=lambda kv: -kv[1])[:4]}}
             for k, sp, rt in zip(per_step, spans, runtime)]
    return steps, run


def summarise(steps: list, batch: int) -> dict:
    groups = {"prefill": [s for s in steps if s["tokens"] > batch],
              "decode": [s for s in steps if s["tokens"] <= batch]}
    out = {}
    for name, group in groups.items():
        kinds, runtime = collections.Counter(), collections.Counter()
        for s in group:
            kinds.update(s["kinds"])
            runtime.update(s["runtime_ms"])
        out[name] = {"steps": len(group), "host_ms": sum(s["host_ms"] for s in group),
                     "device_ms": sum(s["device_ms"] for s in group),
                     "kinds_ms": {k: round(v, 2) for k, v in kinds.most_common()},
                     "runtime_calls_ms": {k: round(v, 2) for k, v in runtime.most_common(6)}}
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (online, from the dummy weights)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--out", default="bench_results/profile_static.json")
    from kernel_switches import add_kernel_switches, apply_kernel_switches  # benchmarks/
    add_kernel_switches(p)
    args = p.parse_args()
    apply_kernel_switches(args)
    return args


def print_profiled(profiled: dict) -> None:
    print(f"static (profiled): {profiled['seconds']:.3f} s wall, device busy "
          f"{profiled['device_busy_ms']:.0f} ms, first-to-last kernel "
          f"{profiled['device_first_to_last_ms']:.0f} ms")
    for name, s in profiled["summary"].items():
        print(f"{name}: {s['steps']} steps, host {s['host_ms']:.0f} ms, device {s['device_ms']:.0f} ms")
        print("    device:", ", ".join(f"{k} {v:.0f}" for k, v in s["kinds_ms"].items()))
        print("    host in runtime calls:", ", ".join(f"{k} {v:.0f}" for k, v in s["runtime_calls_ms"].items()))
    print(f"{'step':>4} {'tokens':>6} {'host':>7} {'device':>7} {'span':>7}  kinds (ms)")
    for r in profiled["steps"]:
        kinds = " ".join(f"{k}={v:.1f}" for k, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1])[:6])
        calls = " ".join(f"{k}={v:.1f}" for k, v in r["runtime_ms"].items())
        print(f"{r['step']:>4} {r['tokens']:>6} {r['host_ms']:>7.1f} {r['device_ms']:>7.1f} "
              f"{r['span_ms']:>7.1f}  {kinds} | {calls}")


def profile_run(engine, prompts: list, params, device: str, batch: int, sync) -> dict:
    """The static run again under torch.profiler; each step's kernels attributed to it."""
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        wall, steps = run_static(engine, prompts, params, "prof",
                                 torch.profiler.record_function)
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    device_steps, run = attribute_kernels(trace, len(steps))
    rows = [{"step": i, "tokens": n, "host_ms": round(h, 2), **d}
            for i, ((n, h, _), d) in enumerate(zip(steps, device_steps))]
    profiled = {"seconds": wall, **run, "summary": summarise(rows, batch), "steps": rows}
    print_profiled(profiled)
    return profiled


def main() -> None:
    args = parse_args()
    import numpy as np
    import torch
    from pagoda import LLM, SamplingParams
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, skip_tokenizer_init=True,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    vocab = engine.model_info.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    from contextlib import nullcontext

    from gpu_compare import StageTimer  # benchmarks/ is this script's directory
    sync()
    timer = StageTimer(engine)
    # Finer stages inside the runner's sampling (`_sample`).
    from pagoda.worker import model_runner as runner_module
    runner = engine.executor.runner
    timer._patch(runner.model, "compute_logits")
    timer._patch(runner, "sampler")
    timer._patch(runner_module, "build_sampling_metadata")
    wall, plain_steps = run_static(engine, prompts, params, "plain", lambda name: nullcontext(),
                                   timer)
    sync()
    report = {"args": vars(args), "plain": {"seconds": wall,
                                            "output_tok_per_s": args.batch * args.output / wall,
                                            "steps": plain_steps}}
    print(f"static (no profiler): {wall:.3f} s, {args.batch * args.output / wall:.0f} output tok/s, "
          f"{len(plain_steps)} steps; host stages per step (ms):")
    for i, (n, host, stages) in enumerate(plain_steps):
        print(f"{i:>4} {n:>6} {host:>7.1f}  " + " ".join(f"{k}={v:.1f}" for k, v in stages.items()))
    # Fresh prompts: the first run's would hit the prefix cache and skip their prefill.
    prompts = [rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.batch)]
    report["profiled"] = profile_run(engine, prompts, params, args.device, args.batch, sync)
    write_json(args.out, report, indent=1)


if __name__ == "__main__":
    main()
