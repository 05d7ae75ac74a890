"""spec_decode replay: the Llama-3.1-8B shape with dummy weights, every layer's residual
branches zeroed, drafts replayed from a recorded greedy run with a chosen fraction
corrupted (ReplayProposer in place of the n-gram host proposer). Batch-1 ms/token at
target acceptances 0, 50, 80 and 95 %, and throughput at each concurrency, for off,
k always and adaptive."""

from __future__ import annotations

import numpy as np

from benchmarks.spec_bench.bench import Bench, make_prompts, zero_residual_branches
from benchmarks.spec_bench.common import KEY_LEN


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
        drafts = list(output[done : done + max_drafts])
        for i in range(len(drafts)):
            if self.rng.random() < self.corrupt:
                drafts[i] = (
                    drafts[i] + 1 + int(self.rng.integers(self.vocab_size - 1))
                ) % self.vocab_size
        return drafts


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


def acceptance_text(run: dict) -> str:
    return "/".join(
        "-" if run.get(key) is None else f"{run[key]:.2f}"
        for key in ("acceptance", "draft_acceptance", "mean_accepted_length")
    )


def _record(bench: Bench, prompts, concurrency: int) -> dict:
    """The greedy run the replay draws from: prompt key -> (prompt length, output)."""
    out = bench.run("off", prompts, concurrency)["outputs"]
    return {tuple(p[:KEY_LEN]): (len(p), o) for p, o in zip(prompts, out)}


def _replay(bench: Bench, mode: str, prompts, concurrency: int, recorded, corrupt) -> dict:
    row = bench.run(mode, prompts, concurrency, ReplayProposer(recorded, corrupt, bench.vocab))
    same = [recorded[tuple(p[:KEY_LEN])][1] == o for p, o in zip(prompts, row.pop("outputs"))]
    return {**row, "corrupt": corrupt, "same_as_recorded": sum(same) / len(same)}


def _same_text(row) -> str:  # the smallest same_as_recorded of the row's runs (1.00: replay held)
    return f"{min(r['same_as_recorded'] for r in row.values() if isinstance(r, dict)):.2f}"


def _batch_1_rows(bench: Bench, args) -> list[dict]:
    """ms/token at batch 1 for off, k always and adaptive at target acceptances 0, 50,
    80 and 95 %, after a warm-up with speculation on."""
    from pagoda import SamplingParams

    prompts = make_prompts(args.batch1_requests, args.input_len, bench.vocab, seed=1)
    bench.llm.generate(
        [{"prompt_token_ids": prompts[0]}],  # warm-up, speculation on
        SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    recorded = _record(bench, prompts, 1)
    batch_1 = []
    print(
        f"\n== batch 1: ms/token ({args.input_len} in, {args.output_len} out, k={args.k}); "
        "acc/draft/len: vLLM's acceptance, per-draft acceptance, mean accepted length"
    )
    print(
        f"{'target':>7}{'off':>9}{'k always':>10}{'adaptive':>10}"
        f"{'always acc/draft/len':>22}{'adaptive acc/draft/len':>24}{'same':>6}"
    )
    for target in (0.0, 0.5, 0.8, 0.95):
        row = {
            m: _replay(bench, m, prompts, 1, recorded, 1.0 - target)
            for m in ("off", "always", "adaptive")
        }
        batch_1.append({"target_acceptance": target, **row})
        print(
            f"{target:>7.2f}{row['off']['ms_per_token']:>9.2f}{row['always']['ms_per_token']:>10.2f}"
            f"{row['adaptive']['ms_per_token']:>10.2f}{acceptance_text(row['always']):>22}"
            f"{acceptance_text(row['adaptive']):>24}{_same_text(row):>6}"
        )
    return batch_1


def _throughput_rows(bench: Bench, args) -> list[dict]:
    """Output tok/s at each concurrency and --target acceptance: off (one run a
    concurrency) against k always and adaptive."""
    rows = []
    print(f"\n== throughput (output tok/s) at target acceptance {args.target}")
    print(
        f"{'conc':>6}{'target':>7}{'off':>10}{'k always':>10}{'adaptive':>10}{'adaptive/off':>14}"
        f"{'always acc/draft/len':>22}{'adaptive acc/draft/len':>24}{'same':>6}"
    )
    for concurrency in args.concurrency:  # the recording and "off" are shared by the targets
        prompts = make_prompts(
            max(2 * concurrency, 4), args.input_len, bench.vocab, seed=100 + concurrency
        )
        recorded = _record(bench, prompts, concurrency)
        off = _replay(bench, "off", prompts, concurrency, recorded, 0.0)
        for target in args.target:
            row = {
                "off": off,
                **{
                    m: _replay(bench, m, prompts, concurrency, recorded, 1.0 - target)
                    for m in ("always", "adaptive")
                },
            }
            rows.append({"concurrency": concurrency, "target_acceptance": target, **row})
            print(
                f"{concurrency:>6}{target:>7.2f}{off['tok_per_s']:>10.1f}"
                f"{row['always']['tok_per_s']:>10.1f}{row['adaptive']['tok_per_s']:>10.1f}"
                f"{row['adaptive']['tok_per_s'] / off['tok_per_s']:>13.2f}x"
                f"{acceptance_text(row['always']):>22}{acceptance_text(row['adaptive']):>24}"
                f"{_same_text(row):>6}"
            )
    return rows


def run_replay(args) -> dict:
    if args.smoke:
        args.model, args.input_len, args.output_len = "tiny-llama", 16, 64
        args.batch1_requests, args.concurrency = 2, [1, 4]
    bench = Bench(args, {"method": "ngram", "num_speculative_tokens": args.k})
    zero_residual_branches(
        bench.engine.executor.runner.model, 2 * bench.engine.model_info.num_hidden_layers
    )
    bench.counter = DraftAcceptance(bench.planner.budget)
    batch_1 = _batch_1_rows(bench, args)
    rows = _throughput_rows(bench, args)
    result = {
        "model": args.model,
        "k": args.k,
        "async_scheduling": bench.engine.async_scheduling,
        "target_residual_branches_zeroed": 2 * bench.engine.model_info.num_hidden_layers,
        "batch_1": batch_1,
        "throughput": rows,
    }
    bench.engine.shutdown()
    return result
