"""Micro-benchmark: the fused q/k norm + rotary + KV store kernel
(pagoda/kernels/attention/qk_rope_store.py) against the unfused launches it replaces (a program,
not a test).

Per attention layer, between the QKV projection and attention: Qwen3-30B-A3B
(32 q heads, 4 KV heads, head_dim 128, qk_norm: five launches unfused: rms_norm q,
rms_norm k, rotary q, rotary k, store_kv) and Llama-3.1-8B (32 / 8 / 128, no qk_norm:
three launches), bf16, block 16, at T = 1, 8 and 256 rows. Every shape is first
checked (the fused kernel's q and cache bytes equal the unfused path's), then timed:
eagerly (host launch overhead included) with triton.testing.do_bench (median), and
from a CUDA graph holding REPEAT copies of the step (per-step device time, replay
launch amortised). The fused kernel is also timed for each heads-per-program choice,
to check the default (kernels/qk_rope_store.py default_heads_per_program).

    python benchmarks/qk_rope_store.py --out benchmarks/results/qk_rope_store.json
    python benchmarks/qk_rope_store.py --smoke   # CPU: tiny shapes in the interpreter
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

from pagoda.kernels.norm import fused_ops  # noqa: E402

from pagoda.kernels.attention import qk_rope_store
from pagoda.kernels.attention.store_kv import store_kv  # noqa: E402
from kernel_timing import time_us  # noqa: E402
from result_file import write_json  # noqa: E402

# name: (heads, kv_heads, head_dim, qk_norm)
MODELS = {"qwen3-30b-a3b": (32, 4, 128, True), "llama-3.1-8b": (32, 8, 128, False)}
SMOKE_MODELS = {"tiny-qk-norm": (4, 2, 32, True), "tiny": (4, 2, 32, False)}
TOKENS, SMOKE_TOKENS = (1, 8, 256), (1, 3)
HEADS_PER_PROGRAM = (1, 2, 4, 8, 16)
BLOCK_SIZE, EPS, REPEAT = 16, 1e-6, 20


class Step:
    """One layer's inputs: qkv rows, cos/sin, norm weights, slots, a KV cache."""

    def __init__(self, tokens, heads, kv_heads, head_dim, qk_norm, dtype, device):
        gen = torch.Generator().manual_seed(tokens)
        self.shape = (heads, kv_heads, head_dim)
        width = (heads + 2 * kv_heads) * head_dim
        self.qkv = torch.randn(tokens, width, generator=gen).to(dtype=dtype, device=device)
        angles = torch.rand(tokens, head_dim // 2, generator=gen) * 1000
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)
        weight = (lambda: torch.rand(head_dim, generator=gen).to(dtype=dtype, device=device))
        self.q_weight, self.k_weight = (weight(), weight()) if qk_norm else (None, None)
        num_blocks = tokens // BLOCK_SIZE + 64
        self.cache = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype,
                                 device=device)
        self.slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:tokens].to(device)

    def fused(self, heads_per_program=None):
        return qk_rope_store.qk_norm_rope_store(
            self.qkv, self.cos, self.sin, self.q_weight, self.k_weight, EPS, self.cache,
            self.slots, None, *self.shape, heads_per_program=heads_per_program)

    def unfused(self):
        """What LlamaAttention launched before: norms, rotaries, store_kv."""
        heads, kv_heads, head_dim = self.shape
        tokens = self.qkv.shape[0]
        q, k, v = self.qkv.split([heads * head_dim, kv_heads * head_dim,
                                  kv_heads * head_dim], -1)
        q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
        if self.q_weight is not None:
            q = fused_ops.rms_norm(q, self.q_weight, EPS)
            k = fused_ops.rms_norm(k, self.k_weight, EPS)
        q, k = fused_ops.rotary(q, self.cos, self.sin), fused_ops.rotary(k, self.cos, self.sin)
        store_kv(k, v.view(tokens, kv_heads, head_dim), self.cache, self.slots)
        return q.reshape(tokens, -1)


def check(step: Step) -> dict:
    """How the fused kernel's q and cache compare with the unfused path's: equal bits,
    or within one ulp of the value plus two of the largest value of each output (each
    compiled kernel contracts its own float32 multiply-adds into FMAs, so a rotated
    value that cancels to near 0 can differ by more than its own ulp: the criterion of
    tests/test_qk_rope_store.py), and the count of values that differ."""
    step.cache.zero_()
    ref_q = step.unfused()
    ref_cache = step.cache.clone()
    step.cache.zero_()
    q = step.fused()
    ulp = torch.finfo(q.dtype).eps

    def close(a, b):
        a, b = a.float(), b.float()
        return bool(((a - b).abs() <= ulp * b.abs() + 2 * ulp * b.abs().max()).all())
    within = close(q, ref_q) and close(step.cache, ref_cache)
    differ = int((q != ref_q).sum() + (step.cache != ref_cache).sum())
    return {"bitwise": differ == 0, "within_two_ulps_of_max": within,
            "values_differing": differ}


def graph_us(fn) -> float:
    """Per-step device time: REPEAT copies of the step in one CUDA graph."""
    from triton.testing import do_bench
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    return do_bench(graph.replay, return_mode="median") * 1e3 / REPEAT


def bench(name, tokens, smoke, device) -> dict:
    heads, kv_heads, head_dim, qk_norm = (SMOKE_MODELS if smoke else MODELS)[name]
    dtype = torch.float16 if smoke else torch.bfloat16
    step = Step(tokens, heads, kv_heads, head_dim, qk_norm, dtype, device)
    row = dict(model=name, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
               qk_norm=qk_norm, unfused_launches=5 if qk_norm else 3,
               default_heads_per_program=qk_rope_store.default_heads_per_program(tokens),
               **check(step))
    row["eager_unfused_us"] = time_us(step.unfused, smoke)
    row["eager_fused_us"] = time_us(step.fused, smoke)
    # Bytes the fused kernel must move: qkv and cos/sin in, q and the K/V slots out.
    row["fused_bytes"] = (step.qkv.numel() * step.qkv.element_size()
                          + 2 * step.cos.numel() * step.cos.element_size()
                          + tokens * (heads + 2 * kv_heads) * head_dim * step.qkv.element_size())
    if not smoke:
        row["graph_unfused_us"] = graph_us(step.unfused)
        row["graph_fused_us"] = graph_us(step.fused)
        row["graph_fused_us_by_heads_per_program"] = {
            str(n): graph_us(lambda n=n: step.fused(n)) for n in HEADS_PER_PROGRAM}
    modes = ("eager",) if smoke else ("eager", "graph")
    print(f"{name:>14} T={tokens:<4} within_2ulps_of_max={row['within_two_ulps_of_max']} differing={row['values_differing']} " + "  ".join(
        f"{m}: {row[f'{m}_unfused_us']:8.2f} -> {row[f'{m}_fused_us']:7.2f} us" for m in modes))
    if not smoke:
        print(" " * 22 + f"fused {row['fused_bytes'] / row['graph_fused_us'] / 1e6:.2f} TB/s; "
              "graph by heads/program: " + "  ".join(
            f"{n}: {us:.2f}" for n, us in row["graph_fused_us_by_heads_per_program"].items()))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (on the CPU in Triton's interpreter)")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--tokens", default=None,
                        help="comma-separated row counts (default 1,8,256; a 16k-token "
                             "prefill step: 16384)")
    parser.add_argument("--models", default=None, help=f"comma-separated, of {list(MODELS)}")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        sys.exit("the benchmark needs CUDA (use --smoke on the CPU)")
    models = list(SMOKE_MODELS if args.smoke else MODELS)
    if args.models:
        unknown = set(args.models.split(",")) - set(models)
        if unknown:
            sys.exit(f"--models: unknown {sorted(unknown)}; choose from {models}")
        models = args.models.split(",")
    tokens = (tuple(int(t) for t in args.tokens.split(",")) if args.tokens
              else SMOKE_TOKENS if args.smoke else TOKENS)
    rows = [bench(name, n, args.smoke, device) for name in models for n in tokens]
    out = args.out or str(Path(__file__).resolve().parent / "results" / (
        "qk_rope_store-smoke.json" if args.smoke else "qk_rope_store.json"))
    name = (torch.cuda.get_device_name() if device == "cuda"
            else platform.processor() or platform.machine())
    write_json(out, dict(
        benchmark="qk_rope_store", smoke=args.smoke, device=name,
        torch=torch.__version__, triton=__import__("triton").__version__, results=rows))
    if not all(row["within_two_ulps_of_max"] for row in rows):
        sys.exit("the fused kernel differs from the unfused path by more than two ulps of "
                 "the largest value")


if __name__ == "__main__":
    main()
