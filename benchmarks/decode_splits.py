"""Decode attention at small batches: the context split into slices (+ the merge launch)
against one unsplit pass, by context length, as a CUDA-graph step runs it.

    python benchmarks/decode_splits.py --out benchmarks/results/decode_splits.json

For each shape (query heads / KV heads: Llama-3.1-8B 32/8, Qwen3-30B-A3B 32/4; head_dim
128, block 16, bf16), batch and context, a CUDA graph runs the attention of `--layers`
layers one after another (each its own KV cache and query, as a step does), each
followed by a copy of `--flush-mb` MB (standing in for the GEMVs that evict the KV from
L2 between two layers in a real step); the flush-only graph is timed too and subtracted.
Split counts: 1 (the kernel writes the output, no merge launch), a few fixed ones, and
"graph": what a decode graph captured for max_model_len (--max-model-len) uses. Every
output is checked against the unsplit one. Prints µs a layer; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batch1_kernel_sweep import graph_us  # noqa: E402
from pagoda.kernels.attention.paged_decode import (choose_num_splits, min_split_tokens,  # noqa: E402
                                         paged_attention_decode)

HEAD_DIM, PAGE = 128, 16
SHAPES = {"llama-8b": (32, 8), "qwen3-30b-a3b": (32, 4)}


class Layers:
    """`layers` independent KV caches and queries for `batch` requests of `context`."""

    def __init__(self, heads, kv_heads, batch, context, layers, device):
        blocks = -(-context // PAGE)
        self.caches = [torch.randn(2, batch * blocks, PAGE, kv_heads, HEAD_DIM, device=device,
                                   dtype=torch.bfloat16) for _ in range(layers)]
        self.qs = [torch.randn(batch, heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
                   for _ in range(layers)]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.tables = torch.arange(batch * blocks, device=device,
                                   dtype=torch.int32).reshape(batch, blocks)
        self.qsl = torch.arange(batch + 1, device=device, dtype=torch.int32)
        self.seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        self.batch = batch

    def run(self, splits, min_split, flush):
        for cache, q, out in zip(self.caches, self.qs, self.outs):
            if splits:
                paged_attention_decode(out, q, cache, self.tables, self.qsl, self.seq_lens,
                                       self.batch, HEAD_DIM ** -0.5, splits, min_split)
            if flush is not None:
                flush[1].copy_(flush[0])


def measure(args, shape, heads, kv_heads, batch, context, flush, sms):
    layers = Layers(heads, kv_heads, batch, context, args.layers, "cuda")
    graph_splits = choose_num_splits(batch, kv_heads, args.max_model_len, sms)
    min_split = min_split_tokens(batch, kv_heads, sms)
    # µs a replay of a graph of one step (graph_us: the median of --replays replays).
    base = graph_us(lambda: layers.run(0, 1, flush), 1, args.replays) if flush else 0.0
    layers.run(1, min_split, None)
    want = [o.clone() for o in layers.outs]
    row = {"shape": shape, "batch": batch, "context": context, "graph_splits": graph_splits,
           "flush_us": base / args.layers, "us_per_layer": {}, "max_diff": {}}
    for splits in sorted({1, *args.splits, graph_splits}):
        total = graph_us(lambda: layers.run(splits, min_split, flush), 1, args.replays)
        layers.run(splits, min_split, None)
        diff = max((o.float() - w.float()).abs().max().item() for o, w in zip(layers.outs, want))
        key = "1" if splits == 1 else "graph" if splits == graph_splits else str(splits)
        row["us_per_layer"][key] = (total - base) / args.layers
        row["max_diff"][str(splits)] = diff
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="llama-8b,qwen3-30b-a3b")
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--contexts", default="64,128,256,384,512,768,1024,2048")
    p.add_argument("--splits", default="4,8", help="fixed split counts besides 1 and the graph's")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--flush-mb", type=int, default=64, help="0: no flush between layers")
    p.add_argument("--replays", type=int, default=100, help="replays timed, one by one")
    p.add_argument("--out", default="benchmarks/results/decode_splits.json")
    args = p.parse_args()
    args.splits = [int(s) for s in args.splits.split(",") if s]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = args.flush_mb * 2 ** 20 // 2
    flush = (torch.empty(n, dtype=torch.bfloat16, device="cuda"),
             torch.empty(n, dtype=torch.bfloat16, device="cuda")) if n else None
    rows = []
    print(f"{'shape':<15}{'batch':>6}{'context':>8}  us a layer by split count (graph = "
          f"the decode graph's)")
    for shape in args.shapes.split(","):
        heads, kv_heads = SHAPES[shape]
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                row = measure(args, shape, heads, kv_heads, batch, context, flush, sms)
                rows.append(row)
                cells = "  ".join(f"{k}: {v:6.2f}" for k, v in row["us_per_layer"].items())
                print(f"{shape:<15}{batch:>6}{context:>8}  {cells}  "
                      f"(graph = {row['graph_splits']} splits)", flush=True)
    report = {"benchmark": "decode_splits", "date": datetime.now(timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "args": vars(args), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
