"""Speculative decoding on the GPU at controlled acceptance: Llama-3.1-8B shape, dummy
weights, one H200.

Random weights make no text worth drafting, so drafts come from a benchmark-only
proposer defined here (ReplayProposer; no product flag reaches it): it replays a
recorded greedy run of the same target on the same prompts, with a chosen fraction
of the draft tokens corrupted. It is installed in place of the n-gram proposer of an
engine started with method "ngram" (the host-proposer path of the scheduler's
DraftPlanner). One engine serves every configuration: "off" detaches its planner,
"k=4 always" turns the adaptive budget off, "adaptive" is the default.

Replay needs a target whose greedy tokens do not depend on the step's shape. With
random weights they do: a verify step (k + 1 rows) rounds differently from a one-row
decode step, flips near-tie argmaxes, and the continuation leaves the recording (the
acceptance measured 0.00-0.03 at every target). So, in this benchmark only, every
decoder layer's attention output projection (o_proj) and MLP down projection
(down_proj) weights are zeroed after the engine is built: each layer adds exactly 0 to
the residual, the next greedy token is a pure function of the current one
(argmax lm_head(norm(embed(t)))), the same in decode and verify steps, while every
GEMM and attention kernel still does its full work (a step costs the same: the
weights are still read). Plain bf16/fp16/fp32 Llama layers only; other layouts are
refused.

1. batch 1: ms per output token at target acceptance 0, 50, 80, 95 % (corruption
   1, 0.5, 0.2, 0.05), for off, k=4 always and adaptive; measured acceptance too:
   "acceptance" is vLLM's (accepted / drafted tokens), "draft_acceptance" the chance
   that a draft is accepted given the ones before it were (what the target sets);
2. throughput (output tok/s) at concurrency 1, 8, 32, 128, 256 at 0 % and 80 % target
   acceptance: off vs adaptive (and k=4 always, to show what adapting saves); at 0 %
   the adaptive budget should stay within 2 % of off.

    python benchmarks/spec_decode_gpu.py --output benchmarks/results/h200-spec-decode.json
    python benchmarks/spec_decode_gpu.py --smoke      # CPU, tiny preset: checks it runs
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing the package
from result_file import write_json  # noqa: E402  (benchmarks/)

KEY_LEN = 8  # prompts differ in their first KEY_LEN tokens: the replay's lookup key


class ReplayProposer:
    """Benchmark-only drafts: the recorded greedy continuation of the request's prompt,
    each draft token replaced by another one with probability `corrupt`."""

    def __init__(self, recorded: dict, corrupt: float, vocab_size: int, seed: int = 0) -> None:
        self.recorded = recorded  # prompt[:KEY_LEN] -> (prompt length, greedy output)
        self.corrupt, self.vocab_size = corrupt, vocab_size
        self.rng = np.random.default_rng(seed)

    def __call__(self, token_ids: list[int], max_drafts: int) -> list[int]:
        prompt_len, output = self.recorded[tuple(token_ids[:KEY_LEN])]
        done = len(token_ids) - prompt_len
        drafts = list(output[done:done + max_drafts])
        for i in range(len(drafts)):
            if self.rng.random() < self.corrupt:
                drafts[i] = (drafts[i] + 1 + int(self.rng.integers(self.vocab_size - 1))) % self.vocab_size
        return drafts


def zero_model_residual_branches(model) -> int:
    """Zeroes every decoder layer's o_proj and down_proj weight of model in place (see
    the module docstring; in place, so captured CUDA graphs read the zeros). Returns
    how many."""
    import torch
    zeroed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in ("o_proj", "down_proj"):
                continue
            method = getattr(getattr(module, "quant_method", None), "name", None)
            weight = getattr(module, "weight", None)
            if method != "unquantized" or weight is None or weight.dtype not in (
                    torch.bfloat16, torch.float16, torch.float32):
                raise SystemExit(f"{name}: only plain float Llama layers can be zeroed "
                                 f"(linear method {method!r})")
            weight.zero_()
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            zeroed += 1
    return zeroed


def zero_residual_branches(engine) -> int:
    """The target's residual branches zeroed (zero_model_residual_branches), checked to
    be every layer's two."""
    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        raise SystemExit("replay needs the in-process executor (one GPU, tensor_parallel_size 1)")
    zeroed = zero_model_residual_branches(runner.model)
    expected = 2 * engine.model_info.num_hidden_layers
    if zeroed != expected:
        raise SystemExit(f"zeroed {zeroed} projections, expected {expected} (o_proj and "
                         "down_proj of every layer): not a Llama layout")
    return zeroed


class DraftAcceptance:
    """Counts the verify outcomes the planner reports to its budget: successes and
    first rejections, so successes / (successes + rejections) estimates the chance that
    a draft is accepted given the ones before it were (the replay's 1 - corrupt)."""

    def __init__(self, budget) -> None:
        self.successes = self.rejections = 0
        observe = budget.observe

        def counting(req_id: str, num_drafts: int, num_accepted: int) -> None:
            if num_drafts:  # 0: the proposer had nothing, not a draft
                self.successes += num_accepted
                self.rejections += num_accepted < num_drafts
            observe(req_id, num_drafts, num_accepted)
        budget.observe = counting

    def snapshot(self) -> tuple[int, int]:
        return self.successes, self.rejections


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(3, vocab_size, size=(count, length)).tolist()
    keys = {tuple(p[:KEY_LEN]) for p in prompts}
    assert len(keys) == count, "prompt keys collide: use longer keys"
    return prompts


class Bench:
    def __init__(self, args) -> None:
        from pagoda import LLM
        self.args = args
        kwargs = dict(load_format="dummy", max_model_len=args.input_len + args.output_len + 64,
                      max_num_seqs=max(args.concurrency), seed=0,
                      speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
        if args.smoke:
            kwargs.update(device="cpu", kv_cache_memory=64 << 20)
        self.llm = LLM(args.model, **kwargs)
        self.engine = self.llm.llm_engine
        self.zeroed = zero_residual_branches(self.engine)
        self.planner = self.engine.scheduler.draft_planner
        self.counter = DraftAcceptance(self.planner.budget)
        self.vocab = self.engine.model_info.vocab_size

    def configure(self, mode: str, concurrency: int, proposer=None) -> None:
        scheduler = self.engine.scheduler
        scheduler.max_num_seqs = concurrency
        scheduler.draft_planner = None if mode == "off" else self.planner
        self.planner.budget.adaptive = mode == "adaptive"
        if proposer is not None:
            self.planner.host_proposer = proposer

    def generate(self, prompts) -> tuple[float, list[list[int]], dict]:
        from pagoda import SamplingParams
        params = SamplingParams(max_tokens=self.args.output_len, temperature=0, ignore_eos=True)
        stats = self.planner.stats
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        counted = self.counter.snapshot()
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        steps, drafted, accepted = (a - b for a, b in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
        successes, rejections = (a - b for a, b in zip(self.counter.snapshot(), counted))
        spec = {"acceptance": accepted / drafted if drafted else None,
                "draft_acceptance": (successes / (successes + rejections)
                                     if successes + rejections else None),
                "mean_accepted_length": 1 + accepted / steps if steps else None,
                "verify_steps": steps}
        return seconds, [o.outputs[0].token_ids for o in outs], spec

    def record(self, prompts, concurrency: int) -> dict:
        """The greedy run the replay proposer draws from (speculation off)."""
        self.configure("off", concurrency)
        _, outputs, _ = self.generate(prompts)
        return {tuple(p[:KEY_LEN]): (len(p), out) for p, out in zip(prompts, outputs)}

    def run(self, mode: str, prompts, concurrency: int, recorded: dict, corrupt: float) -> dict:
        self.configure(mode, concurrency, ReplayProposer(recorded, corrupt, self.vocab))
        seconds, outputs, spec = self.generate(prompts)
        tokens = sum(len(o) for o in outputs)
        same = [recorded[tuple(p[:KEY_LEN])][1] == o for p, o in zip(prompts, outputs)]
        return {"mode": mode, "concurrency": concurrency, "corrupt": corrupt, "seconds": seconds,
                "output_tokens": tokens, "ms_per_token": 1000 * seconds * concurrency / tokens,  # per stream
                "tok_per_s": tokens / seconds, "same_as_recorded": sum(same) / len(same), **spec}


def batch_one(bench: Bench) -> list[dict]:
    args = bench.args
    prompts = make_prompts(args.batch1_requests, args.input_len, bench.vocab, seed=1)
    bench.generate(prompts[:1])  # warm-up
    recorded = bench.record(prompts, 1)
    rows = []
    print(f"\n== batch 1: ms/token ({args.input_len} in, {args.output_len} out, k={args.k})")
    print("(always / adaptive: vLLM's acceptance, per-draft acceptance, mean accepted length;"
          " same: runs equal to the recording)")
    print(f"{'target':>7}{'off':>9}{'k always':>10}{'adaptive':>10}"
          f"{'always acc/draft/len':>22}{'adaptive acc/draft/len':>24}{'same':>6}")
    for target in (0.0, 0.5, 0.8, 0.95):
        row = {m: bench.run(m, prompts, 1, recorded, 1.0 - target)
               for m in ("off", "always", "adaptive")}
        rows.append({"target_acceptance": target, **row})
        print(f"{target:>7.2f}{row['off']['ms_per_token']:>9.2f}{row['always']['ms_per_token']:>10.2f}"
              f"{row['adaptive']['ms_per_token']:>10.2f}{acceptance_text(row['always']):>22}"
              f"{acceptance_text(row['adaptive']):>24}{same_text(row):>6}")
    return rows


def acceptance_text(run: dict) -> str:
    return "/".join("-" if run[key] is None else f"{run[key]:.2f}"
                    for key in ("acceptance", "draft_acceptance", "mean_accepted_length"))


def same_text(row: dict) -> str:
    """The smallest same_as_recorded of the row's runs (1.00: replay held)."""
    return f"{min(run['same_as_recorded'] for run in row.values() if isinstance(run, dict)):.2f}"


def throughput(bench: Bench) -> list[dict]:
    """One row per (concurrency, target): the recording and the "off" run are shared
    by a concurrency's targets (off does not depend on the drafts)."""
    args = bench.args
    rows = []
    print(f"\n== throughput (output tok/s) at target acceptance "
          f"{', '.join(f'{t:.2f}' for t in args.target)}")
    print(f"{'conc':>6}{'target':>7}{'off':>10}{'k always':>10}{'adaptive':>10}{'adaptive/off':>14}"
          f"{'always acc/draft/len':>22}{'adaptive acc/draft/len':>24}{'same':>6}")
    for concurrency in args.concurrency:
        count = max(2 * concurrency, 4)
        prompts = make_prompts(count, args.input_len, bench.vocab, seed=100 + concurrency)
        recorded = bench.record(prompts, concurrency)
        off = bench.run("off", prompts, concurrency, recorded, 0.0)
        for target in args.target:
            row = {"off": off, **{m: bench.run(m, prompts, concurrency, recorded, 1.0 - target)
                                  for m in ("always", "adaptive")}}
            rows.append({"concurrency": concurrency, "target_acceptance": target, **row})
            print(f"{concurrency:>6}{target:>7.2f}{off['tok_per_s']:>10.1f}"
                  f"{row['always']['tok_per_s']:>10.1f}{row['adaptive']['tok_per_s']:>10.1f}"
                  f"{row['adaptive']['tok_per_s'] / off['tok_per_s']:>13.2f}x"
                  f"{acceptance_text(row['always']):>22}{acceptance_text(row['adaptive']):>24}"
                  f"{same_text(row):>6}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="preset (dummy weights)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch1-requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--target", type=float, nargs="+", default=[0.0, 0.8],
                        help="target acceptances of the throughput runs (0: the adaptive "
                             "budget must not lose to speculation off)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, a few tokens")
    parser.add_argument("--output", default=None, help="JSON results file")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.input_len, args.output_len = "tiny-llama", 16, 64
        args.batch1_requests, args.concurrency = 2, [1, 4]
    bench = Bench(args)
    results = {"benchmark": "spec_decode_gpu", "model": args.model, "k": args.k,
               "machine": platform.platform(), "async_scheduling": bench.engine.async_scheduling,
               "target_residual_branches_zeroed": bench.zeroed,
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "batch_1": batch_one(bench), "throughput": throughput(bench)}
    try:
        import torch
        if torch.cuda.is_available():
            results["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    if args.output:
        write_json(args.output, results)
    bench.engine.shutdown()


if __name__ == "__main__":
    main()
