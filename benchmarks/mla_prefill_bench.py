"""MLA prefill attention on the GPU: the Triton kernel (pagoda.kernels.attention.mla_prefill)
against the SDPA path it replaced, and a sweep of its tiles.

    python3 benchmarks/mla_prefill_bench.py --out benchmarks/results/mla_prefill.json
    python3 benchmarks/mla_prefill_bench.py --smoke   # CPU, interpreted, tiny steps

DeepSeek-V2-Lite's attention (16 heads, query/key 128 + 64 wide, value 128, bf16) on
two steps: 16 fresh prompts of 1,024 tokens (a prefill step of the 256 x 1024/128
workload) and 8 chunks of 1,024 tokens after 1,024 cached ones. The inputs are strided
as the layer passes them (k_nope / v halves of kv_b_proj's output, the rope key the
tail of the latent entries). Each variant is checked against the float32 reference
(prefill_attention with upcast) by relative error, then timed with
triton.testing.do_bench (median): the kernel at its default tiles and at each tile of
the sweep, and the old path (the cats that assemble Q and K, then SDPA per chunk).
Reports TFLOP/s of the causal attention. A program: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
sys.path.insert(0, BENCH_DIR)
from result_file import write_json  # noqa: E402  (benchmarks/)

HEADS, NOPE, ROPE, V, RANK = 16, 128, 64, 128, 512
SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
         for m, n, w, s in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 4, 3),
                            (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 2),
                            (64, 32, 4, 4)]]
STEPS = {"16 x 1024 fresh": [(1024, 1024)] * 16, "8 x 1024 after 1024 cached": [(1024, 2048)] * 8}
SMOKE_STEPS = {"fresh": [(20, 20), (9, 9)], "after a cached prefix": [(10, 30)]}


def make_step(layout, gen, dev, dt):
    """The layer's pieces for chunks given as (query rows, context rows)."""
    import torch
    from pagoda.attention.mla_backend import PrefillChunk
    rows = sum(q for q, _ in layout)
    ctx = sum(k for _, k in layout)
    q = torch.randn(rows, HEADS, NOPE + ROPE, device=dev, dtype=dt, generator=gen)
    kv = torch.randn(ctx, HEADS, NOPE + V, device=dev, dtype=dt, generator=gen)
    entries = torch.randn(ctx, RANK + ROPE, device=dev, dtype=dt, generator=gen)
    chunks, r, c = [], 0, 0
    for qlen, klen in layout:
        chunks.append(PrefillChunk(r, r + qlen, c, c + klen))
        r, c = r + qlen, c + klen
    pieces = dict(q_nope=q[..., :NOPE], q_rope=q[..., NOPE:], k_nope=kv[..., :NOPE],
                  k_rope=entries[:, RANK:], v=kv[..., NOPE:])
    visible = sum(sum(range(k - q_ + 1, k + 1)) for q_, k in layout)
    flops = 2 * HEADS * (NOPE + ROPE + V) * visible
    return pieces, chunks, torch.arange(rows, device=dev), flops


def median_ms(fn, smoke: bool) -> float:
    """do_bench's median on the GPU; one timed call under the interpreter (smoke)."""
    if not smoke:
        from triton.testing import do_bench
        return do_bench(fn, return_mode="median")
    import time
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run_step(name, layout, gen, scale, smoke: bool) -> dict:
    import torch
    from pagoda.attention.mla_backend import assemble_prefill_qk, prefill_attention
    from pagoda.kernels.launch.host_copy import host_to_device
    from pagoda.kernels.attention.mla_prefill import mla_prefill_attention, prefill_tile_table
    dev, dt = ("cpu", torch.float16) if smoke else ("cuda", torch.bfloat16)
    p, chunks, rows, flops = make_step(layout, gen, dev, dt)
    q, k = assemble_prefill_qk(p["q_nope"], p["q_rope"], p["k_nope"], p["k_rope"])
    ref = prefill_attention(q, k, p["v"], chunks, scale, upcast=True).float()

    def rel(out):
        return float((out.float() - ref).norm() / ref.norm())

    def old_path():
        qq, kk = assemble_prefill_qk(p["q_nope"], p["q_rope"], p["k_nope"], p["k_rope"])
        return prefill_attention(qq, kk, p["v"], chunks, scale, upcast=False)

    entry = {"step": name, "flops": flops}
    ms = median_ms(old_path, smoke)
    entry["sdpa"] = dict(ms=ms, tflops=flops / ms / 1e9, rel_err=rel(old_path()))
    out = torch.empty(rows.numel(), HEADS, V, device=dev, dtype=dt)
    spans = [(c.row_start, c.row_end, c.ctx_start, c.ctx_end) for c in chunks]
    entry["kernel"] = []
    for cfg in [None] + (SWEEP[:2] if smoke else SWEEP):
        block_m = (cfg or {}).get("BLOCK_M", 128)
        tiles = host_to_device(prefill_tile_table(spans, block_m), torch.int32, dev)
        run = (lambda c=cfg, t=tiles, bm=block_m: mla_prefill_attention(
            out, p["q_nope"], p["q_rope"], p["k_nope"], p["k_rope"], p["v"], rows, t, bm,
            scale, config=c))
        row = {"config": cfg or "default"}
        try:
            out.fill_(float("nan"))
            run()
            row["rel_err"] = rel(out)
            ms = median_ms(run, smoke)
            row.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as exc:  # a tile that does not fit: report, go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        entry["kernel"].append(row)
    return entry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/mla_prefill.json")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny steps")
    args = p.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch
    gen = torch.Generator(device="cpu" if args.smoke else "cuda").manual_seed(0)
    scale = (NOPE + ROPE) ** -0.5
    steps = [run_step(name, layout, gen, scale, args.smoke)
             for name, layout in (SMOKE_STEPS if args.smoke else STEPS).items()]
    for s in steps:
        print(f"\n{s['step']}: {s['flops'] / 1e9:.0f} GFLOP")
        print(f"  sdpa (old path)  {s['sdpa']['ms'] * 1e3:8.1f} us {s['sdpa']['tflops']:6.0f} "
              f"TFLOP/s  rel err {s['sdpa']['rel_err']:.1e}")
        for r in s["kernel"]:
            if "error" in r:
                print(f"  {str(r['config']):<60} error {r['error'][:60]}")
                continue
            print(f"  {str(r['config']):<60} {r['ms'] * 1e3:8.1f} us {r['tflops']:6.0f} "
                  f"TFLOP/s  rel err {r['rel_err']:.1e}")
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    write_json(args.out, {"device": device, "steps": steps})


if __name__ == "__main__":
    main()
