"""FP8 quality beside the speed figures: logprob error and greedy agreement vs float32.

    python benchmarks/fp8_quality.py --out benchmarks/results/fp8_quality_h200.json
    python benchmarks/fp8_quality.py --smoke          # tiny shapes on the CPU (no FP8 there:
                                                      # only the float variants run)

Two models:
- "llama-8b-layers": a random-init transformers Llama with the Llama-3.1-8B layer shape
  (hidden 4096, 32/8 heads, intermediate 14336, vocab 128256) and 2 layers, saved as
  bf16 safetensors; FP8 checkpoints are written from it (compressed-tensors per channel,
  and "fp8" 128x128 blocks, by pagoda.model.quant.fp8_export).
- "smollm2": the embedded SmolLM2-135M GGUF (real weights), run in bf16 and FP8.
Variants (each a fresh LLM): float32 (the reference), bfloat16, fp8 online
(--quantization fp8; also with _scaled_mm's fast accumulation off, and with
--quantize-lm-head), each FP8 checkpoint, and bf16 weights with --kv-cache-dtype fp8
(also with the decode kernel's FP8 q.K dot, paged_decode.FP8_QK_DOT).
Metrics vs float32: |logprob| error of each prompt's actual next tokens (teacher
forcing, prompt_logprobs), mean and max; greedy agreement: the share of 32-token greedy
continuations identical to float32's, the mean length of the common prefix, and the
|logprob| error of the decode steps inside it (the same tokens seen by both).
transformers' own bf16 run of the same checkpoint gives the peer's error for scale.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's pagoda


def save_random_llama(path: Path, smoke: bool) -> None:
    import torch
    import transformers
    if smoke:
        shape = dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    else:
        shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, max_position_embeddings=4096,
                                   rope_theta=500000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path))
    del model


def run_variant(model: str, kwargs: dict, prompts: list[list[int]], device: str) -> dict:
    """Teacher-forced logprobs of every prompt and 32-token greedy continuations.
    kwargs' "fp8_fast_accum" and "fp8_qk_dot" (not LLM arguments) set
    fp8_linear.SCALED_MM_FAST_ACCUM and paged_decode.FP8_QK_DOT for this variant."""
    from pagoda.kernels.fp8 import linear as fp8_linear
    from pagoda.kernels.attention import paged_decode
    kwargs = dict(kwargs)
    defaults = fp8_linear.SCALED_MM_FAST_ACCUM, paged_decode.FP8_QK_DOT
    fp8_linear.SCALED_MM_FAST_ACCUM = kwargs.pop("fp8_fast_accum", defaults[0])
    paged_decode.FP8_QK_DOT = kwargs.pop("fp8_qk_dot", defaults[1])
    try:
        return _run_variant(model, kwargs, prompts, device)
    finally:
        fp8_linear.SCALED_MM_FAST_ACCUM, paged_decode.FP8_QK_DOT = defaults


def _run_variant(model: str, kwargs: dict, prompts: list[list[int]], device: str) -> dict:
    import torch
    from pagoda import LLM, SamplingParams
    llm = LLM(model, device=device, max_model_len=1024, gpu_memory_utilization=0.35,
              enforce_eager=True, skip_tokenizer_init=True, **kwargs)
    scored = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0),
                          use_tqdm=False)
    logprobs = [[pl[tok].logprob for pl, tok in zip(out.prompt_logprobs[1:], p[1:])]
                for out, p in zip(scored, prompts)]
    greedy = llm.generate([{"prompt_token_ids": p[:16]} for p in prompts],
                          SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                         logprobs=0),
                          use_tqdm=False)
    # The sampled tokens' logprobs come from decode steps (the decode attention kernel),
    # the prompt's from prefill.
    result = {"logprobs": logprobs, "greedy": [list(o.outputs[0].token_ids) for o in greedy],
              "greedy_logprobs": [[step[tok].logprob for step, tok in
                                   zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                  for o in greedy]}
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def transformers_logprobs(model_dir: Path, prompts, device: str, dtype: str) -> list:
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            out.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
    del model
    gc.collect()
    return out


def compare(ref: dict, other: dict) -> dict:
    err = np.abs(np.concatenate([np.array(a) - np.array(b)
                                 for a, b in zip(ref["logprobs"], other["logprobs"])]))
    summary = {"logprob_abs_err_mean": float(err.mean()), "logprob_abs_err_max": float(err.max())}
    if "greedy" in other:
        same = [a == b for a, b in zip(ref["greedy"], other["greedy"])]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(ref["greedy"], other["greedy"])]
        summary.update(greedy_identical=float(np.mean(same)),
                       greedy_common_prefix_mean=float(np.mean(prefix)))
        # Decode-step logprob error where both saw the same tokens: the common prefix.
        decode_err = [abs(a - b) for r, o, n in zip(ref["greedy_logprobs"],
                                                     other["greedy_logprobs"], prefix)
                      for a, b in zip(r[:n], o[:n])]
        if decode_err:
            summary.update(decode_logprob_abs_err_mean=float(np.mean(decode_err)),
                           decode_logprob_abs_err_max=float(np.max(decode_err)),
                           decode_tokens_compared=len(decode_err))
    return summary


def variants_for(model_kind: str, fp8_ok: bool, dirs: dict) -> list[tuple[str, str, dict]]:
    base = dirs["float"]
    out = [("float32", base, {"dtype": "float32"}), ("bfloat16", base, {"dtype": "bfloat16"})]
    if fp8_ok:
        out += [("fp8 online", base, {"dtype": "bfloat16", "quantization": "fp8"}),
                ("fp8 online, float32 accumulation", base,
                 {"dtype": "bfloat16", "quantization": "fp8", "fp8_fast_accum": False}),
                ("fp8 online, FP8 LM head", base,
                 {"dtype": "bfloat16", "quantization": "fp8", "quantize_lm_head": True}),
                ("bf16 + fp8 KV", base, {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}),
                ("bf16 + fp8 KV + FP8 q.K decode", base,
                 {"dtype": "bfloat16", "kv_cache_dtype": "fp8", "fp8_qk_dot": True})]
        for scheme in ("channel", "block"):
            if scheme in dirs:
                out.append((f"fp8 checkpoint ({scheme})", dirs[scheme], {"dtype": "bfloat16"}))
    return out


def main() -> None:
    import torch
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--models", default="llama-8b-layers,smollm2")
    p.add_argument("--variants", default=None,
                   help="';'-separated variant names (as printed) to run beside float32 (the "
                        "reference); default: all")
    p.add_argument("--out", default="benchmarks/results/fp8_quality.json")
    args = p.parse_args()
    wanted = None if args.variants is None else {"float32", *args.variants.split(";")}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fp8_ok = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    if args.smoke:
        args.prompts, args.prompt_len = 2, 24
    report = {"benchmark": "fp8_quality", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "gpu": torch.cuda.get_device_name() if device == "cuda" else None},
              "args": vars(args), "models": {}}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models.split(","):
            start = time.perf_counter()
            if kind == "llama-8b-layers":
                dirs = {"float": Path(tmp) / "llama"}
                save_random_llama(dirs["float"], args.smoke)
                if fp8_ok:
                    from pagoda.model.quant.fp8_export import export_fp8
                    for scheme in ("channel", "block"):
                        if wanted is not None and f"fp8 checkpoint ({scheme})" not in wanted:
                            continue
                        dirs[scheme] = Path(tmp) / f"llama-{scheme}"
                        export_fp8(dirs["float"], dirs[scheme], scheme)
                vocab = 512 if args.smoke else 128256
                model_name = str(dirs["float"])
            else:
                from pagoda.model.tokenizer import embedded_model_path
                dirs = {"float": str(embedded_model_path())}
                vocab, model_name = 49152, None
            prompts = [[int(t) for t in rng.integers(10, vocab - 10, size=args.prompt_len)]
                       for _ in range(args.prompts)]
            chosen = [v for v in variants_for(kind, fp8_ok, dirs) if wanted is None or v[0] in wanted]
            if wanted is not None and len(chosen) < len(wanted) and fp8_ok:
                known = [v[0] for v in variants_for(kind, fp8_ok, dirs)]
                raise SystemExit(f"unknown variant in {sorted(wanted)}: known {known}")
            results = {name: run_variant(model, kwargs, prompts, device)
                       for name, model, kwargs in chosen}
            ref = results["float32"]
            entry = {name: compare(ref, r) for name, r in results.items() if name != "float32"}
            if model_name is not None:
                entry["transformers bfloat16 (peer)"] = compare(
                    ref, {"logprobs": transformers_logprobs(Path(model_name), prompts, device,
                                                            "bfloat16")})
            entry["seconds"] = time.perf_counter() - start
            report["models"][kind] = entry
            print(f"\n{kind}: error vs Pagoda float32 ({args.prompts} prompts x {args.prompt_len} "
                  f"tokens)")
            for name, m in entry.items():
                if isinstance(m, dict):
                    extra = (f"  greedy identical {m['greedy_identical']:.0%}, common prefix "
                             f"{m['greedy_common_prefix_mean']:.1f}/32" if "greedy_identical" in m else "")
                    if "decode_logprob_abs_err_mean" in m:
                        extra += (f"; decode |err| mean {m['decode_logprob_abs_err_mean']:.4f} "
                                  f"max {m['decode_logprob_abs_err_max']:.4f} over "
                                  f"{m['decode_tokens_compared']} tokens")
                    print(f"  {name:34s} logprob |err| mean {m['logprob_abs_err_mean']:.4f} "
                          f"max {m['logprob_abs_err_max']:.4f}{extra}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
