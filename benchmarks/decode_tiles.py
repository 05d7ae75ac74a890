"""Tile sweep of the paged decode attention kernel, bf16 vs FP8 KV cache (a program).

    python benchmarks/decode_tiles.py --out benchmarks/results/decode_tiles_h200.json

One layer of the Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128, block 16)
at batch x context (default 256 x 1024 and 64 x 8192): for each KV dtype and each tile
(BLOCK_N, num_warps, num_stages) the kernel's time (triton.testing.do_bench, L2 flushed)
and the achieved bandwidth over the KV bytes it must read, beside a measured copy.
The FP8 cache holds the bf16 values rounded to e4m3 (scales 1.0); outputs are checked
against the bf16 cache's within FP8 rounding before any timing.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from itertools import product
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagoda.kernels.paged_decode import choose_num_splits, paged_attention_decode  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def make_case(batch: int, context: int, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_req = context // PAGE
    num_blocks = batch * blocks_per_req
    cache = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM, device=device,
                        dtype=torch.bfloat16, generator=gen)
    tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, blocks_per_req)
    return {"cache": cache, "tables": tables.int(),
            "q": torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16,
                             generator=gen),
            "qsl": torch.arange(batch + 1, device=device, dtype=torch.int32),
            "seq": torch.full((batch,), context, device=device, dtype=torch.int32)}


def run(case: dict, cache: torch.Tensor, splits: int, config, scales) -> torch.Tensor:
    out = torch.empty_like(case["q"])
    paged_attention_decode(out, case["q"], cache, case["tables"], case["qsl"], case["seq"],
                           case["q"].shape[0], HEAD_DIM ** -0.5, splits, config=config,
                           kv_scales=scales)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/decode_tiles.json")
    p.add_argument("--cases", default="256x1024,64x8192")
    args = p.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    copy_gbps = 2 * x.numel() / do_bench(lambda: x.clone()) / 1e6
    del x
    scales = torch.ones(2, device=device, dtype=torch.float32)
    tiles = [dict(BLOCK_N=bn, num_warps=w, num_stages=s)
             for bn, w, s in product((32, 64, 128, 256), (4, 8), (2, 3, 4))]
    rows = []
    for spec in args.cases.split(","):
        batch, context = map(int, spec.split("x"))
        case = make_case(batch, context, device)
        caches = {"bf16": case["cache"], "fp8": case["cache"].to(torch.float8_e4m3fn)}
        splits = choose_num_splits(batch, KV_HEADS, context, sms)
        ref = run(case, caches["fp8"].to(torch.bfloat16), splits, None, None).float()
        for dtype, cache in caches.items():
            kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM * cache.element_size()
            best = None
            for tile in tiles:
                try:
                    out = run(case, cache, splits, tile, scales if dtype == "fp8" else None)
                    if dtype == "fp8":
                        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
                    ms = do_bench(lambda: run(case, cache, splits, tile,
                                              scales if dtype == "fp8" else None))
                except Exception as e:  # out of resources: recorded, not fatal
                    rows.append({"case": spec, "dtype": dtype, "tile": tile, "error": type(e).__name__})
                    continue
                row = {"case": spec, "dtype": dtype, "tile": tile, "splits": splits,
                       "us": ms * 1e3, "gbps": kv_bytes / ms / 1e6}
                rows.append(row)
                if best is None or row["us"] < best["us"]:
                    best = row
            default = run  # the tile decode_tile_config picks, for comparison
            ms = do_bench(lambda: default(case, cache, splits, None,
                                          scales if dtype == "fp8" else None))
            print(f"{spec:>9s} {dtype:4s} default {ms * 1e3:8.1f} us {kv_bytes / ms / 1e6:7.0f} GB/s"
                  f" | best {best['us']:8.1f} us {best['gbps']:7.0f} GB/s {best['tile']}", flush=True)
            rows.append({"case": spec, "dtype": dtype, "tile": "default", "splits": splits,
                         "us": ms * 1e3, "gbps": kv_bytes / ms / 1e6})
    report = {"benchmark": "decode_tiles", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "platform": platform.platform(), "copy_gbps": copy_gbps, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"copy {copy_gbps:.0f} GB/s; wrote {args.out}")


if __name__ == "__main__":
    main()
