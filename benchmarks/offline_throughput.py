"""Offline throughput on the CPU: Pagoda vs Hugging Face transformers `generate`, one run.

Same model (the embedded SmolLM2-135M GGUF, dequantized to fp32), same prompts (~32
tokens), 128 new tokens each with EOS ignored, greedy, torch threads fixed. Both engines
are loaded once in this process; each point (batch size) is then run --repeats times,
the two engines alternating (and swapping which goes first), and the best run of each
is reported: on a shared machine background load only ever slows a run down. Per-step
times are the median decode step of a run (Pagoda: one engine step; transformers: the
time between two generated tokens). Pagoda runs without prefix caching, so repeats of
the same prompts get no cache hits that `generate` could not have. Prints a table and
writes JSON.

    .venv/bin/python benchmarks/offline_throughput.py --threads 2 --out bench_results/cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from result_file import write_json  # noqa: E402  (benchmarks/)


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    base = ("The history of the city begins with a small settlement by the river, where "
            "farmers and traders met every season to exchange grain, tools and stories about")
    ids = tokenizer(base).input_ids
    prompts = []
    for i in range(count):
        words = tokenizer(f" Story number {i}: ").input_ids
        prompts.append((words + ids)[:length])
    return prompts


def summarize(engine: str, seconds: float, token_ids: list, step_s: list[float]) -> dict:
    tokens = sum(len(t) for t in token_ids)
    return {"engine": engine, "seconds": seconds, "output_tokens": tokens,
            "output_tok_per_s": tokens / seconds,
            "median_step_ms": 1000 * statistics.median(step_s) if step_s else float("nan"),
            "token_ids": token_ids}


class PagodaRunner:
    """LLM.generate, timing every engine step (median step = the decode step time);
    quantization is passed to LLM only when given."""

    def __init__(self, max_batch: int, quantization: str | None = None) -> None:
        from pagoda import LLM, SamplingParams
        kwargs = {} if quantization is None else {"quantization": quantization}
        self.llm = LLM(max_num_seqs=max(max_batch, 1), max_model_len=1024,
                       enable_prefix_caching=False, **kwargs)
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
            outs += self.llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return summarize("pagoda", elapsed, [list(o.outputs[0].token_ids) for o in outs],
                         self.step_s)


class TransformersRunner:
    def __init__(self, model_dir: str, gguf_name: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_name,
                                                          dtype=torch.float32).eval()
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
                chunk = prompts[i:i + batch]
                width = max(len(p) for p in chunk)
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                stamps: list[float] = []
                gen = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                          do_sample=False, pad_token_id=pad,
                                          stopping_criteria=self._stamps(stamps))
                step_s += [b - a for a, b in zip(stamps, stamps[1:])]
                outs += gen[:, width:].tolist()
            elapsed = time.perf_counter() - start
        return summarize("transformers", elapsed, outs, step_s)


def best_runs(runners: dict, order: list[str], prompts, max_tokens: int, batch: int,
              repeats: int) -> tuple[dict, dict]:
    """Runs each engine of order `repeats` times, the order rotating by one each repeat
    (two engines: alternating); returns (the best run of each, every run's tok/s)."""
    best: dict[str, dict] = {}
    history: dict[str, list[float]] = {name: [] for name in order}
    for r in range(repeats):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            result = runners[name].run(prompts, max_tokens, batch)
            history[name].append(round(result["output_tok_per_s"], 2))
            print(f"  batch {batch:3d} repeat {r + 1}/{repeats} {name:12s} "
                  f"{result['output_tok_per_s']:7.1f} tok/s  "
                  f"{result['median_step_ms']:7.1f} ms/step", flush=True)
            if name not in best or result["seconds"] < best[name]["seconds"]:
                best[name] = result
    return best, history


def measure_point(runners: dict, prompts, max_tokens: int, batch: int, repeats: int) -> dict:
    """Runs every engine `repeats` times, alternating (the first engine swaps each
    repeat); returns the best run of each plus every run's tok/s."""
    order = list(runners)
    best, history = best_runs(runners, order, prompts, max_tokens, batch, repeats)
    row = {"batch": batch, "num_prompts": len(prompts), "repeats": repeats}
    for name in order:
        row[name] = dict(best[name], all_runs_tok_per_s=history[name])
    if "transformers" in best:
        pagoda_ids, peer_ids = best["pagoda"]["token_ids"], best["transformers"]["token_ids"]
        row["identical_outputs"] = f"{sum(a == b for a, b in zip(pagoda_ids, peer_ids))}/{len(prompts)}"
        row["speedup"] = (best["pagoda"]["output_tok_per_s"]
                          / best["transformers"]["output_tok_per_s"])
    for name in order:
        row[name].pop("token_ids")
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--num-prompts-batch1", type=int, default=4,
                        help="prompts run one at a time for the batch-1 point")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each engine per point, alternating; the best is reported")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench_results/offline_cpu.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from pagoda.model.tokenizer import embedded_model_path, load_tokenizer
    gguf = embedded_model_path()
    tokenizer = load_tokenizer(str(gguf))
    batches = [int(b) for b in args.batches.split(",")]
    runners = {"pagoda": PagodaRunner(max(batches))}
    if not args.skip_transformers:
        runners["transformers"] = TransformersRunner(str(gguf.parent), gguf.name)
    results = []
    for batch in batches:
        count = args.num_prompts_batch1 if batch == 1 else batch
        prompts = make_prompts(tokenizer, count, args.prompt_len)
        results.append(measure_point(runners, prompts, args.max_tokens, batch, args.repeats))
    print(f"\nbest of {args.repeats} runs each (tok/s, median decode step ms):")
    for row in results:
        peer = row.get("transformers", {})
        print(f"batch {row['batch']:3d}: pagoda {row['pagoda']['output_tok_per_s']:7.1f} tok/s "
              f"{row['pagoda']['median_step_ms']:6.1f} ms/step   transformers "
              f"{peer.get('output_tok_per_s', float('nan')):7.1f} tok/s "
              f"{peer.get('median_step_ms', float('nan')):6.1f} ms/step   "
              f"speedup {row.get('speedup', float('nan')):.2f}x   "
              f"identical {row.get('identical_outputs', '-')}")
    report = {"benchmark": "offline_throughput_cpu", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__},
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "results": results}
    write_json(args.out, report)


if __name__ == "__main__":
    main()
