"""The MoE router at decode sizes: the fused router kernel (router linear + routing in one
launch, pagoda.kernels.moe.router_fused) against the two launches it replaces (MoEGate's
F.linear through cuBLAS, then the routing kernel route_topk via select_experts).

    python3 benchmarks/moe_router_bench.py --out benchmarks/results/moe_router.json
    python3 benchmarks/moe_router_bench.py --smoke     # CPU, tiny shapes, interpreted

Cases (shapes from pagoda/model/presets.py): Qwen3-30B-A3B (E=128, k=8, H=2048, bf16
router, renormalised), DeepSeek-V2-Lite (E=64, k=6, H=2048, float32 router; greedy as in
its config, and the same routing spelt group_limited_greedy n_group=1 topk_group=1 to
time the grouped code path), and DeepSeek-V3's router shape (E=256, H=7168, sigmoid
noaux_tc) for reference; T = 1 and 8 rows (--tokens).

Per case and T, microseconds per MoE layer:
- eager: a Python loop over --layers layers (each its own router weight), CUDA events
  around the loop / layers (includes the CPU launch cost);
- graph: the same loop captured in one CUDA graph, replay time / layers: device time
  per layer. Layers' weights total more than twice the L2 cache, so each layer's weight
  comes from HBM as in a real decode step ("cold"); "hot" repeats one layer's weight;
- the fused kernel's launch-shape sweep (experts per program 1/2/4 x num_warps
  1/2/4/8; each compiled once), graph cold;
- rows whose chosen experts differ between the two paths (only bf16-tied logits may);
- the roofline: router weight bytes / measured copy bandwidth.
Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from datetime import datetime, timezone

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)
from result_file import write_json  # noqa: E402  (benchmarks/)


def cases(smoke: bool) -> list[dict]:
    from pagoda.model.moe_config import MoEConfig
    from pagoda.model.presets import get_preset

    if smoke:
        return [dict(name="tiny-softmax", cfg=MoEConfig(16, 4, 8, renormalize=True),
                     hidden=64, fp32=False),
                dict(name="tiny-noaux-tc", cfg=MoEConfig(
                    32, 4, 8, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4,
                    topk_group=2, renormalize=True, routed_scaling_factor=2.5),
                    hidden=64, fp32=True)]
    qwen, lite = get_preset("qwen3-30b-a3b"), get_preset("deepseek-v2-lite")
    lite_grouped = MoEConfig(lite.moe.num_experts, lite.moe.num_experts_per_tok,
                             lite.moe.moe_intermediate_size, topk_method="group_limited_greedy",
                             n_group=1, topk_group=1)
    v3 = MoEConfig(256, 8, 2048, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8,
                   topk_group=4, renormalize=True, routed_scaling_factor=2.5)
    return [dict(name="qwen3-30b-a3b", cfg=qwen.moe, hidden=qwen.hidden_size, fp32=False),
            dict(name="deepseek-v2-lite", cfg=lite.moe, hidden=lite.hidden_size, fp32=True),
            dict(name="deepseek-v2-lite-grouped", cfg=lite_grouped, hidden=lite.hidden_size,
                 fp32=True),
            dict(name="deepseek-v3-router", cfg=v3, hidden=7168, fp32=True)]


def make_layers(case: dict, num_layers: int, device, dtype):
    """num_layers MoEGates (random weights, each with its fused-router scratch) and the
    correction bias (noaux_tc) they share."""
    import torch
    from pagoda.kernels.moe.router_fused import RouterScratch
    from pagoda.model.layers.moe.gate import MoEGate

    cfg, h = case["cfg"], case["hidden"]
    gen = torch.Generator(device=device).manual_seed(0)
    gates = []
    for _ in range(num_layers):
        gate = MoEGate(h, cfg.num_experts, fp32=case["fp32"])
        wdtype = torch.float32 if case["fp32"] else dtype
        gate.weight.data = (torch.randn(cfg.num_experts, h, device=device, generator=gen)
                            * 2 / h ** 0.5).to(wdtype)
        gate.router_scratch = RouterScratch.create(cfg.num_experts, torch.device(device))
        gates.append(gate)
    bias = None
    if cfg.topk_method == "noaux_tc":
        bias = torch.randn(cfg.num_experts, device=device, generator=gen) * 0.1
    return gates, bias


def unfused(gate, hidden, cfg, bias):
    from pagoda.model.layers.moe.routing import select_experts
    return select_experts(gate(hidden), cfg, bias)  # F.linear, then route_topk on CUDA


def fused(gate, hidden, cfg, bias, tiles=None):
    from pagoda.kernels.moe.router_fused import fused_route
    return fused_route(hidden, gate.weight, cfg, bias, gate.fp32, gate.router_scratch, tiles)


def time_loop_us(fn, gates, device, repeat: int, graph: bool) -> float:
    """Microseconds per layer of `for gate in gates: fn(gate)`, eager or graph-replayed."""
    import time

    import torch

    def loop():
        for gate in gates:
            fn(gate)
    loop()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeat):
            loop()
        return (time.perf_counter() - start) / repeat / len(gates) * 1e6
    run = loop
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            loop()
        g.replay()
        run = g.replay
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times) / len(gates) * 1e3


def rows_differ(a, b) -> int:
    ia, ib = a[1].long().sort(dim=-1).values, b[1].long().sort(dim=-1).values
    return int((ia != ib).any(dim=-1).sum().item())


def bench_case(case: dict, tokens: int, args, device, ceilings: dict) -> dict:
    import torch
    from pagoda.kernels.moe.router_fused import default_tiles

    cfg = case["cfg"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    gates, bias = make_layers(case, args.layers, device, dtype)
    gen = torch.Generator(device=device).manual_seed(tokens)
    hidden = torch.randn(tokens, case["hidden"], device=device, generator=gen).to(dtype)
    tiles = default_tiles(tokens, cfg.num_experts, case["hidden"], cfg)
    out = {"case": case["name"], "tokens": tokens, "num_experts": cfg.num_experts,
           "top_k": cfg.num_experts_per_tok, "hidden": case["hidden"],
           "fp32_router": case["fp32"], "topk_method": cfg.topk_method,
           "default_tiles": vars(tiles),
           "rows_differ": rows_differ(fused(gates[0], hidden, cfg, bias),
                                      unfused(gates[0], hidden, cfg, bias))}
    paths = {"unfused": lambda g: unfused(g, hidden, cfg, bias),
             "fused": lambda g: fused(g, hidden, cfg, bias)}
    graph = device.type == "cuda"
    for name, fn in paths.items():
        out[f"{name}_eager_us"] = time_loop_us(fn, gates, device, args.repeat, False)
        if graph:
            out[f"{name}_graph_us"] = time_loop_us(fn, gates, device, args.repeat, True)
            out[f"{name}_graph_hot_us"] = time_loop_us(fn, [gates[0]] * len(gates), device,
                                                       args.repeat, True)
    if graph:
        out["linear_only_graph_us"] = time_loop_us(lambda g: g(hidden), gates, device,
                                                   args.repeat, True)
    sweep = []
    for block_x in (1, 2, 4):
        for warps in (1, 2, 4, 8):
            t = default_tiles(tokens, cfg.num_experts, case["hidden"], cfg, block_x, warps)
            us = time_loop_us(lambda g: fused(g, hidden, cfg, bias, t), gates, device,
                              args.repeat, graph)
            sweep.append({**vars(t), "us": us,
                          "rows_differ": rows_differ(fused(gates[0], hidden, cfg, bias, t),
                                                     unfused(gates[0], hidden, cfg, bias))})
            if args.smoke:
                break
    out["sweep"] = sweep
    out["best"] = min(sweep, key=lambda s: s["us"])
    weight_bytes = gates[0].weight.numel() * gates[0].weight.element_size()
    out["weight_bytes"] = weight_bytes
    if ceilings:
        out["roofline_us"] = weight_bytes / ceilings["copy_bytes_per_s"] * 1e6
    return out


def print_table(rows: list[dict]) -> None:
    nan = float("nan")
    print(f"\n{'case':<26}{'T':>3}{'unfused eager':>14}{'fused eager':>12}"
          f"{'unfused graph':>14}{'fused graph':>12}{'hot u/f':>14}{'linear':>8}"
          f"{'best sweep':>11}{'roof':>6}{'diff':>5}  (us per layer)")
    for r in rows:
        best = r["best"]
        print(f"{r['case']:<26}{r['tokens']:>3}{r['unfused_eager_us']:>14.2f}"
              f"{r['fused_eager_us']:>12.2f}{r.get('unfused_graph_us', nan):>14.2f}"
              f"{r.get('fused_graph_us', nan):>12.2f}"
              f"{r.get('unfused_graph_hot_us', nan):>7.2f}/{r.get('fused_graph_hot_us', nan):<6.2f}"
              f"{r.get('linear_only_graph_us', nan):>8.2f}"
              f"{best['us']:>7.2f} x{best['block_x']}w{best['num_warps']}"
              f"{r.get('roofline_us', nan):>6.2f}{r['rows_differ']:>5}")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--layers", type=int, default=192,
                   help="distinct router weights per loop (more than 2x L2 in total)")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--cases", default="", help="comma-separated case names (default all)")
    p.add_argument("--out", default="benchmarks/results/moe_router.json")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny shapes, the kernel interpreted (TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.layers, args.repeat = "1,3", 2, 1
    return args


def main() -> None:
    args = parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch
    from gpu_compare import measure_ceilings

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    ceilings = measure_ceilings(device)
    wanted = set(filter(None, args.cases.split(",")))
    report = {"benchmark": "moe_router_bench", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "device": str(device),
                          "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
              "args": vars(args), "ceilings": ceilings, "results": []}
    for case in cases(args.smoke):
        if wanted and case["name"] not in wanted:
            continue
        for tokens in map(int, args.tokens.split(",")):
            row = bench_case(case, tokens, args, device, ceilings)
            report["results"].append(row)
            print({k: v for k, v in row.items() if k != "sweep"}, flush=True)
    write_json(args.out, report)
    print_table(report["results"])


if __name__ == "__main__":
    main()
