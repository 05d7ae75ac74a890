"""Pagoda vs Hugging Face transformers on the same dummy model, on one GPU, with the
rooflines measured in the same run.

    python -m benchmarks.gpu_compare --out results.json            # both engines, all workloads
    python -m benchmarks.gpu_compare --engine pagoda --preset tiny-llama --device cpu --small

Each engine runs in its own subprocess (so one's memory never crowds the other), then
the parent prints one table with the rooflines: a decode step can be no faster than
(weight bytes + KV bytes read) / measured copy bandwidth, nor than FLOPs / measured
bf16 matmul rate. Workloads (Llama-3.1-8B shape, bf16, random weights):
  latency     batch-1 decode, 128 prompt tokens: ms per output token (median gap
              between tokens reaching the host)
  static      256 requests, 1024 in / 128 out: output tok/s
  nanovllm    256 requests, input and output lengths uniform in [100, 1024]: output tok/s
  decode256   decode step at batch 256 with ~1k context: ms per step vs roofline
  profile     host time per engine stage (batch 1 and full batch) and a torch.profiler
              table of one prefill step, after the figures above

Quantized variants run beside bf16 in the same run (each its own subprocess):
    python -m benchmarks.gpu_compare --variants bf16,fp8,fp8kv,fp8+fp8kv \
        --workloads latency,static,decode256
("fp8": --quantization fp8 weights; "fp8+head": and --quantize-lm-head; "fp8kv":
--kv-cache-dtype fp8.) `--ab-sync` adds Pagoda with async scheduling off.

Nothing syncs the device between engine steps: with async scheduling a sync would
serialise host and device again. Step times are host wall time between `step()` returns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime

from benchmarks.harness.compiles import CompileLog
from benchmarks.harness.processes import env_with_repo, module_command
from benchmarks.harness.results import write_result
from benchmarks.harness.rooflines import measure_ceilings, model_bytes_and_flops, roofline_decode_ms
from benchmarks.harness.timing import engine_stage_timer
from benchmarks.harness.workloads import random_prompts, token_arrival_times, uniform_lengths


# ---------------------------------------------------------------- pagoda ----------
def run_pagoda(args) -> dict:
    import numpy as np
    import torch

    from pagoda import LLM

    t0 = time.perf_counter()
    quant = {}
    if args.quantization:
        quant["quantization"] = args.quantization
    if args.kv_cache_dtype:
        quant["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantize_lm_head:
        quant["quantize_lm_head"] = True
    llm = LLM(
        args.preset,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        enforce_eager=args.enforce_eager,
        kv_cache_memory=args.kv_cache_memory,
        async_scheduling=args.engine != "pagoda-sync",
        **quant,
    )
    engine = llm.llm_engine
    runner = engine.executor.runner
    workloads = set(args.workloads.split(","))
    label = args.engine if not args.variant else f"pagoda[{args.variant}]"
    result = {
        "engine": label,
        "async_scheduling": engine.async_scheduling,
        **quant,
        "startup_s": time.perf_counter() - t0,
        "load_s": runner.load_seconds,
        "num_kv_blocks": engine.num_blocks,
        "cuda_graphs": runner.graph_runner is not None,
        "graph_capture_s": getattr(runner.graph_runner, "capture_seconds", 0.0),
        "warmup_s": runner.warmup_seconds,
        "memory": getattr(runner, "memory_report", None),
        "attention_backend": runner.backend.name,
    }
    vocab = engine.model_info.vocab_size
    rng = np.random.default_rng(0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    if "latency" in workloads:
        result["latency"] = pagoda_latency(llm, engine, rng, vocab, sync, args)
    if "static" in workloads:
        result.update(
            pagoda_static(llm, engine, rng, vocab, sync, args, profile="profile" in workloads)
        )
    if "nanovllm" in workloads:
        result["nanovllm"] = pagoda_nanovllm(llm, rng, vocab, sync, args)
    if "decode256" in workloads:
        result["decode256"], prompts = pagoda_decode256(engine, rng, vocab, args)
        if "profile" in workloads:
            result["stage_ms_per_step"] = profile_stages(engine, prompts, sync)
    return result


def pagoda_latency(llm, engine, rng, vocab, sync, args) -> dict:
    """One request; the time between its tokens reaching the host, as a streaming user
    sees it (no device sync between steps: it would undo the overlap)."""
    from pagoda import SamplingParams

    prompt = random_prompts(rng, [args.latency_prompt], vocab)[0]
    params = SamplingParams(max_tokens=args.latency_tokens, temperature=0, ignore_eos=True)
    llm.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
    )
    sync()
    start = time.perf_counter()
    engine.add_request("lat", prompt, params, output_kind="delta")
    arrivals = token_arrival_times(engine)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {
        "prefill_ms": (arrivals[0] - start) * 1e3,
        "decode_ms_per_token_median": statistics.median(gaps) * 1e3,
        "decode_ms_per_token_mean": statistics.mean(gaps) * 1e3,
    }


def pagoda_static(llm, engine, rng, vocab, sync, args, profile: bool) -> dict:
    """batch x (in / out). Stepped by hand to record each step's time and size."""
    from pagoda import SamplingParams

    result = {}
    prompts = random_prompts(rng, [args.static_in] * args.batch, vocab)
    params = SamplingParams(max_tokens=args.static_out, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params, output_kind="final_only")
    step_log, toks = [], 0
    sync()
    s = time.perf_counter()
    with CompileLog() as compiles:  # kernels the warm-up missed compile inside the steps
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            step_log.append((engine.last_num_scheduled_tokens, time.perf_counter() - t))
            toks += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        sync()
        el = time.perf_counter() - s
    prefill_steps = [t for n, t in step_log if n > args.batch]
    result["static"] = {
        "seconds": el,
        "output_tokens": toks,
        "output_tok_per_s": toks / el,
        "preemptions": engine.get_stats().num_preemptions,
        "steps": len(step_log),
        "prefill_steps": len(prefill_steps),
        "prefill_seconds": sum(prefill_steps),
        "triton_compiles": compiles.summary(),
        "step_log": [[n, round(t * 1e3, 2)] for n, t in step_log],
    }
    c = result["static"]["triton_compiles"]
    if c.get("available"):
        print(
            f"  static: {c['count']} Triton compilations inside the steps, {c['seconds']:.2f} s "
            + ", ".join(f"({k['kernel']} {k['seconds'] or 0.0:.2f}s)" for k in c["kernels"][:4]),
            flush=True,
        )
    if args.device == "cuda" and profile:
        result["prefill_profile"] = profile_prefill_step(engine, rng, vocab, args)
    return result


def pagoda_nanovllm(llm, rng, vocab, sync, args) -> dict:
    """Random lengths, as nano-vllm's benchmark."""
    from pagoda import SamplingParams

    ins = uniform_lengths(rng, args.batch, args.nano_min, args.nano_max)
    outs_len = uniform_lengths(rng, args.batch, args.nano_min, args.nano_max)
    prompts = random_prompts(rng, ins, vocab)
    plist = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True) for n in outs_len]
    sync()
    s = time.perf_counter()
    outs = llm.generate(prompts, plist, use_tqdm=False)
    sync()
    el = time.perf_counter() - s
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": el, "output_tokens": toks, "output_tok_per_s": toks / el}


def pagoda_decode256(engine, rng, vocab, args) -> tuple[dict, list]:
    """Steady decode steps at full batch with ~1k context."""
    from pagoda import SamplingParams

    prompts = random_prompts(rng, [args.static_in] * args.batch, vocab)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, params)
    # Step-to-step wall time (no device sync) while all requests decode.
    steps, last = [], time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        if (
            engine.scheduler.num_running == args.batch
            and engine.scheduler.num_waiting == 0
            and all(r.num_computed_tokens > r.num_prompt_tokens for r in engine.scheduler.running)
        ):
            steps.append(now - last)
        last = now
    decode_steps = steps[-16:] if len(steps) > 16 else steps
    return {
        "step_ms_median": statistics.median(decode_steps) * 1e3,
        "context": args.static_in,
        "batch": args.batch,
    }, prompts


def profile_prefill_step(engine, rng, vocab, args) -> str:
    """torch.profiler table of one fresh 16-request prefill step (top kernels)."""
    import torch

    from pagoda import SamplingParams

    prompts = random_prompts(rng, [args.static_in] * 16, vocab)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof{i}", p, SamplingParams(max_tokens=1, ignore_eos=True))
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


def profile_stages(engine, prompts, sync) -> dict:
    """Where a decode step's time goes, at batch 1 and at full batch (after prefill)."""
    from pagoda import SamplingParams

    timer = engine_stage_timer(engine)
    out = {}
    for label, batch in (("batch1", prompts[:1]), ("batch_full", prompts)):
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for i, p in enumerate(batch):
            engine.add_request(f"p{label}{i}", p, params)
        timer.reset()
        start = time.perf_counter()
        while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
            timer.steps += 1
        sync()
        prefill = timer.per_step_ms()
        prefill["step_total"] = (time.perf_counter() - start) / max(timer.steps, 1) * 1e3
        prefill["steps"] = timer.steps
        out[label + "_prefill"] = prefill
        timer.reset()
        start = time.perf_counter()
        for _ in range(16):
            engine.step()
            timer.steps += 1
        sync()
        stages = timer.per_step_ms()
        stages["step_total"] = (time.perf_counter() - start) / timer.steps * 1e3
        out[label] = stages
        while engine.has_unfinished_requests():
            engine.step()
    return out


# ---------------------------------------------------------------- transformers ----
def run_transformers(args) -> dict:
    import numpy as np
    import torch
    import transformers

    from pagoda.model.presets import get_preset

    arch = get_preset(args.preset)
    cfg = transformers.LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
        rope_scaling=arch.rope_scaling,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation="sdpa"
        ).eval()
    model.generation_config.eos_token_id = None
    result = {
        "engine": "transformers",
        "version": transformers.__version__,
        "startup_s": time.perf_counter() - t0,
    }
    rng = np.random.default_rng(0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def generate(prompts, new):
        ids = torch.tensor(prompts, device=args.device)
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )

    prompt = random_prompts(rng, [args.latency_prompt], arch.vocab_size)
    generate(prompt, 4)
    sync()
    s = time.perf_counter()
    generate(prompt, 1)
    sync()
    first = time.perf_counter() - s
    n = args.hf_latency_tokens
    sync()
    s = time.perf_counter()
    generate(prompt, n)
    sync()
    el = time.perf_counter() - s
    result["latency"] = {
        "prefill_ms": first * 1e3,
        "decode_ms_per_token_mean": (el - first) / (n - 1) * 1e3,
    }
    if "static" not in args.workloads.split(","):
        return result
    prompts = random_prompts(rng, [args.static_in] * args.batch, arch.vocab_size)
    sync()
    s = time.perf_counter()
    out = generate(prompts, args.static_out)
    sync()
    el = time.perf_counter() - s
    toks = (out.shape[1] - args.static_in) * out.shape[0]
    result["static"] = {"seconds": el, "output_tokens": toks, "output_tok_per_s": toks / el}
    return result


# ---------------------------------------------------------------- driver ----------
def child_main(args) -> None:
    result = run_transformers(args) if args.engine == "transformers" else run_pagoda(args)
    with open(args.child_out, "w") as f:
        json.dump(result, f, indent=2)


def print_table(report: dict) -> None:
    engines = {r["engine"]: r for r in report["engines"]}
    names = list(engines)
    roof = report.get("roofline", {})

    def get(engine, *keys):
        d = engines.get(engine, {})
        for k in keys:
            d = d.get(k, {}) if isinstance(d, dict) else {}
        return d if isinstance(d, (int, float)) else float("nan")

    rows = [
        (
            "batch-1 decode ms/token (median gap)",
            ("latency", "decode_ms_per_token_median"),
            roof.get("batch1", {}).get("roofline_ms"),
            "{:.2f}",
        ),
        ("static 1024/128 output tok/s", ("static", "output_tok_per_s"), None, "{:.0f}"),
        (
            "nano-vllm uniform 100-1024 output tok/s",
            ("nanovllm", "output_tok_per_s"),
            None,
            "{:.0f}",
        ),
        (
            "decode step batch 256, 1k ctx (ms)",
            ("decode256", "step_ms_median"),
            roof.get("decode256", {}).get("roofline_ms"),
            "{:.2f}",
        ),
    ]
    print("\n" + f"{'workload':44s}" + "".join(f"{n:>14s}" for n in names) + f"{'roofline':>10s}")
    for label, keys, roofline, fmt in rows:
        if label.startswith("batch-1") and "transformers" in engines:
            keys_of = {
                n: keys if n != "transformers" else ("latency", "decode_ms_per_token_mean")
                for n in names
            }
        else:
            keys_of = {n: keys for n in names}
        cells = "".join(f"{fmt.format(get(n, *keys_of[n])):>14s}" for n in names)
        print(f"{label:44s}{cells}{'-' if roofline is None else format(roofline, '.2f'):>10}")
    d = roof.get("decode256", {})
    for n in names:
        step = get(n, "decode256", "step_ms_median")
        if d and step == step and n != "transformers":
            print(f"  {n}: decode step at {d['roofline_ms'] / step:.0%} of the bf16 roofline")
    for variant, roofs in report.get("roofline_by_variant", {}).items():
        if roofs.get("batch1"):
            print(
                f"  roofline of {variant}: batch 1 {roofs['batch1']['roofline_ms']:.2f} ms, "
                f"decode256 {roofs['decode256']['roofline_ms']:.2f} ms"
            )


# bf16 weights; fp8 weights (the LM head in bf16); fp8 with an FP8 LM head too
# (--quantize-lm-head); an fp8 KV cache on bf16 / fp8 weights.
VARIANTS = ("bf16", "fp8", "fp8+head", "fp8kv", "fp8+fp8kv")
FP8_WEIGHT_VARIANTS = ("fp8", "fp8+head", "fp8+fp8kv")


def variant_flags(variant: str) -> list[str]:
    """Child flags of a --variants entry (the last one names the variant)."""
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}: {', '.join(VARIANTS)}")
    flags = []
    if variant in FP8_WEIGHT_VARIANTS:
        flags += ["--quantization", "fp8"]
    if variant == "fp8+head":
        flags += ["--quantize-lm-head"]
    if variant.endswith("fp8kv"):
        flags += ["--kv-cache-dtype", "fp8"]
    return flags + ["--variant", variant]


def variant_rooflines(info: dict, ceilings: dict, variant: str, args) -> dict:
    """Batch-1 and batch-256 rooflines with fp8 weights (1 byte, but the embedding is
    not streamed anyway and the LM head stays bf16) and/or an fp8 KV cache."""
    info = dict(info)
    if variant in FP8_WEIGHT_VARIANTS:
        head = info["embedding_bytes"]  # the LM head stays bf16 (its size equals the embedding's)
        info["weight_bytes"] = (info["weight_bytes"] - 2 * head) // 2 + 2 * head
        if variant == "fp8+head":
            info["weight_bytes"] -= head // 2
    if variant.endswith("fp8kv"):
        info["kv_bytes_per_token"] //= 2
    return {
        "batch1": roofline_decode_ms(
            info, ceilings, 1, args.latency_prompt + args.latency_tokens // 2
        ),
        "decode256": roofline_decode_ms(info, ceilings, args.batch, args.static_in + 12),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument(
        "--engine",
        default="all",
        choices=["all", "pagoda", "pagoda-sync", "transformers"],
        help="pagoda-sync: Pagoda with async scheduling off (an A/B of the overlap)",
    )
    p.add_argument("--ab-sync", action="store_true", help="with --engine all, also run pagoda-sync")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--latency-prompt", type=int, default=128)
    p.add_argument("--latency-tokens", type=int, default=256)
    p.add_argument("--hf-latency-tokens", type=int, default=32)
    p.add_argument("--static-in", type=int, default=1024)
    p.add_argument("--static-out", type=int, default=128)
    p.add_argument("--nano-min", type=int, default=100)
    p.add_argument("--nano-max", type=int, default=1024)
    p.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke run")
    p.add_argument("--quantization", default=None, help="Pagoda --quantization (e.g. fp8)")
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="Pagoda --quantize-lm-head (with --quantization fp8)",
    )
    p.add_argument("--kv-cache-dtype", default=None, help="Pagoda --kv-cache-dtype (e.g. fp8)")
    p.add_argument(
        "--workloads",
        default="latency,static,nanovllm,decode256,profile",
        help="comma list of latency, static, nanovllm, decode256, profile",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma list of Pagoda variants run side by side: bf16, fp8 (weights), "
        "fp8+head (and the LM head), fp8kv (KV cache), fp8+fp8kv",
    )
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench_results/gpu_compare.json")
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.small:
        args.batch, args.latency_prompt, args.latency_tokens, args.hf_latency_tokens = 4, 8, 8, 4
        args.static_in, args.static_out, args.nano_min, args.nano_max = 16, 8, 4, 16
        args.max_model_len = 64
    return args


def main() -> None:
    args = parse_args()
    if args.child_out:
        return child_main(args)

    import torch

    from pagoda.model.presets import get_preset

    device = torch.device(args.device)
    report = {
        "benchmark": "gpu_compare",
        "date": datetime.now(UTC).isoformat(),
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        },
        "args": vars(args),
        "engines": [],
    }
    report["ceilings"] = measure_ceilings(device)
    info = model_bytes_and_flops(get_preset(args.preset))
    report["model"] = info
    report["roofline"] = {
        "batch1": roofline_decode_ms(
            info, report["ceilings"], 1, args.latency_prompt + args.latency_tokens // 2
        ),
        "decode256": roofline_decode_ms(info, report["ceilings"], args.batch, args.static_in + 12),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    engines = [(args.engine, [])]
    if args.engine == "all":
        names = (
            ["pagoda", "pagoda-sync", "transformers"]
            if args.ab_sync
            else ["pagoda", "transformers"]
        )
        engines = [(n, []) for n in names]
    if args.variants:
        engines = [("pagoda", variant_flags(v)) for v in args.variants.split(",")] + (
            [("transformers", [])] if args.engine == "all" else []
        )
        report["roofline_by_variant"] = {
            v: variant_rooflines(info, report["ceilings"], v, args)
            for v in args.variants.split(",")
        }
    for engine, flags in engines:
        tag = engine if not flags else f"{engine}.{flags[-1]}"
        child_out = f"{args.out}.{tag.replace('+', '_')}.json"
        cmd = module_command(
            "benchmarks.gpu_compare",
            [*sys.argv[1:], "--engine", engine, *flags, "--child-out", child_out],
        )
        print(f"running {engine} ...", flush=True)
        proc = subprocess.run(cmd, env=env_with_repo())
        if proc.returncode != 0:
            report["engines"].append({"engine": engine, "error": f"exit code {proc.returncode}"})
            continue
        with open(child_out) as f:
            report["engines"].append(json.load(f))
    write_result(args.out, report)
    print(json.dumps(report["ceilings"]))
    print_table(report)


if __name__ == "__main__":
    main()
