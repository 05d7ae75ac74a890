"""CPU decode speed: Pagoda vs transformers fp32 (and llama.cpp when installed), one run.

    .venv/bin/python benchmarks/cpu_decode.py --threads 2
    .venv/bin/python benchmarks/cpu_decode.py --threads 2 --quantization int4   # once LLM takes it
    .venv/bin/python benchmarks/cpu_decode.py --smoke                          # seconds: checks it runs

The embedded SmolLM2-135M-Instruct GGUF, `--prompt-len` (32) tokens in, `--max-tokens`
(128) out, greedy, EOS ignored, torch threads fixed. Two points: batch 1 (`--num-prompts-
batch1` prompts, one at a time) and 32 requests at once. Pagoda gets `quantization=`
only when `--quantization` is given (default: the float32 weights); transformers always
runs the GGUF dequantized to float32 (`generate`, sdpa). The optional peer llama.cpp
(`llama_cpp`, llama-cpp-python) runs the same GGUF file as it is (Q4_1) with
`n_threads=--threads`, batch 1 only; when it is not importable the script says how to
install it and skips it. Each engine runs `--repeats` times per point, alternating; the
best run is reported (background load only ever slows a run). Prints a table and writes
JSON (default benchmarks/results/cpu-decode.json).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

from offline_throughput import (PagodaRunner, TransformersRunner, best_runs,  # noqa: E402
                                make_prompts, summarize)
from result_file import write_json  # noqa: E402  (benchmarks/)

LLAMA_CPP_HINT = ("llama.cpp peer skipped: `llama_cpp` is not importable. Install it with "
                  "`pip install llama-cpp-python==0.3.36` (builds from source, ~6 min on 2 cores)")


class LlamaCppRunner:
    """llama-cpp-python on the GGUF file as shipped; one sequence at a time (batch 1)."""

    def __init__(self, gguf_path: str, threads: int) -> None:
        import llama_cpp
        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_threads=threads,
                                   n_threads_batch=threads, n_ctx=1024, n_batch=512,
                                   verbose=False)
        self.run([[1, 2, 3, 4]], 4, 1)  # warm-up

    def run(self, prompts, max_tokens: int, batch: int) -> dict:
        if batch != 1:
            raise ValueError("the llama.cpp peer runs batch 1 only")
        outs, step_s = [], []
        start = time.perf_counter()
        for prompt in prompts:
            tokens, stamps = [], []
            # temp 0: greedy; generate() yields every sampled token, EOS included.
            for token in self.llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0,
                                           reset=True):
                stamps.append(time.perf_counter())
                tokens.append(token)
                if len(tokens) == max_tokens:
                    break
            step_s += [b - a for a, b in zip(stamps, stamps[1:])]
            outs.append(tokens)
        elapsed = time.perf_counter() - start
        return summarize("llama.cpp", elapsed, outs, step_s)


def make_runners(args, gguf, batches: list[int]) -> dict:
    runners = {"pagoda": PagodaRunner(max(batches), args.quantization)}
    if not args.skip_transformers:
        runners["transformers"] = TransformersRunner(str(gguf.parent), gguf.name)
    if not args.skip_llama_cpp:
        try:
            runners["llama.cpp"] = LlamaCppRunner(str(gguf), args.threads)
        except ImportError:
            print(LLAMA_CPP_HINT, flush=True)
    return runners


def run_point(runners: dict, prompts, args, batch: int) -> dict:
    """Every engine that runs this batch size (llama.cpp: batch 1) `--repeats` times,
    the order rotating each repeat; the best run of each, every run's tok/s, and how
    many outputs equal Pagoda's (transformers: should be all; llama.cpp computes in
    Q4_1 and need not)."""
    order = [k for k in runners if batch == 1 or k != "llama.cpp"]
    best, history = best_runs(runners, order, prompts, args.max_tokens, batch, args.repeats)
    row = {"batch": batch, "num_prompts": len(prompts), "repeats": args.repeats}
    ours = best["pagoda"]["token_ids"]
    for name in order:
        row[name] = dict(best[name], all_runs_tok_per_s=history[name])
        ids = row[name].pop("token_ids")
        if name != "pagoda":
            row[name]["same_tokens_as_pagoda"] = (f"{sum(a == b for a, b in zip(ours, ids))}"
                                                  f"/{len(prompts)}")
            row[name]["pagoda_speedup"] = (best["pagoda"]["output_tok_per_s"]
                                           / best[name]["output_tok_per_s"])
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--num-prompts-batch1", type=int, default=2,
                        help="prompts run one at a time for the batch-1 point")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantization", default=None,
                        help="Pagoda's LLM(quantization=...); default: float32 weights")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="batch 1 and 4, 8 tokens, one repeat: checks it runs")
    parser.add_argument("--out", default=os.path.join(_HERE, "results", "cpu-decode.json"))
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.max_tokens, args.repeats, args.num_prompts_batch1 = "1,4", 8, 1, 1
    return args


def main() -> None:
    args = parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from pagoda.model.tokenizer import embedded_model_path, load_tokenizer
    gguf = embedded_model_path()
    tokenizer = load_tokenizer(str(gguf))
    batches = [int(b) for b in args.batches.split(",")]
    runners = make_runners(args, gguf, batches)
    results = []
    for batch in batches:
        count = args.num_prompts_batch1 if batch == 1 else batch
        prompts = make_prompts(tokenizer, count, args.prompt_len)
        results.append(run_point(runners, prompts, args, batch))
    print(f"\nbest of {args.repeats} runs each (output tok/s, median decode step ms):")
    for row in results:
        cells = [f"{name} {row[name]['output_tok_per_s']:7.1f} tok/s "
                 f"{row[name]['median_step_ms']:6.1f} ms" for name in runners if name in row]
        peers = [f"pagoda/{name} {row[name]['pagoda_speedup']:.2f}x "
                 f"(same tokens {row[name]['same_tokens_as_pagoda']})"
                 for name in runners if name in row and name != "pagoda"]
        print(f"batch {row['batch']:3d}: " + "   ".join(cells))
        if peers:
            print("           " + "   ".join(peers))
    report = {"benchmark": "cpu_decode", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": os.cpu_count(), "threads": args.threads,
                          "torch": torch.__version__},
              "quantization": args.quantization, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens,
              "llama_cpp": getattr(runners.get("llama.cpp"), "version", None),
              "results": results}
    write_json(args.out, report)


if __name__ == "__main__":
    main()
