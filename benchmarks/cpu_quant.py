"""CPU quantized decode: Pagoda float32 vs int8 vs int4 vs gguf on the embedded SmolLM2,
with transformers fp32 and llama.cpp (llama-cpp-python, same GGUF file, if importable)
as peers in the same run, and each Pagoda scheme's quality beside its speed.

Workloads (random prompt token ids, fixed seed, every request runs to its length):
- batch 1: one request, --prompt-len in / --output-len out, output tok/s.
- batch N: --batch requests of the same shape submitted together, output tok/s.
Quality (Pagoda schemes vs Pagoda float32, over --quality-prompts text prompts):
greedy agreement (tokens equal before the first difference / tokens generated) and the
logprob error of the float model's greedy tokens, teacher-forced (max and mean |delta|).
--kernels adds per-layer matmul timings: float32 linear vs the block kernel vs torch's
own weight-packed int8/int4 CPU kernels.
--ab A,B replaces the sweep by two modes loaded side by side in one process and timed in
alternation (A, B, A, B, ... for --rounds rounds; medians), with every greedy output of
A compared token by token with B's. Mode "default" is LLM() with no quantization given
(what a user gets); "float32" asks for float weights (quantization="none"); a mode may
name a kernel-config variant after "@" (benchmarks/harness/variants.py), e.g.
`default@cpu_blocks.quantize_activations=1`.

    python -m benchmarks.cpu_quant --threads 2
    python -m benchmarks.cpu_quant --ab default,float32 --rounds 5
    python -m benchmarks.cpu_quant --smoke      # a quick check that everything runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from benchmarks.harness.results import write_result
from benchmarks.harness.timing import min_seconds
from benchmarks.harness.variants import configs_for

QUALITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three laws of robotics are",
    "To make a cup of tea, first",
    "Water boils at",
    "import numpy as np\n",
    "The best way to learn a language is",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="best of this many timed runs")
    p.add_argument("--modes", default="float32,int8,int4,gguf")
    p.add_argument("--peers", default="transformers,llama_cpp")
    p.add_argument("--quality-tokens", type=int, default=32)
    p.add_argument("--quality-prompts", type=int, default=len(QUALITY_PROMPTS))
    p.add_argument("--kernels", action="store_true", help="also time each layer's matmul")
    p.add_argument(
        "--ab",
        default=None,
        metavar="A,B",
        help="two modes side by side, timed in alternation (instead of the sweep)",
    )
    p.add_argument("--rounds", type=int, default=5, help="--ab: timed runs of each mode")
    p.add_argument("--smoke", action="store_true", help="tiny lengths: check that it runs")
    p.add_argument(
        "--out",
        "--output",
        dest="out",
        default="bench_results/cpu-quant.json",
        help="JSON result file",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.prompt_len, args.output_len, args.batch, args.repeats = 8, 8, 4, 1
        args.quality_tokens, args.quality_prompts, args.rounds = 4, 2, 2
    if args.ab is not None and len(args.ab.split(",")) != 2:
        p.error(f"--ab takes two modes, A,B: got {args.ab!r}")
    return args


def prompts(args, count):
    import random

    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(count)]


def best_rate(run, tokens, repeats):
    """Output tokens per second of the best of repeats runs (after one warm-up run)."""
    return tokens / min_seconds(run, repeats, warmup=1)


# --- Pagoda ---------------------------------------------------------------------------


def quantization_of(mode):
    """LLM(quantization=...) of a mode: "default" gives none (the user's default),
    "float32" asks for float weights, any other mode is a scheme's name."""
    return {"default": None, "float32": "none"}.get(mode, mode)


def pagoda_mode(args, path, mode):
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(str(path), quantization=quantization_of(mode), device="cpu")
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    one, many = prompts(args, 1), prompts(args, args.batch)
    result = {
        "load_s": round(load_s, 2),
        "batch1_tok_s": best_rate(
            lambda: llm.generate(one, params, use_tqdm=False), args.output_len, args.repeats
        ),
        f"batch{args.batch}_tok_s": best_rate(
            lambda: llm.generate(many, params, use_tqdm=False),
            args.output_len * args.batch,
            args.repeats,
        ),
    }
    result["quality_tokens"] = greedy_and_logprobs(llm, args)
    return result, llm


def greedy_and_logprobs(llm, args):
    """(greedy tokens per prompt, teacher-forcing logprob lists) for the quality prompts:
    the logprobs are computed later, on the float model's greedy continuations."""
    from pagoda.sampling_params import SamplingParams

    texts = QUALITY_PROMPTS[: args.quality_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.quality_tokens, ignore_eos=True)
    outs = llm.generate(texts, params, use_tqdm=False)
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs]


def forced_logprobs(llm, prompt_ids, continuations):
    """log p(token) of each continuation token given everything before it."""
    from pagoda.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    seqs = [p + c for p, c in zip(prompt_ids, continuations)]
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    result = []
    for out, p, s in zip(outs, prompt_ids, seqs):
        lps = out.prompt_logprobs  # lps[i]: token i given tokens < i (lps[0] is None)
        result.append([lps[i][s[i]].logprob for i in range(len(p), len(s))])
    return result


def agreement(ref, got):
    fractions = []
    for a, b in zip(ref, got):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fractions.append(same / len(a))
    return sum(fractions) / len(fractions)


def quality(ref_lp, lp, ref_tokens, tokens):
    deltas = [abs(a - b) for ra, rb in zip(ref_lp, lp) for a, b in zip(ra, rb)]
    return {
        "greedy_agreement": round(agreement(ref_tokens, tokens), 4),
        "logprob_err_max": round(max(deltas), 5),
        "logprob_err_mean": round(sum(deltas) / len(deltas), 6),
    }


def run_pagoda(args, path):
    modes = [m for m in args.modes.split(",") if m]
    if "float32" not in modes:
        modes.insert(0, "float32")  # the quality reference
    results, ref = {}, None
    for mode in modes:
        print(f"pagoda {mode} ...", flush=True)
        result, llm = pagoda_mode(args, path, mode)
        prompt_ids, tokens = result.pop("quality_tokens")
        if ref is None:
            ref = (prompt_ids, tokens, None)
        lp = forced_logprobs(llm, ref[0], ref[1])
        if ref[2] is None:
            ref = (ref[0], ref[1], lp)
        result["quality_vs_float32"] = quality(ref[2], lp, ref[1], tokens)
        results[mode] = result
        print(f"  {json.dumps(result)}", flush=True)
        del llm
        gc.collect()
    return results


# --- two modes side by side ---------------------------------------------------------------


def run_ab(args, path):
    """Modes A and B (--ab) loaded together, each workload timed A, B, A, B, ... over
    --rounds (after one untimed run of each); medians of output tok/s and their ratio
    A / B; every greedy output (timed workloads and the quality prompts) compared."""
    from statistics import median

    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    modes = args.ab.split(",")
    llms = {}
    for mode in modes:
        print(f"loading {mode} ...", flush=True)
        # No prefix caching: every round recomputes its prompts, as a new user's would be.
        scheme, _, variant = mode.partition("@")
        llms[mode] = LLM(
            str(path),
            quantization=quantization_of(scheme),
            device="cpu",
            enable_prefix_caching=False,
        )
        if variant:  # a kernel-config variant, e.g. cpu_blocks.quantize_activations=1
            runner = llms[mode].llm_engine.executor.runner
            runner.use_kernel_configs(configs_for(variant, "cpu"))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    workloads = {"batch1": prompts(args, 1), f"batch{args.batch}": prompts(args, args.batch)}
    result = {"modes": modes, "rounds": args.rounds, "workloads": {}}
    tokens = {mode: [] for mode in modes}
    for name, batch in workloads.items():
        rates = {mode: [] for mode in modes}
        for mode in modes:  # warm-up, and the outputs compared below
            outs = llms[mode].generate(batch, params, use_tqdm=False)
            tokens[mode] += [list(o.outputs[0].token_ids) for o in outs]
        for r in range(args.rounds):
            for mode in modes:
                start = time.perf_counter()
                llms[mode].generate(batch, params, use_tqdm=False)
                rates[mode].append(len(batch) * args.output_len / (time.perf_counter() - start))
                print(f"  {name} round {r + 1} {mode:10s} {rates[mode][-1]:7.1f} tok/s", flush=True)
        medians = {mode: median(rates[mode]) for mode in modes}
        result["workloads"][name] = {
            "tok_s": {mode: [round(x, 1) for x in rates[mode]] for mode in modes},
            "median_tok_s": {mode: round(v, 1) for mode, v in medians.items()},
            "ratio": round(medians[modes[0]] / medians[modes[1]], 2),
        }
    texts = QUALITY_PROMPTS[: args.quality_prompts]
    greedy = SamplingParams(temperature=0, max_tokens=args.quality_tokens)
    for mode in modes:
        outs = llms[mode].generate(texts, greedy, use_tqdm=False)
        tokens[mode] += [list(o.outputs[0].token_ids) for o in outs]
    a, b = (tokens[mode] for mode in modes)
    result["outputs_compared"] = len(a)
    result["outputs_identical"] = sum(x == y for x, y in zip(a, b))
    return result


# --- peers ------------------------------------------------------------------------------


def run_transformers(args, path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()

    def gen(ids):
        x = torch.tensor(ids)
        with torch.inference_mode():
            model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                pad_token_id=0,
            )

    one, many = prompts(args, 1), prompts(args, args.batch)
    return {
        "batch1_tok_s": best_rate(lambda: gen(one), args.output_len, args.repeats),
        f"batch{args.batch}_tok_s": best_rate(
            lambda: gen(many), args.output_len * args.batch, args.repeats
        ),
    }


def run_llama_cpp(args, path):
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=args.prompt_len + args.output_len + 8,
        n_batch=512,
        verbose=False,
    )
    one = prompts(args, 1)[0]

    def gen():
        llm.reset()
        for i, _ in enumerate(llm.generate(one, top_k=1, temp=0.0, reset=True)):
            if i + 1 == args.output_len:
                break

    return {
        "batch1_tok_s": best_rate(gen, args.output_len, args.repeats),
        "note": "batch 1 only (llama-cpp-python runs one sequence per context)",
    }


# --- per-layer kernels ------------------------------------------------------------------


def run_kernels(args):
    import torch

    from pagoda.model.layers.matmul import linear
    from pagoda.model.quant import cpu_kernels as ck

    shapes = {
        "qkv": (960, 576),
        "o": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
        "lm_head": (49152, 576),
    }
    out = {}
    for m in (1, args.batch):
        for name, (n, k) in shapes.items():
            w, x = torch.randn(n, k), torch.randn(m, k)
            reps = 3 if name == "lm_head" else 30
            b8, b4 = ck.quantize_q8_0(w), ck.quantize_q4_1(w)
            s = w.abs().amax(1) / 127
            i8 = torch.round(w / s[:, None]).to(torch.int8)
            i4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.randint(0, 16, (n, k), dtype=torch.int32), 1
            )
            sz = torch.randn(k // 32, n, 2)
            fns = {
                "float32": lambda: linear(x, w),
                "q8_0_kernel": lambda: ck.blocks_mm(x, b8, "q8_0"),
                "q4_1_kernel": lambda: ck.blocks_mm(x, b4, "q4_1"),
                "torch_int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, i8, s),
                "torch_int4pack_g32": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, i4, 32, sz
                ),
            }
            row = {}
            for label, fn in fns.items():
                fn()
                row[label] = round(
                    min_seconds(lambda: [fn() for _ in range(reps)], 3, 0) / reps * 1e6, 1
                )
            out[f"{name} M={m}"] = row
            print(f"  {name} M={m} us: {row}", flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from pagoda.model.quant.cpu_kernels import native_status
    from pagoda.model.tokenizer import embedded_model_path

    path = embedded_model_path()
    report = {
        "benchmark": "cpu_quant",
        "machine": {"threads": args.threads},
        "kernel": native_status(),
        "workload": {
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "batch": args.batch,
            "repeats": args.repeats,
        },
        "model": path.name,
    }
    if args.ab is not None:
        report["ab"] = run_ab(args, path)
        print(json.dumps(report, indent=1))
        write_result(args.out, report, indent=1)
        return report
    if args.kernels:
        report["kernels_us"] = run_kernels(args)
    report["pagoda"] = run_pagoda(args, path)
    peers = [p for p in args.peers.split(",") if p]
    for peer, fn in (("transformers", run_transformers), ("llama_cpp", run_llama_cpp)):
        if peer not in peers:
            continue
        print(f"{peer} ...", flush=True)
        try:
            report[peer] = fn(args, path)
        except ImportError as e:
            report[peer] = {"skipped": f"not importable: {e}"}
        print(f"  {json.dumps(report[peer])}", flush=True)
    print(json.dumps(report, indent=1))
    write_result(args.out, report, indent=1)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
