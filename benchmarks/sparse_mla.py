"""DeepSeek Sparse Attention against dense MLA: what a step costs as the context grows, and
bf16 fidelity against transformers.

    python -m benchmarks.sparse_mla steps --layers 4 --batch 32 \\
        --contexts 1024,4096,16384,65536 --prefill 65536
    python -m benchmarks.sparse_mla fidelity --tokens 3072
    python -m benchmarks.sparse_mla steps --smoke      # the CPU, tiny shapes

`steps`: the DeepSeek-V3.2 preset (sparse: a lightning indexer keeps 2,048 tokens a
query) and the DeepSeek-V3 preset (dense MLA over the whole context), each cut to its
first --layers layers, dummy bf16 weights, the Triton backends. The KV pool is filled
with random latents and indexer keys (what a decode step reads does not depend on how
they got there), and --batch requests of each --contexts length decode one token: the
median device time of the whole forward (embedding to logits, eager: sparse MLA runs
without CUDA graphs) and of one layer's attention block alone. Then one --prefill-token
prompt is prefilled from nothing in chunks of --chunk tokens (as the scheduler's budget
cuts it), timed end to end. Both models run in the same process, one after the other.

`fidelity`: a random DeepseekV32ForCausalLM at the released layer shapes (hidden 7168, 128
heads, latent 512 + 64, indexer 64 x 128 keeping 2,048; --layers dense layers, a small
vocabulary) saved as safetensors; transformers in float32 is the reference, and the
figure is the log-probability error of transformers' own bf16 model against it beside
Pagoda's bf16 (the Triton backend, prefilled in --chunk-token chunks through the paged
caches), teacher-forced over --tokens random tokens (longer than 2,048, so the
indexer selects).
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.harness.results import write_result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    steps = sub.add_parser("steps", help="decode step and prefill: sparse vs dense MLA")
    steps.add_argument("--layers", type=int, default=4)
    steps.add_argument("--batch", type=int, default=32)
    steps.add_argument("--contexts", default="1024,4096,16384,65536")
    steps.add_argument("--prefill", type=int, default=65536, help="0: no prefill run")
    steps.add_argument("--chunk", type=int, default=16384)
    steps.add_argument("--repeats", type=int, default=10)
    steps.add_argument("--models", default="deepseek-v3.2,deepseek-v3")
    steps.add_argument(
        "--profile",
        action="store_true",
        help="also print each model's kernels by device time: one decode step at the "
        "longest context and the prefill's last chunk",
    )
    fid = sub.add_parser("fidelity", help="bf16 logprob error vs transformers' own")
    fid.add_argument("--layers", type=int, default=2)
    fid.add_argument("--tokens", type=int, default=3072)
    fid.add_argument("--chunk", type=int, default=1024)
    fid.add_argument("--vocab", type=int, default=16384)
    for sp in (steps, fid):
        sp.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
        sp.add_argument("--out", default=None)
    return p.parse_args(argv)


class Steps:
    """One model's pool and backend, and the metadata of a step of given shape."""

    def __init__(self, arch, device, dtype, block_size: int, num_blocks: int, model=None):
        """model: loaded weights (default: dummy ones)."""
        import torch

        from pagoda.attention.kv_pool import KVCachePool
        from pagoda.attention.selector import make_attention_backend
        from pagoda.core.kv_cache_spec import KVCacheConfig
        from pagoda.model.layers.attention import kv_cache_specs
        from pagoda.model.loader.build import build_model
        from pagoda.model.loader.dummy import fill_dummy_weights

        self.arch, self.device, self.block_size = arch, torch.device(device), block_size
        if model is None:
            model = build_model(arch, dtype, device)
            fill_dummy_weights(model, 0)
        self.model = model
        self.backend = make_attention_backend("auto", self.device.type, arch.attention_shape())
        specs = kv_cache_specs(self.model, block_size, dtype)
        self.pool = KVCachePool(KVCacheConfig(num_blocks, specs), self.device)
        gen = torch.Generator(self.device).manual_seed(0)
        for cache in self.pool.caches:  # random entries: attention reads real values
            cache.normal_(generator=gen)

    def metadata(self, query_lens, seq_lens):
        from pagoda.attention.metadata import build_attention_metadata

        bs, tables, next_block = self.block_size, [], 0
        for seq_len in seq_lens:
            blocks = -(-seq_len // bs)
            tables.append(list(range(next_block, next_block + blocks)))
            next_block += blocks
        common = build_attention_metadata(query_lens, seq_lens, tables, bs, self.device)
        return self.backend.build_metadata(common)

    def forward(self, plan, ids, positions, attention_only: bool = False):
        import torch

        from pagoda.attention.forward_context import forward_context

        with torch.inference_mode(), forward_context(self.backend, plan, self.pool):
            if attention_only:
                layer = self.model.model.layers[0].self_attn
                hidden = self.model.model.embed_tokens(ids)
                cos, sin = self.model.model.rotary_emb(positions)
                return layer(hidden, cos, sin)
            return self.model.compute_logits(self.model(ids, positions))


def _timed_ms(fn, repeats: int, device) -> float:

    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e3
    from benchmarks.harness.timing import median_cuda_ms

    return median_cuda_ms(fn, repeats, 2)


def run_steps(args) -> dict:
    import torch

    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for name in args.models.split(","):
        rows.append(_measure_model(name, args, contexts, device, smoke))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "contexts": contexts, "batch": args.batch}


def _measure_model(name: str, args, contexts: list[int], device, smoke: bool) -> dict:
    """One preset's decode steps at each context, its layer-0 attention, its prefill."""
    import torch

    from pagoda.model.presets import get_preset

    arch = get_preset(name).replace(num_hidden_layers=args.layers)
    if smoke:
        arch = _tiny(arch)
    block_size = 64
    longest = max(contexts + [args.prefill])
    num_blocks = max(args.batch * -(-max(contexts) // block_size), -(-longest // block_size))
    dtype = torch.float32 if smoke else torch.bfloat16
    steps = Steps(arch, device, dtype, block_size, num_blocks + 1)
    row = {"model": name, "layers": args.layers, "decode": {}, "attention": {}}
    for context in contexts:
        plan = steps.metadata([1] * args.batch, [context] * args.batch)
        ids = torch.randint(0, arch.vocab_size, (args.batch,), device=device)
        pos = torch.full((args.batch,), context - 1, device=device)
        for key, only in (("decode", False), ("attention", True)):
            row[key][context] = _timed_ms(
                lambda only=only: steps.forward(plan, ids, pos, attention_only=only),
                args.repeats,
                device,
            )
        print(
            f"{name:<14} batch {args.batch} context {context:>6}: step "
            f"{row['decode'][context]:8.3f} ms, layer-0 attention "
            f"{row['attention'][context]:8.3f} ms",
            flush=True,
        )
    if args.prefill:
        row["prefill_ms"] = _prefill_ms(steps, args.prefill, args.chunk, device)
        print(f"{name:<14} prefill {args.prefill} tokens: {row['prefill_ms']:.1f} ms")
    if args.profile and device.type == "cuda":
        _profile(steps, args, max(contexts), device)
    return row


def _profile(steps, args, context: int, device) -> None:
    """Kernels by device time: a decode step at `context`, the prefill's last chunk."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    plan = steps.metadata([1] * args.batch, [context] * args.batch)
    ids = torch.randint(0, steps.arch.vocab_size, (args.batch,), device=device)
    pos = torch.full((args.batch,), context - 1, device=device)
    start = max(0, args.prefill - args.chunk)
    chunk_plan = steps.metadata([args.prefill - start], [args.prefill])
    chunk_ids = torch.randint(0, steps.arch.vocab_size, (args.prefill - start,), device=device)
    chunk_pos = torch.arange(start, args.prefill, device=device)
    for label, fn in (
        (f"decode step, context {context}", lambda: steps.forward(plan, ids, pos)),
        ("prefill's last chunk", lambda: steps.forward(chunk_plan, chunk_ids, chunk_pos)),
    ):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"--- {label}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


def _prefill_ms(steps, tokens: int, chunk: int, device) -> float:
    """One prompt of `tokens` tokens prefilled from nothing in chunks: milliseconds."""
    import torch

    ids = torch.randint(0, steps.arch.vocab_size, (tokens,), device=device)

    def prefill():
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            plan = steps.metadata([end - start], [end])
            pos = torch.arange(start, end, device=device)
            steps.forward(plan, ids[start:end], pos)

    prefill()  # compiles every kernel variant once
    return _timed_ms(prefill, 2, device)


def _tiny(arch):
    """The preset's structure at test sizes (the CPU smoke run)."""
    import dataclasses

    mla = dataclasses.replace(
        arch.mla,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    if mla.indexer is not None:
        mla = dataclasses.replace(
            mla, indexer=dataclasses.replace(mla.indexer, num_heads=4, head_dim=16, topk=64)
        )
    moe = dataclasses.replace(
        arch.moe,
        num_experts=8,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
    )
    return arch.replace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=128,
        vocab_size=512,
        mla=mla,
        moe=moe,
        torch_dtype="float32",
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode == "steps":
        if args.smoke:
            args.contexts, args.prefill, args.chunk, args.batch = "64,256", 512, 128, 2
        result = run_steps(args)
    else:
        from benchmarks.sparse_mla_fidelity import run_fidelity

        result = run_fidelity(args)
    out = args.out or f"bench_results/sparse-mla-{args.mode}.json"
    write_result(out, {"args": vars(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
