"""CPU decode speed: Pagoda vs transformers `generate` (and llama.cpp when installed),
the same model and prompts, in one run.

    python -m benchmarks.cpu_compare --threads 2
    python -m benchmarks.cpu_compare --threads 2 --skip-llama-cpp --num-prompts-batch1 4
    python -m benchmarks.cpu_compare --threads 2 --quantization int4
    python -m benchmarks.cpu_compare --smoke                         # seconds: checks it runs

The embedded SmolLM2-135M-Instruct GGUF, `--prompt-len` (32) tokens in, `--max-tokens`
(128) out, greedy, EOS ignored, torch threads fixed. Points: batch 1 (`--num-prompts-
batch1` prompts, one at a time) and 32 requests at once (`--batches`). Pagoda runs
without prefix caching (repeats of the same prompts get no cache hits that `generate`
could not have) and gets `quantization=` from `--quantization` (default: none, the
float32 weights); transformers runs the GGUF dequantized to float32 (`generate`,
sdpa). The optional peer llama.cpp (`llama_cpp`, llama-cpp-python) runs the same GGUF
file as it is (Q4_1) with `n_threads=--threads`, batch 1 only; when it is not importable
the script says how to install it and skips it. Each engine is loaded once, then runs
`--repeats` times per point, the order rotating each repeat; the best run is reported
(background load on a shared machine only ever slows a run down). Per-step times are the
median decode step of a run (Pagoda: one engine step; the peers: the time between two
generated tokens). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.harness.results import write_result


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    base = (
        "The history of the city begins with a small settlement by the river, where "
        "farmers and traders met every season to exchange grain, tools and stories about"
    )
    ids = tokenizer(base).input_ids
    prompts = []
    for i in range(count):
        words = tokenizer(f" Story number {i}: ").input_ids
        prompts.append((words + ids)[:length])
    return prompts


def summarize(engine: str, seconds: float, token_ids: list, step_s: list[float]) -> dict:
    tokens = sum(len(t) for t in token_ids)
    return {
        "engine": engine,
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / seconds,
        "median_step_ms": 1000 * statistics.median(step_s) if step_s else float("nan"),
        "token_ids": token_ids,
    }


class PagodaRunner:
    """LLM.generate, timing every engine step (median step = the decode step time);
    quantization is passed to LLM only when given."""

    def __init__(self, max_batch: int, quantization: str | None = None) -> None:
        from pagoda import LLM, SamplingParams

        kwargs = {} if quantization is None else {"quantization": quantization}
        self.llm = LLM(
            max_num_seqs=max(max_batch, 1),
            max_model_len=1024,
            enable_prefix_caching=False,
            **kwargs,
        )
        self.params = SamplingParams
        engine = self.llm.llm_engine
        step, self.step_s = engine.step, []

        def timed_step():  # LLM.generate calls engine.step(): time every step
            start = time.perf_counter()
            outs = step()
            self.step_s.append(time.perf_counter() - start)
            return outs

        engine.step = timed_step
        self.run([[1, 2, 3, 4]], 4, 1)  # warm-up

    def run(self, prompts, max_tokens: int, batch: int) -> dict:
        params = self.params(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.step_s = []
        start = time.perf_counter()
        outs = []
        for i in range(0, len(prompts), batch):
            outs += self.llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return summarize(
            "pagoda", elapsed, [list(o.outputs[0].token_ids) for o in outs], self.step_s
        )


class TransformersRunner:
    def __init__(self, model_dir: str, gguf_name: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, gguf_file=gguf_name, dtype=torch.float32
        ).eval()
        self.model.generation_config.eos_token_id = None  # EOS ignored: exactly max_tokens
        self.run([[1, 2, 3, 4]], 4, 1)  # warm-up

    def _stamps(self, stamps: list[float]):
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Stamp(StoppingCriteria):  # called once per generated token: never stops
            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(time.perf_counter())
                return input_ids.new_zeros(input_ids.shape[0], dtype=bool)

        return StoppingCriteriaList([Stamp()])

    def run(self, prompts, max_tokens: int, batch: int) -> dict:
        torch, pad, outs, step_s = self.torch, 0, [], []
        with torch.inference_mode():
            start = time.perf_counter()
            for i in range(0, len(prompts), batch):
                chunk = prompts[i : i + batch]
                width = max(len(p) for p in chunk)
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                stamps: list[float] = []
                gen = self.model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    stopping_criteria=self._stamps(stamps),
                )
                step_s += [b - a for a, b in zip(stamps, stamps[1:])]
                outs += gen[:, width:].tolist()
            elapsed = time.perf_counter() - start
        return summarize("transformers", elapsed, outs, step_s)


def best_runs(
    runners: dict, order: list[str], prompts, max_tokens: int, batch: int, repeats: int
) -> tuple[dict, dict]:
    """Runs each engine of order `repeats` times, the order rotating by one each repeat
    (two engines: alternating); returns (the best run of each, every run's tok/s)."""
    best: dict[str, dict] = {}
    history: dict[str, list[float]] = {name: [] for name in order}
    for r in range(repeats):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            result = runners[name].run(prompts, max_tokens, batch)
            history[name].append(round(result["output_tok_per_s"], 2))
            print(
                f"  batch {batch:3d} repeat {r + 1}/{repeats} {name:12s} "
                f"{result['output_tok_per_s']:7.1f} tok/s  "
                f"{result['median_step_ms']:7.1f} ms/step",
                flush=True,
            )
            if name not in best or result["seconds"] < best[name]["seconds"]:
                best[name] = result
    return best, history


LLAMA_CPP_HINT = (
    "llama.cpp peer skipped: `llama_cpp` is not importable. Install it with "
    "`pip install llama-cpp-python==0.3.36` (builds from source, ~6 min on 2 cores)"
)


class LlamaCppRunner:
    """llama-cpp-python on the GGUF file as shipped; one sequence at a time (batch 1)."""

    def __init__(self, gguf_path: str, threads: int) -> None:
        import llama_cpp

        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(
            model_path=gguf_path,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=1024,
            n_batch=512,
            verbose=False,
        )
        self.run([[1, 2, 3, 4]], 4, 1)  # warm-up

    def run(self, prompts, max_tokens: int, batch: int) -> dict:
        if batch != 1:
            raise ValueError("the llama.cpp peer runs batch 1 only")
        outs, step_s = [], []
        start = time.perf_counter()
        for prompt in prompts:
            tokens, stamps = [], []
            # temp 0: greedy; generate() yields every sampled token, EOS included.
            for token in self.llm.generate(
                prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True
            ):
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
            row[name]["same_tokens_as_pagoda"] = (
                f"{sum(a == b for a, b in zip(ours, ids))}/{len(prompts)}"
            )
            row[name]["pagoda_speedup"] = (
                best["pagoda"]["output_tok_per_s"] / best[name]["output_tok_per_s"]
            )
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument(
        "--num-prompts-batch1",
        type=int,
        default=2,
        help="prompts run one at a time for the batch-1 point",
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quantization",
        default="none",
        help="Pagoda's LLM(quantization=...); default: none, the float32 weights",
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument(
        "--smoke", action="store_true", help="batch 1 and 4, 8 tokens, one repeat: checks it runs"
    )
    parser.add_argument(
        "--out",
        "--output",
        dest="out",
        default="bench_results/cpu-compare.json",
        help="JSON result file",
    )
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
        cells = [
            f"{name} {row[name]['output_tok_per_s']:7.1f} tok/s "
            f"{row[name]['median_step_ms']:6.1f} ms"
            for name in runners
            if name in row
        ]
        peers = [
            f"pagoda/{name} {row[name]['pagoda_speedup']:.2f}x "
            f"(same tokens {row[name]['same_tokens_as_pagoda']})"
            for name in runners
            if name in row and name != "pagoda"
        ]
        print(f"batch {row['batch']:3d}: " + "   ".join(cells))
        if peers:
            print("           " + "   ".join(peers))
    report = {
        "benchmark": "cpu_compare",
        "machine": {"threads": args.threads},
        "quantization": args.quantization,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "llama_cpp": getattr(runners.get("llama.cpp"), "version", None),
        "results": results,
    }
    write_result(args.out, report)


if __name__ == "__main__":
    main()
