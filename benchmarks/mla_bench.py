"""MLA / DeepSeek benchmark (a program, not a test): DeepSeek-V2-Lite shape, dummy bf16.

    python benchmarks/mla_bench.py                     # one H200: every section
    python benchmarks/mla_bench.py --smoke             # tiny preset on the CPU

Sections, printed and written as JSON (default benchmarks/results/mla-<device>-<date>.json):
  kv        KV cache tokens per GiB: the latent cache (kv_lora_rank + rope = 576 values per
            token and layer) against a GQA cache of the same 27 layers (8 KV heads x 128,
            K and V: 2048 values) and against the model's own heads decompressed (16 x
            (192 + 128) = 5120); plus the pool the engine actually allocated
  latency   batch-1 decode, 128 prompt tokens: ms per output token (median gap)
  static    256 requests x 1024 in / 128 out: output tok/s
  kernel    the latent decode kernel (kernels/mla_decode.py) against the torch reference
            at one layer's shape (16 heads), batch x context; GB/s over the latent bytes
            read, next to the measured copy bandwidth
  roofline  a decode step cannot beat (weight bytes touched + KV bytes read) / copy
            bandwidth; weights touched at batch B: everything but the routed experts, plus
            the experts B tokens are expected to reach under uniform top-k routing
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_compare import measure_ceilings, random_prompts  # noqa: E402
from pagoda.core.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec, bytes_per_block  # noqa: E402
from pagoda.model.presets import get_preset  # noqa: E402

GIB = 1 << 30


def kv_capacity(arch, dtype: str, block_size: int = 16) -> dict:
    """Tokens per GiB of each cache layout over arch's layers (exact, from the specs)."""
    mla, layers = arch.mla, arch.num_hidden_layers
    latent = [MLAAttentionSpec(block_size, mla.kv_lora_rank, mla.qk_rope_head_dim, dtype)] * layers
    gqa = [FullAttentionSpec(block_size, 8, 128, dtype)] * layers
    # The model's own heads without compression: keys qk_head_dim wide, values v_head_dim;
    # as bytes, the same as a full-attention cache of H heads of (qk + v) / 2.
    mha_values = arch.num_attention_heads * (mla.qk_head_dim + mla.v_head_dim)
    per_token = {"mla_latent": bytes_per_block(latent) / block_size,
                 "gqa_8x128": bytes_per_block(gqa) / block_size,
                 "mha_decompressed": layers * mha_values * (bytes_per_block(latent) / block_size
                                                            / layers / mla.latent_dim)}
    tokens = {k: GIB / v for k, v in per_token.items()}
    return {"bytes_per_token": per_token, "tokens_per_gib": tokens,
            "ratio_vs_gqa_8x128": tokens["mla_latent"] / tokens["gqa_8x128"],
            "ratio_vs_mha_decompressed": tokens["mla_latent"] / tokens["mha_decompressed"]}


def weight_split(model) -> dict:
    """Bytes of the routed experts and of everything else (the embedding apart)."""
    routed = embedding = other = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith(("experts.w13_weight", "experts.w2_weight")):
            routed += size
        elif "embed_tokens" in name:
            embedding += size
        else:
            other += size
    return {"routed_expert_bytes": routed, "embedding_bytes": embedding, "other_bytes": other}


def roofline(arch, weights: dict, ceilings: dict, batch: int, context: int) -> dict:
    if not ceilings:
        return {}
    moe = arch.moe
    touched = 1.0 - (1.0 - moe.num_experts_per_tok / moe.num_experts) ** batch
    kv = batch * context * arch.num_hidden_layers * arch.mla.latent_dim * 2
    read = weights["other_bytes"] + touched * weights["routed_expert_bytes"] + kv
    return {"batch": batch, "context": context, "expert_fraction_touched": touched,
            "bytes_read": read, "roofline_ms": read / ceilings["copy_bytes_per_s"] * 1e3}


def run_engine(args) -> dict:
    import numpy as np
    from pagoda import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=args.batch,
              kv_cache_memory=args.kv_cache_memory, skip_tokenizer_init=True)
    engine = llm.llm_engine
    runner = engine.executor.runner
    pool = runner.kv_pool
    result = {"startup_s": time.perf_counter() - start, "attention_backend": runner.backend.name,
              "cuda_graphs": runner.graph_runner is not None,
              "kv_pool": {"num_blocks": pool.config.num_blocks, "bytes": pool.nbytes,
                          "tokens": pool.config.num_blocks * pool.block_size,
                          "tokens_per_gib": pool.config.num_blocks * pool.block_size / pool.nbytes * GIB},
              "weights": weight_split(runner.model)}
    vocab = engine.model_info.vocab_size
    rng = np.random.default_rng(0)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    prompt = random_prompts(rng, [args.latency_prompt], vocab)[0]
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    sync()
    engine.add_request("lat", prompt, SamplingParams(max_tokens=args.latency_tokens,
                                                     temperature=0, ignore_eos=True),
                       output_kind="delta")
    arrivals = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            arrivals.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    result["latency"] = {"decode_ms_per_token_median": statistics.median(gaps) * 1e3,
                         "decode_ms_per_token_mean": statistics.mean(gaps) * 1e3}

    prompts = random_prompts(rng, [args.static_in] * args.batch, vocab)
    params = SamplingParams(max_tokens=args.static_out, temperature=0, ignore_eos=True)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["static"] = {"batch": args.batch, "input": args.static_in, "output": args.static_out,
                        "seconds": elapsed, "output_tok_per_s": tokens / elapsed,
                        "preemptions": engine.get_stats().num_preemptions}
    return result


def kernel_bench(arch, ceilings: dict, batches, contexts, ref_max_batch: int) -> list[dict]:
    """The latent decode kernel vs latent_attention_ref at one layer's shape (CUDA only)."""
    from triton.testing import do_bench

    from pagoda.attention.mla_backend import latent_attention_ref
    from pagoda.kernels.attention.mla_decode import mla_decode
    from pagoda.kernels.attention.paged_decode import choose_num_splits
    from pagoda.model.mla_config import mla_softmax_scale

    mla, heads, bs = arch.mla, arch.num_attention_heads, 16
    scale = mla_softmax_scale(mla, arch.rope_scaling)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in batches:
        for context in contexts:
            nblk = -(-context // bs)
            cache = torch.randn(batch * nblk, bs, mla.latent_dim, device="cuda",
                                dtype=torch.bfloat16) * 0.5
            tables = torch.randperm(batch * nblk, device="cuda").view(batch, nblk).int()
            q = torch.randn(batch, heads, mla.latent_dim, device="cuda", dtype=torch.bfloat16)
            req = torch.arange(batch, device="cuda", dtype=torch.int32)
            lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            out = torch.empty(batch, heads, mla.kv_lora_rank, device="cuda", dtype=torch.bfloat16)
            splits = choose_num_splits(batch, -(-heads // 16), context, sms)

            def kernel():
                mla_decode(out, q, cache, tables, req, lens, scale, mla.kv_lora_rank, splits)
            ms = do_bench(kernel, return_mode="median")
            read = batch * context * mla.latent_dim * 2
            row = {"batch": batch, "context": context, "num_splits": splits, "kernel_ms": ms,
                   "kernel_gb_per_s": read / (ms * 1e-3) / 1e9}
            if ceilings:
                row["fraction_of_copy_bw"] = read / (ms * 1e-3) / ceilings["copy_bytes_per_s"]
            if batch <= ref_max_batch:
                kernel()
                want = latent_attention_ref(q, cache, tables, req, lens, scale, mla.kv_lora_rank)
                row["max_abs_err_vs_ref"] = (out.float() - want).abs().max().item()
                row["ref_ms"] = do_bench(lambda: latent_attention_ref(
                    q, cache, tables, req, lens, scale, mla.kv_lora_rank, context),
                    return_mode="median")
            rows.append(row)
            cache = None  # free this shape's cache before the next one is allocated
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="deepseek-v2-lite")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--latency-prompt", type=int, default=128)
    p.add_argument("--latency-tokens", type=int, default=128)
    p.add_argument("--static-in", type=int, default=1024)
    p.add_argument("--static-out", type=int, default=128)
    p.add_argument("--skip-engine", action="store_true", help="kv and kernel sections only")
    p.add_argument("--smoke", action="store_true",
                   help="tiny-deepseek-v2 on the CPU, tiny workloads (checks the script runs)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.preset, args.device, args.dtype = "tiny-deepseek-v2", "cpu", "float32"
        args.batch, args.latency_prompt, args.latency_tokens = 4, 8, 8
        args.static_in, args.static_out, args.max_model_len = 16, 8, 64
        args.kv_cache_memory = 8 << 20
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    stamp = datetime.now(timezone.utc)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        f"mla-{'h200' if on_gpu else 'cpu'}-{stamp:%Y-%m-%d}{'-smoke' if args.smoke else ''}.json")
    report = {"benchmark": "mla_bench", "date": stamp.isoformat(), "args": vars(args),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name() if on_gpu else None}}
    report["ceilings"] = measure_ceilings(device)
    lite = get_preset("deepseek-v2-lite")
    report["kv"] = kv_capacity(lite, "bfloat16")
    arch = get_preset(args.preset)
    if not args.skip_engine:
        report["engine"] = run_engine(args)
        weights = report["engine"]["weights"]
        report["roofline"] = [roofline(arch, weights, report["ceilings"], 1, args.latency_prompt),
                              roofline(arch, weights, report["ceilings"], args.batch,
                                       args.static_in + args.static_out // 2)]
    if on_gpu:
        report["kernel"] = kernel_bench(lite, report["ceilings"], (1, 64, 256),
                                        (1024, 8192), ref_max_batch=64)
    print_report(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


def print_report(report: dict) -> None:
    kv = report["kv"]
    print("KV tokens per GiB (DeepSeek-V2-Lite, bf16): " + ", ".join(
        f"{k} {v:,.0f}" for k, v in kv["tokens_per_gib"].items()))
    print(f"  latent vs GQA 8x128: {kv['ratio_vs_gqa_8x128']:.2f}x; vs decompressed MHA: "
          f"{kv['ratio_vs_mha_decompressed']:.2f}x")
    engine = report.get("engine")
    if engine:
        print(f"engine ({engine['attention_backend']}, graphs {engine['cuda_graphs']}): pool "
              f"{engine['kv_pool']['tokens']:,} tokens, "
              f"{engine['kv_pool']['tokens_per_gib']:,.0f} tokens/GiB")
        print(f"  batch-1 decode: {engine['latency']['decode_ms_per_token_median']:.2f} ms/token")
        s = engine["static"]
        print(f"  {s['batch']} x {s['input']}/{s['output']}: {s['output_tok_per_s']:,.0f} "
              f"output tok/s ({s['seconds']:.1f} s, {s['preemptions']} preemptions)")
    for r in report.get("roofline", []):
        if r:
            print(f"  roofline batch {r['batch']} ctx {r['context']}: {r['roofline_ms']:.2f} ms/step "
                  f"(experts touched {r['expert_fraction_touched']:.0%})")
    for r in report.get("kernel", []):
        ref = f", ref {r['ref_ms']:.3f} ms, err {r['max_abs_err_vs_ref']:.1e}" if "ref_ms" in r else ""
        print(f"kernel batch {r['batch']:>3} ctx {r['context']:>5}: {r['kernel_ms']:.3f} ms, "
              f"{r['kernel_gb_per_s']:,.0f} GB/s ({r['num_splits']} splits){ref}")


if __name__ == "__main__":
    main()
