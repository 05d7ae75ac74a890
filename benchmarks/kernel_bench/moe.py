"""MoE kernel modes: `moe` (the fused MoE layer against the torch reference, by path, with
its roofline; optional tile sweeps) and `router` (the fused router against the gate's
linear plus the routing kernel).

moe: one layer of --model's shape (Qwen3-30B-A3B: 128 experts of 768, top 8, hidden
2048; DeepSeek-V2-Lite: 64 of 1408, top 6), random routing, at --tokens: fused_moe at
the kernel-config variant's tiles (--config) against fused_moe_reference, each path
(gemv decode kernels, grouped GEMMs) eager and from a CUDA graph at decode sizes, the
routing (torch ops against the one Triton kernel), and the roofline: the bytes of the
experts the step hits over the copy bandwidth, or its FLOPs over the matmul rate.
--sweep-grouped: the grouped GEMMs' tiles (candidate BLOCK_M x BLOCK_N x BLOCK_K x
warps x stages, with --tma their B tiles by tensor descriptor), each checked against the
default's output; --sweep-gemv: the batch-1 decode GEMVs' tiles (gate/up and down).

router: Qwen3-30B-A3B (bf16 router), DeepSeek-V2-Lite (float32 router) and DeepSeek-V3's
router shape (256 experts, hidden 7168, sigmoid noaux_tc) at --tokens rows: us per layer
over --layers distinct router weights (together more than the L2), eager and from a
CUDA graph, fused (one launch) against unfused (cuBLAS linear + routing kernel), the
fused kernel's launch-shape sweep, rows whose chosen experts differ, and the roofline
(the router weight's time at the copy bandwidth).
"""

from __future__ import annotations

import itertools

from benchmarks.harness.variants import add_variant_args, configs_for
from benchmarks.kernel_bench import common

MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408)}
GROUPED_CANDIDATES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (128, 128, 32, 8, 5),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 256, 64, 8, 3),
    (32, 128, 128, 4, 3),
    (16, 128, 128, 4, 4),
    (32, 128, 64, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 64, 256, 4, 3),
    (16, 256, 64, 8, 4),
    (32, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
]


def add_moe_args(p) -> None:
    p.add_argument("--model", choices=tuple(MOE_SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="1,16384")
    p.add_argument("--sweep-grouped", action="store_true")
    p.add_argument("--tma", action="store_true", help="the sweep also with TMA B tiles")
    p.add_argument("--sweep-gemv", action="store_true")
    add_variant_args(p)


def _layer(shape, tokens: int, run, seed: int = 0):
    import torch

    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device=run.device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=run.device, generator=gen).to(run.dtype)
    w13 = (
        torch.randn(experts, 2 * inter, hidden, device=run.device, generator=gen) * hidden**-0.5
    ).to(run.dtype)
    w2 = (torch.randn(experts, hidden, inter, device=run.device, generator=gen) * inter**-0.5).to(
        run.dtype
    )
    logits = torch.randn(tokens, experts, device=run.device, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, w13, w2, (weights / weights.sum(-1, keepdim=True)).float(), ids.int(), logits


def _moe_tokens(shape, tokens: int, run, config) -> dict:
    import torch

    from pagoda.kernels.moe import fused_moe as fm

    experts, top_k, hidden, inter = shape
    x, w13, w2, weights, ids, _ = _layer(shape, tokens, run, seed=tokens)
    args = (x, w13, w2, weights, ids)
    default = fm.fused_moe(*args, config=config)
    hit = int(torch.unique(ids).numel())
    nbytes = hit * 3 * hidden * inter * x.element_size()
    flops = 2 * 3 * hidden * inter * tokens * top_k
    row = {
        "tokens": tokens,
        "experts_hit": hit,
        "reference_us": common.time_us(lambda: fm.fused_moe_reference(*args), run, "events"),
        "roofline_us": max(
            common.memory_roofline_us(nbytes, run), common.compute_roofline_us(flops, run)
        ),
    }
    for path in fm.PATHS:
        if path == "gemv" and tokens * top_k > 64:
            continue
        call = lambda p=path: fm.fused_moe(*args, path=p, config=config)
        row[f"{path}_us"] = common.time_us(call, run, "events")
        if tokens <= 64:
            row[f"{path}_graph_us"] = common.time_us(call, run, "graph", calls=1)
        row[f"{path}_max_diff"] = float((call().float() - default.float()).abs().max())
    best = min(v for k, v in row.items() if k.endswith("_us") and k.split("_")[0] in fm.PATHS)
    row["speedup_vs_reference"] = row["reference_us"] / best
    row["tflops"] = flops / best / 1e6
    return row


def _routing_row(shape, tokens: int, run) -> dict:
    from pagoda.model.layers.moe import routing
    from pagoda.model.moe_config import MoEConfig

    experts, top_k, _, inter = shape
    cfg = MoEConfig(experts, top_k, inter, renormalize=True)
    logits = _layer(shape, tokens, run)[5]
    row = {
        "tokens": tokens,
        "routing_torch_us": common.time_us(
            lambda: routing.select_experts_torch(logits, cfg), run, "graph", calls=1
        ),
    }
    if run.device == "cuda":
        from pagoda.kernels.moe.routing import route_topk

        row["routing_kernel_us"] = common.time_us(
            lambda: route_topk(logits, cfg, None), run, "graph", calls=1
        )
    return row


def _sweep_grouped(shape, tokens: int, run, tma: bool) -> list:
    """Each candidate tile for both grouped GEMMs alone (moe_align done once per
    BLOCK_M), checked against the default tiles' output."""
    import torch

    from pagoda.kernels.moe import fused_moe as fm

    experts, top_k, hidden, inter = shape
    x, w13, w2, weights, ids, _ = _layer(shape, tokens, run)
    pairs, flat = tokens * top_k, weights.reshape(-1).contiguous()
    act_in = torch.randn(pairs, inter, device=run.device).to(run.dtype)
    gemms = {"gate_up": (x, w13, inter, top_k, True), "down": (act_in, w2, hidden, 1, False)}
    candidates = [None] + [
        dict(
            BLOCK_M=m,
            BLOCK_N=n,
            BLOCK_K=k,
            num_warps=w,
            num_stages=s,
            GROUP_M=8 if tokens > 1024 else 1,
        )
        for m, n, k, w, s in GROUPED_CANDIDATES[: 2 if run.smoke else None]
    ]
    if tma:
        candidates += [dict(c, B_TMA=True) for c in candidates[1:]]
    rows, ref = [], {}
    for cand in candidates:
        for name, (a, b, width, div, gate_up) in gemms.items():
            cfg = cand or fm.pick_config(pairs, experts, gemm=name)
            sorted_ids, expert_ids, used = fm.moe_align_block_size(ids, cfg["BLOCK_M"], experts)
            out = torch.empty(pairs, width, device=run.device, dtype=run.dtype)

            def call(
                cfg=cfg,
                out=out,
                a=a,
                b=b,
                div=div,
                gate_up=gate_up,
                s=sorted_ids,
                e=expert_ids,
                u=used,
            ):
                fm._grouped_gemm(
                    a, b, out, flat, s, e, u, div, not gate_up, cfg, gate_up_act=gate_up
                )

            row = {
                "gemm": name,
                "tokens": tokens,
                "default": cand is None,
                "tiles": ":".join(
                    str(cfg[k])
                    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
                )
                + (" tma" if cfg.get("B_TMA") else ""),
            }
            try:
                call()
                ref.setdefault(name, out.float().clone())
                row["max_diff"] = float((out.float() - ref[name]).abs().max())
                row["us"] = common.time_us(call, run, "events")
            except Exception as exc:  # out of shared memory or registers
                row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            rows.append(row)
    common.print_rows(
        rows,
        ["gemm", "tokens", "tiles", "default", "us", "max_diff", "error"],
        f"grouped GEMM tiles at {tokens} tokens",
    )
    return rows


def _sweep_gemv(shape, run) -> list:
    """The batch-1 decode GEMVs' tiles, gate/up and down separately, bandwidth over the
    chosen experts' bytes."""
    from pagoda.kernels.moe import fused_moe_decode as fmd
    from pagoda.kernels.moe.config import DownTiles, GateUpTiles

    experts, top_k, hidden, inter = shape
    x, w13, w2, weights, ids, _ = _layer(shape, 1, run)
    import torch

    ids, weights = ids.reshape(-1), weights.reshape(-1)
    act = torch.randn(top_k, inter, device=run.device).to(run.dtype)
    out = torch.empty(1, hidden, device=run.device, dtype=run.dtype)
    nbytes = top_k * 3 * hidden * inter * x.element_size() // 3
    small = run.smoke
    rows = []
    for bn, bk, warps, stages in itertools.product(
        *(
            ([16], [256], [4], [2])
            if small
            else ([8, 16, 32], [128, 256, 512], [2, 4, 8], [2, 3, 4])
        )
    ):
        tiles = GateUpTiles(bn, bk, warps, stages)
        us = common.time_us(lambda: fmd.launch_gate_up(x, w13, ids, act, w13, top_k, 0, tiles), run)
        rows.append(
            {
                "kernel": "gate_up",
                "tiles": f"{bn}:{bk}:{warps}:{stages}",
                "us": us,
                "tb_per_s": common.tb_per_s(2 * nbytes, us),
            }
        )
    for bn, bk, warps, stages in itertools.product(
        *(
            ([8], [None], [4], [2])
            if small
            else ([1, 2, 4, 8, 16], [None, 256, 512], [1, 2, 4, 8], [2, 3, 4, 6])
        )
    ):
        tiles = DownTiles(bn, bk, warps, stages)
        us = common.time_us(
            lambda: fmd.launch_down(act, w2, ids, weights, out, w2, top_k, 0, tiles), run
        )
        rows.append(
            {
                "kernel": "down",
                "tiles": f"{bn}:{bk}:{warps}:{stages}",
                "us": us,
                "tb_per_s": common.tb_per_s(nbytes, us),
            }
        )
    rows = sorted((r for r in rows if r["us"] == r["us"]), key=lambda r: (r["kernel"], r["us"]))
    common.print_rows(
        rows[:8] + [r for r in rows if r["kernel"] == "down"][:8],
        ["kernel", "tiles", "us", "tb_per_s"],
        "batch-1 MoE GEMV tiles (best)",
    )
    return rows


def run_moe(args, run) -> dict:
    shape = (8, 2, 64, 48) if run.smoke else MOE_SHAPES[args.model]
    config = configs_for(args.config, run.device).moe
    tokens = [1, 16] if run.smoke else common.parse_ints(args.tokens)
    rows = [_moe_tokens(shape, t, run, config) for t in tokens]
    common.print_rows(
        rows,
        [
            "tokens",
            "experts_hit",
            "gemv_us",
            "gemv_graph_us",
            "fused_us",
            "fused_graph_us",
            "reference_us",
            "speedup_vs_reference",
            "roofline_us",
            "tflops",
        ],
        f"fused MoE, {args.model} layer, variant {args.config}",
    )
    routing = [_routing_row(shape, t, run) for t in tokens]
    common.print_rows(
        routing, ["tokens", "routing_torch_us", "routing_kernel_us"], "routing (graph)"
    )
    out = {"rows": rows, "routing": routing}
    if args.sweep_grouped:
        out["grouped_sweep"] = [r for t in tokens for r in _sweep_grouped(shape, t, run, args.tma)]
    if args.sweep_gemv:
        out["gemv_sweep"] = _sweep_gemv(shape, run)
    return out


# ------------------------------------------------------------------ router --------
def add_router_args(p) -> None:
    p.add_argument("--tokens", default="1,8")
    p.add_argument(
        "--layers",
        type=int,
        default=192,
        help="distinct router weights a loop (more than twice the L2)",
    )


def _router_cases(smoke: bool) -> list:
    from pagoda.model.moe_config import MoEConfig
    from pagoda.model.presets import get_preset

    if smoke:
        return [("tiny-softmax", MoEConfig(16, 4, 8, renormalize=True), 64, False)]
    qwen, lite = get_preset("qwen3-30b-a3b"), get_preset("deepseek-v2-lite")
    v3 = MoEConfig(
        256,
        8,
        2048,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=8,
        topk_group=4,
        renormalize=True,
        routed_scaling_factor=2.5,
    )
    return [
        ("qwen3-30b-a3b", qwen.moe, qwen.hidden_size, False),
        ("deepseek-v2-lite", lite.moe, lite.hidden_size, True),
        ("deepseek-v3-router", v3, 7168, True),
    ]


def _gates(cfg, hidden: int, fp32: bool, layers: int, run):
    import torch

    from pagoda.kernels.moe.router_fused import RouterScratch
    from pagoda.model.layers.moe.gate import MoEGate

    gen = torch.Generator(device=run.device).manual_seed(0)
    gates = []
    for _ in range(layers):
        gate = MoEGate(hidden, cfg.num_experts, fp32=fp32)
        gate.weight.data = (
            torch.randn(cfg.num_experts, hidden, device=run.device, generator=gen) * 2 / hidden**0.5
        ).to(torch.float32 if fp32 else run.dtype)
        gate.router_scratch = RouterScratch.create(cfg.num_experts, torch.device(run.device))
        gates.append(gate)
    bias = (
        torch.randn(cfg.num_experts, device=run.device, generator=gen) * 0.1
        if cfg.topk_method == "noaux_tc"
        else None
    )
    return gates, bias


def run_router(args, run) -> dict:
    import torch

    from pagoda.kernels.moe.router_fused import default_tiles, fused_route
    from pagoda.model.layers.moe.routing import select_experts

    rows = []
    for name, cfg, hidden_size, fp32 in _router_cases(run.smoke):
        gates, bias = _gates(cfg, hidden_size, fp32, 2 if run.smoke else args.layers, run)
        for tokens in [1, 3] if run.smoke else common.parse_ints(args.tokens):
            hidden = torch.randn(tokens, hidden_size, device=run.device).to(run.dtype)

            def loop(fn, layers=gates):
                return lambda: [fn(g) for g in layers]

            fused = lambda g, t=None: fused_route(
                hidden, g.weight, cfg, bias, g.fp32, g.router_scratch, t
            )
            unfused = lambda g: select_experts(g(hidden), cfg, bias)
            n = len(gates)
            a, b = fused(gates[0])[1].sort(-1).values, unfused(gates[0])[1].sort(-1).values
            row = {
                "case": name,
                "tokens": tokens,
                "rows_differ": int((a.long() != b.long()).any(-1).sum()),
                "unfused_us": common.time_us(loop(unfused), run, "graph", 1) / n,
                "fused_us": common.time_us(loop(fused), run, "graph", 1) / n,
                "fused_hot_us": common.time_us(loop(fused, [gates[0]] * n), run, "graph", 1) / n,
                "roofline_us": common.memory_roofline_us(
                    gates[0].weight.numel() * gates[0].weight.element_size(), run
                ),
            }
            best = None
            for block_x, warps in itertools.product((1, 2, 4), (1, 2, 4, 8)):
                t = default_tiles(tokens, cfg.num_experts, hidden_size, cfg, block_x, warps)
                us = common.time_us(loop(lambda g, t=t: fused(g, t)), run, "graph", 1) / n
                if best is None or us < best[0]:
                    best = (us, f"x{block_x}w{warps}")
                if run.smoke:
                    break
            row["best_sweep_us"], row["best_sweep"] = best
            rows.append(row)
    common.print_rows(
        rows,
        [
            "case",
            "tokens",
            "unfused_us",
            "fused_us",
            "fused_hot_us",
            "best_sweep_us",
            "best_sweep",
            "roofline_us",
            "rows_differ",
        ],
        "MoE router, us a layer (graph; cold weights but for 'hot')",
    )
    return {"rows": rows}
