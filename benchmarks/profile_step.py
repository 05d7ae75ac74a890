"""Where an engine step's time goes, four ways (dummy weights of a preset unless noted).
Diagnostic programs: they print tables, write JSON and assert nothing.

    python -m benchmarks.profile_step decode --preset qwen3-30b-a3b --batches 1,64
    python -m benchmarks.profile_step static --preset llama-3.1-8b
    python -m benchmarks.profile_step timeline --preset llama-3.1-8b --quantization fp8
    python -m benchmarks.profile_step cpu --threads 2 --batch 1
    python -m benchmarks.profile_step decode --smoke     # each mode has --smoke (static: small flags)

decode    Per batch size: fill the batch with `--context`-token prompts (`--batch1-context`
          at batch 1), step until all decode, then profile `--steps` decode steps eagerly
          (CUDA graphs off, so every kernel is seen): the kernel table of one step (launches,
          device us, share) and coarse groups (GEMM, MoE, attention, norm, ...); and the
          step as served: the engine's step wall time with CUDA graphs and the bare replay
          of the decode graph (CUDA events, median). On the CPU: CPU operators by self time.
static    gpu_compare's static workload (batch x prompt in, `--output` out, greedy) once
          for its wall time with host stage timers, then again under torch.profiler, every
          step in a record_function range: per step the tokens, host ms, device ms of its
          kernels by kind (a kernel belongs to the step whose range launched it, joined by
          the profiler's correlation id, so it holds with async scheduling) and device span;
          over the run, device busy time against wall time.
timeline  One request (or --batch) decodes with CUDA graphs and async scheduling, as served:
          the median gap between tokens without a profiler, then `--steps` steps under
          torch.profiler (no Python stacks): device busy/idle time per step, the largest
          idle gaps with the host work around each, host time per CPU op / runtime call, and
          per kernel its increment after its predecessor (with PDL a kernel starts before
          its predecessor ends). The chrome trace is written too (--trace, gzip).
cpu       The embedded SmolLM2-135M on the CPU (float32 unless --quantization), LLM.generate
          over `--batch` prompts with wall-clock timers around the engine's stages and the
          model's parts (linears, norms, rotary, attention with its KV store, ...); only
          decode steps count. Timers are inclusive and nest ("forward: other" is the Python
          between the parts). A second pass counts torch operators per step. `--skinny`: a
          random model with SmolLM2's depth, heads and vocabulary but 64-wide linears, so
          its step time is the per-step overhead.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from contextlib import nullcontext

from benchmarks.harness.results import write_result
from benchmarks.harness.timing import StageTimer, engine_stage_timer, engine_step_timing
from benchmarks.harness.traces import attribute_kernels, chrome_trace, group_of, timeline
from benchmarks.harness.workloads import (
    config_dir,
    decode_ready,
    random_prompts,
    token_arrival_times,
)


def _profiler_activities(on_cuda: bool) -> list:
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def _sync(device: str):
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


# ================================================================ decode ===========
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
        with torch.profiler.profile(activities=_profiler_activities(on_cuda)) as prof:
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
        points.append(decode_point(llm, batch, context, args.steps, _sync(args.device), on_cuda))
        print_decode_point(points[-1], args.rows)
    llm.llm_engine.shutdown()
    return {"points": points}


# ================================================================ static ===========
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
    sync = _sync(args.device)
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
    with torch.profiler.profile(activities=_profiler_activities(args.device == "cuda")) as prof:
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


# ================================================================ timeline =========
def print_timeline(result: dict) -> None:
    print(
        f"\ntokens: median gap {result['ms_per_token']:.3f} ms "
        f"(batch {result['batch']}, {result['preset']})"
    )
    a = result["profile"]
    if a.get("device_spans"):
        print(
            f"profiled {result['steps']} steps: device busy {a['busy_us_per_step']:.1f} us "
            f"a step, idle {a['idle_us_per_step']:.1f} us, "
            f"{a['gaps_over_5us_per_step']:.1f} gaps > 5 us a step"
        )
        for g in a["largest_gaps"]:
            print(f"  gap {g['us']:8.1f} us  {g['device_before'][:40]} -> {g['device_after'][:40]}")
            print(f"      host ended before: {g['host_ended_before']}")
            print(f"      host spanning:     {g['host_spanning']}")
            print(f"      host started in:   {g['host_started_in_gap'][:6]}")
        print(
            f"\n{'kernel':<42}{'after':<42}{'n/step':>7}{'incr us':>8}{'dur us':>8}{'early us':>9}"
        )
        for r in a["increments"][:20]:
            print(
                f"{r['kernel']:<42}{r['after']:<42}{r['per_step']:>7.1f}"
                f"{r['increment_us']:>8.2f}{r['duration_us']:>8.2f}{r['head_start_us']:>9.2f}"
            )
    print(f"\n{'host op / runtime call':<70}{'cat':>14}{'calls':>7}{'us/step':>10}")
    for r in a["host_table"][:25]:
        print(
            f"{r['name'][:69]:<70}{r['cat'][:13]:>14}{r['per_step']:>7.1f}{r['us_per_step']:>10.1f}"
        )


def run_timeline(args) -> dict:
    import numpy as np
    import torch

    from pagoda import LLM, SamplingParams

    if args.smoke:
        args.max_model_len, args.prompt, args.tokens, args.steps = 256, 16, 8, 4
    extra = (
        dict(device="cpu", dtype="float32", kv_cache_memory=1 << 24)
        if args.smoke
        else dict(dtype="bfloat16")
    )
    preset = "tiny-llama" if args.smoke else args.preset
    llm = LLM(
        preset,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        skip_tokenizer_init=True,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **extra,
    )
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [args.prompt] * args.batch, engine.model_info.vocab_size)
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=8, **greedy),
        use_tqdm=False,
    )  # warm
    for i, p in enumerate(prompts):
        engine.add_request(
            f"t{i}", p, SamplingParams(max_tokens=args.tokens, **greedy), output_kind="delta"
        )
    arrivals = token_arrival_times(engine)
    per_token = [b - a for a, b in zip(arrivals[:: args.batch], arrivals[args.batch :: args.batch])]
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=args.steps + 16, **greedy))
    for _ in range(6):  # prefill and the first decode steps: not profiled
        engine.step()
    on_cuda = torch.cuda.is_available()
    with torch.profiler.profile(activities=_profiler_activities(on_cuda)) as prof:
        for _ in range(args.steps):
            engine.step()
        if on_cuda:
            torch.cuda.synchronize()
    trace = chrome_trace(prof, args.trace)
    while engine.has_unfinished_requests():
        engine.step()
    result = {
        "preset": preset,
        "batch": args.batch,
        "steps": args.steps,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "ms_per_token": statistics.median(per_token) * 1e3,
        "profile": timeline(trace, args.steps),
        "trace": args.trace,
    }
    print_timeline(result)
    engine.shutdown()
    return result


# ================================================================ cpu ==============
def instrument_cpu(llm, timers: StageTimer) -> None:
    """Wraps the engine's stages and the model's parts (in-process executor only)."""
    import pagoda.worker.model_runner as mr
    from pagoda.model import llama
    from pagoda.model.layers.activation import SiluAndMul
    from pagoda.model.layers.attention import Attention
    from pagoda.model.layers.embedding import VocabParallelEmbedding
    from pagoda.model.layers.layernorm import RMSNorm
    from pagoda.model.layers.linear import LinearBase

    engine = llm.llm_engine
    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        raise SystemExit("the cpu mode needs the in-process executor")
    for owner, attr, name in (
        (engine.scheduler, "schedule", "scheduler.schedule"),
        (engine.scheduler, "update_from_output", "scheduler.update_from_output"),
        (engine.output_processor, "process_outputs", "output processing (detokenize)"),
        (runner, "execute_model", "runner.execute_model"),
        (runner, "sample_tokens", "runner.sample_tokens"),
        (mr, "apply_scheduler_output", "  input batch update"),
        (mr, "build_step_inputs", "  step inputs (ids, positions, attn common)"),
        (runner.backend, "build_metadata", "  attention plan (build_metadata)"),
        (runner.model, "forward", "  forward"),
        (runner.model, "compute_logits", "  lm head (compute_logits)"),
        (mr, "build_sampling_metadata", "  sampling metadata"),
        (runner, "sampler", "  sampler"),
        (llama, "apply_rotary", "    rotary"),
    ):
        timers.wrap(owner, attr, name)
    if hasattr(llama, "cpu_fused_decode"):  # the whole decode step in one C call, when it applies
        timers.wrap(llama.cpu_fused_decode, "decode_step", "    fused decode step (all layers)")
    if hasattr(llama, "apply_rotary_tables"):  # the CPU form
        timers.wrap(llama, "apply_rotary_tables", "    rotary")
    timers.wrap_module_forwards(
        runner.model.model,
        {
            RMSNorm: "    rmsnorm (+ residual add)",
            Attention: "    attention (+ kv store)",
            SiluAndMul: "    silu_and_mul",
            VocabParallelEmbedding: "    embedding",
            LinearBase: "    linear",
        },
    )


def count_decode_steps_only(llm, timers: StageTimer, decode_steps: list[float]) -> None:
    """Counts a step only when every scheduled request computes one token."""
    engine = llm.llm_engine
    step, schedule = engine.step, engine.scheduler.schedule
    state = {"decode": False}

    def schedule_and_classify():
        out = schedule()
        state["decode"] = bool(out.num_scheduled_tokens) and all(
            n == 1 for n in out.num_scheduled_tokens.values()
        )
        timers.active = state["decode"]
        return out

    engine.scheduler.schedule = schedule_and_classify

    def timed_step():
        snapshot = dict(timers.totals), dict(timers.calls)
        timers.active = True  # the schedule timer itself; reset by the classifier
        start = time.perf_counter()
        outs = step()
        elapsed = time.perf_counter() - start
        if state["decode"]:
            decode_steps.append(elapsed)
        else:  # undo what a non-decode step added
            timers.totals.clear(), timers.calls.clear()
            timers.totals.update(snapshot[0]), timers.calls.update(snapshot[1])
        timers.active = False
        return outs

    engine.step = timed_step


def op_counts(llm, prompts, params, steps: int) -> dict:
    """torch.profiler over `steps` decode steps: operators per step and their self time."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    for prompt in prompts:
        engine.add_request(None, prompt, params)
    for _ in range(3):  # the prompts (one step each at these lengths), then decode
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    table = [
        {
            "op": evt.key,
            "calls_per_step": evt.count / steps,
            "self_ms_per_step": evt.self_cpu_time_total / 1000 / steps,
        }
        for evt in prof.key_averages()
        if evt.key.startswith(("aten::", "mkl"))
    ]
    table.sort(key=lambda r: -r["self_ms_per_step"])
    total_calls = sum(r["calls_per_step"] for r in table if r["op"].startswith("aten::"))
    return {"aten_calls_per_step": total_calls, "top": table[:25]}


# SmolLM2-135M's depth, attention shape and vocabulary; hidden 64 and MLP 64 wide.
SKINNY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 64,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_ORDER = [
    "scheduler.schedule",
    "runner.execute_model",
    "  input batch update",
    "  step inputs",
    "  attention plan",
    "  forward",
    "    embedding",
    "    rmsnorm",
    "    linear",
    "    rotary",
    "    attention",
    "    silu_and_mul",
    "    fused",
    "runner.sample_tokens",
    "  lm head",
    "  sampling metadata",
    "  sampler",
    "scheduler.update_from_output",
    "output processing",
]


def stage_rows(timers: StageTimer, steps: list[float]) -> list[dict]:
    n = len(steps)
    step_ms = 1000 * sum(steps) / n
    rows = [{"stage": "decode step (wall)", "ms_per_step": step_ms, "calls_per_step": 1.0}]
    rank = lambda name: next((i for i, p in enumerate(_ORDER) if name.startswith(p)), len(_ORDER))  # noqa: E731
    for name in sorted(timers.totals, key=rank):
        rows.append(
            {
                "stage": name,
                "ms_per_step": 1000 * timers.totals[name] / n,
                "calls_per_step": timers.calls[name] / n,
            }
        )
    by_name = {r["stage"]: r["ms_per_step"] for r in rows}
    parts = [v for k, v in by_name.items() if k.startswith("    ")]
    if "  forward" in by_name:
        at = max(i for i, r in enumerate(rows) if r["stage"].startswith(("  forward", "    "))) + 1
        rows.insert(
            at,
            {
                "stage": "    forward: other (python between parts)",
                "ms_per_step": by_name["  forward"] - sum(parts),
                "calls_per_step": 0,
            },
        )
    top = [
        "scheduler.schedule",
        "runner.execute_model",
        "runner.sample_tokens",
        "scheduler.update_from_output",
        "output processing (detokenize)",
    ]
    rows.append(
        {
            "stage": "engine: other (step minus the above)",
            "calls_per_step": 0,
            "ms_per_step": step_ms - sum(by_name.get(k, 0.0) for k in top),
        }
    )
    print(f"\n{n} decode steps, mean {step_ms:.2f} ms/step ({1000 / step_ms:.1f} steps/s)")
    for r in rows:
        print(
            f"  {r['stage']:48s} {r['ms_per_step']:8.3f} ms  "
            f"{100 * r['ms_per_step'] / step_ms:5.1f}%  x{r['calls_per_step']:.0f}"
        )
    return rows


def run_cpu(args) -> dict:
    import torch

    from pagoda import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    if args.smoke:
        args.max_tokens, args.profiler_steps = min(args.max_tokens, 16), 2
    kwargs = dict(max_num_seqs=max(args.batch, 1), max_model_len=1024, enable_prefix_caching=False)
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.skinny:
        from pagoda.model.tokenizer import embedded_model_path

        llm = LLM(
            config_dir(SKINNY_CONFIG, "pagoda-skinny-"),
            load_format="dummy",
            tokenizer=str(embedded_model_path()),
            kv_cache_memory=256 << 20,
            **kwargs,
        )
    else:
        llm = LLM(**kwargs)
    vocab = llm.llm_engine.model_info.vocab_size
    prompts = [
        [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)]
        for i in range(args.batch)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    timers, steps = StageTimer(), []
    timers.active = False
    instrument_cpu(llm, timers)
    count_decode_steps_only(llm, timers, steps)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"generate: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s (timers on)"
    )
    rows = stage_rows(timers, steps)
    ops = op_counts(llm, prompts, params, args.profiler_steps)
    print(
        f"\ntorch.profiler, {args.profiler_steps} decode steps: "
        f"{ops['aten_calls_per_step']:.0f} aten calls per step; top by self time:"
    )
    for r in ops["top"][:15]:
        print(f"  {r['op']:40s} x{r['calls_per_step']:6.0f} {r['self_ms_per_step']:8.3f} ms")
    return {
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "tok_per_s_with_timers": tokens / elapsed,
        "stages": rows,
        "profiler": ops,
    }


# ================================================================ command line =====
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)

    def mode(name: str, help_text: str, preset: str, out: str):
        p = modes.add_parser(name, help=help_text, description=help_text)
        if preset:
            p.add_argument("--preset", default=preset)
            p.add_argument("--quantization", default=None, help="e.g. fp8 (FP8 weights)")
            p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (an FP8 KV cache)")
            p.add_argument("--max-model-len", type=int, default=2304)
        p.add_argument("--out", default=f"bench_results/{out}.json", help="JSON result file")
        return p

    p = mode(
        "decode",
        "per-kernel table of one decode step, and the step as served",
        "qwen3-30b-a3b",
        "profile-decode",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch1-context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=40, help="kernel rows printed")
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny-qwen3-moe, float32, a few steps (checks the mode runs)",
    )
    p = mode(
        "static",
        "the static workload step by step: device time by kernel kind, host stages",
        "llama-3.1-8b",
        "profile-static",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=128, help="output tokens per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p = mode(
        "timeline",
        "a served decode step's device busy/idle time and the host work around each gap",
        "qwen3-30b-a3b",
        "profile-timeline",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens of the timed run")
    p.add_argument("--steps", type=int, default=12, help="decode steps profiled")
    p.add_argument("--trace", default="bench_results/profile-timeline.trace.json.gz")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-llama, float32")
    p = mode("cpu", "a CPU decode step's engine stages and model op kinds", "", "profile-cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--profiler-steps", type=int, default=8)
    p.add_argument("--quantization", default=None, help="passed to LLM(quantization=...)")
    p.add_argument(
        "--skinny",
        action="store_true",
        help="SmolLM2's depth and heads with 64-wide linears: overhead only",
    )
    p.add_argument("--smoke", action="store_true", help="few tokens: checks it runs")
    args = parser.parse_args(argv)
    if args.mode == "decode" and args.smoke:
        args.preset, args.dtype, args.device = "tiny-qwen3-moe", "float32", "cpu"
        args.batches, args.context, args.batch1_context = "1,2", 8, 8
        args.steps, args.max_model_len, args.kv_cache_memory = 2, 128, 1 << 24
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    run = {"decode": run_decode, "static": run_static, "timeline": run_timeline, "cpu": run_cpu}[
        args.mode
    ]
    result = run(args)
    write_result(
        args.out, {"benchmark": f"profile_step {args.mode}", "args": vars(args), **result}, indent=1
    )


if __name__ == "__main__":
    main()
