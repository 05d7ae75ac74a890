"""Tile sweep of the fused MoE grouped GEMMs (gate/up with the SiLU-and-mul epilogue, and
down with the routing weights), one layer of each model's shape, on the GPU.

    python3 benchmarks/moe_gemm_sweep.py --out benchmarks/results/moe_gemm_sweep.json
    python3 benchmarks/moe_gemm_sweep.py --models qwen3-30b-a3b --tokens 16384

For each model (Qwen3-30B-A3B: 128 experts of 768, top 8; DeepSeek-V2-Lite: 64 of
1408, top 6; hidden 2048) and token count (16384: a prefill step; 256: a decode step at
batch 256), random routing, each candidate tile config of
pagoda.kernels.moe.fused_moe._grouped_gemm is timed on its own (median of CUDA-event timed
launches after a warm-up) and checked against the default config's output. Reports
TFLOP/s and the bandwidth over the expert weights the step touches, with the ceilings
measured in the same run, and the best config per (model, tokens, GEMM). Prints a table;
writes JSON. A diagnostic program: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)
from moe_bench import time_ms  # noqa: E402  (benchmarks/)
from result_file import write_json  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); GROUP_M 8 for prefill, 1 for decode.
# The first entries of each list: the best of the sweeps so far (--configs N keeps them).
PREFILL_CONFIGS = [
    (128, 128, 32, 8, 5), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
    (64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (128, 64, 128, 4, 3), (64, 64, 64, 4, 4),
    (64, 256, 64, 8, 3),
]
DECODE_CONFIGS = [
    (32, 128, 128, 4, 3), (16, 128, 128, 4, 4), (32, 128, 64, 4, 4), (16, 64, 128, 4, 4),
    (16, 64, 256, 4, 3), (16, 128, 64, 4, 5), (16, 256, 64, 8, 4), (32, 64, 128, 4, 4),
    (16, 32, 256, 4, 4), (16, 64, 128, 2, 4), (64, 128, 64, 4, 4),
]
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v2-lite": (64, 2048, 1408, 6)}


def make_layer(model: str, tokens: int, seed: int = 0):
    import torch
    num_experts, hidden, inter, top_k = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=dt,
                      generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, device=dev, dtype=dt,
                     generator=gen) * inter ** -0.5
    logits = torch.randn(tokens, num_experts, device=dev, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def sweep_case(model: str, tokens: int, configs, repeat: int, ceilings: dict,
               tma: bool = False) -> dict:
    results_names = ("gate_up", "down")
    import torch
    from pagoda.kernels.moe import fused_moe as fm
    x, w13, w2, weights, ids = make_layer(model, tokens)
    num_experts, hidden, inter, top_k = SHAPES[model]
    pairs = tokens * top_k
    flat_w = weights.reshape(-1).contiguous()
    hit = int(torch.unique(ids).numel())
    gemms = {"gate_up": (2 * pairs * hidden * 2 * inter, hit * 2 * inter * hidden * 2),
             "down": (2 * pairs * inter * hidden, hit * hidden * inter * 2)}
    # The defaults: pick_config's tiles, one per GEMM (they share BLOCK_M).
    defaults = {name: fm.pick_config(pairs, num_experts, gemm=name) for name in results_names}
    default = defaults["gate_up"]
    ref = {}
    results = {name: [] for name in results_names}
    act_in = torch.randn(pairs, inter, device="cuda", dtype=torch.bfloat16)
    candidates = [default] + [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s,
                                   GROUP_M=8 if tokens > 1024 else 1)
                              for m, n, k, w, s in configs]
    if tma:  # each candidate again with its B tiles by tensor descriptor
        candidates += [{**c, "B_TMA": True} for c in candidates]
    for i, candidate in enumerate(candidates):
        sorted_ids, expert_ids, used = fm.moe_align_block_size(ids, candidate["BLOCK_M"],
                                                               num_experts)
        for name in results_names:
            cfg = defaults[name] if i == 0 else candidate
            if name == "gate_up":
                out = torch.empty(pairs, inter, device="cuda", dtype=torch.bfloat16)
                run = (lambda c=cfg, o=out, s=sorted_ids, e=expert_ids, u=used: fm._grouped_gemm(
                    x, w13, o, flat_w, s, e, u, top_k, False, c, gate_up_act=True))
            else:
                out = torch.empty(pairs, hidden, device="cuda", dtype=torch.bfloat16)
                run = (lambda c=cfg, o=out, s=sorted_ids, e=expert_ids, u=used: fm._grouped_gemm(
                    act_in, w2, o, flat_w, s, e, u, 1, True, c))
            entry = {"config": cfg, "default": i == 0}
            try:
                ms = time_ms(run, x.device, repeat)
            except Exception as exc:  # out of shared memory / registers: report, go on
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                results[name].append(entry)
                continue
            out.zero_()
            run()
            if i == 0:
                ref[name] = out.float().clone()
            flops, nbytes = gemms[name]
            entry.update(ms=ms, tflops=flops / ms / 1e9, weight_tbps=nbytes / ms / 1e9,
                         max_abs_diff=(out.float() - ref[name]).abs().max().item())
            if ceilings:
                entry["roofline_ms"] = max(flops / ceilings["bf16_matmul_flops"],
                                           nbytes / ceilings["copy_bytes_per_s"]) * 1e3
            results[name].append(entry)
    return {"model": model, "tokens": tokens, "pairs": pairs, "experts_hit": hit,
            "gemms": results}


def print_case(case: dict) -> None:
    print(f"\n{case['model']} T={case['tokens']} ({case['pairs']} pairs)")
    for name, rows in case["gemms"].items():
        ok = [r for r in rows if "ms" in r]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        for r in rows:
            c = r["config"]
            tag = (f"{c['BLOCK_M']:>3}x{c['BLOCK_N']:<3} k{c['BLOCK_K']:<3} w{c['num_warps']} "
                   f"s{c['num_stages']}{' tma' if c.get('B_TMA') else '    '}")
            if "ms" not in r:
                print(f"  {name:<8} {tag}  error {r['error'][:60]}")
                continue
            mark = (" <- default" if r["default"] else "") + (" <- best" if r is best else "")
            print(f"  {name:<8} {tag}  {r['ms'] * 1e3:8.1f} us {r['tflops']:6.0f} TFLOP/s "
                  f"{r['weight_tbps']:5.2f} TB/s diff {r['max_abs_diff']:.2e}{mark}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite")
    p.add_argument("--tokens", default="16384,256")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--tma", action="store_true",
                   help="also each config with its B tiles by tensor descriptor (B_TMA)")
    p.add_argument("--configs", type=int, default=None,
                   help="only the first N candidate configs of each list (with the default)")
    p.add_argument("--out", default="benchmarks/results/moe_gemm_sweep.json")
    args = p.parse_args()
    import torch
    from gpu_compare import measure_ceilings
    ceilings = measure_ceilings(torch.device("cuda"))
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceilings['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    cases = []
    for model in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            configs = (PREFILL_CONFIGS if tokens > 1024 else DECODE_CONFIGS)[:args.configs]
            case = sweep_case(model, tokens, configs, args.repeat, ceilings, args.tma)
            print_case(case)
            cases.append(case)
            torch.cuda.empty_cache()
    write_json(args.out, {"device": torch.cuda.get_device_name(), "ceilings": ceilings,
                          "cases": cases})


if __name__ == "__main__":
    main()
