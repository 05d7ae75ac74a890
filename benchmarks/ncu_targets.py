"""Kernel cases for Nsight Compute: each runs one kernel of interest a few times (a program).

    ncu --kernel-name regex:_decode_words --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/ncu_targets.py --case decode-fp8-256x1024-hnd

Cases (Llama-3.1-8B / Qwen3-30B-A3B shapes, random bf16 values, FP8 scales 1.0):
- decode-{bf16,fp8}-BATCHxCONTEXT-{nhd,hnd} (e.g. decode-fp8-256x1024-nhd): paged
  decode attention of one layer, 32 query / 8 KV heads, head_dim 128, block 16, built
  as benchmarks/decode_tiles.py builds its cases; nhd is the engine's token-major block,
  hnd the same blocks stored head-major (seen through the same view's strides);
- moe-qwen3-b1: the MoE GEMV decode path (gate/up then down) of one Qwen3-30B-A3B layer
  at one token, top 8 of 128 experts (benchmarks/batch1_kernel_sweep.py's inputs).
Each case prints the output's checksum so a broken kernel shows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagoda.kernels.attention.paged_decode import choose_num_splits  # noqa: E402

CALLS = 5
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
LAYOUTS = ("nhd", "hnd")


def decode_case(dtype: str, spec: str, layout: str, device: torch.device):
    """A closure launching one decode-attention layer (decode_tiles.run)."""
    from decode_tiles import KV_HEADS, in_layout, make_case, run
    if dtype not in DTYPES or layout not in LAYOUTS:
        raise SystemExit(f"decode case: dtype one of {list(DTYPES)}, layout one of "
                         f"{list(LAYOUTS)}; got {dtype!r}, {layout!r}")
    batch, context = map(int, spec.split("x"))
    case = make_case(batch, context, 16, device)
    cache = in_layout(case["cache"], DTYPES[dtype], layout)
    scales = torch.ones(2, device=device) if dtype == "fp8" else None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = choose_num_splits(batch, KV_HEADS, context, sms)
    return lambda: run(case, cache, splits, None, scales)


def moe_case(device: torch.device):
    from batch1_kernel_sweep import MOE_SHAPES, moe_inputs
    from pagoda.kernels.moe.fused_moe_decode import fused_moe_gemv
    x, w13, w2, ids, weights, _, _ = moe_inputs(MOE_SHAPES["qwen3-30b-a3b"], device,
                                                torch.bfloat16)
    return lambda: fused_moe_gemv(x, w13, w2, weights.view(1, -1), ids.view(1, -1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", required=True)
    args = p.parse_args()
    device = torch.device("cuda")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.case.startswith("decode-"):
        _, dtype, spec, layout = args.case.split("-")
        launch = decode_case(dtype, spec, layout, device)
    elif args.case == "moe-qwen3-b1":
        launch = moe_case(device)
    else:
        raise SystemExit(f"unknown case {args.case!r}")
    for _ in range(CALLS):
        out = launch()
    torch.cuda.synchronize()
    print(f"{args.case}: checksum {out.float().abs().sum().item():.6g}")


if __name__ == "__main__":
    main()
