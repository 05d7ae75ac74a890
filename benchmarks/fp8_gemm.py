"""FP8 weight matmuls on one GPU (pagoda.kernels.fp8.linear) against bf16 F.linear, at
the Llama-3.1-8B linear shapes.

    python3 benchmarks/fp8_gemm.py --out benchmarks/results/h200-fp8-gemm.json
    python3 benchmarks/fp8_gemm.py --sweep --out ...   # also tile sweeps (a few minutes)
    python3 benchmarks/fp8_gemm.py --smoke             # CPU, tiny shapes, interpreted
    python3 benchmarks/fp8_gemm.py --decode-compare --shapes qkv,o,gate_up,down --ms 1,8 \
        --out benchmarks/results/h200-fp8-decode.json     # W8A16 weight decodes only (~2 min)

For each shape (N x K: qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336,
lm_head 128256x4096) and M rows in {1, 4, 16, 64, 256, 1024, 4096, 16384}, side by side:
- bf16: F.linear on the bf16 weight (the baseline and the reference output);
- fp8: fp8_linear as the engine calls it (dispatch by W8A16_MAX_M);
- scaled_mm: per-token activation quant + torch._scaled_mm rowwise (forced, every M),
  with fast accumulation as fp8_linear.SCALED_MM_FAST_ACCUM says (the engine's default);
- scaled_mm_exact: the same with the accumulator promoted to float32 (use_fast_accum off);
- w8a16: the Triton W8A16 kernel (forced, M <= W8A16_ROWS_LIMIT);
- w8a8: per-token quant + the Triton W8A8 GEMM, per-channel scales (forced);
- block: fp8_block_linear with 128x128 weight blocks (its own dispatch);
- block_cublas: group quant + torch._scaled_mm with 1x128 / 128x128 block scales, where
  this torch / cuBLAS takes them (else 'n/a' and the reason in the JSON).
Per cell: microseconds (median, L2 flushed before every call: each layer's weights are
cold in a real step), achieved TB/s over the minimal bytes (x + W + y) and TFLOP/s; the
relative error max|y - y_bf16| / max|y_bf16|. The roofline is the weight bytes over the
copy bandwidth measured in the same run. Prints tables and the M where scaled_mm starts
to beat w8a16 per shape (what W8A16_MAX_M should be); --sweep also prints the best
W8A16 and W8A8 tiles per shape and M. --decode-compare runs instead of the table: the
W8A16 kernel's weight decodes (DECODE "cvt" vs "bits", see fp8_w8a16.W8A16_DECODES) on
the default tiles and a few alternatives (decode_variants) at each M <= 16 given, next to
bf16 F.linear. Writes JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
from result_file import write_json  # noqa: E402  (benchmarks/)

LLAMA_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                   "down": (4096, 14336), "lm_head": (128256, 4096)}
MS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
SMOKE_SHAPES = {"a": (48, 64), "b": (40, 160)}
SMOKE_MS = [1, 4, 20]
METHODS = ["bf16", "fp8", "scaled_mm", "scaled_mm_exact", "w8a16", "w8a8", "block",
           "block_cublas"]


# ------------------------------------------------------------------ timing ---------
class Timer:
    """Median time of fn in microseconds. CUDA: a 512 MiB buffer is zeroed before each
    call (flushes L2 and keeps the GPU busy while Python enqueues the call), events
    around the call alone. CPU (smoke): wall clock."""

    def __init__(self, device, repeat: int):
        import torch
        self.device, self.repeat = device, repeat
        self.flush = (torch.empty(512 << 20, dtype=torch.uint8, device=device)
                      if device.type == "cuda" else None)

    def __call__(self, fn) -> float:
        import torch
        fn()  # compile / warm up
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(self.repeat):
                fn()
            return (time.perf_counter() - start) / self.repeat * 1e6
        times = []
        for _ in range(self.repeat):
            self.flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times) * 1e3


def copy_bandwidth(device) -> float | None:
    """bytes/s of a 1 GiB device-to-device copy (read + write), or None on CPU."""
    import torch
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = Timer(device, 10)(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6)


# ------------------------------------------------------------------ methods --------
def make_methods(kl, kq, w, device, dtype):
    """{name: (fn(x) -> y or None when the method does not apply to x's M)}, and the
    weights' byte counts, for one weight w [N, K]."""
    import torch

    from pagoda.kernels.fp8 import w8a16 as kw  # the W8A16 kernel's module
    import torch.nn.functional as F
    w8, s = kq.quantize_weight_per_channel(w)
    wb, sb = kq.quantize_weight_blockwise(w, (128, 128))
    n, k = w.shape

    def scaled_mm(x):
        xq, xs = kq.per_token_quant_fp8(x)
        return kl.scaled_mm_linear(xq, xs, w8, s, out_dtype=dtype)

    def scaled_mm_exact(x):
        xq, xs = kq.per_token_quant_fp8(x)
        return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=s.view(1, -1),
                                out_dtype=dtype, use_fast_accum=False)

    def w8a16(x):
        return kw.w8a16_linear(x, w8, s) if x.shape[0] <= kw.W8A16_ROWS_LIMIT else None

    def w8a8(x):
        xq, xs = kq.per_token_quant_fp8(x)
        return kl.w8a8_gemm(xq, xs, w8, s, out_dtype=dtype)

    sb_t = sb.t()  # cuBLAS reads the [K/128, N/128] view of the [N/128, K/128] scales

    def block_cublas(x):
        xq, xs = kq.per_token_group_quant_fp8(x, 128, column_major=True)
        return torch._scaled_mm(xq, wb.t(), scale_a=xs, scale_b=sb_t, out_dtype=dtype)

    methods = {
        "bf16": lambda x: F.linear(x, w),
        "fp8": lambda x: kl.fp8_linear(x, w8, s),
        "scaled_mm": scaled_mm,
        "scaled_mm_exact": scaled_mm_exact,
        "w8a16": w8a16,
        "w8a8": w8a8,
        "block": lambda x: kl.fp8_block_linear(x, wb, sb, (128, 128)),
        "block_cublas": block_cublas,
    }
    weight_bytes = {"bf16": n * k * w.element_size()}
    for name in METHODS[1:]:
        weight_bytes[name] = n * k  # fp8 weights (the scales are negligible)
    return methods, weight_bytes, (w8, s)


def bench_cell(name, fn, x, ref, timer, w_bytes, n, k) -> dict:
    """Time and check one method at one (shape, M)."""
    import torch
    m = x.shape[0]
    try:
        y = fn(x)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
        return {"status": "n/a", "reason": str(exc).splitlines()[0][:200]}
    if y is None:
        return {"status": "n/a", "reason": "not this M"}
    err = ((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
    us = timer(lambda: fn(x))
    moved = w_bytes + m * k * x.element_size() + m * n * y.element_size()
    return {"status": "ok", "us": us, "tb_s": moved / (us * 1e-6) / 1e12,
            "tflop_s": 2 * m * n * k / (us * 1e-6) / 1e12, "rel_err": err,
            "finite": bool(torch.isfinite(y).all())}


def run_shape(kl, kq, label, n, k, ms, device, dtype, timer, copy_bw) -> list[dict]:
    import torch
    gen = torch.Generator(device=device).manual_seed(0)
    # Weights of a trained model's spread; activations of unit scale.
    w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
    methods, w_bytes, _ = make_methods(kl, kq, w, device, dtype)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=device, generator=gen).to(dtype)
        ref = methods["bf16"](x).float() if dtype != torch.float32 else x @ w.t()
        row = {"shape": label, "N": n, "K": k, "M": m,
               "roofline_us": n * k / copy_bw * 1e6 if copy_bw else None}
        for name in METHODS:
            row[name] = bench_cell(name, methods[name], x, ref, timer, w_bytes[name], n, k)
        rows.append(row)
        print(format_row(row), flush=True)
        del x, ref
    del w, methods
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ sweeps ---------
W8A16_SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4 if bn * bk <= 16384 else 8)
               for bn in (8, 16, 32, 64) for bk in (256, 512, 1024) for sk in (1, 2, 4)]
W8A8_SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=nw, num_stages=st)
              for bm in (64, 128) for bn in (64, 128, 256) for nw in (4, 8) for st in (3, 4)]


# Batch-1 GEMV tiles only (--gemv-sweep): narrower rows, longer K steps, more splits.
GEMV_SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=4, LOOP_STAGES=st)
              for bn in (8, 16) for bk in (256, 512, 1024) for st in (3, 4, 6)]


def gemv_sweep(kl, kq, shapes, device, dtype, timer) -> list[dict]:
    import torch

    from pagoda.kernels.fp8 import w8a16 as kw  # the W8A16 kernel's module
    found = []
    for label, (n, k) in shapes.items():
        w8, s = kq.quantize_weight_per_channel((torch.randn(n, k, device=device) * 0.02).to(dtype))
        x = torch.randn(1, k, device=device).to(dtype)
        tiles = GEMV_SWEEP if device.type == "cuda" else GEMV_SWEEP[:2]
        found.append(_best(f"gemv {label} M=1", tiles, timer,
                           lambda c: kw.w8a16_linear(x, w8, s, config=c)))
    return found


def sweep(kl, kq, shapes, device, dtype, timer) -> list[dict]:
    """Best W8A16 tile per shape at M in {1, 4, 16, 64}; best W8A8 tile at M in
    {64, 1024, 16384} (the smoke: two tiles each at the smoke's Ms)."""
    import torch
    found = []
    for label, (n, k) in shapes.items():
        found += _sweep_shape(kl, kq, label, n, k, device, dtype, timer)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return found


def _sweep_shape(kl, kq, label, n, k, device, dtype, timer) -> list[dict]:
    import torch

    from pagoda.kernels.fp8 import w8a16 as kw  # the W8A16 kernel's module
    smoke = device.type != "cuda"
    w8a16_tiles, w8a8_tiles = ((W8A16_SWEEP[:2], W8A8_SWEEP[:2]) if smoke
                               else (W8A16_SWEEP, W8A8_SWEEP))
    w8, s = kq.quantize_weight_per_channel((torch.randn(n, k, device=device) * 0.02).to(dtype))
    found = []
    for m in (SMOKE_MS if smoke else (1, 4, 16, 64)):
        x = torch.randn(m, k, device=device).to(dtype)
        found.append(_best(f"w8a16 {label} M={m}", w8a16_tiles, timer,
                           lambda c: kw.w8a16_linear(x, w8, s, config=c)))
    for m in (SMOKE_MS[-1:] if smoke else (64, 1024, 16384)):
        xq, xs = kq.per_token_quant_fp8(torch.randn(m, k, device=device).to(dtype))
        found.append(_best(f"w8a8 {label} M={m}", w8a8_tiles, timer,
                           lambda c: kl.w8a8_gemm(xq, xs, w8, s, out_dtype=dtype, config=c)))
    return found


def _best(what, configs, timer, call) -> dict:
    results = []
    for cfg in configs:
        try:
            results.append((timer(lambda: call(cfg)), cfg))
        except Exception as exc:  # noqa: BLE001  (a tile that does not compile/fit: skip it)
            print(f"  {what} {cfg}: {type(exc).__name__}", flush=True)
    results.sort(key=lambda r: r[0])
    best = ({"what": what, "best_us": results[0][0], "config": results[0][1]} if results
            else {"what": what, "best_us": None})
    print(f"sweep {what}: " + (f"{best['best_us']:.1f} us {best['config']}" if results
                               else "nothing ran"), flush=True)
    return best


# ------------------------------------------------------------ decode compare -------
def decode_variants(kl, m: int, n: int, k: int) -> list[tuple[str, dict]]:
    """(label, W8A16 config) pairs to time with each decode: the default tiles
    (w8a16_config); at one row also half as many rows per program (twice the programs
    resident per SM), 8 warps, and the tl.dot path (16-row tile, 15 padding rows)."""
    from pagoda.kernels.fp8 import w8a16 as kw  # the W8A16 kernel's module
    base = kw.w8a16_config(m, n, k)
    out = [("default", base)]
    if m == 1 and n < 65536:
        out += [("bn4", dict(base, BLOCK_N=4)), ("warps8", dict(base, num_warps=8)),
                ("dot", dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=2 if k >= 8192 else 1,
                             num_warps=4, DOT=True))]
    return out


def decode_compare(kl, kq, shapes, ms, device, dtype, timer, copy_bw) -> list[dict]:
    """Per shape and M (<= W8A16_MAX_M): bf16 F.linear, then every decode_variants config
    with each decode; microseconds, TB/s over x + W + y, error vs the dequantized-weight
    float32 product (which the decodes must all match)."""
    import torch

    from pagoda.kernels.fp8 import w8a16 as kw  # the W8A16 kernel's module
    import torch.nn.functional as F
    rows = []
    for label, (n, k) in shapes.items():
        gen = torch.Generator(device=device).manual_seed(0)
        w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
        w8, s = kq.quantize_weight_per_channel(w)
        for m in [m for m in ms if m <= kl.W8A16_MAX_M]:
            x = torch.randn(m, k, device=device, generator=gen).to(dtype)
            ref = x.float() @ (w8.float() * s[:, None]).t()
            moved = n * k + 2 * m * k * x.element_size()  # fp8 weights, x in, y out
            us = timer(lambda: F.linear(x, w))
            rows.append(_decode_row(label, m, "bf16_linear", "-", us, moved + n * k, None,
                                    copy_bw, n, k))
            for name, cfg in decode_variants(kl, m, n, k):
                for dec in kw.W8A16_DECODES:
                    c = dict(cfg, DECODE=dec)
                    try:
                        y = kw.w8a16_linear(x, w8, s, config=c)
                        us = timer(lambda: kw.w8a16_linear(x, w8, s, config=c))
                    except Exception as exc:  # noqa: BLE001  (a tile that does not compile)
                        print(f"  {label} M={m} {name} {dec}: {type(exc).__name__}", flush=True)
                        continue
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    rows.append(_decode_row(label, m, name, dec, us, moved, err, copy_bw,
                                            n, k, c))
        del w, w8, s
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _decode_row(shape, m, variant, decode, us, moved, err, copy_bw, n, k, cfg=None) -> dict:
    row = {"shape": shape, "N": n, "K": k, "M": m, "variant": variant, "decode": decode,
           "us": us, "tb_s": moved / (us * 1e-6) / 1e12, "rel_err": err, "config": cfg,
           "fp8_roofline_us": n * k / copy_bw * 1e6 if copy_bw else None}
    print(f"{shape:>8} {m:>3} {variant:>12} {decode:>5} {us:9.2f} us {row['tb_s']:5.2f} TB/s"
          + (f"  err {err:.2e}" if err is not None else ""), flush=True)
    return row


def decode_summary(rows: list[dict]) -> dict:
    """Per (shape, M): the fastest row of each decode, and bits over cvt on the defaults."""
    out = {}
    for r in rows:
        if r["decode"] == "-":
            continue
        key = f"{r['shape']} M={r['M']}"
        best = out.setdefault(key, {})
        if r["decode"] not in best or r["us"] < best[r["decode"]]["us"]:
            best[r["decode"]] = {"us": r["us"], "variant": r["variant"], "config": r["config"]}
        if r["variant"] == "default":
            best.setdefault("default_us", {})[r["decode"]] = r["us"]
    for key, best in out.items():
        print(f"{key:>16}: " + ", ".join(f"{d} best {b['us']:.2f} us ({b['variant']})"
                                         for d, b in best.items() if d != "default_us")
              + f"; defaults {best.get('default_us')}", flush=True)
    return out


# ------------------------------------------------------------------ report ---------
def _cell(c: dict) -> str:
    if c["status"] != "ok":
        return f"{'n/a':>16}"
    return f"{c['us']:8.1f} {c['tb_s']:4.2f}T" if c["tb_s"] >= 0.01 else f"{c['us']:8.1f}    - "


def format_row(row: dict) -> str:
    return f"{row['shape']:>8} {row['M']:>6} " + " ".join(_cell(row[m]) for m in METHODS)


def header() -> str:
    return (f"{'shape':>8} {'M':>6} " + " ".join(f"{m:>16}" for m in METHODS)
            + "\n(each cell: microseconds, achieved TB/s over x + W + y bytes)")


def summary(rows: list[dict]) -> dict:
    """Per shape: the first M of the list where scaled_mm beats w8a16 (the dispatch
    threshold to set), and the largest relative error of each method."""
    out = {"crossover": {}, "max_rel_err": {}}
    for row in rows:
        sm, w16 = row["scaled_mm"], row["w8a16"]
        if sm["status"] == "ok" and w16["status"] == "ok" and sm["us"] < w16["us"]:
            out["crossover"].setdefault(row["shape"], row["M"])
        for name in METHODS[1:]:
            c = row[name]
            if c["status"] == "ok":
                best = out["max_rel_err"].get(name, 0.0)
                out["max_rel_err"][name] = max(best, c["rel_err"])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/fp8_gemm.json")
    p.add_argument("--shapes", default=",".join(LLAMA_8B_SHAPES),
                   help="comma-separated subset of " + ",".join(LLAMA_8B_SHAPES))
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--sweep", action="store_true", help="also sweep W8A16 / W8A8 tiles")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="also sweep the batch-1 W8A16 tiles more widely (GEMV_SWEEP)")
    p.add_argument("--decode-compare", action="store_true",
                   help="only the W8A16 decode comparison (cvt vs bits) at the Ms <= 16 given")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny shapes, Triton interpreted (checks the script runs)")
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    from pagoda.kernels.fp8 import linear as kl
    from pagoda.kernels.fp8 import quant as kq
    from pagoda.kernels.fp8 import w8a16 as kw  # the W8A16 kernel's module

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        shapes, ms, dtype, repeat = SMOKE_SHAPES, SMOKE_MS, torch.float32, 2
    else:
        names = [s for s in args.shapes.split(",") if s]
        unknown = [s for s in names if s not in LLAMA_8B_SHAPES]
        if unknown:
            p.error(f"unknown shapes {unknown}; known: {list(LLAMA_8B_SHAPES)}")
        shapes = {s: LLAMA_8B_SHAPES[s] for s in names}
        ms, dtype, repeat = [int(m) for m in args.ms.split(",")], torch.bfloat16, args.repeat
    timer = Timer(device, repeat)
    copy_bw = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(f"device {device} ({name}), torch {torch.__version__}, copy bandwidth "
          + (f"{copy_bw / 1e12:.2f} TB/s" if copy_bw else "n/a"), flush=True)
    rows, summ, decodes = [], {}, []
    if args.decode_compare:
        decodes = decode_compare(kl, kq, shapes, ms, device, dtype, timer, copy_bw)
        summ = {"decodes": decode_summary(decodes)}
    else:
        print(header(), flush=True)
        for label, (n, k) in shapes.items():
            rows += run_shape(kl, kq, label, n, k, ms, device, dtype, timer, copy_bw)
        summ = summary(rows)
        print("scaled_mm beats w8a16 from M =", summ["crossover"] or "never (in the Ms run)",
              f"(W8A16_MAX_M is {kl.W8A16_MAX_M})")
        print("max relative error vs bf16:",
              {k: f"{v:.4f}" for k, v in summ["max_rel_err"].items()})
    sweeps = sweep(kl, kq, shapes, device, dtype, timer) if args.sweep else []
    if args.gemv_sweep:
        sweeps += gemv_sweep(kl, kq, shapes, device, dtype, timer)
    result = {
        "benchmark": "fp8_gemm", "time": datetime.now(timezone.utc).isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": __import__("triton").__version__,
        "smoke": args.smoke, "copy_bandwidth_bytes_s": copy_bw, "dtype": str(dtype),
        "w8a16_max_m": kl.W8A16_MAX_M, "rows": rows, "summary": summ, "sweeps": sweeps,
        "decode_rows": decodes,
        "configs": {"W8A16_GEMV": kw.W8A16_GEMV_CONFIG, "W8A16_DOT": kw.W8A16_DOT_CONFIG,
                    "W8A8_SMALL": kl.W8A8_SMALL_CONFIG, "W8A8_LARGE": kl.W8A8_LARGE_CONFIG},
    }
    write_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
