"""profile_step static: gpu_compare's static workload once for its wall time with host
stage timers, then again under torch.profiler with every step in a record_function
range: per step the device time of its kernels by kind (joined to the step that launched
them), host time and device span; over the run, device busy time against wall time."""

from __future__ import annotations

import time
from contextlib import nullcontext

from benchmarks.harness.timing import engine_stage_timer
from benchmarks.harness.traces import attribute_kernels, chrome_trace
from benchmarks.profile_bench.common import device_sync, profiler_activities


def run_static_steps(engine, prompts, params, label: str, record, timer=None) -> tuple[float, list]:
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
        stages = {
            k: round((v - before.get(k, 0.0)) * 1e3, 2)
            for k, v in (timer.totals if timer else {}).items()
            if v != before.get(k, 0.0)
        }
        steps.append([engine.last_num_scheduled_tokens, (time.perf_counter() - t) * 1e3, stages])
        i += 1
    return time.perf_counter() - start, steps


def summarise_static(steps: list, batch: int) -> dict:
    import collections

    groups = {
        "prefill": [s for s in steps if s["tokens"] > batch],
        "decode": [s for s in steps if s["tokens"] <= batch],
    }
    out = {}
    for name, group in groups.items():
        kinds, runtime = collections.Counter(), collections.Counter()
        for s in group:
            kinds.update(s["kinds"])
            runtime.update(s["runtime_ms"])
        out[name] = {
            "steps": len(group),
            "host_ms": sum(s["host_ms"] for s in group),
            "device_ms": sum(s["device_ms"] for s in group),
            "kinds_ms": {k: round(v, 2) for k, v in kinds.most_common()},
            "runtime_calls_ms": {k: round(v, 2) for k, v in runtime.most_common(6)},
        }
    return out


def print_static_profile(profiled: dict) -> None:
    print(
        f"static (profiled): {profiled['seconds']:.3f} s wall, device busy "
        f"{profiled['device_busy_ms']:.0f} ms, first-to-last kernel "
        f"{profiled['device_first_to_last_ms']:.0f} ms"
    )
    for name, s in profiled["summary"].items():
        print(
            f"{name}: {s['steps']} steps, host {s['host_ms']:.0f} ms, device {s['device_ms']:.0f} ms"
        )
        print("    device:", ", ".join(f"{k} {v:.0f}" for k, v in s["kinds_ms"].items()))
        print(
            "    host in runtime calls:",
            ", ".join(f"{k} {v:.0f}" for k, v in s["runtime_calls_ms"].items()),
        )
    print(f"{'step':>4} {'tokens':>6} {'host':>7} {'device':>7} {'span':>7}  kinds (ms)")
    for r in profiled["steps"]:
        kinds = " ".join(
            f"{k}={v:.1f}" for k, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1])[:6]
        )
        calls = " ".join(f"{k}={v:.1f}" for k, v in r["runtime_ms"].items())
        print(
            f"{r['step']:>4} {r['tokens']:>6} {r['host_ms']:>7.1f} {r['device_ms']:>7.1f} "
            f"{r['span_ms']:>7.1f}  {kinds} | {calls}"
        )


def run_static(args) -> dict:
    import numpy as np
    import torch

    from pagoda import LLM, SamplingParams
    from pagoda.worker import model_runner as runner_module

    llm = LLM(
        args.preset,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        skip_tokenizer_init=True,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.llm_engine
    vocab = engine.model_info.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    sync = device_sync(args.device)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    sync()
    timer = engine_stage_timer(engine)
    runner = engine.executor.runner  # finer stages inside the runner's sampling (`_sample`)
    timer.wrap(runner.model, "compute_logits")
    timer.wrap(runner, "sampler")
    timer.wrap(runner_module, "build_sampling_metadata")
    wall, plain_steps = run_static_steps(
        engine, prompts, params, "plain", lambda name: nullcontext(), timer
    )
    sync()
    report = {
        "plain": {
            "seconds": wall,
            "output_tok_per_s": args.batch * args.output / wall,
            "steps": plain_steps,
        }
    }
    print(
        f"static (no profiler): {wall:.3f} s, {args.batch * args.output / wall:.0f} output "
        f"tok/s, {len(plain_steps)} steps; host stages per step (ms):"
    )
    for i, (n, host, stages) in enumerate(plain_steps):
        print(f"{i:>4} {n:>6} {host:>7.1f}  " + " ".join(f"{k}={v:.1f}" for k, v in stages.items()))
    # Fresh prompts: the first run's would hit the prefix cache and skip their prefill.
    prompts = [rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.batch)]
    with torch.profiler.profile(activities=profiler_activities(args.device == "cuda")) as prof:
        wall, steps = run_static_steps(
            engine, prompts, params, "prof", torch.profiler.record_function
        )
        sync()
    device_steps, run = attribute_kernels(chrome_trace(prof), len(steps))
    rows = [
        {"step": i, "tokens": n, "host_ms": round(h, 2), **d}
        for i, ((n, h, _), d) in enumerate(zip(steps, device_steps))
    ]
    report["profiled"] = {
        "seconds": wall,
        **run,
        "summary": summarise_static(rows, args.batch),
        "steps": rows,
    }
    print_static_profile(report["profiled"])
    return report
