"""Benchmark of the Triton attention backend on CUDA (a program, not a test).

Decode: batch 1/64/256 x context 1k/8k/32k, Llama-3.1-8B attention (32 query heads,
8 KV heads, head_dim 128, bf16, block 16). Prefill: chunks of 2048 tokens, with and
without a cached prefix, and a full 16k-token step. Every shape is first checked
against torch_ref (on a few of its requests, to bound the reference's memory), then
timed with triton.testing.do_bench (median; it flushes the L2 before each call):
one layer's step as the model runs it (the KV pool's store_kv, then the backend's
attention on the plan build_metadata made once for the step), eagerly (host launch
overhead included) and, for decode, replayed from a CUDA graph.
Decode reports achieved GB/s over the KV bytes it must read, next to a measured
device-to-device copy bandwidth; prefill reports TFLOP/s of the causal attention.

    python benchmarks/attention_kernels.py --out results/attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagoda.attention.metadata import build_attention_metadata  # noqa: E402
from pagoda.attention.torch_ref import TorchRefBackend  # noqa: E402
from pagoda.attention.triton_backend import TritonBackend  # noqa: E402
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig  # noqa: E402
from pagoda.attention.kv_pool import KVCachePool  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
REF_REQUESTS = 4  # requests of each batch checked against torch_ref
DEVICE = "cuda"


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus bytes written."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB of float32
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def make_pool(num_blocks: int) -> KVCachePool:
    """One full-attention layer with random contents (on CUDA the pool stores with the
    Triton kernel)."""
    spec = FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, str(DTYPE).removeprefix("torch."))
    pool = KVCachePool(KVCacheConfig(num_blocks, [spec]), DEVICE)
    pool.cache(0).copy_(torch.randn_like(pool.cache(0)))
    return pool


def attend(backend, pool: KVCachePool, q, k, v, md, plan=None, **kw):
    """One layer's step: store k/v through the pool, then attend on the step's plan."""
    pool.store(0, md, k, v)
    plan = backend.build_metadata(md) if plan is None else plan
    return backend.forward(q, pool.cache(0), plan, **kw)


def make_batch(contexts: list[int], query_lens: list[int], gen: torch.Generator):
    """Random KV pool, block tables, q/k/v for requests of given final lengths."""
    needed = [-(-(c + q) // BLOCK_SIZE) for c, q in zip(contexts, query_lens)]
    num_blocks = sum(needed) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in needed:
        tables.append(order[:n])
        order = order[n:]
    seqs = [c + q for c, q in zip(contexts, query_lens)]
    md = build_attention_metadata(query_lens, seqs, tables, BLOCK_SIZE, DEVICE)
    pool = make_pool(num_blocks)
    rows = sum(query_lens)
    q = torch.randn(rows, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    k = torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    v = torch.randn_like(k)
    return md, pool, q, k, v, tables, seqs


def check_against_reference(backend, md, pool, q, k, v, tables, seqs, query_lens) -> dict:
    """Runs the full batch, then torch_ref on its first and last requests (same pool:
    the reference rewrites the same k/v into the same slots)."""
    out = torch.full_like(q, float("nan"))
    attend(backend, pool, q, k, v, md, out=out)
    picked = sorted(set(list(range(min(REF_REQUESTS - 1, len(seqs)))) + [len(seqs) - 1]))
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in picked]).to(DEVICE)
    sub = build_attention_metadata([query_lens[i] for i in picked], [seqs[i] for i in picked],
                                   [tables[i] for i in picked], BLOCK_SIZE, DEVICE)
    ref_backend = TorchRefBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, backend.scale)
    ref = attend(ref_backend, pool, q[rows], k[rows], v[rows], sub).float()
    got = out[rows].float()
    max_abs = float((got - ref).abs().max())
    rel = float((got - ref).norm() / ref.norm())
    ok = bool(not out.isnan().any()) and rel < 1e-2 and max_abs < 5e-2
    return dict(max_abs_err=max_abs, rel_err=rel, ok=ok)


def bench_decode(batch: int, context: int, copy_gbps: float, gen: torch.Generator) -> dict:
    contexts = [context - 1] * batch  # the new token makes the context `context` long
    md, pool, q, k, v, tables, seqs = make_batch(contexts, [1] * batch, gen)
    backend = TritonBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 1 / math.sqrt(HEAD_DIM))
    check = check_against_reference(backend, md, pool, q, k, v, tables, seqs, [1] * batch)
    out = torch.empty_like(q)
    plan = backend.build_metadata(md)  # once per step in the runner, not per layer
    eager_ms = do_bench(lambda: attend(backend, pool, q, k, v, md, plan, out=out),
                        return_mode="median")

    # The same step from a CUDA graph, as the model runner replays it.
    backend.init_cuda_graph_state(batch, md.block_tables.shape[1], BLOCK_SIZE, "cuda")
    graph_plan = backend.metadata_for_capture(batch)
    backend.prepare_replay(md, batch)
    attend(backend, pool, q, k, v, graph_plan.common, graph_plan, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(backend, pool, q, k, v, graph_plan.common, graph_plan, out=out)
    graph_ms = do_bench(graph.replay, return_mode="median")
    graph_out = out.clone()
    attend(backend, pool, q, k, v, md, plan, out=out)
    check["graph_matches_eager"] = bool(torch.equal(graph_out, out))

    from pagoda.kernels.attention.paged_decode import choose_num_splits
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * pool.cache(0).element_size()
    gbps = kv_bytes / (graph_ms * 1e-3) / 1e9
    result = dict(kind="decode", batch=batch, context=context,
                  num_splits=choose_num_splits(batch, NUM_KV_HEADS, context, sms),
                  kv_bytes=kv_bytes, eager_us=eager_ms * 1e3, graph_us=graph_ms * 1e3,
                  kv_gbps=gbps, fraction_of_copy_bw=gbps / copy_gbps, **check)
    del pool, graph
    torch.cuda.empty_cache()
    return result


def bench_prefill(name: str, contexts: list[int], query_lens: list[int], gen: torch.Generator) -> dict:
    md, pool, q, k, v, tables, seqs = make_batch(contexts, query_lens, gen)
    backend = TritonBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 1 / math.sqrt(HEAD_DIM))
    check = check_against_reference(backend, md, pool, q, k, v, tables, seqs, query_lens)
    out = torch.empty_like(q)
    plan = backend.build_metadata(md)
    ms = do_bench(lambda: attend(backend, pool, q, k, v, md, plan, out=out), return_mode="median")
    # Causal: the query at position p sees p + 1 keys; 2 FLOPs per MAC, QK^T and PV.
    visible = sum(sum(range(c + 1, c + n + 1)) for c, n in zip(contexts, query_lens))
    flops = 4 * NUM_HEADS * HEAD_DIM * visible
    result = dict(kind="prefill", name=name, contexts=contexts, query_lens=query_lens,
                  eager_us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12, **check)
    del pool
    torch.cuda.empty_cache()
    return result


DECODE_SWEEP = [dict(BLOCK_N=bn, num_warps=w, num_stages=st)
                for bn, w, st in [(32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4),
                                  (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3)]]
CHUNK_SWEEP = [dict(GROUP_PAD=4, BLOCK_Q=rows // 4, BLOCK_N=bn, num_warps=w, num_stages=st)
               for rows, bn, w, st in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3),
                                       (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 4, 4),
                                       (128, 128, 4, 3), (256, 64, 8, 3), (256, 64, 8, 2),
                                       (256, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                                       (64, 128, 4, 2)]]
# (requests, tokens each) of the chunk sweep: 8 x 2048 and the static workload's 16 x 1024.
CHUNK_SWEEP_SHAPES = [(8, 2048), (16, 1024)]


def sweep_configs(gen: torch.Generator) -> list[dict]:
    """Times kernel tile configs and split counts directly (outputs checked against the
    default config's, itself checked against torch_ref by the main run)."""
    from pagoda.kernels.attention.paged_attention import paged_attention_chunks
    from pagoda.kernels.attention.paged_decode import paged_attention_decode
    scale = 1 / math.sqrt(HEAD_DIM)
    rows = []
    for batch, context, split_options in [(1, 32768, [8, 16, 32, 64]), (64, 8192, [1, 2, 4]),
                                          (256, 2048, [1, 2]), (256, 1100, [1, 2])]:
        md, pool, q, k, v, _, _ = make_batch([context - 1] * batch, [1] * batch, gen)
        cache = pool.cache(0)
        args = (q, cache, md.block_tables, md.query_start_loc, md.seq_lens, batch, scale)
        base = torch.empty_like(q)
        paged_attention_decode(base, *args, split_options[0])
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
        for splits in split_options:
            for cfg in DECODE_SWEEP:
                out = torch.empty_like(q)
                paged_attention_decode(out, *args, splits, config=cfg)
                err = float((out.float() - base.float()).abs().max())
                ms = do_bench(lambda: paged_attention_decode(out, *args, splits, config=cfg),
                              return_mode="median")
                rows.append(dict(kind="decode_sweep", batch=batch, context=context, splits=splits,
                                 config=cfg, us=ms * 1e3, kv_gbps=kv_bytes / (ms * 1e-3) / 1e9,
                                 max_abs_vs_default=err))
        del cache, pool
        torch.cuda.empty_cache()
    for num_reqs, length in CHUNK_SWEEP_SHAPES:
        md, pool, q, k, v, _, _ = make_batch([0] * num_reqs, [length] * num_reqs, gen)
        cache = pool.cache(0)
        flops = 4 * NUM_HEADS * HEAD_DIM * num_reqs * sum(range(1, length + 1))
        base = torch.empty_like(q)
        args = (q, cache, md.block_tables, md.query_start_loc, md.seq_lens, num_reqs,
                md.num_actual_tokens, scale)
        paged_attention_chunks(base, *args, skip_single_token=False)
        for cfg in CHUNK_SWEEP:
            out = torch.empty_like(q)
            paged_attention_chunks(out, *args, skip_single_token=False, config=cfg)
            err = float((out.float() - base.float()).abs().max())
            ms = do_bench(lambda: paged_attention_chunks(out, *args, skip_single_token=False,
                                                         config=cfg), return_mode="median")
            rows.append(dict(kind="chunk_sweep", batch=num_reqs, context=length, config=cfg,
                             us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12,
                             max_abs_vs_default=err))
        del cache, pool
        torch.cuda.empty_cache()
    return rows


def print_sweep(rows: list[dict]) -> None:
    best: dict = {}
    for r in rows:
        key = (r["kind"], r.get("batch"), r.get("context"))
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    for r in rows:
        if r["kind"] == "decode_sweep":
            print(f"decode b{r['batch']:<3} ctx {r['context']:<6} splits {r['splits']:<3} {r['config']} "
                  f"{r['us']:8.1f} us {r['kv_gbps']:6.0f} GB/s err {r['max_abs_vs_default']:.1e}")
        else:
            print(f"chunk {r['batch']}x{r['context']} {r['config']} {r['us']:8.1f} us {r['tflops']:6.1f} TFLOP/s "
                  f"err {r['max_abs_vs_default']:.1e}")
    for key, r in best.items():
        print("best", key, r.get("splits"), r["config"], f"{r['us']:.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--sweep", action="store_true", help="also time tile configs and split counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    results = []
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'eager us':>9} {'graph us':>9} "
          f"{'KV GB/s':>8} {'of copy':>7} {'rel err':>8} ok")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            r = bench_decode(batch, context, copy_gbps, gen)
            results.append(r)
            print(f"{batch:>5} {context:>7} {r['num_splits']:>6} {r['eager_us']:>9.1f} "
                  f"{r['graph_us']:>9.1f} {r['kv_gbps']:>8.0f} {r['fraction_of_copy_bw']:>7.0%} "
                  f"{r['rel_err']:>8.1e} {r['ok'] and r['graph_matches_eager']}", flush=True)
    prefills = [("chunk 2048, no context", [0], [2048]),
                ("chunk 2048 after 8192 cached", [8192], [2048]),
                ("8 x 2048 fresh (16k-token step)", [0] * 8, [2048] * 8)]
    print(f"{'prefill':<34} {'us':>9} {'TFLOP/s':>8} {'rel err':>8} ok")
    for name, contexts, query_lens in prefills:
        r = bench_prefill(name, contexts, query_lens, gen)
        results.append(r)
        print(f"{name:<34} {r['eager_us']:>9.1f} {r['tflops']:>8.1f} {r['rel_err']:>8.1e} {r['ok']}",
              flush=True)
    if args.sweep:
        sweep_rows = sweep_configs(gen)
        print_sweep(sweep_rows)
        results.extend(sweep_rows)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(),
                  copy_gbps=copy_gbps, heads=NUM_HEADS, kv_heads=NUM_KV_HEADS,
                  head_dim=HEAD_DIM, block_size=BLOCK_SIZE, dtype=str(DTYPE), results=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    bad = [r for r in results if not r.get("ok", True) or not r.get("graph_matches_eager", True)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
