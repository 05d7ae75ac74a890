"""fp8 quality: FP8 weights and KV cache against float32 on a random Llama with the
Llama-3.1-8B layer shape (and FP8 checkpoints written from it) and on the embedded
SmolLM2: teacher-forced logprob error, greedy agreement and decode-step logprob error,
beside transformers' own bf16 error for scale."""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.fp8_bench.common import common_prefix, save_random_llama

LLAMA_8B_LAYER = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)


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
