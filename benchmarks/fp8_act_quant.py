"""Micro-benchmark: per-token FP8 activation quantization fused into its producer
(pagoda/kernels/fp8/fused_quant.py) against the unfused pair it replaces (a program,
not a test).

Above W8A16_MAX_M rows an FP8 (W8A8) linear quantizes its input per token. In a Llama
layer the inputs of qkv_proj / gate_up_proj come from an RMSNorm with the residual add,
down_proj's from the SiLU-and-mul. Unfused: the producer writes its bf16 output, then
per_token_quant_fp8 reads it back (twice: amax, then quantize) and writes the fp8 rows
and scales. Fused: one kernel writes the fp8 rows and scales directly. Llama-3.1-8B
widths (hidden 4096, intermediate 14336), bf16, at M = 256 and 16384 rows (a decode
batch and a 16k-token prefill step). Each case is first checked on the device (fp8
bytes, scales and the residual sum equal the unfused path's), then timed with
triton.testing.do_bench (median; it clears L2 between runs): unfused (and each of its
two kernels), fused, and, for the SiLU, the fused kernel at each BLOCK (the row held in
registers, 16384, against two passes over chunks). Bytes are what each path must move
through DRAM (the quantization's second read of its input counted once: it mostly hits
L2), and TB/s is those bytes over the time.

    python benchmarks/fp8_act_quant.py --out benchmarks/results/fp8_act_quant.json
    python benchmarks/fp8_act_quant.py --smoke   # CPU: tiny shapes in the interpreter
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagoda.kernels.fp8 import fused_quant as fp8_fused_quant  # noqa: E402

from pagoda.kernels.norm import fused_ops
from pagoda.kernels.fp8.quant import per_token_quant_fp8  # noqa: E402
from kernel_timing import time_us  # noqa: E402
from result_file import write_json  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 14336
SMOKE_HIDDEN, SMOKE_INTERMEDIATE = 100, 72
ROWS, SMOKE_ROWS = (256, 16384), (3, 20)
SILU_BLOCKS, SMOKE_SILU_BLOCKS = (16384, 8192, 4096, 2048), (128, 32)
EPS = 1e-5


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _differing(pairs) -> int:
    """Elements that differ between each (got, want) pair, fp8 compared as bytes."""
    count = 0
    for got, want in pairs:
        if got.dtype == torch.float8_e4m3fn:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        count += int((got != want).sum())
    return count


def bench_norm(rows, hidden, dtype, device, smoke) -> dict:
    gen = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, hidden, generator=gen).to(dtype=dtype, device=device)
                   for _ in range(2))
    weight = torch.rand(hidden, generator=gen).to(dtype=dtype, device=device)

    def unfused():
        normed, summed = fused_ops.fused_add_rms_norm(x, residual, weight, EPS)
        return (*per_token_quant_fp8(normed), summed)

    def fused():
        return fp8_fused_quant.rms_norm_fp8(x, weight, EPS, residual)

    normed, _ = fused_ops.fused_add_rms_norm(x, residual, weight, EPS)
    q, s, summed = fused()
    differ = _differing(zip(fused(), unfused()))
    # DRAM bytes. Unfused: the norm reads x, residual, weight and writes the sum and its
    # bf16 output; the quantization reads that output and writes fp8 rows and scales.
    fused_bytes = _nbytes(x, residual, weight, summed, q, s)
    row = dict(case="rms_norm+residual", rows=rows, width=hidden, bitwise=differ == 0,
               values_differing=differ, fused_bytes=fused_bytes,
               unfused_bytes=fused_bytes + 2 * _nbytes(normed))
    row["unfused_us"] = time_us(unfused, smoke)
    row["unfused_norm_us"] = time_us(
        lambda: fused_ops.fused_add_rms_norm(x, residual, weight, EPS), smoke)
    row["unfused_quant_us"] = time_us(lambda: per_token_quant_fp8(normed), smoke)
    row["fused_us"] = time_us(fused, smoke)
    return row


def bench_silu(rows, intermediate, dtype, device, smoke, blocks) -> dict:
    gen = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, 2 * intermediate, generator=gen).to(dtype=dtype, device=device)

    def unfused():
        return per_token_quant_fp8(fused_ops.silu_and_mul(x))

    act = fused_ops.silu_and_mul(x)
    default_block = fp8_fused_quant.silu_and_mul_block(intermediate)
    differ = {b: _differing(zip(fp8_fused_quant.silu_and_mul_fp8(x, b), unfused()))
              for b in sorted({default_block, *blocks})}
    q, s = fp8_fused_quant.silu_and_mul_fp8(x)
    fused_bytes = _nbytes(x, q, s)
    row = dict(case="silu_and_mul", rows=rows, width=intermediate,
               bitwise=not any(differ.values()), values_differing=sum(differ.values()),
               default_block=default_block, fused_bytes=fused_bytes,
               unfused_bytes=fused_bytes + 2 * _nbytes(act))
    row["unfused_us"] = time_us(unfused, smoke)
    row["unfused_silu_us"] = time_us(lambda: fused_ops.silu_and_mul(x), smoke)
    row["unfused_quant_us"] = time_us(lambda: per_token_quant_fp8(act), smoke)
    row["fused_us"] = time_us(lambda: fp8_fused_quant.silu_and_mul_fp8(x), smoke)
    row["fused_us_by_block"] = {
        str(b): time_us(lambda b=b: fp8_fused_quant.silu_and_mul_fp8(x, b), smoke)
        for b in blocks}
    return row


def report(row: dict) -> None:
    tbps = (lambda b, us: b / us / 1e6)
    parts = "  ".join(f"{k[8:-3]} {v:.1f}" for k, v in row.items()
                      if k.startswith("unfused_") and k.endswith("_us") and k != "unfused_us")
    print(f"{row['case']:>18} M={row['rows']:<6} bitwise={row['bitwise']} "
          f"(differing {row['values_differing']})  unfused {row['unfused_us']:9.1f} us "
          f"({parts}; {tbps(row['unfused_bytes'], row['unfused_us']):.2f} TB/s) -> fused "
          f"{row['fused_us']:9.1f} us ({tbps(row['fused_bytes'], row['fused_us']):.2f} TB/s)")
    if "fused_us_by_block" in row:
        print(" " * 20 + "fused by BLOCK: " + "  ".join(
            f"{b}: {us:.1f} us" for b, us in row["fused_us_by_block"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (on the CPU in Triton's interpreter)")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--rows", default=None,
                        help="comma-separated row counts (default 256,16384)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("the benchmark needs CUDA (use --smoke on the CPU)")
    smoke = args.smoke
    dtype = torch.float16 if smoke else torch.bfloat16  # the interpreter: no bfloat16
    hidden, intermediate = (SMOKE_HIDDEN, SMOKE_INTERMEDIATE) if smoke else (HIDDEN, INTERMEDIATE)
    blocks = SMOKE_SILU_BLOCKS if smoke else SILU_BLOCKS
    rows = (tuple(int(r) for r in args.rows.split(",")) if args.rows
            else SMOKE_ROWS if smoke else ROWS)
    results = []
    for m in rows:
        for row in (bench_norm(m, hidden, dtype, device, smoke),
                    bench_silu(m, intermediate, dtype, device, smoke, blocks)):
            report(row)
            results.append(row)
    out = args.out or str(Path(__file__).resolve().parent / "results" / (
        "fp8_act_quant-smoke.json" if smoke else "fp8_act_quant.json"))
    name = (torch.cuda.get_device_name() if device == "cuda"
            else platform.processor() or platform.machine())
    write_json(out, dict(
        benchmark="fp8_act_quant", smoke=smoke, device=name, dtype=str(dtype),
        torch=torch.__version__, triton=__import__("triton").__version__, results=results))
    if not all(row["bitwise"] for row in results):
        sys.exit("a fused kernel's bytes differ from the unfused path's")


if __name__ == "__main__":
    main()
