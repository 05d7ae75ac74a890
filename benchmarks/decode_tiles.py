"""Sweep of the paged decode attention kernel: bf16 vs FP8 KV cache, kernel paths x tiles (a program).

    python benchmarks/decode_tiles.py --out benchmarks/results/decode_tiles_h200.json

One layer of the Llama-3.1-8B shape (32 query heads, 8 KV heads, head_dim 128, block 16)
at batch x context (default 256 x 1024, 64 x 4096 and 32 x 1024). `--layouts nhd,hnd`
also times each case with the cache's blocks head-major (HND: one head's tokens of a
block contiguous, the kernels seeing the same [2, blocks, page, heads, dim] view through
its strides); `--page` sets the block size. For each KV dtype, each
FP8 kernel path (paged_decode.FP8_PATHS: "tile", "words_bits", "words_cvt", "words_qk8",
"words_kq8") and each tile
(BLOCK_N, num_warps, num_stages): the kernel's time (triton.testing.do_bench, L2 flushed),
the bandwidth over the KV bytes it must read, and the speedup over the bf16 cache with
its default tile, beside a measured copy. `--sweep quick` times only the defaults and a
few word-kernel tiles; `--splits 1,2,4` times every variant at each of those context-slice
counts instead of the engine's choice. num_stages 5 / 7 / 9 are the ones that give the
K / V loads 2 / 3 / 4 buffers (paged_decode.decode_tile_config); 1 stages nothing. The FP8 cache holds the
bf16 values rounded to e4m3 (scales 1.0); every FP8 output is checked against the bf16
kernel reading the same rounded values before it is timed (the query-rounding paths
against it with the queries rounded as they round them). `--sweep wide` adds the full
BLOCK_N x warps x stages product for the "tile" path. The FP8 rows also time
"two-buffer", "words_qk8" on FP8_CVT_TILES (5 stages, query rows padded to 16, the
switches off: the default at batch 1 before the twenty-sixth session, and at every
grid before the twenty-fourth); `--sweep defaults` times only the FP8 default, that
row and the bf16 default.

`--pool-blocks N` shrinks the KV pool to N blocks, the block tables wrapping over them:
with N * block bytes within L2 (512 blocks of this shape: 16 MB FP8, 32 MB bf16) every
read hits L2, so a kernel's time is what its instructions and their latencies cost, not
DRAM. On an H100 at 1.98 GHz that stands in for the H200's power-capped batch-256 step,
where the FP8 kernel is bound the same way (docs/performance.md, 2026-12-07, twenty-fourth
session): the bandwidth column then counts L2 bytes.

`--timer graph` times each variant as replays of a CUDA graph of back-to-back calls
(triton.testing.do_bench_cudagraph) instead of Python launches between events (do_bench):
cases under ~100 µs (batch 1 and 8) are bound by the launch there (the same config read
84 and 94 µs in one run), as the engine's decode steps, replayed from graphs, are not. A
graph cannot flush L2 between calls, so the calls take turns over enough copies of the
cache to span twice the L2 (a layer's KV is not in L2 when the engine reaches it); with
`--pool-blocks` they share the one pool, which is meant to stay in L2.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from itertools import cycle, product
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagoda.kernels.attention.paged_decode import (  # noqa: E402
    FP8_CVT_TILES, MIN_SPLIT_TOKENS, QUERY_ROUNDING_PATHS, choose_num_splits,
    decode_tile_config, min_split_tokens, paged_attention_decode, quantize_q_fp8_reference)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
# (BLOCK_N, num_warps, num_stages); None = decode_tile_config's choice.
BF16_TILES = [None, (64, 4, 5), (64, 4, 7), (128, 4, 5), (32, 4, 9)]
# num_stages 1: no software pipelining, so an FP8 tile is loaded into registers and
# converted there (packed e4m3 -> f16 pairs) before the dots' operand layout change,
# instead of staged in shared memory as bytes and read back one byte per load.
FP8_TILES = {
    "tile": [(128, 4, 4), (64, 4, 5), (64, 4, 7), (128, 4, 5), (128, 4, 7),
             (32, 4, 1), (64, 4, 1), (64, 8, 1), (128, 4, 1), (128, 8, 1)],
    "words_bits": [(128, 4, 4), (64, 4, 3), (64, 4, 5), (64, 4, 7), (64, 4, 9), (128, 4, 5),
                   (128, 8, 5)],
    "words_cvt": [(128, 4, 4), (64, 4, 5), (64, 4, 7), (64, 4, 9), (128, 4, 5),
                  (64, 4, 1), (128, 4, 1)],
    "words_qk8": [(128, 4, 5), (64, 4, 5), (128, 4, 7), (64, 4, 9), (128, 8, 5), (256, 4, 5),
                  (128, 4, 3)],
    "words_kq8": [(128, 4, 5), (64, 4, 5), (128, 4, 7), (64, 4, 9), (128, 8, 5), (256, 4, 5),
                  (128, 4, 3)],
}


def make_case(batch: int, context: int, page: int, device, pool_blocks: int = 0) -> dict:
    """One layer's decode inputs; pool_blocks > 0: the block tables wrap over that many
    physical blocks (every request still reads context tokens, from a smaller pool)."""
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_req = context // page
    num_blocks = batch * blocks_per_req
    pool = min(pool_blocks, num_blocks) if pool_blocks > 0 else num_blocks
    cache = torch.randn(2, pool, page, KV_HEADS, HEAD_DIM, device=device,
                        dtype=torch.bfloat16, generator=gen)
    tables = (torch.randperm(num_blocks, device=device, generator=gen) % pool).view(
        batch, blocks_per_req)
    return {"cache": cache, "tables": tables.int(),
            "q": torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16,
                             generator=gen),
            "qsl": torch.arange(batch + 1, device=device, dtype=torch.int32),
            "seq": torch.full((batch,), context, device=device, dtype=torch.int32)}


def run(case: dict, cache: torch.Tensor, splits: int, config, scales,
        min_split: int = MIN_SPLIT_TOKENS) -> torch.Tensor:
    out = torch.empty_like(case["q"])
    paged_attention_decode(out, case["q"], cache, case["tables"], case["qsl"], case["seq"],
                           case["q"].shape[0], HEAD_DIM ** -0.5, splits, min_split,
                           config=config, kv_scales=scales)
    return out


# --sweep quick: the FP8 default and these tiles of the word kernel's paths only.
_QUICK_TILES = [(128, 4, 5), (64, 4, 5), (128, 4, 7), (64, 4, 9), (128, 8, 5)]
QUICK_WORD_TILES = {"words_cvt": _QUICK_TILES, "words_qk8": _QUICK_TILES,
                    "words_kq8": _QUICK_TILES + [(128, 4, 4)]}


def variants(dtype: str, sweep: str) -> list[tuple[str, dict | None]]:
    """(label, config) pairs for one KV dtype; config None = the defaults."""
    def cfg(path, tile):
        if tile is None:
            return None
        c = dict(BLOCK_N=tile[0], num_warps=tile[1], num_stages=tile[2])
        return c if path is None else dict(c, fp8_path=path)
    wide = sweep == "wide"
    if dtype == "bf16":
        if sweep == "defaults":
            return [("default", None)]
        tiles = [None, (64, 4, 5)] if sweep == "quick" else BF16_TILES
        tiles = tiles + (list(product((32, 64, 128), (4, 8), (2, 3, 4))) if wide else [])
        return [(f"{t or 'default'}", cfg(None, t)) for t in tiles]
    out = [("default", None), ("two-buffer", dict(FP8_CVT_TILES, fp8_path="words_qk8"))]
    if sweep == "defaults":
        return out
    if sweep == "quick":
        return out + [(f"{path} {t}", cfg(path, t)) for path, tiles in QUICK_WORD_TILES.items()
                      for t in tiles]
    for path, tiles in FP8_TILES.items():
        if path == "tile" and wide:
            tiles = tiles + list(product((32, 64, 128, 256), (4, 8), (2, 3, 4)))
        out += [(f"{path} {t or 'default'}", cfg(path, t)) for t in tiles]
    return out


def in_layout(cache: torch.Tensor, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """cache ([2, blocks, page, heads, dim]) as dtype, stored token-major (nhd) or with
    each block head-major (hnd), seen through the same [2, blocks, page, heads, dim] view."""
    if layout == "nhd":
        return cache.to(dtype).contiguous()
    return cache.to(dtype).permute(0, 1, 3, 2, 4).contiguous().permute(0, 1, 3, 2, 4)


def cache_copies(cache: torch.Tensor, device) -> list[torch.Tensor]:
    """The cache and as many clones as it takes to span twice the L2, so that calls
    taking turns over them read from DRAM without a flush (--timer graph)."""
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    cache_bytes = cache.numel() * cache.element_size()
    count = min(64, -(-2 * l2_bytes // cache_bytes))
    return [cache] + [cache.clone() for _ in range(count - 1)]


def sweep_case(spec: str, layout: str, page: int, device, sms: int, sweep: str,
               rows: list, split_counts: list[int] | None = None, pool_blocks: int = 0,
               timer=do_bench) -> None:
    batch, context = map(int, spec.split("x"))
    case = make_case(batch, context, page, device, pool_blocks)
    caches = {"bf16": in_layout(case["cache"], torch.bfloat16, layout),
              "fp8": in_layout(case["cache"], torch.float8_e4m3fn, layout)}
    scales = torch.ones(2, device=device, dtype=torch.float32)
    splits = choose_num_splits(batch, KV_HEADS, context, sms)
    ref = run(case, caches["fp8"].to(torch.bfloat16), splits, None, None).float()
    q8, q_scale = quantize_q_fp8_reference(case["q"])
    ref_qk8 = run(dict(case, q=(q8.float() * q_scale).to(torch.bfloat16)),
                  caches["fp8"].to(torch.bfloat16), splits, None, None).float()
    base_us = None
    # --splits: each variant also at these slice counts (slices as short as 16 tokens
    # allowed, so the count is what runs); otherwise the engine's plan: choose_num_splits
    # and the shortest slice it allows at this grid (min_split_tokens).
    engine_plan = (splits, min_split_tokens(batch, KV_HEADS, sms))
    plans = [(n, 16) for n in split_counts] if split_counts else [engine_plan]
    for dtype, cache in caches.items():
        kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM * cache.element_size()
        sc = scales if dtype == "fp8" else None
        copies = (cache_copies(cache, device) if timer is do_bench_cudagraph and not pool_blocks
                  else [cache])
        next_copy = cycle(copies).__next__
        for (label, config), (n_splits, min_split) in product(variants(dtype, sweep), plans):
            if split_counts:
                label = f"{label} s{n_splits}"
            row = {"case": spec, "layout": layout, "page": page, "pool_blocks": pool_blocks,
                   "dtype": dtype,
                   "variant": label, "config": config, "splits": n_splits}
            try:
                out = run(case, cache, n_splits, config, sc, min_split)
                if dtype == "fp8":
                    path = (config or decode_tile_config(case["q"].dtype, True)).get("fp8_path")
                    rounded = path in QUERY_ROUNDING_PATHS
                    torch.testing.assert_close(out.float(), ref_qk8 if rounded else ref,
                                               atol=2e-2, rtol=2e-2)
                ms = timer(lambda: run(case, next_copy(), n_splits, config, sc, min_split))
            except Exception as e:  # out of resources, or a wrong result: recorded, not fatal
                rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
                print(f"{spec:>9s} {layout} {dtype:4s} {label:28s} {type(e).__name__}", flush=True)
                continue
            if base_us is None:  # bf16, default tile: the first row of the case
                base_us = ms * 1e3
            row.update(us=ms * 1e3, gbps=kv_bytes / ms / 1e6, speedup_vs_bf16=base_us / (ms * 1e3))
            rows.append(row)
            print(f"{spec:>9s} {layout} {dtype:4s} {label:28s} {row['us']:8.1f} us {row['gbps']:6.0f} GB/s"
                  f"  x{row['speedup_vs_bf16']:.2f} vs bf16 default", flush=True)
    del case, caches, copies
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/decode_tiles.json")
    p.add_argument("--cases", default="256x1024,64x4096,32x1024")
    p.add_argument("--sweep", choices=("defaults", "quick", "focused", "wide"), default="focused")
    p.add_argument("--layouts", default="nhd", help="comma list of nhd, hnd")
    p.add_argument("--page", type=int, default=16, help="tokens per KV block")
    p.add_argument("--pool-blocks", type=int, default=0,
                   help="KV pool of this many blocks, the tables wrapping over it (512: "
                        "held in L2; see the module docstring); 0: one block per table entry")
    p.add_argument("--splits", default="",
                   help="comma list of context-slice counts to time each variant at "
                        "(default: the engine's choose_num_splits)")
    p.add_argument("--timer", choices=("events", "graph"), default="events",
                   help="events: Python launches, L2 flushed (triton do_bench); graph: "
                        "replays of a CUDA graph of back-to-back calls (see the docstring)")
    args = p.parse_args()
    timer = do_bench_cudagraph if args.timer == "graph" else do_bench
    split_counts = [int(n) for n in args.splits.split(",") if n]
    start = time.time()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    copy_gbps = 2 * x.numel() / do_bench(lambda: x.clone()) / 1e6
    del x
    rows: list = []
    for spec in args.cases.split(","):
        for layout in args.layouts.split(","):
            sweep_case(spec, layout, args.page, device, sms, args.sweep, rows, split_counts,
                       args.pool_blocks, timer)
    best = {}
    for row in rows:
        key = (row["case"], row["layout"], row["dtype"])
        if "us" in row and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row
    for (spec, layout, dtype), row in best.items():
        print(f"best {spec:>9s} {layout} {dtype:4s} {row['variant']:28s} {row['us']:8.1f} us "
              f"{row['gbps']:6.0f} GB/s x{row['speedup_vs_bf16']:.2f}")
    report = {"benchmark": "decode_tiles", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "platform": platform.platform(), "copy_gbps": copy_gbps, "page": args.page,
              "pool_blocks": args.pool_blocks, "timer": args.timer,
              "seconds": time.time() - start, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"copy {copy_gbps:.0f} GB/s; {time.time() - start:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
