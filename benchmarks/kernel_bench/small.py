"""Modes for the small kernels of a decode step: `rope-store` (q/k norm + rotary + KV
store in one launch against one launch each) and `argmax` (the greedy
sampler's argmax over chunk sizes).

rope-store: per attention layer between the QKV projection and attention, Qwen3-30B-A3B
(32 q heads, 4 KV heads, head_dim 128, q/k norm: five launches unfused) and
Llama-3.1-8B (32 / 8 / 128, no norm: three launches), at --tokens rows: the fused
kernel's q and cache against the unfused path's (equal, or within two ulps of the
largest value: each compiled kernel contracts its own multiply-adds), then both timed,
and the fused kernel at each heads-per-program choice (the default is
qk_rope_store.default_heads_per_program), TB/s over the bytes it must move against the
copy roofline.

argmax: argmax_rows of one row of logits (Llama-3's 128256 and Qwen3's 151936 words) at
each chunk size, the default marked.
"""

from __future__ import annotations

from benchmarks.kernel_bench import common

ROPE_MODELS = {"qwen3-30b-a3b": (32, 4, 128, True), "llama-3.1-8b": (32, 8, 128, False)}
SMOKE_ROPE_MODELS = {"tiny-qk-norm": (4, 2, 32, True)}


def add_rope_args(p) -> None:
    p.add_argument("--tokens", default="1,8,256")
    p.add_argument("--models", default=",".join(ROPE_MODELS))


class _Step:
    """One layer's inputs: qkv rows, cos / sin, norm weights, slots, a KV cache."""

    def __init__(self, tokens, heads, kv_heads, head_dim, qk_norm, run):
        import torch

        gen = torch.Generator().manual_seed(tokens)
        self.shape = (heads, kv_heads, head_dim)
        width = (heads + 2 * kv_heads) * head_dim
        self.qkv = torch.randn(tokens, width, generator=gen).to(run.dtype).to(run.device)
        angles = torch.rand(tokens, head_dim // 2, generator=gen) * 1000
        self.cos, self.sin = angles.cos().to(run.device), angles.sin().to(run.device)
        weight = lambda: torch.rand(head_dim, generator=gen).to(run.dtype).to(run.device)
        self.q_weight, self.k_weight = (weight(), weight()) if qk_norm else (None, None)
        blocks = tokens // 16 + 64
        self.cache = torch.zeros(
            2, blocks, 16, kv_heads, head_dim, dtype=run.dtype, device=run.device
        )
        self.slots = torch.randperm(blocks * 16, generator=gen)[:tokens].to(run.device)

    def fused(self, heads_per_program=None):
        from pagoda.kernels.attention import qk_rope_store

        return qk_rope_store.qk_norm_rope_store(
            self.qkv,
            self.cos,
            self.sin,
            self.q_weight,
            self.k_weight,
            1e-6,
            self.cache,
            self.slots,
            None,
            *self.shape,
            heads_per_program=heads_per_program,
        )

    def unfused(self):
        """Norms, rotaries and store_kv, one launch each."""
        from pagoda.kernels.attention.store_kv import store_kv
        from pagoda.kernels.norm import fused_ops

        heads, kv_heads, head_dim = self.shape
        tokens = self.qkv.shape[0]
        q, k, v = self.qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
        if self.q_weight is not None:
            q = fused_ops.rms_norm(q, self.q_weight, 1e-6)
            k = fused_ops.rms_norm(k, self.k_weight, 1e-6)
        q, k = fused_ops.rotary(q, self.cos, self.sin), fused_ops.rotary(k, self.cos, self.sin)
        store_kv(k, v.view(tokens, kv_heads, head_dim), self.cache, self.slots)
        return q.reshape(tokens, -1)


def _close(step: _Step) -> tuple[bool, int]:
    """(within two ulps of the largest value, values differing) of the fused path's q
    and cache against the unfused path's."""
    import torch

    step.cache.zero_()
    ref_q, ref_cache = step.unfused(), step.cache.clone()
    step.cache.zero_()
    q = step.fused()
    ulp = torch.finfo(q.dtype).eps

    def close(a, b):
        a, b = a.float(), b.float()
        return bool(((a - b).abs() <= ulp * b.abs() + 2 * ulp * b.abs().max()).all())

    return (
        close(q, ref_q) and close(step.cache, ref_cache),
        int((q != ref_q).sum() + (step.cache != ref_cache).sum()),
    )


def run_rope_store(args, run) -> dict:
    from pagoda.kernels.attention.qk_rope_store import default_heads_per_program

    models = (
        SMOKE_ROPE_MODELS if run.smoke else {m: ROPE_MODELS[m] for m in args.models.split(",") if m}
    )
    rows = []
    for name, shape in models.items():
        for tokens in [1, 3] if run.smoke else common.parse_ints(args.tokens):
            step = _Step(tokens, *shape, run)
            within, differing = _close(step)
            heads, kv_heads, head_dim, _ = shape
            nbytes = (
                2 * step.qkv.numel() * step.qkv.element_size()
                + 2 * step.cos.numel() * step.cos.element_size()
            )
            row = {
                "model": name,
                "tokens": tokens,
                "within_2_ulps": within,
                "differing": differing,
                "unfused_us": common.time_us(step.unfused, run),
                "fused_us": common.time_us(step.fused, run),
                "default_heads": default_heads_per_program(tokens),
                "roofline_us": common.memory_roofline_us(nbytes, run),
            }
            row["fused_tb_per_s"] = common.tb_per_s(nbytes, row["fused_us"])
            by_heads = {
                n: common.time_us(lambda n=n: step.fused(n), run)
                for n in ((1, 4) if run.smoke else (1, 2, 4, 8, 16))
            }
            row["best_heads"] = min(by_heads, key=by_heads.get)
            row["fused_us_by_heads"] = by_heads
            rows.append(row)
    common.print_rows(
        rows,
        [
            "model",
            "tokens",
            "unfused_us",
            "fused_us",
            "fused_tb_per_s",
            "roofline_us",
            "default_heads",
            "best_heads",
            "within_2_ulps",
            "differing",
        ],
        "q/k norm + rotary + KV store",
    )
    return {"rows": rows, "ok": all(r["within_2_ulps"] for r in rows)}


def add_argmax_args(p) -> None:
    p.add_argument("--vocabs", default="128256,151936")
    p.add_argument("--chunks", default="512,1024,2048,4096,8192")


def run_argmax(args, run) -> dict:
    import torch
    import triton

    from pagoda.kernels.sample.argmax import MAX_CHUNKS, argmax_rows, default_chunk

    rows = []
    vocabs, chunks = (
        ([3000], [256, 1024])
        if run.smoke
        else (common.parse_ints(args.vocabs), common.parse_ints(args.chunks))
    )
    for vocab in vocabs:
        logits = torch.randn(1, vocab, device=run.device).to(run.dtype)
        for chunk in chunks:
            if triton.cdiv(vocab, chunk) > MAX_CHUNKS:  # argmax_rows refuses it
                continue
            rows.append(
                {
                    "vocab": vocab,
                    "chunk": chunk,
                    "default": chunk == default_chunk(1, vocab),
                    "us": common.time_us(lambda: argmax_rows(logits, chunk), run),
                }
            )
    common.print_rows(rows, ["vocab", "chunk", "default", "us"], "greedy argmax of one row")
    return {"rows": rows}
