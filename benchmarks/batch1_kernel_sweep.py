"""Tile sweep of the kernels of a batch-1 decode step that are not dense GEMMs (a program).

    python benchmarks/batch1_kernel_sweep.py --out benchmarks/results/batch1_sweep.json
    python benchmarks/batch1_kernel_sweep.py --smoke      # CPU interpreter, tiny shapes

Three parts, each timed as the engine sees it: `--calls` back-to-back launches captured
in one CUDA graph, replayed, the replay's time divided by the launch count (the tail of
one launch overlaps the head of the next, as inside the engine's step graph):

- MoE GEMV decode path (pagoda/kernels/moe/fused_moe_decode.py) at one token: the gate/up
  kernel and the down kernel separately, over tiles (BLOCK_N, BLOCK_K, warps, stages),
  for the Qwen3-30B-A3B layer (128 experts, top 8, hidden 2048, intermediate 768) and
  the DeepSeek-V2-Lite layer (64, top 6, 2048, 1408); bandwidth over the bytes of the
  chosen experts' weights;
- paged decode attention (pagoda/kernels/attention/paged_decode.py) at batch 1 over context
  lengths, split counts and minimum slice lengths, for 32 query heads over 4 and 8 KV
  heads (Qwen3-30B-A3B, Llama-3.1-8B);
- the one-row FP8 W8A16 GEMVs (pagoda/kernels/fp8/w8a16.py) of the Llama-3.1-8B layer
  (qkv, o, gated gate/up, down) over tiles (BLOCK_N, BLOCK_K, warps, loop stages),
  bandwidth over the e4m3 weight bytes;
- the greedy sampler's argmax (pagoda/kernels/sample/argmax.py) of one row of logits over
  chunk sizes, for the vocabularies of Llama-3 (128256) and Qwen3 (151936);
- the bandwidth ceiling (gpu_compare.measure_ceilings' copy).

Prints each part's table sorted by time and the best entry; writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH_DIR), BENCH_DIR]  # pagoda, and benchmarks/ modules
if "--smoke" in sys.argv:  # before Triton picks its driver (none on a CPU machine)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from gpu_compare import measure_ceilings  # noqa: E402
from result_file import write_json  # noqa: E402
from pagoda.kernels.moe import fused_moe_decode as fmd  # noqa: E402
from pagoda.kernels.attention.mla_decode import mla_decode  # noqa: E402
from pagoda.kernels.attention.paged_decode import paged_attention_decode  # noqa: E402

# Llama-3.1-8B's projections: name -> (N, K, gated: the weight is [gate; up], 2N rows).
W8A16_SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False),
                "gate_up": (14336, 4096, True), "down": (4096, 14336, False)}
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408)}


def graph_us(fn, calls: int, repeat: int) -> float:
    """Device microseconds per call of fn, from a CUDA graph of `calls` launches; NaN
    for a tile the GPU cannot run (too much shared memory)."""
    try:
        fn()
    except triton.runtime.errors.OutOfResources:
        return float("nan")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def cpu_us(fn, calls: int, repeat: int) -> float:
    import time
    fn()
    start = time.perf_counter()
    for _ in range(max(1, repeat // 10)):
        fn()
    return (time.perf_counter() - start) * 1e6 / max(1, repeat // 10)


def moe_inputs(shape, device, dtype):
    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).to(device, dtype)
    ids = torch.randperm(experts, generator=gen)[:top_k].to(device, torch.int32)
    weights = torch.rand(top_k, generator=gen).to(device)
    act = torch.randn(top_k, inter, generator=gen).to(device, dtype)
    out = torch.empty(1, hidden, device=device, dtype=dtype)
    return x, w13, w2, ids, weights, act, out


def sweep_gate_up(name, shape, args, timer) -> list[dict]:
    experts, top_k, hidden, inter = shape
    x, w13, _, ids, _, act, _ = moe_inputs(shape, args.device, args.dtype)
    nbytes = top_k * 2 * inter * hidden * x.element_size()
    rows = []
    for block_n, block_k, warps, stages in itertools.product(
            args.gate_up_block_n, args.gate_up_block_k, args.warps, args.stages):
        def call():
            fmd.launch_gate_up(x, w13, ids, act, w13, top_k, 0, dict(
                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages))
        us = timer(call, args.calls, args.repeat)
        rows.append({"model": name, "kernel": "gate_up", "BLOCK_N": block_n, "BLOCK_K": block_k,
                     "num_warps": warps, "num_stages": stages, "us": us,
                     "TB_per_s": nbytes / us / 1e6})
    return rows


def sweep_down(name, shape, args, timer) -> list[dict]:
    experts, top_k, hidden, inter = shape
    _, _, w2, ids, weights, act, out = moe_inputs(shape, args.device, args.dtype)
    nbytes = top_k * hidden * inter * act.element_size()
    one_chunk = triton.next_power_of_2(inter)
    rows = []
    for block_n, block_k, warps, stages in itertools.product(
            args.down_block_n, [one_chunk, *args.down_block_k], args.down_warps, args.stages):
        if block_k > one_chunk or (block_k == one_chunk and block_k > 2048):
            continue
        def call():
            fmd.launch_down(act, w2, ids, weights, out, w2, top_k, 0, dict(
                BLOCK_N=block_n, BLOCK_K=block_k, ONE_CHUNK=block_k >= inter,
                LOOP_STAGES=stages, num_warps=warps))
        us = timer(call, args.calls, args.repeat)
        rows.append({"model": name, "kernel": "down", "BLOCK_N": block_n, "BLOCK_K": block_k,
                     "num_warps": warps, "loop_stages": stages, "us": us,
                     "TB_per_s": nbytes / us / 1e6})
    return rows


def sweep_attention(args, timer) -> list[dict]:
    page, head_dim, heads = 16, 128, 32
    rows = []
    for kv_heads, context in itertools.product(args.kv_heads, args.contexts):
        num_blocks = triton.cdiv(max(args.contexts), page) + 1
        cache = torch.randn(2, num_blocks, page, kv_heads, head_dim, device=args.device,
                            dtype=args.dtype)
        q = torch.randn(1, heads, head_dim, device=args.device, dtype=args.dtype)
        out = torch.empty_like(q)
        tables = torch.arange(num_blocks, device=args.device, dtype=torch.int32)[None, :]
        qsl = torch.tensor([0, 1], device=args.device, dtype=torch.int32)
        seq_lens = torch.tensor([context], device=args.device, dtype=torch.int32)
        nbytes = 2 * context * kv_heads * head_dim * cache.element_size()
        for splits, min_split in itertools.product(args.splits, args.min_splits):
            def call():
                paged_attention_decode(out, q, cache, tables, qsl, seq_lens, 1, head_dim ** -0.5,
                                       splits, min_split_tokens=min_split)
            us = timer(call, args.calls, args.repeat)
            rows.append({"kernel": "decode_attention", "kv_heads": kv_heads, "context": context,
                         "num_splits": splits, "min_split": min_split, "us": us,
                         "TB_per_s": nbytes / us / 1e6})
    return rows


def sweep_mla(args, timer) -> list[dict]:
    """DeepSeek-V2-Lite's latent decode: 16 heads over one 576-wide entry per token
    (kv_lora_rank 512 + rope 64)."""
    page, heads, rank, entry = 16, 16, 512, 576
    rows = []
    num_blocks = triton.cdiv(max(args.contexts), page) + 1
    cache = torch.randn(num_blocks, page, entry, device=args.device, dtype=args.dtype)
    q = torch.randn(1, heads, entry, device=args.device, dtype=args.dtype)
    out = torch.empty(1, heads, rank, device=args.device, dtype=args.dtype)
    tables = torch.arange(num_blocks, device=args.device, dtype=torch.int32)[None, :]
    row_req = torch.zeros(1, device=args.device, dtype=torch.int32)
    for context in args.contexts:
        row_len = torch.tensor([context], device=args.device, dtype=torch.int32)
        nbytes = context * entry * cache.element_size()
        for splits, min_split in itertools.product(args.splits, args.min_splits):
            def call():
                mla_decode(out, q, cache, tables, row_req, row_len, entry ** -0.5, rank,
                           splits, min_split_tokens=min_split)
            us = timer(call, args.calls, args.repeat)
            rows.append({"kernel": "mla_decode", "kv_heads": 1, "context": context,
                         "num_splits": splits, "min_split": min_split, "us": us,
                         "TB_per_s": nbytes / us / 1e6})
    return rows


def sweep_mla_projections(args, timer) -> list[dict]:
    """DeepSeek-V2-Lite's absorbed query (q_nope W_UK + rope) and value projection
    (o_lat W_UV^T) at one token: 16 heads, qk_nope 128, rope 64, rank 512, v 128."""
    from pagoda.kernels.attention import mla_absorb as ab
    heads, nope, rope, rank, v = 16, 128, 64, 512, 128
    dev, dt = args.device, args.dtype
    q = torch.randn(1, heads * (nope + rope), device=dev, dtype=dt)
    q_nope, q_rope = q.view(1, heads, nope + rope).split([nope, rope], dim=-1)
    w = torch.randn(heads, nope + v, rank, device=dev, dtype=dt) * 0.05
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    cos = torch.rand(1, rope // 2, device=dev)
    o_lat = torch.randn(1, heads, rank, device=dev, dtype=dt)
    saved = {k: getattr(ab, k) for k in ("BLOCK_R", "BLOCK_D", "ABSORB_WARPS", "BLOCK_V",
                                         "PROJECT_V_WARPS")}
    rows = []
    for block_r, block_d, warps in itertools.product(args.absorb_r, args.absorb_d, args.warps):
        ab.BLOCK_R, ab.BLOCK_D, ab.ABSORB_WARPS = block_r, block_d, warps
        us = timer(lambda: ab.absorb_q(q_nope, q_rope, w_uk, cos, cos), args.calls, args.repeat)
        rows.append({"model": "deepseek-v2-lite", "kernel": "absorb_q", "BLOCK_R": block_r,
                     "BLOCK_D": block_d, "num_warps": warps, "us": us})
    for block_v, warps in itertools.product(args.project_v, args.warps):
        ab.BLOCK_V, ab.PROJECT_V_WARPS = block_v, warps
        us = timer(lambda: ab.project_v(o_lat, w_uv), args.calls, args.repeat)
        rows.append({"model": "deepseek-v2-lite", "kernel": "project_v", "BLOCK_V": block_v,
                     "num_warps": warps, "us": us})
    bmm = lambda: torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1
                                                                                 ).reshape(1, -1)
    rows.append({"model": "deepseek-v2-lite", "kernel": "project_v", "BLOCK_V": "torch bmm",
                 "num_warps": 0, "us": timer(bmm, args.calls, args.repeat)})
    for k, val in saved.items():
        setattr(ab, k, val)
    return rows


def sweep_w8a16(args, timer) -> list[dict]:
    """One-row W8A16 GEMVs of the Llama-3.1-8B layer at each tile; "default" marks
    w8a16_linear's own choice (timed as config None)."""
    from pagoda.kernels.fp8.w8a16 import w8a16_linear
    rows = []
    for name in args.w8a16_shapes:
        n, k, gated = W8A16_SHAPES[name] if not args.smoke else (96, 128, name == "gate_up")
        gen = torch.Generator(device=args.device).manual_seed(0)
        w = (torch.randn(2 * n if gated else n, k, device=args.device, generator=gen) * 0.05
             ).to(torch.float8_e4m3fn)
        scale = torch.rand(w.shape[0], device=args.device, generator=gen) * 0.01 + 1e-3
        x = torch.randn(1, k, device=args.device, dtype=args.dtype, generator=gen)
        tiles = [None] + list(itertools.product(args.w8a16_block_n, args.w8a16_block_k,
                                                args.warps, args.w8a16_stages))
        for tile in tiles:
            cfg = None if tile is None else dict(BLOCK_N=tile[0], BLOCK_K=tile[1], SPLIT_K=1,
                                                 num_warps=tile[2], LOOP_STAGES=tile[3])
            try:
                us = timer(lambda: w8a16_linear(x, w, scale, config=cfg, gated=gated),
                           args.calls, args.repeat)
            except Exception as e:  # a tile the compiler refuses: recorded, not fatal
                print(f"w8a16 {name} {tile}: {type(e).__name__}", flush=True)
                us = float("nan")
            row = {"model": "llama-3.1-8b fp8", "kernel": f"w8a16 {name}", "us": us,
                   "TB_per_s": w.numel() / us / 1e6}
            row.update(dict(BLOCK_N="default") if tile is None else
                       dict(BLOCK_N=tile[0], BLOCK_K=tile[1], num_warps=tile[2],
                            loop_stages=tile[3]))
            rows.append(row)
    return rows


def sweep_argmax(args, timer) -> list[dict]:
    """argmax_rows of one row of logits at each chunk size (elements per program)."""
    from pagoda.kernels.sample.argmax import MAX_CHUNKS, argmax_rows, default_chunk
    rows = []
    for vocab in args.vocabs:
        logits = torch.randn(1, vocab, device=args.device, dtype=args.dtype)
        for chunk in args.argmax_chunks:
            if triton.cdiv(vocab, chunk) > MAX_CHUNKS:  # argmax_rows refuses it
                continue
            us = timer(lambda: argmax_rows(logits, chunk), args.calls, args.repeat)
            rows.append({"model": f"vocabulary {vocab}", "kernel": "argmax", "chunk": chunk,
                         "default": chunk == default_chunk(1, vocab), "us": us})
    return rows


def print_best(rows: list[dict], keys: tuple[str, ...], top: int) -> None:
    groups: dict = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
    for key, group in groups.items():
        group.sort(key=lambda r: r["us"])
        print(f"\n== {dict(zip(keys, key))}")
        for row in group[:top]:
            print("  " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items() if k not in keys))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/batch1_kernel_sweep.json")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--parts", default="gate_up,down,attention,mla,mla_proj,argmax,w8a16")
    p.add_argument("--w8a16-shapes", default=None,
                   help="comma list of " + ",".join(W8A16_SHAPES) + " (default: all)")
    p.add_argument("--models", default=",".join(MOE_SHAPES))
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    args.gate_up_block_n, args.gate_up_block_k = [8, 16, 32], [128, 256, 512]
    args.down_block_n, args.down_block_k = [1, 2, 4, 8, 16], [256, 512]
    args.warps, args.stages = [2, 4, 8], [2, 3, 4]
    args.down_warps = [1, 2, 4, 8]  # few rows per program (BLOCK_N 1-2) may want one warp
    args.kv_heads, args.contexts = [4, 8], [128, 256, 1024, 4096]
    args.splits, args.min_splits = [1, 2, 4, 8, 16], [16, 32, 64, 256]
    args.absorb_r, args.absorb_d, args.project_v = [32, 64, 128, 256], [32, 64, 128], [4, 8, 16, 32]
    args.vocabs, args.argmax_chunks = [128256, 151936], [512, 1024, 2048, 4096, 8192]
    args.w8a16_shapes = args.w8a16_shapes.split(",") if args.w8a16_shapes else list(W8A16_SHAPES)
    args.w8a16_block_n, args.w8a16_block_k, args.w8a16_stages = [4, 8, 16], [512, 1024], [3, 4]
    args.device, args.dtype = "cuda", torch.bfloat16
    if args.smoke:
        args.vocabs, args.argmax_chunks = [3000], [256, 1024]
        args.w8a16_shapes, args.w8a16_block_n, args.w8a16_block_k = ["o", "gate_up"], [8], [64]
        args.w8a16_stages = [2]
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.device, args.dtype = "cpu", torch.float32
        args.gate_up_block_n, args.gate_up_block_k = [16], [256]
        args.down_block_n, args.down_block_k = [8], [256]
        args.warps, args.stages = [4], [2]
        args.down_warps = [4]
        args.kv_heads, args.contexts, args.splits, args.min_splits = [4], [64], [1, 2], [16]
        args.absorb_r, args.absorb_d, args.project_v = [64], [32], [16]
        args.calls, args.repeat = 1, 10
    return args


def main() -> None:
    args = parse_args()
    timer = graph_us if args.device == "cuda" else cpu_us
    parts = args.parts.split(",")
    shapes = ({"tiny": (8, 2, 64, 48)} if args.smoke
              else {m: MOE_SHAPES[m] for m in args.models.split(",") if m})
    rows: list[dict] = []
    for name, shape in shapes.items():
        if "gate_up" in parts:
            rows += sweep_gate_up(name, shape, args, timer)
        if "down" in parts:
            rows += sweep_down(name, shape, args, timer)
    if "attention" in parts:
        rows += sweep_attention(args, timer)
    if "mla" in parts:
        rows += sweep_mla(args, timer)
    if "mla_proj" in parts:
        rows += sweep_mla_projections(args, timer)
    if "argmax" in parts:
        rows += sweep_argmax(args, timer)
    if "w8a16" in parts:
        rows += sweep_w8a16(args, timer)
    ceiling = measure_ceilings(torch.device(args.device)).get("copy_bytes_per_s", float("nan")) / 1e12
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    rows = [r for r in rows if r["us"] == r["us"]]  # NaN: the tile did not fit
    print_best([r for r in rows if "model" in r], ("model", "kernel"), 6)
    print_best([r for r in rows if "model" not in r], ("kernel", "kv_heads", "context"), 6)
    write_json(args.out, {"benchmark": "batch1_kernel_sweep", "copy_TB_per_s": ceiling,
                          "device": torch.cuda.get_device_name() if args.device == "cuda"
                          else "cpu", "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
