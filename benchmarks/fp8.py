"""FP8 weights and FP8 KV cache beside the speed figures: their error against float32, and
the FP8 KV cache's capacity and decode step against the model-dtype cache, in one run.

    python -m benchmarks.fp8 quality                   # GPU (FP8 needs compute 8.9+)
    python -m benchmarks.fp8 kv                        # GPU: Llama-3.1-8B shape, batch 256
    python -m benchmarks.fp8 quality --smoke           # CPU, tiny shapes (float variants only)
    python -m benchmarks.fp8 kv --smoke                # CPU, tiny shapes, a few seconds

quality  Two models: "llama-8b-layers", a random-init transformers Llama with the
         Llama-3.1-8B layer shape and 2 layers saved as bf16 safetensors, with FP8
         checkpoints written from it (compressed-tensors per channel, and 128x128 blocks,
         by pagoda.model.quant.fp8_export); and "smollm2", the embedded SmolLM2-135M GGUF
         (real weights). Variants, each a fresh LLM: float32 (the reference), bfloat16,
         fp8 online (--quantization fp8, also with --quantize-lm-head), each FP8
         checkpoint, and bf16 weights with --kv-cache-dtype fp8. Against float32: the
         |logprob| error of each prompt's actual next tokens (teacher forcing), mean and
         max; the share of 32-token greedy continuations identical to float32's, their
         mean common prefix, and the |logprob| error of the decode steps inside it.
         transformers' own bf16 run of the same checkpoint gives a peer's error for scale.
kv       Speed and capacity (dummy weights of the preset): for each cache dtype (auto,
         fp8), in its own process (each pool sized from the same free memory), the KV
         pool's token capacity, then `--batch` requests of `--context` random tokens
         stepped until all decode, and the decode step timed as served (engine step wall
         time with CUDA graphs, and the bare replay of the decode graph), beside the
         roofline (weights + KV bytes read) / measured copy bandwidth. Quality: a small
         random-init Llama served with auto, with fp8 (scales 1.0, as a checkpoint without
         scales) and with fp8 under calibrated scales (per layer amax / 448 of K and of V
         from the auto run's cache, saved as self_attn.k_scale / v_scale): next-token
         logprob difference (max, mean) and greedy agreement against auto.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness.processes import run_json_child, write_child_result
from benchmarks.harness.results import write_result
from benchmarks.harness.rooflines import measure_ceilings, model_bytes_and_flops, roofline_decode_ms
from benchmarks.harness.timing import engine_step_timing
from benchmarks.harness.workloads import decode_ready

LLAMA_8B_LAYER = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)
E4M3_MAX = 448.0


def save_random_llama(path, shape: dict, layers: int, dtype: str, **config) -> None:
    """A random-init transformers Llama (its own default init, seed 0) as safetensors."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=layers, rms_norm_eps=1e-5, tie_word_embeddings=False, **shape, **config
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    del model


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


# ================================================================ quality ==========
def run_variant(model: str, kwargs: dict, prompts: list[list[int]], device: str) -> dict:
    """Teacher-forced logprobs of every prompt and 32-token greedy continuations."""
    import torch

    from pagoda import LLM, SamplingParams

    llm = LLM(
        model,
        device=device,
        max_model_len=1024,
        gpu_memory_utilization=0.35,
        enforce_eager=True,
        skip_tokenizer_init=True,
        **kwargs,
    )
    scored = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0),
        use_tqdm=False,
    )
    logprobs = [
        [pl[tok].logprob for pl, tok in zip(out.prompt_logprobs[1:], p[1:])]
        for out, p in zip(scored, prompts)
    ]
    greedy = llm.generate(
        [{"prompt_token_ids": p[:16]} for p in prompts],
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0),
        use_tqdm=False,
    )
    # The sampled tokens' logprobs come from decode steps, the prompt's from prefill.
    result = {
        "logprobs": logprobs,
        "greedy": [list(o.outputs[0].token_ids) for o in greedy],
        "greedy_logprobs": [
            [step[tok].logprob for step, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            for o in greedy
        ],
    }
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def transformers_logprobs(model_dir: Path, prompts, device: str, dtype: str) -> list:
    import torch
    import transformers

    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype)
        )
        .to(device)
        .eval()
    )
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            out.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
    del model
    gc.collect()
    return out


def quality_compare(ref: dict, other: dict) -> dict:
    err = np.abs(
        np.concatenate(
            [np.array(a) - np.array(b) for a, b in zip(ref["logprobs"], other["logprobs"])]
        )
    )
    summary = {"logprob_abs_err_mean": float(err.mean()), "logprob_abs_err_max": float(err.max())}
    if "greedy" in other:
        prefix = [common_prefix(a, b) for a, b in zip(ref["greedy"], other["greedy"])]
        summary.update(
            greedy_identical=float(
                np.mean([a == b for a, b in zip(ref["greedy"], other["greedy"])])
            ),
            greedy_common_prefix_mean=float(np.mean(prefix)),
        )
        # Decode-step logprob error where both saw the same tokens: the common prefix.
        decode_err = [
            abs(a - b)
            for r, o, n in zip(ref["greedy_logprobs"], other["greedy_logprobs"], prefix)
            for a, b in zip(r[:n], o[:n])
        ]
        if decode_err:
            summary.update(
                decode_logprob_abs_err_mean=float(np.mean(decode_err)),
                decode_logprob_abs_err_max=float(np.max(decode_err)),
                decode_tokens_compared=len(decode_err),
            )
    return summary


def quality_variants(fp8_ok: bool, dirs: dict) -> list[tuple[str, str, dict]]:
    base = dirs["float"]
    out = [("float32", base, {"dtype": "float32"}), ("bfloat16", base, {"dtype": "bfloat16"})]
    if fp8_ok:
        out += [
            ("fp8 online", base, {"dtype": "bfloat16", "quantization": "fp8"}),
            (
                "fp8 online, FP8 LM head",
                base,
                {"dtype": "bfloat16", "quantization": "fp8", "quantize_lm_head": True},
            ),
            ("bf16 + fp8 KV", base, {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}),
        ]
        out += [
            (f"fp8 checkpoint ({scheme})", dirs[scheme], {"dtype": "bfloat16"})
            for scheme in ("channel", "block")
            if scheme in dirs
        ]
    return out


def print_quality(kind: str, entry: dict, args) -> None:
    print(f"\n{kind}: error vs Pagoda float32 ({args.prompts} prompts x {args.prompt_len} tokens)")
    for name, m in entry.items():
        if not isinstance(m, dict):
            continue
        extra = (
            f"  greedy identical {m['greedy_identical']:.0%}, common prefix "
            f"{m['greedy_common_prefix_mean']:.1f}/32"
            if "greedy_identical" in m
            else ""
        )
        if "decode_logprob_abs_err_mean" in m:
            extra += (
                f"; decode |err| mean {m['decode_logprob_abs_err_mean']:.4f} max "
                f"{m['decode_logprob_abs_err_max']:.4f} over {m['decode_tokens_compared']} tokens"
            )
        print(
            f"  {name:34s} logprob |err| mean {m['logprob_abs_err_mean']:.4f} "
            f"max {m['logprob_abs_err_max']:.4f}{extra}"
        )


def run_quality(args) -> dict:
    import torch

    wanted = None if args.variants is None else {"float32", *args.variants.split(";")}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp8_ok = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    if args.smoke:
        args.prompts, args.prompt_len = 2, 24
    models, rng = {}, np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            start = time.perf_counter()
            if kind == "llama-8b-layers":
                dirs = {"float": Path(tmp) / "llama"}
                shape = (
                    dict(
                        vocab_size=512,
                        hidden_size=256,
                        intermediate_size=512,
                        num_attention_heads=4,
                        num_key_value_heads=2,
                        head_dim=64,
                    )
                    if args.smoke
                    else LLAMA_8B_LAYER
                )
                save_random_llama(
                    dirs["float"],
                    shape,
                    2,
                    "bfloat16",
                    max_position_embeddings=4096,
                    rope_theta=500000.0,
                )
                if fp8_ok:
                    from pagoda.model.quant.fp8_export import export_fp8

                    for scheme in ("channel", "block"):
                        if wanted is None or f"fp8 checkpoint ({scheme})" in wanted:
                            dirs[scheme] = Path(tmp) / f"llama-{scheme}"
                            export_fp8(dirs["float"], dirs[scheme], scheme)
                vocab, model_name = shape["vocab_size"], str(dirs["float"])
            else:
                from pagoda.model.tokenizer import embedded_model_path

                dirs = {"float": str(embedded_model_path())}
                vocab, model_name = 49152, None
            prompts = [
                [int(t) for t in rng.integers(10, vocab - 10, size=args.prompt_len)]
                for _ in range(args.prompts)
            ]
            known = quality_variants(fp8_ok, dirs)
            chosen = [v for v in known if wanted is None or v[0] in wanted]
            if wanted is not None and len(chosen) < len(wanted) and fp8_ok:
                raise SystemExit(
                    f"unknown variant in {sorted(wanted)}: known {[v[0] for v in known]}"
                )
            results = {
                name: run_variant(model, kwargs, prompts, device) for name, model, kwargs in chosen
            }
            entry = {
                name: quality_compare(results["float32"], r)
                for name, r in results.items()
                if name != "float32"
            }
            if model_name is not None:
                entry["transformers bfloat16 (peer)"] = quality_compare(
                    results["float32"],
                    {
                        "logprobs": transformers_logprobs(
                            Path(model_name), prompts, device, "bfloat16"
                        )
                    },
                )
            entry["seconds"] = time.perf_counter() - start
            models[kind] = entry
            print_quality(kind, entry, args)
    return {"models": models}


# ================================================================ kv ===============
def kv_speed(args, kv_dtype: str) -> dict:
    """One engine with kv_cache_dtype kv_dtype: pool capacity and decode step time."""
    import torch

    from pagoda import LLM, SamplingParams

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    llm = LLM(
        args.preset,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=kv_dtype,
        skip_tokenizer_init=True,
    )
    engine = llm.llm_engine
    runner = engine.executor.runner
    kv = engine.kv_cache_config
    result = {
        "kv_cache_dtype": kv_dtype,
        "cache_torch_dtype": str(runner.kv_dtype),
        "num_blocks": kv.num_blocks,
        "block_size": kv.block_size,
        "token_capacity": kv.num_blocks * kv.block_size,
        "pool_bytes": kv.total_bytes,
    }
    rng = np.random.default_rng(0)
    vocab = engine.model_info.vocab_size
    params = SamplingParams(max_tokens=args.steps + 16, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(0, vocab, args.context).tolist(), params)
    while not decode_ready(engine):
        engine.step()
    for _ in range(4):  # settle: the first decode steps may compile
        engine.step()
    timing = engine_step_timing(engine, runner, args.batch, args.steps, sync)
    result.update(
        step_ms=timing["step_ms"],
        step_ms_median=statistics.median(timing["step_ms"]),
        replay_ms=timing.get("replay_ms"),
    )
    engine.shutdown()
    return result


def kv_roofline(args, entry_bytes: int, ceilings: dict) -> dict:
    """A decode step reads the weights (less the embedding) and every context's K/V."""
    if not ceilings:
        return {}
    from pagoda.model.presets import get_preset

    info = model_bytes_and_flops(get_preset(args.preset))
    info["kv_bytes_per_token"] = info["kv_bytes_per_token"] // 2 * entry_bytes
    bound = roofline_decode_ms(info, ceilings, args.batch, args.context + args.steps)
    weight_bytes = info["weight_bytes"] - info["embedding_bytes"]
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": bound["bytes_read"] - weight_bytes,
        "roofline_ms": bound["memory_ms"],
    }


def quality_llm(path: str, args, kv_dtype: str):
    from pagoda import LLM

    return LLM(
        path,
        dtype=args.dtype,
        device=args.device,
        kv_cache_dtype=kv_dtype,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        kv_cache_memory=1 << 28,
        enable_prefix_caching=False,
    )


def run_prompts(llm, prompts, max_tokens: int):
    """(greedy outputs, teacher-forced next-token logprobs of each prompt) of one engine."""
    from pagoda import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    return (
        [list(o.outputs[0].token_ids) for o in outs],
        [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs],
    )


def with_scales(src: str, dst: str, amax: list[tuple[float, float]]) -> None:
    """A copy of the checkpoint with self_attn.k_scale / v_scale = amax / 448."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for i, (k, v) in enumerate(amax):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(max(k, 1e-6) / E4M3_MAX)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(max(v, 1e-6) / E4M3_MAX)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


def kv_compare(ref, other) -> dict:
    (ref_tokens, ref_lp), (tokens, lp) = ref, other
    diffs = [abs(a - b) for ra, rb in zip(ref_lp, lp) for a, b in zip(ra, rb)]
    prefix = [common_prefix(a, b) / len(a) for a, b in zip(ref_tokens, tokens)]
    return {
        "logprob_abs_diff_max": max(diffs),
        "logprob_abs_diff_mean": sum(diffs) / len(diffs),
        "num_logprobs": len(diffs),
        "greedy_identical": sum(a == b for a, b in zip(ref_tokens, tokens)),
        "greedy_prompts": len(tokens),
        "greedy_common_prefix_mean": sum(prefix) / len(prefix),
    }


def kv_quality(args) -> dict:
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        shape = (
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=512,
            )
            if args.smoke
            else dict(
                hidden_size=512,
                intermediate_size=1408,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=8192,
            )
        )
        save_random_llama(
            path,
            shape,
            2 if args.smoke else 4,
            args.dtype,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            bos_token_id=1,
            eos_token_id=2,
        )
        hi = min(args.max_model_len - args.quality_tokens, 48 if args.smoke else 512)
        prompts = [
            rng.integers(3, shape["vocab_size"], int(n)).tolist()
            for n in rng.integers(hi // 4, hi, args.quality_prompts)
        ]
        auto = quality_llm(path, args, "auto")
        ref = run_prompts(auto, prompts, args.quality_tokens)
        pool = auto.llm_engine.executor.runner.kv_pool  # per layer (max |K|, max |V|)
        amax = [(float(c[0].abs().max()), float(c[1].abs().max())) for c in pool.caches]
        auto.llm_engine.shutdown()
        scaled = os.path.join(tmp, "scaled")
        with_scales(path, scaled, amax)
        result = {
            "model": "random-init LlamaForCausalLM (transformers default init)",
            "kv_amax_per_layer": amax,
            "prompt_lens": [len(p) for p in prompts],
        }
        for name, model in (("fp8_scale_1", path), ("fp8_calibrated", scaled)):
            llm = quality_llm(model, args, "fp8")
            result[name] = kv_compare(ref, run_prompts(llm, prompts, args.quality_tokens))
            llm.llm_engine.shutdown()
        return result


def run_kv(args) -> dict:
    if args.speed_child is not None:
        write_child_result(args.child_out, kv_speed(args, args.speed_child))
        return {}
    start = time.perf_counter()
    runs = {}
    for kv in ("auto", "fp8"):  # each in a fresh process: the previous engine's memory is gone
        argv = [
            "kv",
            "--speed-child",
            kv,
            *(
                f"--{k.replace('_', '-')}={getattr(args, k)}"
                for k in (
                    "preset",
                    "dtype",
                    "device",
                    "batch",
                    "context",
                    "steps",
                    "max_model_len",
                    "kv_cache_memory",
                )
                if getattr(args, k) is not None
            ),
        ]
        runs[kv] = run_json_child("benchmarks.fp8", argv)
        if "error" in runs[kv]:
            raise SystemExit(f"the {kv} speed run failed: {runs[kv]['error']}")
    ceilings = measure_ceilings(args.device)
    entry_bytes = {"auto": 4 if args.dtype == "float32" else 2, "fp8": 1}
    for kv, run in runs.items():
        run["roofline"] = kv_roofline(args, entry_bytes[kv], ceilings)
    auto, fp8 = runs["auto"], runs["fp8"]
    summary = {
        "speedup_step": auto["step_ms_median"] / fp8["step_ms_median"],
        "speedup_replay": (
            auto["replay_ms"] / fp8["replay_ms"]
            if auto.get("replay_ms") and fp8.get("replay_ms")
            else None
        ),
        "capacity_ratio": fp8["token_capacity"] / auto["token_capacity"],
    }
    quality = kv_quality(args)
    print(f"\n{args.preset}, batch {args.batch}, context {args.context}, {args.dtype} weights")
    print(f"{'kv cache':<10}{'tokens':>12}{'step ms':>10}{'replay ms':>11}{'roofline ms':>13}")
    for kv, run in runs.items():
        print(
            f"{kv:<10}{run['token_capacity']:>12}{run['step_ms_median']:>10.3f}"
            f"{run.get('replay_ms') or float('nan'):>11.3f}"
            f"{run['roofline'].get('roofline_ms', float('nan')):>13.3f}"
        )
    print(
        f"fp8 vs auto: step {summary['speedup_step']:.2f}x faster, "
        f"{summary['capacity_ratio']:.2f}x the tokens"
    )
    for name in ("fp8_scale_1", "fp8_calibrated"):
        q = quality[name]
        print(
            f"quality {name}: next-token logprob |diff| max {q['logprob_abs_diff_max']:.4f} "
            f"mean {q['logprob_abs_diff_mean']:.4f} over {q['num_logprobs']}; greedy "
            f"identical {q['greedy_identical']}/{q['greedy_prompts']}, common prefix "
            f"{q['greedy_common_prefix_mean']:.0%}"
        )
    return {
        "runs": runs,
        "summary": summary,
        "quality": quality,
        "seconds": time.perf_counter() - start,
    }


# ================================================================ command line =====
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)
    p = modes.add_parser("quality", help="FP8 weights / KV: error against float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--models", default="llama-8b-layers,smollm2")
    p.add_argument(
        "--variants",
        default=None,
        help="';'-separated variant names (as printed) to run beside float32 (the "
        "reference); default: all",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes (on the CPU: float only)")
    p.add_argument("--out", "--output", dest="out", default="bench_results/fp8-quality.json")
    p = modes.add_parser("kv", help="FP8 KV cache against auto: capacity, decode step, quality")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="bytes of KV cache (default: the GPU memory profile)",
    )
    p.add_argument("--quality-prompts", type=int, default=8)
    p.add_argument("--quality-tokens", type=int, default=32)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny-llama, float32, a few steps (checks the mode runs)",
    )
    p.add_argument("--out", "--output", dest="out", default="bench_results/fp8-kv.json")
    p.add_argument("--speed-child", choices=("auto", "fp8"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "kv" and args.smoke:
        args.preset, args.dtype, args.device = "tiny-llama", "float32", "cpu"
        args.batch, args.context, args.steps, args.max_model_len = 4, 48, 3, 256
        args.kv_cache_memory = args.kv_cache_memory or 1 << 22
        args.quality_prompts, args.quality_tokens = 3, 8
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    result = (run_quality if args.mode == "quality" else run_kv)(args)
    if getattr(args, "speed_child", None):
        return
    write_result(
        args.out, {"benchmark": f"fp8 {args.mode}", "args": vars(args), **result}, indent=1
    )


if __name__ == "__main__":
    main()
