"""Kernel cases for Nsight Compute: each runs one kernel of interest a few times (a program).

    ncu --kernel-name regex:_decode_words --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/ncu_targets.py --case decode-fp8-256x1024-hnd

Cases (Llama-3.1-8B / Qwen3-30B-A3B shapes, random bf16 values, FP8 scales 1.0):
- decode-{bf16,fp8}-256x1024-{nhd,hnd}: paged decode attention of one layer, 256
  requests x 1024 tokens, 32 query / 8 KV heads, head_dim 128, block 16; nhd is the
  engine's token-major block, hnd the same blocks stored head-major (seen through the
  same view's strides, as benchmarks/decode_tiles.py does);
- moe-qwen3-b1: the MoE GEMV decode path (gate/up then down) of one Qwen3-30B-A3B layer
  at one token, top 8 of 128 experts.
Each case prints the output's checksum so a broken kernel shows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagoda.kernels.paged_decode import choose_num_splits, paged_attention_decode  # noqa: E402

CALLS = 5


def decode_case(dtype: str, layout: str, device: torch.device):
    """A closure launching one decode-attention layer."""
    from decode_tiles import HEAD_DIM, KV_HEADS, in_layout, make_case
    case = make_case(256, 1024, 16, device)
    kv_dtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    cache = in_layout(case["cache"], kv_dtype, layout)
    scales = torch.ones(2, device=device) if dtype == "fp8" else None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = choose_num_splits(256, KV_HEADS, 1024, sms)
    out = torch.empty_like(case["q"])

    def launch():
        paged_attention_decode(out, case["q"], cache, case["tables"], case["qsl"],
                               case["seq"], 256, HEAD_DIM ** -0.5, splits, kv_scales=scales)
        return out
    return launch


def moe_case(device: torch.device):
    from pagoda.kernels.fused_moe_decode import fused_moe_gemv
    gen = torch.Generator(device=device).manual_seed(0)
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16,
                      generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16,
                     generator=gen) * 0.02
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16, generator=gen)
    ids = torch.randperm(experts, device=device, generator=gen)[:top_k].view(1, top_k)
    weights = torch.softmax(torch.randn(1, top_k, device=device, generator=gen), -1)
    return lambda: fused_moe_gemv(x, w13, w2, weights, ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", required=True)
    args = p.parse_args()
    device = torch.device("cuda")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.case.startswith("decode-"):
        _, dtype, _, layout = args.case.split("-")
        launch = decode_case(dtype, layout, device)
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
