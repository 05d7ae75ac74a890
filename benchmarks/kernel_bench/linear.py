"""Linear-layer kernel modes: `gemv` (the decode GEMV's tiles against cuBLAS, and the
routing-table entries to paste) and `fp8-quant` (FP8 activation quantization fused into
its producer against the unfused pair).

gemv: for each shape (N x K, bf16; Qwen3-30B-A3B, Llama-3.1-8B and DeepSeek-V2-Lite
projections, --shapes, or --extra NxK) and M rows (--rows), cuBLAS F.linear and every
candidate tile (a grid of BLOCK_N x BLOCK_K x warps, then LOOP_STAGES x SPLIT_K around
the --refine best), timed as the engine's step graph sees them: `calls` launches in one
CUDA graph, each on its own copy of the weight (together 3x the L2: every layer's
weights are cold in a decode step). A candidate whose output is off the float32
reference by more than 1% of its largest value, or not bitwise its first after the graph
replays, is reported as wrong. TB/s counts weight + x + y bytes; the roofline is the
weight's time at the copy bandwidth. Prints the GEMV_TABLES entries (the (N, K, M) where
the best tile beat cuBLAS by more than --margin) to paste into
pagoda/kernels/gemv/config.py.

fp8-quant: Llama-3.1-8B widths (hidden 4096, intermediate 14336) at --rows: the RMSNorm
with the residual add, and the SiLU-and-mul, each with per-token FP8 output in one
kernel, against the producer followed by per_token_quant_fp8; bytes equal (checked
first), TB/s over the DRAM bytes each path must move; the SiLU's fused kernel also at
each BLOCK (the row held in registers against two passes over chunks).
"""

from __future__ import annotations

import math

from benchmarks.kernel_bench import common

GEMV_SHAPES = {
    "qkv_30b": (5120, 2048),
    "o_30b": (2048, 4096),  # Qwen3-30B-A3B
    "qkv_8b": (6144, 4096),
    "o_8b": (4096, 4096),  # Llama-3.1-8B
    "gate_up_8b": (28672, 4096),
    "down_8b": (4096, 14336),
    "o_dsv2l": (2048, 2048),
    "q_dsv2l": (3072, 2048),  # DeepSeek-V2-Lite
    "kv_a_dsv2l": (576, 2048),
    "shared_gate_up_dsv2l": (5632, 2048),
    "shared_down_dsv2l": (2048, 2816),
}
SMOKE_GEMV_SHAPES = {"a": (48, 64), "b": (40, 160)}
MAX_REL_ERR = 1e-2


def add_gemv_args(p) -> None:
    p.add_argument("--shapes", default=",".join(GEMV_SHAPES))
    p.add_argument("--extra", default="", help="comma list of NxK shapes besides --shapes")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--refine", type=int, default=3)
    p.add_argument("--margin", type=float, default=0.03)


def _phase1(m: int, n: int, k: int, sms: int, smoke: bool) -> list:
    """The grid of tile shapes and warps at 3 stages, the K split doubled while the
    programs are fewer than two an SM."""
    from pagoda.kernels.gemv.config import GemvTiles

    if smoke:
        grid = [(bn, bk, 4, False) for bn in (8, 16) for bk in (32, 64)]
    elif m == 1:
        grid = [(bn, bk, w, False) for bn in (4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8)]
    else:
        grid = [(bn, bk, w, False) for bn in (2, 4, 8) for bk in (128, 256, 512) for w in (4, 8)]
        grid += [(bn, bk, 4, True) for bn in (16, 32, 64) for bk in (64, 128, 256)]
    out = []
    for bn, bk, warps, dot in grid:
        lanes, rows = 32 * warps, 1 if m == 1 else 1 << (m - 1).bit_length()
        regs = bn * bk // lanes if dot else rows * bn * bk // lanes
        if bk > k or regs > (64 if m == 1 or dot else 128):
            continue
        blocks, split = -(-n // bn), 1
        while blocks * split < 2 * sms and k >= 2 * split * bk and split < 16:
            split *= 2
        out.append(GemvTiles(bn, bk, split, 3, warps, dot))
    return out


def _phase2(best: list, n: int, k: int, sms: int) -> list:
    """Loop stages x K splits around each of the best phase-1 tiles."""
    from dataclasses import replace

    out = []
    for base in best:
        blocks = -(-n // base.block_n)
        for stages in (2, 3, 4):
            for split in (1, 2, 4, 8, 16):
                if (
                    k < split * base.block_k
                    or (split > 1 and blocks * split > 8 * sms)
                    or (split > 4 and blocks >= sms)
                ):
                    continue
                tiles = replace(base, loop_stages=stages, split_k=split)
                if tiles not in out and tiles not in best:
                    out.append(tiles)
    return out


def _name(t) -> str:
    return (
        f"{'dot' if t.dot else 'fma'} n{t.block_n} k{t.block_k} s{t.split_k} "
        f"st{t.loop_stages} w{t.num_warps}"
    )


def _gemv_cell(kg, ws: list, m: int, run, refine: int, sms: int) -> dict:
    import torch
    import torch.nn.functional as F

    n, k = ws[0].shape
    x = torch.randn(
        m, k, generator=torch.Generator(run.device).manual_seed(m), device=run.device
    ).to(ws[0].dtype)
    ref = x.float() @ ws[0].float().t()
    nbytes = (n * k + m * k + m * n) * x.element_size()
    cell = {
        "N": n,
        "K": k,
        "M": m,
        "cublas_us": common.time_us(
            common.rotated(lambda w: F.linear(x, w), ws), run, calls=max(run.calls, len(ws))
        ),
    }

    def attempt(tiles) -> dict:
        row = {"tiles": _name(tiles), "config": tiles}
        try:
            first = kg.gemv(x, ws[0], None, tiles)
        except Exception as exc:  # out of resources, a refused tile
            return dict(row, status="error", reason=str(exc).splitlines()[0][:160])
        err = float((first.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if not err <= MAX_REL_ERR:
            return dict(row, status="wrong", rel_err=err)
        us = common.time_us(
            common.rotated(lambda w: kg.gemv(x, w, None, tiles), ws),
            run,
            calls=max(run.calls, len(ws)),
        )
        if not torch.equal(kg.gemv(x, ws[0], None, tiles), first):
            return dict(row, status="wrong", reason="differs after the graph replays")
        return dict(row, status="ok", rel_err=err, us=us)

    tried = [attempt(t) for t in _phase1(m, n, k, sms, run.smoke)]
    ok = sorted((r for r in tried if r["status"] == "ok"), key=lambda r: r["us"])
    tried += [attempt(t) for t in _phase2([r["config"] for r in ok[:refine]], n, k, sms)]
    ok = sorted((r for r in tried if r["status"] == "ok"), key=lambda r: r["us"])
    cell["wrong"] = [r["tiles"] for r in tried if r["status"] == "wrong"]
    cell["tried"] = len(tried)
    if ok:
        cell.update(
            best=ok[0]["tiles"],
            best_config=ok[0]["config"],
            gemv_us=ok[0]["us"],
            speedup=cell["cublas_us"] / ok[0]["us"],
        )
        cell["gemv_tb_per_s"] = common.tb_per_s(nbytes, ok[0]["us"])
    cell["cublas_tb_per_s"] = common.tb_per_s(nbytes, cell["cublas_us"])
    cell["roofline_us"] = common.memory_roofline_us(n * k * x.element_size(), run)
    return cell


def run_gemv(args, run) -> dict:
    import torch

    from pagoda.kernels.gemv import gemv as kg

    shapes = (
        SMOKE_GEMV_SHAPES if run.smoke else {s: GEMV_SHAPES[s] for s in args.shapes.split(",") if s}
    )
    for spec in (s for s in args.extra.split(",") if s):
        n, k = (int(v) for v in spec.lower().split("x"))
        shapes[f"{n}x{k}"] = (n, k)
    rows = [1, 3] if run.smoke else common.parse_ints(args.rows)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if run.device == "cuda" else 4
    cells = []
    for label, (n, k) in shapes.items():
        w = (
            torch.randn(
                n,
                k,
                device=run.device,
                generator=torch.Generator(run.device).manual_seed(n * 31 + k),
            )
            / math.sqrt(k)
        ).to(run.dtype)
        ws = common.l2_copies(w, run, times=3.0, most=256)
        for m in rows:
            cell = dict(_gemv_cell(kg, ws, m, run, args.refine, sms), shape=label)
            cells.append(cell)
        del ws, w
    common.print_rows(
        cells,
        [
            "shape",
            "M",
            "cublas_us",
            "gemv_us",
            "speedup",
            "gemv_tb_per_s",
            "roofline_us",
            "best",
            "wrong",
        ],
        "GEMV vs cuBLAS (graph)",
    )
    entries = [
        c
        for c in cells
        if c["M"] & (c["M"] - 1) == 0 and "best" in c and c["speedup"] > 1 + args.margin
    ]
    print("\n# pagoda/kernels/gemv/config.py GEMV_TABLES entries, measured on this GPU:")
    for c in entries:
        t = c["best_config"]
        print(
            f"        ({c['N']}, {c['K']}, {c['M']}): _tiles({t.block_n}, {t.block_k}, "
            f"{t.split_k}, {t.loop_stages}{', dot=True' if t.dot else ''}),  # "
            f"{c['cublas_us']:.2f} -> {c['gemv_us']:.2f} us"
        )
    for c in cells:
        c.pop("best_config", None)
    return {"cells": cells}


# ------------------------------------------------------------------ fp8-quant -------
def add_fp8_quant_args(p) -> None:
    p.add_argument("--rows", default="256,16384")


def _differing(pairs) -> int:
    """Elements that differ between each (got, want) pair, FP8 compared as bytes."""
    import torch

    count = 0
    for got, want in pairs:
        if got.dtype == torch.float8_e4m3fn:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        count += int((got != want).sum())
    return count


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_fp8_quant(args, run) -> dict:
    import torch

    from pagoda.kernels.fp8 import fused_quant
    from pagoda.kernels.fp8.quant import per_token_quant_fp8
    from pagoda.kernels.norm import fused_ops

    hidden, inter = (100, 72) if run.smoke else (4096, 14336)
    rows_list = [3, 20] if run.smoke else common.parse_ints(args.rows)
    rows = []
    for m in rows_list:
        gen = torch.Generator().manual_seed(m)
        x, residual = (
            torch.randn(m, hidden, generator=gen).to(run.dtype).to(run.device) for _ in range(2)
        )
        weight = torch.rand(hidden, generator=gen).to(run.dtype).to(run.device)
        normed, summed = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5)

        def unfused_norm():
            n, s = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
            return (*per_token_quant_fp8(n), s)

        def fused_norm():
            return fused_quant.rms_norm_fp8(x, weight, 1e-5, residual)

        q, s, _ = fused_norm()
        fused_bytes = _nbytes(x, residual, weight, summed, q, s)
        rows.append(
            dict(
                case="rms_norm+residual",
                rows=m,
                differing=_differing(zip(fused_norm(), unfused_norm())),
                unfused_us=common.time_us(unfused_norm, run, "events"),
                fused_us=common.time_us(fused_norm, run, "events"),
                fused_bytes=fused_bytes,
                unfused_bytes=fused_bytes + 2 * _nbytes(normed),
            )
        )
        gate_up = torch.randn(m, 2 * inter, generator=gen).to(run.dtype).to(run.device)
        act = fused_ops.silu_and_mul(gate_up)
        q, s = fused_quant.silu_and_mul_fp8(gate_up)
        fused_bytes = _nbytes(gate_up, q, s)
        blocks = (128, 32) if run.smoke else (16384, 8192, 4096, 2048)
        by_block = {
            b: common.time_us(lambda b=b: fused_quant.silu_and_mul_fp8(gate_up, b), run, "events")
            for b in blocks
        }
        rows.append(
            dict(
                case="silu_and_mul",
                rows=m,
                fused_us_by_block=by_block,
                default_block=fused_quant.silu_and_mul_block(inter),
                differing=_differing(
                    zip(fused_quant.silu_and_mul_fp8(gate_up), per_token_quant_fp8(act))
                ),
                unfused_us=common.time_us(
                    lambda: per_token_quant_fp8(fused_ops.silu_and_mul(gate_up)), run, "events"
                ),
                fused_us=common.time_us(
                    lambda: fused_quant.silu_and_mul_fp8(gate_up), run, "events"
                ),
                fused_bytes=fused_bytes,
                unfused_bytes=fused_bytes + 2 * _nbytes(act),
            )
        )
    for row in rows:
        row["unfused_tb_per_s"] = common.tb_per_s(row["unfused_bytes"], row["unfused_us"])
        row["fused_tb_per_s"] = common.tb_per_s(row["fused_bytes"], row["fused_us"])
        row["roofline_us"] = common.memory_roofline_us(row["fused_bytes"], run)
    common.print_rows(
        rows,
        [
            "case",
            "rows",
            "differing",
            "unfused_us",
            "unfused_tb_per_s",
            "fused_us",
            "fused_tb_per_s",
            "roofline_us",
        ],
        "FP8 activation quantization: fused into its producer vs after it",
    )
    return {"rows": rows, "bitwise": all(r["differing"] == 0 for r in rows)}
