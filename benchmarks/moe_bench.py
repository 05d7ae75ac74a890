"""Mixture-of-experts on one GPU: the fused Triton MoE kernel against the torch reference,
and whole MoE models (dummy bf16 weights) through pagoda.LLM, with rooflines.

    python3 benchmarks/moe_bench.py --out benchmarks/results/moe.json
    python3 benchmarks/moe_bench.py --models qwen3-30b-a3b,deepseek-v2-lite --out moe.json
    python3 benchmarks/moe_bench.py --smoke          # CPU, tiny shapes (kernel interpreted)

(a) kernel: one MoE layer of the first model's shape (Qwen3-30B-A3B: 128 experts of
    768, top 8, hidden 2048), random routing, at T = 1 and T = 16384 tokens: fused
    kernel (eager, and replayed from a CUDA graph at T = 1) vs the torch reference
    (loop over experts), speedup, and the roofline: bytes of the experts actually hit
    (T = 1) or of all experts (T = 16384) / copy bandwidth, and FLOPs / bf16 matmul rate.
    Side by side, each fused_moe path (gemv decode kernels, grouped GEMMs with the
    SiLU-and-mul epilogue, the unfused first version), eager and in a CUDA graph, and the
    routing (torch ops vs the one Triton kernel; graph replay times in the table).
(b) models (each in its own process): batch-1 decode ms/token (median gap between
    tokens, 128-token prompt) and 256 requests x 1024 in / 128 out output tok/s (run
    --static-runs times with fresh prompts: the first cold, the last reported), with
    rooflines: active-parameter bytes per decode step at batch 1, all weight bytes at
    large batch, / measured copy bandwidth.
Prints a table; writes JSON.
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
from datetime import datetime, timezone

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)
from result_file import write_json  # noqa: E402  (benchmarks/)


# ---------------------------------------------------------------- sizes -----------
def moe_active_bytes(arch, dtype_bytes: int = 2) -> dict:
    """Weight bytes streamed by one decode step: at batch 1 (dense weights + the top-k
    routed experts and the shared ones per MoE layer), and at large batch (all experts).
    The embedding is only looked up (not streamed); the LM head is."""
    from pagoda.model.layers.moe.deepseek_moe import is_moe_layer

    h, moe = arch.hidden_size, arch.moe
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    attention = h * (q + 2 * kv) + q * h
    dense_mlp = 3 * h * arch.intermediate_size
    expert = 3 * h * moe.moe_intermediate_size
    active = total = arch.vocab_size * h  # LM head
    for layer in range(arch.num_hidden_layers):
        active += attention
        total += attention
        if is_moe_layer(arch, layer):
            shared = moe.n_shared_experts * expert + moe.num_experts * h  # + router
            active += shared + moe.num_experts_per_tok * expert
            total += shared + moe.num_experts * expert
        else:
            active += dense_mlp
            total += dense_mlp
    return {"active_bytes": active * dtype_bytes, "all_bytes": total * dtype_bytes,
            "kv_bytes_per_token": 2 * arch.num_hidden_layers * kv * dtype_bytes}


# ---------------------------------------------------------------- (a) kernel -------
def time_ms(fn, device, repeat: int) -> float:
    import torch
    for _ in range(2):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - start) / repeat * 1e3
    times = []
    for _ in range(repeat):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _graph_ms(fn, repeat: int) -> float:
    import torch
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, torch.device("cuda"), repeat)


def bench_kernel(arch, tokens: int, device, ceilings: dict, repeat: int) -> dict:
    import torch
    from pagoda.kernels.moe import fused_moe as fm
    from pagoda.model.layers.moe.routing import select_experts

    moe, h, inter = arch.moe, arch.hidden_size, arch.moe.moe_intermediate_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, h, device=device, dtype=dtype, generator=gen)
    w13 = torch.randn(moe.num_experts, 2 * inter, h, device=device, dtype=dtype,
                      generator=gen) * h ** -0.5
    w2 = torch.randn(moe.num_experts, h, inter, device=device, dtype=dtype,
                     generator=gen) * inter ** -0.5
    logits = torch.randn(tokens, moe.num_experts, device=device, generator=gen)
    correction = (torch.zeros(moe.num_experts, device=device)
                  if moe.topk_method == "noaux_tc" else None)
    weights, ids = select_experts(logits, moe, correction)
    out = {"tokens": tokens, "experts_hit": int(torch.unique(ids).numel())}
    out["fused_ms"] = time_ms(lambda: fm.fused_moe(x, w13, w2, weights, ids), device, repeat)
    out["reference_ms"] = time_ms(lambda: fm.fused_moe_reference(x, w13, w2, weights, ids),
                                   device, max(1, repeat // 4))
    out["speedup"] = out["reference_ms"] / out["fused_ms"]
    if device.type == "cuda" and tokens <= 64:
        out["fused_graph_ms"] = _graph_ms(lambda: fm.fused_moe(x, w13, w2, weights, ids), repeat)
    out["paths"] = compare_paths(fm, (x, w13, w2, weights, ids), device, repeat)
    out["routing"] = compare_routing(logits, moe, correction, device, repeat)
    expert_bytes = 3 * h * inter * x.element_size()
    read = out["experts_hit"] * expert_bytes
    flops = 2 * 3 * h * inter * tokens * moe.num_experts_per_tok
    out["weight_bytes_read"] = read
    if ceilings:
        out["roofline_ms"] = max(read / ceilings["copy_bytes_per_s"],
                                 flops / ceilings["bf16_matmul_flops"]) * 1e3
        out["fused_tflops"] = flops / out["fused_ms"] / 1e9
    return out


def compare_paths(fm, args, device, repeat: int) -> dict:
    """Each fused_moe path (pagoda.kernels.moe.fused_moe.PATHS) on the same inputs: eager ms,
    CUDA-graph replay ms at decode sizes, and the largest difference from the default
    path's output. The GEMV path only up to 64 tokens (it re-reads shared experts)."""
    tokens = args[0].shape[0]
    default = fm.fused_moe(*args)
    paths = {}
    for path in fm.PATHS:
        if path == "gemv" and tokens > 64:
            continue
        run = (lambda p=path: fm.fused_moe(*args, path=p))
        entry = {"ms": time_ms(run, device, repeat),
                 "max_abs_diff_vs_default": (run().float() - default.float()).abs().max().item()}
        if device.type == "cuda" and tokens <= 64:
            entry["graph_ms"] = _graph_ms(run, repeat)
        paths[path] = entry
    return paths


def compare_routing(logits, moe, correction, device, repeat: int) -> dict:
    """select_experts: the torch ops against the one Triton kernel (CUDA)."""
    from pagoda.model.layers.moe import routing
    out = {"torch_ms": time_ms(lambda: routing.select_experts_torch(logits, moe, correction),
                                device, repeat)}
    if device.type == "cuda":
        from pagoda.kernels.moe.routing import route_topk
        out["kernel_ms"] = time_ms(lambda: route_topk(logits, moe, correction), device, repeat)
        out["torch_graph_ms"] = _graph_ms(
            lambda: routing.select_experts_torch(logits, moe, correction), repeat)
        out["kernel_graph_ms"] = _graph_ms(lambda: route_topk(logits, moe, correction), repeat)
    return out


# ---------------------------------------------------------------- (b) models -------
def run_model(preset: str, args) -> dict:
    import numpy as np
    from gpu_compare import random_prompts, token_arrival_times
    from kernel_switches import apply_kernel_switches
    from triton_compiles import CompileLog
    from pagoda import LLM, SamplingParams

    apply_kernel_switches(args)
    t0 = time.perf_counter()
    kwargs = dict(kv_cache_memory=1 << 26, device="cpu") if args.smoke else {}
    llm = LLM(preset, load_format="dummy", dtype="float32" if args.smoke else "bfloat16",
              max_model_len=args.max_model_len, max_num_seqs=args.batch,
              skip_tokenizer_init=True, **kwargs)
    engine = llm.llm_engine
    result = {"preset": preset, "startup_s": time.perf_counter() - t0}
    vocab, rng = engine.model_info.vocab_size, np.random.default_rng(0)
    prompt = random_prompts(rng, [args.latency_prompt], vocab)[0]
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, **greedy),
                 use_tqdm=False)
    engine.add_request("lat", prompt, SamplingParams(max_tokens=args.latency_tokens, **greedy),
                       output_kind="delta")
    arrivals = token_arrival_times(engine)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    result["batch1_ms_per_token"] = statistics.median(gaps) * 1e3
    if args.batch1_only:
        engine.shutdown()
        return result
    # The first run also pays Triton's compilation of the kernels (and tile
    # configurations) that the 16k-token prefill steps and the shrinking decode batches
    # meet first; later runs, with fresh prompts (no prefix hits), are the steady state.
    runs = []
    for _ in range(args.static_runs):
        prompts = [{"prompt_token_ids": p}
                   for p in random_prompts(rng, [args.static_in] * args.batch, vocab)]
        with CompileLog() as compiles:
            start = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=args.static_out, **greedy),
                                use_tqdm=False)
            seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"seconds": seconds, "output_tokens": tokens,
                     "output_tok_per_s": tokens / seconds,
                     "triton_compiles": compiles.summary()})
    result["static_runs"], result["static"] = runs, runs[-1]
    engine.shutdown()
    return result


def model_entry(preset: str, args, ceilings: dict) -> dict:
    from pagoda.model.presets import get_preset

    sizes = moe_active_bytes(get_preset(preset))
    entry = {"model": preset, **sizes}
    if ceilings:
        bw = ceilings["copy_bytes_per_s"]
        entry["roofline_batch1_ms"] = sizes["active_bytes"] / bw * 1e3
        entry["roofline_all_experts_ms"] = sizes["all_bytes"] / bw * 1e3
    argv = [sys.executable, os.path.abspath(__file__), "--child", preset,
            *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k not in ("models", "out", "child", "smoke", "child_timeout", "skip_models",
                           "batch1_only") and v is not None],
            *(["--smoke"] if args.smoke else []), *(["--batch1-only"] if args.batch1_only else [])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=args.child_timeout)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        entry["result"] = json.loads(lines[-1]) if lines else {"error": out.stderr[-3000:]}
    except subprocess.TimeoutExpired:
        entry["result"] = {"error": f"timed out after {args.child_timeout:.0f} s"}
    return entry


# ---------------------------------------------------------------- driver ----------
def parse_args():
    from kernel_switches import add_kernel_switches
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b",
                   help="comma-separated MoE presets; the first one's layer shape is (a)'s")
    p.add_argument("--kernel-tokens", default="1,16384")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--latency-prompt", type=int, default=128)
    p.add_argument("--latency-tokens", type=int, default=128)
    p.add_argument("--static-in", type=int, default=1024)
    p.add_argument("--static-out", type=int, default=128)
    p.add_argument("--static-runs", type=int, default=2,
                   help="runs of the static workload; the first is cold, the last reported")
    p.add_argument("--skip-models", action="store_true", help="only the kernel part (a)")
    p.add_argument("--batch1-only", action="store_true",
                   help="models: the batch-1 decode only, not the 256-request run")
    add_kernel_switches(p)
    p.add_argument("--out", default="benchmarks/results/moe_bench.json")
    p.add_argument("--child-timeout", type=float, default=1500.0)
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny-qwen3-moe, tiny workloads; the kernel runs interpreted")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.models, args.kernel_tokens, args.repeat = "tiny-qwen3-moe", "1,16", 2
        args.max_model_len, args.batch, args.latency_prompt = 64, 4, 8
        args.latency_tokens, args.static_in, args.static_out = 4, 16, 4
    if args.static_runs < 1:
        p.error("--static-runs must be at least 1")
    return args


def print_table(report: dict) -> None:
    print(f"\n{'kernel T':>9}{'fused ms':>11}{'graph ms':>10}{'ref ms':>10}{'speedup':>9}"
          f"{'roofline ms':>13}")
    for k in report["kernel"]:
        print(f"{k['tokens']:>9}{k['fused_ms']:>11.3f}{k.get('fused_graph_ms', float('nan')):>10.3f}"
              f"{k['reference_ms']:>10.3f}{k['speedup']:>9.1f}"
              f"{k.get('roofline_ms', float('nan')):>13.3f}")
    print(f"\n{'kernel T':>9}{'path':>9}{'eager ms':>10}{'graph ms':>10}{'max diff':>10}"
          f"{'route torch':>13}{'route kernel':>14}")
    nan = float("nan")
    for k in report["kernel"]:
        r = k["routing"]
        for path, e in k["paths"].items():
            print(f"{k['tokens']:>9}{path:>9}{e['ms']:>10.3f}{e.get('graph_ms', nan):>10.3f}"
                  f"{e['max_abs_diff_vs_default']:>10.2e}"
                  f"{r.get('torch_graph_ms', r['torch_ms']):>13.4f}"
                  f"{r.get('kernel_graph_ms', nan):>14.4f}")
    print(f"\n{'model':<20}{'b1 ms/tok':>11}{'roof b1 ms':>12}{'static tok/s':>14}"
          f"{'first run':>11}{'roof all ms':>13}")
    for e in report["models"]:
        r = e["result"]
        first = r.get("static_runs", [{}])[0]
        print(f"{e['model']:<20}{r.get('batch1_ms_per_token', float('nan')):>11.2f}"
              f"{e.get('roofline_batch1_ms', float('nan')):>12.2f}"
              f"{r.get('static', {}).get('output_tok_per_s', float('nan')):>14.0f}"
              f"{first.get('output_tok_per_s', float('nan')):>11.0f}"
              f"{e.get('roofline_all_experts_ms', float('nan')):>13.2f}")
        for i, run in enumerate(r.get("static_runs", [])):
            c = run.get("triton_compiles", {})
            if c.get("count"):
                top = ", ".join(f"{k['kernel']} {k['seconds'] or 0:.2f}s" for k in c["kernels"][:4])
                print(f"   static run {i}: {c['count']} Triton compilations, {c['seconds']:.2f} s ({top})")
        if "error" in r:
            print("   error:", r["error"][-400:])


def main() -> None:
    args = parse_args()
    if args.smoke and not args.child:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    if args.child:
        print(json.dumps(run_model(args.child, args)))
        return
    import torch
    from gpu_compare import measure_ceilings
    from kernel_switches import apply_kernel_switches
    from pagoda.model.presets import get_preset

    apply_kernel_switches(args)  # the kernel part (a) runs with them too

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    ceilings = measure_ceilings(device)
    models = args.models.split(",")
    report = {"benchmark": "moe_bench", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "device": str(device), "gpus": torch.cuda.device_count()},
              "args": vars(args), "ceilings": ceilings, "kernel": [], "models": []}
    arch = get_preset(models[0])
    for tokens in [int(t) for t in args.kernel_tokens.split(",") if t]:  # "" skips (a)
        report["kernel"].append(bench_kernel(arch, tokens, device, ceilings, args.repeat))
        print(json.dumps(report["kernel"][-1]), flush=True)
    torch.cuda.empty_cache() if device.type == "cuda" else None
    for preset in ([] if args.skip_models else models):
        report["models"].append(model_entry(preset, args, ceilings))
        print(json.dumps(report["models"][-1])[:600], flush=True)
    write_json(args.out, report, indent=1)
    print_table(report)


if __name__ == "__main__":
    main()
