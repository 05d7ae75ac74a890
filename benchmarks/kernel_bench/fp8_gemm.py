"""The `fp8-gemm` mode: FP8 weight matmuls (pagoda.kernels.fp8.linear) against bf16
F.linear at the Llama-3.1-8B linear shapes.

For each shape (N x K: qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336,
lm_head 128256x4096; --shapes) and M rows (--ms), side by side:
- bf16: F.linear on the bf16 weight (the baseline and the reference output);
- fp8: fp8_linear as the engine calls it (W8A16 up to W8A16_MAX_M rows, else W8A8);
- scaled_mm: per-token activation quant + torch._scaled_mm rowwise, fast accumulation
  (the engine's), and scaled_mm_exact: the accumulator promoted to float32;
- w8a16: the Triton W8A16 kernel (M <= W8A16_ROWS_LIMIT); w8a8: per-token quant + the
  Triton W8A8 GEMM; block: fp8_block_linear with 128 x 128 weight blocks.
Each cell: microseconds (events timer: L2 flushed before each call), TB/s over x + W + y
and the relative error against bf16; the roofline is the FP8 weight's time at the copy
bandwidth. Prints the first M where scaled_mm beats w8a16 per shape (what W8A16_MAX_M
should be). --sweep: the best W8A16 and W8A8 tiles per shape and M. --decode-compare
(instead of the table): the W8A16 kernel's weight decodes ("cvt" vs "bits") on the
default tiles and a few others at each M <= 16.
"""

from __future__ import annotations

from benchmarks.kernel_bench import common

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
SMOKE_SHAPES = {"a": (48, 64), "b": (40, 160)}
METHODS = ("bf16", "fp8", "scaled_mm", "scaled_mm_exact", "w8a16", "w8a8", "block")


def add_args(p) -> None:
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--ms", default="1,4,16,64,256,1024,4096,16384")
    p.add_argument("--sweep", action="store_true", help="also the best W8A16 / W8A8 tiles")
    p.add_argument(
        "--decode-compare",
        action="store_true",
        help="only the W8A16 weight decodes (cvt vs bits) at the Ms <= 16",
    )


def _methods(w, run) -> dict:
    """{name: fn(x) -> y, or None where the method does not take x's rows}."""
    import torch
    import torch.nn.functional as F

    from pagoda.kernels.fp8 import linear as kl
    from pagoda.kernels.fp8 import quant as kq
    from pagoda.kernels.fp8 import w8a16 as kw

    w8, s = kq.quantize_weight_per_channel(w)
    wb, sb = kq.quantize_weight_blockwise(w, (128, 128))

    def scaled_mm(x, exact=False):
        if run.device != "cuda":
            return None
        xq, xs = kq.per_token_quant_fp8(x)
        return torch._scaled_mm(
            xq,
            w8.t(),
            scale_a=xs,
            scale_b=s.view(1, -1),
            out_dtype=x.dtype,
            use_fast_accum=not exact,
        )

    def w8a8(x):
        xq, xs = kq.per_token_quant_fp8(x)
        return kl.w8a8_gemm(xq, xs, w8, s, out_dtype=x.dtype)

    return {
        "bf16": lambda x: F.linear(x, w),
        "fp8": lambda x: kl.fp8_linear(x, w8, s),
        "scaled_mm": scaled_mm,
        "scaled_mm_exact": lambda x: scaled_mm(x, exact=True),
        "w8a16": lambda x: kw.w8a16_linear(x, w8, s) if x.shape[0] <= kw.W8A16_ROWS_LIMIT else None,
        "w8a8": w8a8,
        "block": lambda x: kl.fp8_block_linear(x, wb, sb, (128, 128)),
    }


def _cell(fn, x, ref, run, w_bytes: int) -> dict:
    try:
        y = fn(x)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
        return {"status": "n/a", "reason": str(exc).splitlines()[0][:160]}
    if y is None:
        return {"status": "n/a"}
    m, k = x.shape
    us = common.time_us(lambda: fn(x), run, "events")
    moved = w_bytes + m * k * x.element_size() + y.numel() * y.element_size()
    return {
        "status": "ok",
        "us": us,
        "tb_per_s": common.tb_per_s(moved, us),
        "rel_err": float((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)),
    }


def _table(shapes, ms, run) -> tuple[list, dict]:
    import torch

    rows, crossover = [], {}
    for label, (n, k) in shapes.items():
        gen = torch.Generator(device=run.device).manual_seed(0)
        w = (torch.randn(n, k, device=run.device, generator=gen) * 0.02).to(run.dtype)
        methods = _methods(w, run)
        for m in ms:
            x = torch.randn(m, k, device=run.device, generator=gen).to(run.dtype)
            ref = methods["bf16"](x).float()
            row = {"shape": label, "M": m, "roofline_us": common.memory_roofline_us(n * k, run)}
            for name in METHODS:
                cell = _cell(methods[name], x, ref, run, n * k * (2 if name == "bf16" else 1))
                row[name] = cell.get("us", float("nan"))
                row[f"{name}_cell"] = cell
            if row["scaled_mm"] < row["w8a16"]:
                crossover.setdefault(label, m)
            rows.append(row)
        del w, methods
    common.print_rows(
        rows,
        ["shape", "M", "roofline_us", *METHODS],
        "FP8 linear, microseconds (TB/s and errors in the JSON)",
    )
    print("scaled_mm beats w8a16 from M =", crossover or "never (in the Ms run)")
    return rows, crossover


def _best(what: str, tiles: list, call, run) -> dict:
    results = []
    for cfg in tiles:
        try:
            results.append((common.time_us(lambda: call(cfg), run, "events"), cfg))
        except Exception as exc:  # a tile that does not compile or fit
            print(f"  {what} {cfg}: {type(exc).__name__}", flush=True)
    results.sort(key=lambda r: r[0])
    best = {
        "what": what,
        "us": results[0][0] if results else None,
        "config": results[0][1] if results else None,
    }
    print(f"sweep {what}: {best['us']} us {best['config']}", flush=True)
    return best


def _sweep(shapes, run) -> list:
    import torch

    from pagoda.kernels.fp8 import linear as kl
    from pagoda.kernels.fp8 import quant as kq
    from pagoda.kernels.fp8 import w8a16 as kw

    w8a16_tiles = [
        dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4 if bn * bk <= 16384 else 8)
        for bn in (8, 16, 32, 64)
        for bk in (256, 512, 1024)
        for sk in (1, 2, 4)
    ]
    w8a8_tiles = [
        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=nw, num_stages=st)
        for bm in (64, 128)
        for bn in (64, 128, 256)
        for nw in (4, 8)
        for st in (3, 4)
    ]
    if run.smoke:
        w8a16_tiles, w8a8_tiles = w8a16_tiles[:2], w8a8_tiles[:2]
    found = []
    for label, (n, k) in shapes.items():
        w8, s = kq.quantize_weight_per_channel(
            (torch.randn(n, k, device=run.device) * 0.02).to(run.dtype)
        )
        for m in (1, 4) if run.smoke else (1, 4, 16, 64):
            x = torch.randn(m, k, device=run.device).to(run.dtype)
            found.append(
                _best(
                    f"w8a16 {label} M={m}",
                    w8a16_tiles,
                    lambda c: kw.w8a16_linear(x, w8, s, config=c),
                    run,
                )
            )
        for m in (20,) if run.smoke else (64, 1024, 16384):
            xq, xs = kq.per_token_quant_fp8(torch.randn(m, k, device=run.device).to(run.dtype))
            found.append(
                _best(
                    f"w8a8 {label} M={m}",
                    w8a8_tiles,
                    lambda c: kl.w8a8_gemm(xq, xs, w8, s, out_dtype=run.dtype, config=c),
                    run,
                )
            )
    return found


def _decode_compare(shapes, ms, run) -> list:
    """Per shape and M <= W8A16_MAX_M: the W8A16 kernel at its default tiles (and at one
    row half the rows a program, 8 warps, the tl.dot path) with each weight decode."""
    import torch

    from pagoda.kernels.fp8 import linear as kl
    from pagoda.kernels.fp8 import quant as kq
    from pagoda.kernels.fp8 import w8a16 as kw

    rows = []
    for label, (n, k) in shapes.items():
        w8, s = kq.quantize_weight_per_channel(
            (torch.randn(n, k, device=run.device) * 0.02).to(run.dtype)
        )
        for m in (m for m in ms if m <= kl.W8A16_MAX_M):
            x = torch.randn(m, k, device=run.device).to(run.dtype)
            ref = x.float() @ (w8.float() * s[:, None]).t()
            base = kw.w8a16_config(m, n, k)
            variants = [("default", base)]
            if m == 1 and n < 65536:
                variants += [
                    ("bn4", dict(base, BLOCK_N=4)),
                    ("warps8", dict(base, num_warps=8)),
                    (
                        "dot",
                        dict(
                            BLOCK_N=32,
                            BLOCK_K=256,
                            SPLIT_K=2 if k >= 8192 else 1,
                            num_warps=4,
                            DOT=True,
                        ),
                    ),
                ]
            for name, cfg in variants:
                for decode in kw.W8A16_DECODES:
                    c = dict(cfg, DECODE=decode)
                    try:
                        y = kw.w8a16_linear(x, w8, s, config=c)
                        us = common.time_us(
                            lambda: kw.w8a16_linear(x, w8, s, config=c), run, "events"
                        )
                    except Exception as exc:  # a tile that does not compile
                        print(f"  {label} M={m} {name} {decode}: {type(exc).__name__}")
                        continue
                    rows.append(
                        {
                            "shape": label,
                            "M": m,
                            "variant": name,
                            "decode": decode,
                            "us": us,
                            "roofline_us": common.memory_roofline_us(n * k, run),
                            "rel_err": float((y.float() - ref).abs().max() / ref.abs().max()),
                        }
                    )
    common.print_rows(
        rows,
        ["shape", "M", "variant", "decode", "us", "roofline_us", "rel_err"],
        "W8A16 weight decodes",
    )
    return rows


def run_fp8_gemm(args, run) -> dict:
    shapes = SMOKE_SHAPES if run.smoke else {s: SHAPES[s] for s in args.shapes.split(",") if s}
    ms = [1, 4, 20] if run.smoke else common.parse_ints(args.ms)
    if args.decode_compare:
        return {"decode_rows": _decode_compare(shapes, ms, run)}
    rows, crossover = _table(shapes, ms, run)
    out = {"rows": rows, "crossover_m": crossover}
    if args.sweep:
        out["sweeps"] = _sweep(shapes, run)
    return out
