"""Decode steps of one engine under kernel variants, A/B in one process.

    python benchmarks/decode_variants.py --preset qwen3-30b-a3b \\
        --variants benchmarks/variants/qwen3-b1.json --rounds 3 --out result.json
    python benchmarks/decode_variants.py --preset llama-3.1-8b --kv-cache-dtype fp8 \\
        --batch 256 --prompt 1024 --tokens 24 --variants <file> --out result.json

A kernel tile that wins alone can lose in the step (its PDL predecessor, the kernels
sharing its SMs: docs/performance.md), and leases differ by more than most changes
gain, so only A/B inside one run decides. This program builds the engine once (dummy
weights, --batch sequences), then for each round and each variant in turn: sets the
variant's module attributes (a variants file maps names to {"module.ATTR": value} or
{"module.DICT[key]": value}; key: comma-separated ints make a tuple), captures the CUDA
graphs again (the kernels read those attributes when launched), runs --batch greedy
requests of --prompt tokens for --tokens tokens and records the median time between the
steps that decode all of them (at batch 1: the gap between tokens, as moe_bench.py and
gpu_compare.py's latency report it), then puts the attributes back. Variants take turns
within a round, so drift of clocks and power lands on all of them. It prints each
variant's median over the rounds with its spread and writes JSON. Values replace whole
attributes (a dict value replaces the dict).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from result_file import write_json  # noqa: E402  (benchmarks/)


def parse_target(target: str):
    """"pkg.mod.ATTR" -> (module, "ATTR", None); "pkg.mod.DICT[1,2,3]" -> (module,
    "DICT", (1, 2, 3)); "pkg.mod.DICT[name]" -> (module, "DICT", "name")."""
    key = None
    if target.endswith("]"):
        target, _, raw = target[:-1].partition("[")
        parts = raw.split(",")
        key = (tuple(int(p) for p in parts) if all(p.strip().lstrip("-").isdigit()
                                                    for p in parts) else raw)
    module_name, _, attribute = target.rpartition(".")
    if not module_name:
        raise ValueError(f"variant target {target!r} names no module")
    return importlib.import_module(module_name), attribute, key


_MISSING = object()


def apply_overrides(overrides: dict) -> list:
    """Sets each target; returns what undo_overrides needs to put them back. A target
    that cannot be set raises, with the ones set before it put back."""
    undo = []
    try:
        for target, value in overrides.items():
            module, attribute, key = parse_target(target)
            if not hasattr(module, attribute):
                raise ValueError(f"{module.__name__} has no attribute {attribute!r}")
            if key is None:
                undo.append((module, attribute, None, getattr(module, attribute)))
                setattr(module, attribute, value)
            else:
                table = getattr(module, attribute)
                undo.append((module, attribute, key, table.get(key, _MISSING)))
                table[key] = value
    except Exception:
        undo_overrides(undo)
        raise
    return undo


def undo_overrides(undo: list) -> None:
    for module, attribute, key, old in reversed(undo):
        if key is None:
            setattr(module, attribute, old)
        elif old is _MISSING:
            del getattr(module, attribute)[key]
        else:
            getattr(module, attribute)[key] = old


def decode_ms(engine, prompts: list[list[int]], tokens: int) -> float:
    """Median host time (ms) between consecutive steps that each gave every one of the
    greedy requests (one per prompt, all added at once) a new token: the steps after the
    last prompt's prefill, while all of them decode."""
    from pagoda import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    tag = time.perf_counter_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"v{tag}-{i}", prompt, params, output_kind="delta")
    arrivals = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if len(prompts) == sum(1 for o in outs if o.outputs[0].token_ids):
            arrivals.append(time.perf_counter())
    if len(arrivals) < 2:
        raise RuntimeError(f"only {len(arrivals)} steps decoded all {len(prompts)} requests: "
                           "raise --tokens (or the token budget, for a large --batch)")
    return statistics.median(b - a for a, b in zip(arrivals, arrivals[1:])) * 1e3


def recapture(runner, max_model_len: int) -> float:
    """Drops the runner's graphs and captures them again; seconds taken."""
    import torch
    start = time.perf_counter()
    runner.graph_runner = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    runner.graph_runner = runner.capture_cuda_graphs(runner.model, runner.backend,
                                                     max_model_len)
    return time.perf_counter() - start


def run(args, variants: dict) -> dict:
    import numpy as np
    from pagoda import LLM
    smoke = dict(device="cpu", dtype="float32", kv_cache_memory=1 << 24) if args.smoke else {}
    llm = LLM(args.preset, load_format="dummy", max_model_len=args.max_model_len,
              max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
              skip_tokenizer_init=True, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, **{"dtype": "bfloat16", **smoke})
    engine = llm.llm_engine
    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        raise SystemExit("decode_variants needs the in-process executor (one device): it "
                         "captures the model runner's graphs again between variants")
    rng = np.random.default_rng(0)
    vocab = engine.model_info.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt).tolist() for _ in range(args.batch)]
    decode_ms(engine, prompts[:1], 8)  # first use of the sampler and the step loop
    samples = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name, overrides in variants.items():
            undo = apply_overrides(overrides)
            try:
                capture_s = recapture(runner, args.max_model_len)
                ms = decode_ms(engine, prompts, args.tokens)
            finally:
                undo_overrides(undo)
            samples[name].append(ms)
            print(f"round {round_index} {name:<28} {ms:.4f} ms/step (capture {capture_s:.1f} s)",
                  flush=True)
    engine.shutdown()
    rows = []
    for name, values in samples.items():
        rows.append({"variant": name, "overrides": variants[name], "ms_per_step": values,
                     "median_ms": statistics.median(values),
                     "spread_ms": max(values) - min(values)})
    return {"rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--variants", required=True,
                   help="JSON file: {name: {\"module.ATTR\": value, ...}} ({} = the defaults)")
    p.add_argument("--only", default=None, help="comma-separated variant names to run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step's token budget (default: 512 at batch 1, else the engine's)")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--out", default="benchmarks/results/decode_variants.json")
    p.add_argument("--smoke", action="store_true", help="CPU, float32 (checks the program only)")
    args = p.parse_args()
    if args.batch < 1:
        p.error("--batch must be at least 1")
    if args.max_num_batched_tokens is None and args.batch == 1:
        args.max_num_batched_tokens = 512  # few mixed graphs to capture again per variant
    with open(args.variants) as f:
        variants = json.load(f)
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in variants]
        if unknown:
            p.error(f"unknown variants {unknown}; the file has {sorted(variants)}")
        variants = {w: variants[w] for w in wanted}
    for overrides in variants.values():  # fail before the model loads
        undo_overrides(apply_overrides(overrides))
    result = {"benchmark": "decode_variants", "args": vars(args), **run(args, variants)}
    import torch
    result["machine"] = {"torch": torch.__version__,
                         "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    print(f"\n{'variant':<28}{'ms/step':>10}{'spread':>8}  (median over {args.rounds} rounds)")
    for row in result["rows"]:
        print(f"{row['variant']:<28}{row['median_ms']:>10.4f}{row['spread_ms']:>8.4f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
