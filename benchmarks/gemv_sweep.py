"""Tile sweep of the decode GEMV (pagoda.kernels.gemv.gemv) against torch F.linear (cuBLAS), at
the dense projection shapes of Qwen3-30B-A3B, Llama-3.1-8B and DeepSeek-V2-Lite.

    python3 benchmarks/gemv_sweep.py --out benchmarks/results/h200-gemv-sweep.json
    python3 benchmarks/gemv_sweep.py --shapes qkv_30b,o_30b --rows 1 4    # a subset
    python3 benchmarks/gemv_sweep.py --extra 2560x2048,2048x2048           # other shapes
    python3 benchmarks/gemv_sweep.py --smoke          # CPU, tiny shapes, interpreted

For each shape (N x K, bf16) and M rows (default 1, 2, 4, 8), side by side:
- cublas: F.linear, eager and in a CUDA graph;
- gemv: every candidate tile config (two phases: a grid of BLOCK_N x BLOCK_K x warps,
  then LOOP_STAGES x SPLIT_K around the --refine best), in a CUDA graph; the best one
  eager as well. A candidate whose output differs from the float32 reference by more
  than 1% of its largest value, or whose output after the graph replays is not bitwise
  its first one, is dropped (reported as WRONG OUTPUT: a kernel bug to look at).
Timing: one CUDA graph holds `calls` >= 20 launches, each on its own copy of the weight
(enough copies that they do not fit in L2 together: in a decode step every layer's
weights are cold), replayed; microseconds per launch = replay time / calls (median of
trials). That is what the engine's CUDA-graph step sees; eager adds the host's launch
cost. TB/s counts the weight, x and y bytes; the roofline is the copy bandwidth
measured in the same run.

Prints a table per shape, then the GEMV_CONFIGS entries to paste into
pagoda/kernels/gemv/gemv.py: the (N, K, M) where the best gemv beat cuBLAS in the graph by
more than --margin. Writes JSON.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)
from result_file import write_json  # noqa: E402  (benchmarks/)

# name -> (N, K): the per-rank weight of a single-GPU run.
SHAPES = {
    "qkv_30b": (5120, 2048),        # Qwen3-30B-A3B: 32 q + 2 * 4 kv heads of 128
    "o_30b": (2048, 4096),          # Qwen3-30B-A3B o_proj
    "router_30b": (128, 2048),      # Qwen3-30B-A3B router (if it ran in bf16)
    "qkv_8b": (6144, 4096),         # Llama-3.1-8B
    "o_8b": (4096, 4096),
    "gate_up_8b": (28672, 4096),
    "down_8b": (4096, 14336),
    "sq_2048": (2048, 2048),        # DeepSeek-V2-Lite o_proj (16 heads x 128 -> 2048)
    "q_dsv2l": (3072, 2048),        # DeepSeek-V2-Lite q_proj (16 x 192, no q LoRA)
    "kv_a_dsv2l": (576, 2048),      # DeepSeek-V2-Lite kv_a_proj_with_mqa (512 + 64)
    "shared_gate_up_dsv2l": (5632, 2048),  # 2 shared experts x 1408, gate and up
    "shared_down_dsv2l": (2048, 2816),
}
ROWS = [1, 2, 4, 8]
SMOKE_SHAPES = {"a": (48, 64), "b": (40, 160)}
SMOKE_ROWS = [1, 3]
MAX_REL_ERR = 1e-2


# ------------------------------------------------------------------ candidates -------
def _regs_ok(m: int, cfg: dict) -> bool:
    """Rough float32 registers per thread of the product tile (the accumulator for one
    row, the per-step [M, N, K] product for FMA rows) at most 64 / 128."""
    lanes = 32 * cfg["num_warps"]
    if cfg["DOT"]:
        return cfg["BLOCK_N"] * cfg["BLOCK_K"] // lanes <= 64
    rows = 1 if m == 1 else 1 << (m - 1).bit_length()
    return rows * cfg["BLOCK_N"] * cfg["BLOCK_K"] // lanes <= (64 if m == 1 else 128)


def _default_split(n: int, k: int, cfg: dict, sms: int) -> int:
    """Phase 1's split: doubled (up to 16) while the programs are fewer than two per SM
    and each split keeps at least one BLOCK_K step."""
    blocks, split = -(-n // cfg["BLOCK_N"]), 1
    while blocks * split < 2 * sms and k >= 2 * split * cfg["BLOCK_K"] and split < 16:
        split *= 2
    return split


def phase1(m: int, n: int, k: int, sms: int, smoke: bool) -> list[dict]:
    """The grid of tile shapes and warps, 3 stages, split by _default_split."""
    if smoke:
        grid = [(bn, bk, 4, False) for bn in (8, 16) for bk in (32, 64)]
        grid += [(16, 32, 4, True)] if m > 1 else []
    elif m == 1:
        grid = [(bn, bk, w, False) for bn in (4, 8, 16) for bk in (256, 512, 1024)
                for w in (4, 8)]
    else:
        grid = [(bn, bk, w, False) for bn in (2, 4, 8) for bk in (128, 256, 512)
                for w in (4, 8)]
        grid += [(bn, bk, 4, True) for bn in (16, 32, 64) for bk in (64, 128, 256)]
    out = []
    for bn, bk, warps, dot in grid:
        cfg = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, LOOP_STAGES=3, num_warps=warps, DOT=dot)
        if bk > k or not _regs_ok(m, cfg):
            continue
        cfg["SPLIT_K"] = _default_split(n, k, cfg, sms)
        out.append(cfg)
    return out


def phase2(best: list[dict], n: int, k: int, sms: int) -> list[dict]:
    """LOOP_STAGES x SPLIT_K around each of the best phase-1 configs. Splits of 8 and 16
    only for fewer column blocks than SMs (a router); a split shorter than one BLOCK_K,
    or more than 8 programs per SM, is skipped."""
    out = []
    for base in best:
        blocks = -(-n // base["BLOCK_N"])
        for stages in (2, 3, 4):
            for split in (1, 2, 4, 8, 16):
                if (k < split * base["BLOCK_K"] or (split > 1 and blocks * split > 8 * sms)
                        or (split > 4 and blocks >= sms)):
                    continue
                cfg = dict(base, LOOP_STAGES=stages, SPLIT_K=split)
                if cfg not in out and cfg not in best:
                    out.append(cfg)
    return out


def config_name(cfg: dict) -> str:
    return (f"{'dot' if cfg['DOT'] else 'fma'} n{cfg['BLOCK_N']} k{cfg['BLOCK_K']} "
            f"s{cfg['SPLIT_K']} st{cfg['LOOP_STAGES']} w{cfg['num_warps']}")


# ------------------------------------------------------------------ timing -----------
class Bench:
    """Times a function of (x, weight) over rotating weight copies: µs per call, in a
    CUDA graph and eager. CPU (smoke): wall clock of eager calls, no graph."""

    def __init__(self, device, trials: int, replays: int):
        import torch
        self.torch, self.device = torch, device
        self.trials, self.replays = trials, replays
        self.cuda = device.type == "cuda"
        props = torch.cuda.get_device_properties(device) if self.cuda else None
        # (older torch builds lack the attribute: assume 64 MiB, more than an H200's)
        self.l2 = getattr(props, "L2_cache_size", 64 << 20) if props is not None else 0
        self.sms = props.multi_processor_count if props is not None else 4

    def weights(self, w):
        """w and enough copies that together they are 3x the L2 (at most 256)."""
        if not self.cuda:
            return [w]
        copies = min(256, max(1, math.ceil(3 * self.l2 / (w.numel() * w.element_size()))))
        return [w] + [w.clone() for _ in range(copies - 1)]

    def _calls(self, fn, x, ws):
        calls = max(20, len(ws)) if self.cuda else 1
        return calls, (lambda: [fn(x, ws[i % len(ws)]) for i in range(calls)])

    def _events(self, run, calls) -> float:
        torch = self.torch
        times = []
        for _ in range(self.trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.replays):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / (self.replays * calls))
        return statistics.median(times)

    def eager(self, fn, x, ws) -> float:
        calls, run = self._calls(fn, x, ws)
        run()
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(self.trials):
                run()
            return (time.perf_counter() - start) / self.trials * 1e6
        self.torch.cuda.synchronize(self.device)
        return self._events(run, calls)

    def graph(self, fn, x, ws) -> float:
        if not self.cuda:
            return self.eager(fn, x, ws)
        torch = self.torch
        calls, run = self._calls(fn, x, ws)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            run()  # compile, allocate the split-K counters (never inside the capture)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        us = self._events(graph.replay, calls)
        del graph
        return us


def copy_bandwidth(device) -> float | None:
    """bytes/s of a 1 GiB device-to-device copy (read + write), or None on CPU."""
    import torch
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) * 1e-3)


# ------------------------------------------------------------------ the sweep --------
def _rel_err(y, ref) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _try_config(bench, kg, cfg, x, ws, ref) -> dict:
    """One candidate: checked against the reference eagerly (compiles it; a config that
    does not compile or computes wrongly is reported, never timed), timed, then run once
    more: the output must be bitwise the first one (deterministic split-K, counters
    reset by every launch of the graph)."""
    def fn(xx, w):
        return kg.gemv(xx, w, None, cfg)
    row = {"config": dict(cfg), "name": config_name(cfg)}
    try:
        first = fn(x, ws[0])
    except Exception as exc:  # compile failures (out of resources), rejected configs
        return dict(row, status="error", reason=str(exc).splitlines()[0][:200])
    err = _rel_err(first, ref)
    if not err <= MAX_REL_ERR:
        return dict(row, status="wrong", rel_err=err)
    us = bench.graph(fn, x, ws)
    if not bench.torch.equal(fn(x, ws[0]), first):
        return dict(row, status="wrong", rel_err=err, reason="differs after the graph replays")
    return dict(row, status="ok", rel_err=err, graph_us=us)


def make_weights(bench, n: int, k: int, dtype) -> list:
    """A random weight [n, k] (rows of unit norm on average) and its copies, made on the
    device (a CPU generator would take seconds for the largest shapes)."""
    import torch
    gen = torch.Generator(bench.device).manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=gen, device=bench.device) / math.sqrt(k)
    return bench.weights(w.to(dtype))


def sweep_cell(bench, kg, ws: list, m: int, smoke: bool, refine: int) -> dict:
    """cuBLAS and every candidate at one (shape, M) (phase 2 around the `refine` best of
    phase 1); the best candidate eager too."""
    import torch
    import torch.nn.functional as F
    w = ws[0]
    n, k = w.shape
    gen = torch.Generator(bench.device).manual_seed(m)
    x = torch.randn(m, k, generator=gen, device=bench.device).to(w.dtype)
    ref = x.float() @ w.float().t()
    cell = {"N": n, "K": k, "M": m, "weight_copies": len(ws),
            "bytes": (n * k + m * k + m * n) * w.element_size(),
            "cublas": {"graph_us": bench.graph(F.linear, x, ws),
                       "eager_us": bench.eager(F.linear, x, ws),
                       "rel_err": _rel_err(F.linear(x, w), ref)}}
    rows = [_try_config(bench, kg, cfg, x, ws, ref) for cfg in phase1(m, n, k, bench.sms, smoke)]
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["graph_us"])
    rows += [_try_config(bench, kg, cfg, x, ws, ref)
             for cfg in phase2([r["config"] for r in ok[:refine]], n, k, bench.sms)]
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["graph_us"])
    cell["candidates"] = rows
    if ok:
        best = dict(ok[0])
        best["eager_us"] = bench.eager(lambda xx, ww: kg.gemv(xx, ww, None, best["config"]),
                                       x, ws)
        cell["best"] = best
        cell["speedup_graph"] = cell["cublas"]["graph_us"] / best["graph_us"]
    return cell


def _tbs(nbytes: int, us: float) -> str:
    return f"{nbytes / (us * 1e-6) / 1e12:5.2f}"


def print_shape(name: str, cells: list[dict], copy_bw) -> None:
    n, k = cells[0]["N"], cells[0]["K"]
    wbytes = n * k * 2
    roof = f", roofline {wbytes / copy_bw * 1e6:.2f} us" if copy_bw else ""
    print(f"\n{name}: N={n} K={k} ({wbytes / 1e6:.1f} MB{roof})")
    print(f"{'M':>3} {'cublas eager':>12} {'cublas graph':>12} {'TB/s':>5} {'gemv graph':>10} "
          f"{'TB/s':>5} {'gemv eager':>10} {'speedup':>7}  best config (of n ok / tried)")
    for c in cells:
        cb = c["cublas"]
        line = (f"{c['M']:>3} {cb['eager_us']:>12.2f} {cb['graph_us']:>12.2f} "
                f"{_tbs(c['bytes'], cb['graph_us'])}")
        ok = sum(r["status"] == "ok" for r in c["candidates"])
        if "best" in c:
            b = c["best"]
            line += (f" {b['graph_us']:>10.2f} {_tbs(c['bytes'], b['graph_us'])} "
                     f"{b['eager_us']:>10.2f} {c['speedup_graph']:>6.2f}x  {b['name']}")
        else:
            line += "  no candidate ran"
        print(line + f" ({ok}/{len(c['candidates'])})")
        bad = [r for r in c["candidates"] if r["status"] == "wrong"]
        if bad:
            print(f"    WRONG OUTPUT: {', '.join(r['name'] for r in bad)}")


def table_entries(cells: list[dict], margin: float) -> list[tuple]:
    """((N, K, M), config, cublas us, gemv us) where gemv won by more than margin (M a
    power of two: the table's row buckets)."""
    out = []
    for c in cells:
        bucket = c["M"] & (c["M"] - 1) == 0
        if bucket and "best" in c and c["speedup_graph"] > 1 + margin:
            out.append(((c["N"], c["K"], c["M"]), c["best"]["config"],
                        c["cublas"]["graph_us"], c["best"]["graph_us"]))
    return out


def print_table(entries: list[tuple]) -> None:
    print("\n# pagoda/kernels/gemv/gemv.py: measured on this GPU, in a CUDA graph")
    print("GEMV_CONFIGS: dict[tuple[int, int, int], dict] = {")
    for key, cfg, cublas_us, gemv_us in entries:
        args = ", ".join(f"{k}={v}" for k, v in cfg.items())
        print(f"    {key}: dict({args}),  # {cublas_us:.2f} -> {gemv_us:.2f} us")
    print("}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help="comma-separated names of SHAPES (all)")
    p.add_argument("--extra", default=None,
                   help="comma-separated NxK shapes to sweep (alone, or with --shapes)")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="M values (1 2 4 8)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--refine", type=int, default=3,
                   help="phase 2 varies stages and splits around this many phase-1 configs")
    p.add_argument("--margin", type=float, default=0.03,
                   help="list a shape only when gemv beats cuBLAS by more than this")
    p.add_argument("--time-limit", type=float, default=480,
                   help="seconds after which the remaining shapes are skipped (listed)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, interpreted")
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "results", "gemv-sweep.json"))
    return p.parse_args(argv)


def _select_shapes(args) -> dict:
    """--shapes names (default all) plus --extra NxK shapes (e.g. a tensor-parallel
    rank's)."""
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        unknown = set(args.shapes.split(",")) - set(shapes)
        if unknown:
            raise SystemExit(f"unknown shapes {sorted(unknown)}; known: {sorted(shapes)}")
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    elif args.extra:
        shapes = {}
    for spec in (args.extra.split(",") if args.extra else []):
        try:
            n, k = (int(v) for v in spec.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--extra: want NxK shapes such as 2560x2048, got {spec!r}")
        shapes[f"{n}x{k}"] = (n, k)
    return shapes


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    import torch
    import triton
    from pagoda.kernels.gemv.gemv import gemv as kg
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = _select_shapes(args)
    rows = args.rows or (SMOKE_ROWS if args.smoke else ROWS)
    if max(rows) > kg.GEMV_MAX_ROWS:
        raise SystemExit(f"--rows: the kernel takes at most {kg.GEMV_MAX_ROWS} rows")
    dtype = torch.float16 if args.smoke else torch.bfloat16  # the interpreter gets bf16 wrong
    bench = Bench(device, 1 if args.smoke else args.trials, 1 if args.smoke else args.replays)
    out = {"date": datetime.now(timezone.utc).isoformat(), "host": platform.node(),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype),
           "copy_bytes_per_s": copy_bandwidth(device), "smoke": args.smoke,
           "margin": args.margin, "shapes": {}, "not_run": [], "gemv_configs": []}
    started, entries = time.time(), []
    for name, (n, k) in shapes.items():
        if time.time() - started > args.time_limit:
            out["not_run"].append(name)
            continue
        ws = make_weights(bench, n, k, dtype)
        out["shapes"][name] = [sweep_cell(bench, kg, ws, m, args.smoke, args.refine)
                               for m in rows]
        del ws
        print_shape(name, out["shapes"][name], out["copy_bytes_per_s"])
        entries = table_entries([c for cells in out["shapes"].values() for c in cells],
                                args.margin)
        out["gemv_configs"] = [{"key": list(key), "config": cfg, "cublas_us": c_us,
                                "gemv_us": g_us} for key, cfg, c_us, g_us in entries]
        write_json(args.out, out)  # after every shape: a run cut short keeps what it did
        sys.stdout.flush()
    print_table(entries)
    print(f"\nswept in {time.time() - started:.0f} s")
    write_json(args.out, out)
    if out["not_run"]:
        print(f"time limit reached; not run: --shapes {','.join(out['not_run'])}")
    return out


if __name__ == "__main__":
    main()
