"""The kernel timer: Triton kernels against their references and rooflines, one mode a
kernel family, and engine steps under named kernel-config variants.

    python -m benchmarks.kernels decode --batch 256 --context 1024 --kv-cache-dtype fp8
    python -m benchmarks.kernels decode --batch 256 --context 1024 --kv-cache-dtype fp8 \\
        --config fp8-tiles-64-keys
    python -m benchmarks.kernels steps --preset qwen3-30b-a3b --batch 1 \\
        --variants default,moe-down-4x1w-s4 --rounds 3
    python -m benchmarks.kernels MODE --smoke      # the CPU's interpreter, tiny shapes

Modes (each: `python -m benchmarks.kernels MODE --help`):
  decode      paged decode attention of one layer (bf16 or FP8 KV), GB/s vs copy roofline
  prefill     the chunk attention kernel on prefill steps, TFLOP/s vs matmul roofline
  gemv        the decode GEMV's tiles vs cuBLAS; routing-table entries to paste
  fp8-gemm    FP8 weight matmuls vs bf16 F.linear by rows; W8A16 / W8A8 tiles, decodes
  fp8-quant   FP8 activation quantization fused into its producer vs after it
  moe         the fused MoE layer vs its reference, by path; grouped-GEMM / GEMV tiles
  router      the fused MoE router vs the gate linear + routing kernel
  mla         MLA latent decode and prefill kernels vs references; the projections
  rope-store  q/k norm + rotary + KV store in one launch vs one launch each
  argmax      the greedy sampler's argmax over chunk sizes
  steps       decode steps of one engine under kernel-config variants, A/B by rounds
  ncu         launch one case a few times for Nsight Compute (no timing)

A kernel mode picks its tiles from a named kernel-config variant (`--config NAME`,
benchmarks/harness/variants.py); `steps` takes several (`--variants A,B`). Each mode
prints a table and writes one JSON file (--out) with the machine it ran on.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# mode: (module under benchmarks.kernel_bench, its add-args function, its run function)
MODES = {
    "decode": ("attention", "add_decode_args", "run_decode"),
    "prefill": ("attention", "add_prefill_args", "run_prefill"),
    "gemv": ("linear", "add_gemv_args", "run_gemv"),
    "fp8-gemm": ("fp8_gemm", "add_args", "run_fp8_gemm"),
    "fp8-quant": ("linear", "add_fp8_quant_args", "run_fp8_quant"),
    "moe": ("moe", "add_moe_args", "run_moe"),
    "router": ("moe", "add_router_args", "run_router"),
    "mla": ("mla", "add_args", "run_mla"),
    "rope-store": ("small", "add_rope_args", "run_rope_store"),
    "argmax": ("small", "add_argmax_args", "run_argmax"),
    "steps": ("steps", "add_args", "run_steps"),
}
NCU_CASES = ("decode-{bf16,fp8}-BATCHxCONTEXT[-hnd]", "moe-qwen3-b1")


def _module(name: str):
    return importlib.import_module(f"benchmarks.kernel_bench.{name}")


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.kernel_bench.common import add_common_args

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    modes = p.add_subparsers(dest="mode", required=True)
    for mode, (module, add, _) in MODES.items():
        sub = modes.add_parser(mode, help=f"see benchmarks/kernel_bench/{module}.py")
        getattr(_module(module), add)(sub)
        add_common_args(sub)
        sub.add_argument("--out", default=f"bench_results/kernels-{mode}.json")
    ncu = modes.add_parser("ncu", help="one case launched a few times, for Nsight Compute")
    ncu.add_argument("--case", required=True, help=" or ".join(NCU_CASES))
    ncu.add_argument("--launches", type=int, default=5)
    add_common_args(ncu)
    return p.parse_args(argv)


def run_ncu(args, run) -> None:
    """Launches the case --launches times and prints its output's checksum (a broken
    kernel shows): `ncu --kernel-name regex:_decode_words --launch-skip 2 --launch-count 1
    python -m benchmarks.kernels ncu --case decode-fp8-256x1024`."""
    import torch

    if args.case.startswith("decode-"):
        from benchmarks.kernel_bench.attention import ncu_decode_case

        launch = ncu_decode_case(args.case.removeprefix("decode-"), run)
    elif args.case == "moe-qwen3-b1":
        from benchmarks.kernel_bench.moe import MOE_SHAPES, _layer
        from pagoda.kernels.moe.fused_moe_decode import fused_moe_gemv

        x, w13, w2, weights, ids, _ = _layer(MOE_SHAPES["qwen3-30b-a3b"], 1, run)
        launch = lambda: fused_moe_gemv(x, w13, w2, weights, ids)
    else:
        raise SystemExit(f"unknown case {args.case!r}; cases: {', '.join(NCU_CASES)}")
    for _ in range(args.launches):
        out = launch()
    if run.device == "cuda":
        torch.cuda.synchronize()
    print(f"{args.case}: checksum {out.float().abs().sum().item():.6g}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if getattr(args, "list_variants", False):
        from benchmarks.harness.variants import VARIANTS, describe

        for name in VARIANTS:
            print(describe(name))
        return 0
    from benchmarks.kernel_bench.common import start_run

    run = start_run(args)  # before any kernel module imports triton (--smoke)
    if args.mode == "ncu":
        run_ncu(args, run)
        return 0
    module, _, function = MODES[args.mode]
    result = getattr(_module(module), function)(args, run)
    from benchmarks.harness.results import write_result

    write_result(
        args.out,
        {
            "benchmark": f"kernels {args.mode}",
            "args": vars(args),
            "ceilings": run.ceilings,
            **result,
        },
    )
    return 0 if result.get("ok", True) and result.get("bitwise", True) else 1


if __name__ == "__main__":
    sys.exit(main())
