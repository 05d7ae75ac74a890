"""Speculative decoding, with speculation off and on in the same run, four ways.

    python -m benchmarks.spec_decode cpu                       # embedded SmolLM2, batch 1, CPU
    python -m benchmarks.spec_decode replay                    # GPU, controlled acceptance
    python -m benchmarks.spec_decode draft --draft matched     # GPU, a draft model
    python -m benchmarks.spec_decode serve                     # through `pagoda serve`
    python -m benchmarks.spec_decode replay --smoke            # cpu/replay/draft: --smoke

cpu     The embedded SmolLM2-135M at batch 1, greedy, two workloads: grounded (edit or
        summarise a given text, so the answer copies the prompt: n-gram drafts, adaptive
        budget on and off) and chat (free questions: layer-skip self-speculation, the
        target's first 29 of 30 layers draft). Per configuration: output tok/s, speedup
        over off, acceptance (accepted / drafted), mean accepted length (tokens per verify
        step, the bonus included), and whether the greedy output equals off's (it must).
        `--async-scheduling on` runs every configuration with it, `both` adds the
        layer-skip configurations with it; `--confidence T ...` adds draft-confidence
        thresholds.
replay  Llama-3.1-8B shape, dummy weights, at controlled acceptance. Random weights give
        nothing worth drafting, so drafts come from a benchmark-only proposer
        (ReplayProposer, installed in place of an "ngram" engine's host proposer): it
        replays a recorded greedy run of the same target on the same prompts with a chosen
        fraction of draft tokens corrupted. Replay needs greedy tokens that do not depend
        on the step's shape, which random weights do not give (a verify step rounds
        differently from a decode step and flips near-ties), so every layer's o_proj and
        down_proj weights are zeroed: each layer adds exactly 0 to the residual, the next
        token is a function of the current one only, and every kernel still does its full
        work. Batch 1: ms/token at target acceptance 0, 50, 80, 95 % for off, k always and
        adaptive ("acceptance" is vLLM's; "draft_acceptance" the chance that a draft is
        accepted given the ones before were). Throughput at concurrency 1..256 at
        `--target` acceptances: off vs adaptive (and k always); at 0 % adaptive should
        stay within 2 % of off.
draft   A draft model (`--draft`): `matched` is the target's width with `--draft-layers`
        layers sharing its embedding, final norm and LM head, residual branches zeroed in
        both models, so the draft is always right while every kernel does its full work
        (the ceiling of what drafting buys at this draft cost); a preset name (e.g.
        llama-3.2-1b) drafts with random weights, almost always wrong (what drafting costs).
        Batch-1 ms/token and tok/s at each concurrency for off, always and adaptive.
serve   Through a real `pagoda serve`, measured by `pagoda bench serve` on the grounded
        prompts (chat-templated, sent as a custom JSONL dataset): TTFT / TPOT percentiles,
        output throughput and the server's acceptance, for off and n-gram. Server flags
        after --server-flags (default: --device cpu).

In every engine mode one engine serves all configurations: "off" detaches the
scheduler's draft planner, "always" turns the adaptive budget off, "adaptive" is the
default. Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from benchmarks.harness.results import write_result
from benchmarks.harness.server import bench_serve, serve
from benchmarks.harness.workloads import config_dir

TEXTS = [
    "The library opens at nine in the morning and closes at six in the evening. "
    "On Saturdays it closes at noon, and on Sundays it is closed all day. Members can "
    "borrow up to five books at a time for three weeks, and renew them twice online.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the "
    "warm water slowly and knead the dough for ten minutes until it is smooth. Leave it "
    "to rise for an hour, shape it, and bake it for thirty minutes at two hundred degrees.",
    "The meeting on Tuesday covered three topics: the budget for next year, the new "
    "office in Lyon, and the hiring plan. The budget was approved, the office opens in "
    "March, and the hiring plan will be discussed again at the next meeting.",
    "Our train leaves the central station at eight fifteen and arrives in the city at "
    "ten forty. Tickets cost twenty euros each way, and children under twelve travel "
    "free when they are with an adult who holds a ticket.",
]
TASKS = [
    "Correct any mistakes in the text below and return the whole corrected text.",
    "Rewrite the text below exactly, as it is, in one paragraph.",
    "Summarise the text below, keeping its sentences as they are.",
]
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works to a ten year old.",
    "What are three good habits for staying healthy?",
    "Describe a walk along a beach at sunset.",
]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
LAYER_SKIP = {"method": "layer_skip", "num_layers": 29, "num_speculative_tokens": 2}
KEY_LEN = 8  # replay prompts differ in their first KEY_LEN tokens: the replay's lookup key


def grounded_messages(count: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{TEXTS[i % len(TEXTS)]}"}]
        for i in range(count)
    ]


def chat_messages(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]


def draft_counts(stats) -> tuple[int, int, int]:
    """(verify steps, draft tokens, accepted tokens) of spec-decode stats (None: zeros)."""
    if stats is None:
        return 0, 0, 0
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def spec_delta(after: tuple, before: tuple) -> dict:
    """Acceptance figures between two draft_counts."""
    steps, drafted, accepted = (a - b for a, b in zip(after, before))
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": steps,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
    }


# ================================================================ cpu ==============
def cpu_config(config, conversations, max_tokens: int) -> dict:
    """Batch 1: each conversation alone, greedy; tok/s over the timed requests.
    config: (speculative config or None, async scheduling)."""
    from pagoda import LLM, SamplingParams

    spec, async_scheduling = config
    llm = LLM(
        max_model_len=1024,
        kv_cache_memory=64 << 20,
        speculative_config=spec,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.chat(conversations[0], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    engine = llm.llm_engine
    before = draft_counts(engine.get_stats().spec_decode)
    outputs, tokens, seconds = [], 0, 0.0
    for conversation in conversations:
        start = time.perf_counter()
        out = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        outputs.append(out.token_ids)
    result = {
        "config": spec,
        "async_scheduling": async_scheduling,
        "output_tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "outputs": outputs,
    }
    after = engine.get_stats().spec_decode
    if after is not None:
        delta = spec_delta(draft_counts(after), before)
        result.update(
            draft_tokens=delta["draft_tokens"],
            accepted_tokens=delta["accepted_tokens"],
            verify_steps=delta["verify_steps"],
            acceptance_rate=delta["acceptance"],
            mean_accepted_length=delta["mean_accepted_length"],
        )
    engine.shutdown()
    return result


def cpu_compare(name: str, conversations, configs: dict, max_tokens: int) -> dict:
    runs = {label: cpu_config(spec, conversations, max_tokens) for label, spec in configs.items()}
    off = runs["off"]
    print(f"\n== {name}: {len(conversations)} requests, batch 1, {max_tokens} tokens max")
    print(f"{'config':<22}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'mean len':>10}  same as off")
    for label, run in runs.items():
        run["speedup"] = run["tok_per_s"] / off["tok_per_s"]
        run["same_as_off"] = run["outputs"] == off["outputs"]
        rate, length = run.get("acceptance_rate"), run.get("mean_accepted_length")
        print(
            f"{label:<22}{run['tok_per_s']:>8.1f}{run['speedup']:>8.2f}x"
            f"{'' if rate is None else f'{rate:.2f}':>8}"
            f"{'' if length is None else f'{length:.2f}':>10}  {run['same_as_off']}"
        )
    for run in runs.values():
        del run["outputs"]
    return runs


def layer_skip_configs(async_mode: str, confidences: list[float]) -> dict:
    """label -> (speculative config, async scheduling) of the layer-skip workload; each
    confidence threshold adds the adaptive budget, k = 2 and k = 4 (always drafting)
    with it, beside k = 4 without one."""
    ways = {"off": [False], "on": [True], "both": [False, True]}[async_mode]
    configs = {}
    for on in ways:
        suffix = " async" if async_mode == "both" and on else ""
        configs.update(
            {
                f"off{suffix}": (None, on),
                f"layer_skip adaptive{suffix}": (LAYER_SKIP, on),
                f"layer_skip k=2 always{suffix}": ({**LAYER_SKIP, "adaptive": False}, on),
            }
        )
        if confidences:
            configs[f"k=4 always{suffix}"] = (
                {**LAYER_SKIP, "adaptive": False, "num_speculative_tokens": 4},
                on,
            )
        for threshold in confidences:
            configs[f"adaptive conf {threshold}{suffix}"] = (
                {**LAYER_SKIP, "draft_confidence_threshold": threshold},
                on,
            )
            for k in (2, 4):
                configs[f"k={k} conf {threshold}{suffix}"] = (
                    {
                        **LAYER_SKIP,
                        "adaptive": False,
                        "num_speculative_tokens": k,
                        "draft_confidence_threshold": threshold,
                    },
                    on,
                )
    return configs


def run_cpu(args) -> dict:
    import torch

    if args.smoke:
        args.requests, args.max_tokens = 1, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    on = args.async_scheduling == "on"
    results = {"torch_threads": torch.get_num_threads(), "async_scheduling": args.async_scheduling}
    if not args.skip_ngram:
        results["grounded_ngram"] = cpu_compare(
            "grounded (n-gram)",
            grounded_messages(args.requests),
            {
                "off": (None, on),
                "ngram adaptive": (NGRAM, on),
                "ngram k=4 always": ({**NGRAM, "adaptive": False}, on),
            },
            args.max_tokens,
        )
    results["chat_layer_skip"] = cpu_compare(
        "chat (layer skip, 29 of 30 layers)",
        chat_messages(args.requests),
        layer_skip_configs(args.async_scheduling, args.confidence),
        args.max_tokens,
    )
    return results


# ================================================================ replay / draft ===
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


def zero_residual_branches(model, expected: int) -> None:
    """Zeroes every decoder layer's o_proj and down_proj weight (and bias) in place, so
    captured CUDA graphs read the zeros; refuses anything but plain float Llama layers
    and a count other than `expected`."""
    import torch

    zeroed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] not in ("o_proj", "down_proj"):
                continue
            method = getattr(getattr(module, "quant_method", None), "name", None)
            weight = getattr(module, "weight", None)
            if (
                method != "unquantized"
                or weight is None
                or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            ):
                raise SystemExit(
                    f"{name}: only plain float Llama layers can be zeroed "
                    f"(linear method {method!r})"
                )
            weight.zero_()
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            zeroed += 1
    if zeroed != expected:
        raise SystemExit(
            f"zeroed {zeroed} projections, expected {expected} (o_proj and "
            "down_proj of every layer): not a Llama layout"
        )


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


def make_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    prompts = np.random.default_rng(seed).integers(3, vocab_size, size=(count, length)).tolist()
    assert len({tuple(p[:KEY_LEN]) for p in prompts}) == count, "prompt keys collide"
    return prompts


class Bench:
    """One engine with a draft planner; `run` times one configuration."""

    def __init__(self, args, speculative_config: dict) -> None:
        from pagoda import LLM

        self.args = args
        kwargs = dict(
            load_format="dummy",
            max_model_len=args.input_len + args.output_len + 64,
            max_num_seqs=max(args.concurrency),
            seed=0,
            speculative_config=speculative_config,
        )
        if args.smoke:
            kwargs.update(device="cpu", kv_cache_memory=64 << 20)
        if getattr(args, "async_scheduling", None) is not None:
            kwargs["async_scheduling"] = args.async_scheduling == "on"
        self.llm = LLM(args.model, **kwargs)
        self.engine = self.llm.llm_engine
        self.planner = self.engine.scheduler.draft_planner
        self.vocab = self.engine.model_info.vocab_size
        self.counter = None

    def run(self, mode: str, prompts, concurrency: int, proposer=None) -> dict:
        from pagoda import SamplingParams

        scheduler = self.engine.scheduler
        scheduler.max_num_seqs = concurrency
        scheduler.draft_planner = None if mode == "off" else self.planner
        self.planner.budget.adaptive = mode == "adaptive"
        if proposer is not None:
            self.planner.host_proposer = proposer
        params = SamplingParams(max_tokens=self.args.output_len, temperature=0, ignore_eos=True)
        before = draft_counts(self.planner.stats)
        counted = (self.counter.successes, self.counter.rejections) if self.counter else (0, 0)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        outputs = [o.outputs[0].token_ids for o in outs]
        tokens = sum(len(o) for o in outputs)
        delta = spec_delta(draft_counts(self.planner.stats), before)
        row = {
            "mode": mode,
            "concurrency": concurrency,
            "seconds": seconds,
            "output_tokens": tokens,
            "ms_per_token": 1000 * seconds * concurrency / tokens,
            "tok_per_s": tokens / seconds,
            "acceptance": delta["acceptance"],
            "mean_accepted_length": delta["mean_accepted_length"],
            "verify_steps": delta["verify_steps"],
            "outputs": outputs,
        }
        if self.counter:
            successes = self.counter.successes - counted[0]
            rejections = self.counter.rejections - counted[1]
            row["draft_acceptance"] = (
                successes / (successes + rejections) if successes + rejections else None
            )
        return row


def acceptance_text(run: dict) -> str:
    return "/".join(
        "-" if run.get(key) is None else f"{run[key]:.2f}"
        for key in ("acceptance", "draft_acceptance", "mean_accepted_length")
    )


def run_replay(args) -> dict:
    from pagoda import SamplingParams

    if args.smoke:
        args.model, args.input_len, args.output_len = "tiny-llama", 16, 64
        args.batch1_requests, args.concurrency = 2, [1, 4]
    bench = Bench(args, {"method": "ngram", "num_speculative_tokens": args.k})
    zero_residual_branches(
        bench.engine.executor.runner.model, 2 * bench.engine.model_info.num_hidden_layers
    )
    bench.counter = DraftAcceptance(bench.planner.budget)

    def record(prompts, concurrency):  # the greedy run the replay draws from
        out = bench.run("off", prompts, concurrency)["outputs"]
        return {tuple(p[:KEY_LEN]): (len(p), o) for p, o in zip(prompts, out)}

    def replay(mode, prompts, concurrency, recorded, corrupt):
        row = bench.run(mode, prompts, concurrency, ReplayProposer(recorded, corrupt, bench.vocab))
        same = [recorded[tuple(p[:KEY_LEN])][1] == o for p, o in zip(prompts, row.pop("outputs"))]
        return {**row, "corrupt": corrupt, "same_as_recorded": sum(same) / len(same)}

    def same_text(row):  # the smallest same_as_recorded of the row's runs (1.00: replay held)
        return f"{min(r['same_as_recorded'] for r in row.values() if isinstance(r, dict)):.2f}"

    prompts = make_prompts(args.batch1_requests, args.input_len, bench.vocab, seed=1)
    bench.llm.generate(
        [{"prompt_token_ids": prompts[0]}],  # warm-up, speculation on
        SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    recorded = record(prompts, 1)
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
            m: replay(m, prompts, 1, recorded, 1.0 - target) for m in ("off", "always", "adaptive")
        }
        batch_1.append({"target_acceptance": target, **row})
        print(
            f"{target:>7.2f}{row['off']['ms_per_token']:>9.2f}{row['always']['ms_per_token']:>10.2f}"
            f"{row['adaptive']['ms_per_token']:>10.2f}{acceptance_text(row['always']):>22}"
            f"{acceptance_text(row['adaptive']):>24}{same_text(row):>6}"
        )
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
        recorded = record(prompts, concurrency)
        off = replay("off", prompts, concurrency, recorded, 0.0)
        for target in args.target:
            row = {
                "off": off,
                **{
                    m: replay(m, prompts, concurrency, recorded, 1.0 - target)
                    for m in ("always", "adaptive")
                },
            }
            rows.append({"concurrency": concurrency, "target_acceptance": target, **row})
            print(
                f"{concurrency:>6}{target:>7.2f}{off['tok_per_s']:>10.1f}"
                f"{row['always']['tok_per_s']:>10.1f}{row['adaptive']['tok_per_s']:>10.1f}"
                f"{row['adaptive']['tok_per_s'] / off['tok_per_s']:>13.2f}x"
                f"{acceptance_text(row['always']):>22}{acceptance_text(row['adaptive']):>24}"
                f"{same_text(row):>6}"
            )
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


def matched_draft_config(target: str, num_layers: int) -> dict:
    """The target preset's shape with num_layers layers (the engine gives a dummy
    target's draft random weights of that shape)."""
    from pagoda.model.presets import get_preset

    arch = get_preset(target)
    return {
        "architectures": [arch.architecture],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.intermediate_size,
        "vocab_size": arch.vocab_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def run_draft(args) -> dict:
    import torch

    if args.smoke:
        args.model, args.input_len, args.output_len = "tiny-llama", 16, 12
        args.batch1_requests, args.concurrency, args.draft_layers = 2, [1, 4], 1
    matched = args.draft == "matched"
    draft = (
        config_dir(matched_draft_config(args.model, args.draft_layers), "matched-draft-")
        if matched
        else args.draft
    )
    bench = Bench(args, {"model": draft, "num_speculative_tokens": args.k})
    engine = bench.engine
    if matched:  # neither model writes to the residual; the draft reads the target's head
        runner = engine.executor.runner
        zero_residual_branches(runner.model, 2 * engine.model_info.num_hidden_layers)
        zero_residual_branches(runner.draft.model, 2 * runner.draft.arch.num_hidden_layers)
        theirs, mine = (
            dict(runner.model.named_parameters()),
            dict(runner.draft.model.named_parameters()),
        )
        with torch.no_grad():
            for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                mine[name].copy_(theirs[name])
    info = engine.model_info
    fraction = info.draft_weight_bytes / info.weight_bytes
    print(
        f"\n== {args.model} + draft {args.draft} (k={args.k}, async scheduling "
        f"{'on' if engine.async_scheduling else 'off'}, draft bytes {fraction:.3f} of the "
        f"target's), {args.input_len} in / {args.output_len} out"
    )
    print(
        f"{'conc':>6}{'off':>10}{'always':>10}{'adaptive':>10}{'adapt/off':>10}"
        f"{'accept':>8}{'mean len':>9}   (batch 1: ms/token; else tok/s)"
    )
    bench.run("off", make_prompts(1, args.input_len, bench.vocab, 0), 1)  # warm-up
    rows = []
    for concurrency in args.concurrency:
        count = args.batch1_requests if concurrency == 1 else 2 * concurrency
        prompts = make_prompts(count, args.input_len, bench.vocab, seed=concurrency)
        row = {m: bench.run(m, prompts, concurrency) for m in ("off", "always", "adaptive")}
        same = row["off"]["outputs"] == row["always"]["outputs"] == row["adaptive"]["outputs"]
        for r in row.values():
            del r["outputs"], r["verify_steps"]
        rows.append({"concurrency": concurrency, "outputs_equal": same, **row})
        key = "ms_per_token" if concurrency == 1 else "tok_per_s"
        ratio = (
            row["off"][key] / row["adaptive"][key]
            if concurrency == 1
            else row["adaptive"][key] / row["off"][key]
        )
        acc, length = row["always"]["acceptance"], row["always"]["mean_accepted_length"]
        print(
            f"{concurrency:>6}{row['off'][key]:>10.2f}{row['always'][key]:>10.2f}"
            f"{row['adaptive'][key]:>10.2f}{ratio:>9.2f}x{acc or 0:>8.2f}{length or 0:>9.2f}"
            f"{'' if same else '   OUTPUTS DIFFER'}"
        )
    result = {
        "model": args.model,
        "draft": args.draft,
        "draft_layers": args.draft_layers if matched else None,
        "k": args.k,
        "draft_weight_fraction": fraction,
        "async_scheduling": engine.async_scheduling,
        "rows": rows,
    }
    engine.shutdown()
    return result


# ================================================================ serve ============
REPORTED = (
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "output_throughput",
    "completed",
    "failed",
)


def run_serve(args) -> dict:
    from pagoda.model.tokenizer import apply_chat_template, embedded_model_path, load_tokenizer

    workdir = tempfile.mkdtemp(prefix="spec-serve-")
    dataset = os.path.join(workdir, "grounded.jsonl")
    tokenizer = load_tokenizer(embedded_model_path())
    with open(dataset, "w", encoding="utf-8") as f:  # chat-templated grounded prompts
        for messages in grounded_messages(args.num_prompts):
            prompt = tokenizer.decode(apply_chat_template(tokenizer, messages, True, None, None))
            f.write(json.dumps({"prompt": prompt, "output_tokens": args.output_tokens}) + "\n")
    rows = []
    for name, spec in {"off": None, "ngram": NGRAM}.items():
        flags = list(args.server_flags)
        if spec is not None:
            flags += ["--speculative-config", json.dumps(spec)]
        with serve(flags, os.path.join(workdir, f"{name}.log")) as server:
            for concurrency in args.concurrency:
                label = f"{name}-c{concurrency}"
                report = bench_serve(
                    server.url,
                    [
                        "--dataset-name",
                        "custom",
                        "--dataset-path",
                        dataset,
                        "--num-prompts",
                        str(args.num_prompts),
                        "--max-concurrency",
                        str(concurrency),
                        "--temperature",
                        "0",
                        "--seed",
                        "0",
                        "--label",
                        label,
                    ],
                    workdir,
                    f"{label}.json",
                )
                metrics = report.get("server_metrics") or {}
                rows.append(
                    {
                        "config": name,
                        "concurrency": concurrency,
                        **{key: report.get(key) for key in REPORTED},
                        "acceptance": metrics.get("spec_decode_acceptance_rate"),
                        "mean_accepted_length": metrics.get("spec_decode_mean_accepted_length"),
                    }
                )
    print(
        f"\n{'config':>8}{'conc':>6}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
        f"{'tok/s':>9}{'accept':>8}{'mean len':>9}"
    )
    for row in rows:
        print(
            f"{row['config']:>8}{row['concurrency']:>6}{row['p50_ttft_ms']:>10.1f}"
            f"{row['p99_ttft_ms']:>8.1f}{row['p50_tpot_ms']:>10.1f}{row['p99_tpot_ms']:>8.1f}"
            f"{row['output_throughput']:>9.1f}{row['acceptance'] or 0:>8.2f}"
            f"{row['mean_accepted_length'] or 0:>9.2f}"
        )
    return {
        "server_flags": args.server_flags,
        "speculative_config": NGRAM,
        "num_prompts": args.num_prompts,
        "output_tokens": args.output_tokens,
        "rows": rows,
    }


# ================================================================ command line =====
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)

    def mode(name: str, help_text: str):
        p = modes.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--out",
            "--output",
            dest="out",
            default=f"bench_results/spec-{name}.json",
            help="JSON result file",
        )
        return p

    p = mode("cpu", "embedded SmolLM2 at batch 1: n-gram and layer-skip drafts")
    p.add_argument("--requests", type=int, default=6, help="requests per workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--async-scheduling",
        choices=["off", "on", "both"],
        default="off",
        help="async scheduling for every run (on), or layer-skip both ways",
    )
    p.add_argument(
        "--confidence",
        type=float,
        nargs="*",
        default=[],
        help="layer-skip draft confidence thresholds to compare",
    )
    p.add_argument("--skip-ngram", action="store_true", help="the layer-skip workload only")
    p.add_argument("--smoke", action="store_true", help="one short request each: checks it runs")
    for name, help_text, conc in (
        (
            "replay",
            "replayed drafts at controlled acceptance (zeroed residual branches)",
            [1, 8, 32, 128, 256],
        ),
        ("draft", "a draft model: matched (always right) or a preset (random)", [1, 8, 32, 128]),
    ):
        p = mode(name, help_text)
        p.add_argument("--model", default="llama-3.1-8b", help="target preset (dummy weights)")
        p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--batch1-requests", type=int, default=4)
        p.add_argument("--concurrency", type=int, nargs="+", default=conc)
        p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, a few tokens")
        if name == "replay":
            p.add_argument(
                "--target",
                type=float,
                nargs="+",
                default=[0.0, 0.8],
                help="target acceptances of the throughput runs",
            )
        else:
            p.add_argument("--draft", default="matched", help="'matched' or a preset name")
            p.add_argument(
                "--draft-layers", type=int, default=2, help="layers of the matched draft"
            )
            p.add_argument(
                "--async-scheduling",
                choices=["on", "off"],
                default=None,
                help="default: the engine's (on for CUDA)",
            )
    p = mode("serve", "through `pagoda serve`, measured by `pagoda bench serve`")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument(
        "--server-flags",
        nargs=argparse.REMAINDER,
        default=["--device", "cpu"],
        help="flags for `pagoda serve` (default: --device cpu); the last option",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    run = {"cpu": run_cpu, "replay": run_replay, "draft": run_draft, "serve": run_serve}[args.mode]
    result = run(args)
    write_result(args.out, {"benchmark": f"spec_decode {args.mode}", "args": vars(args), **result})


if __name__ == "__main__":
    main()
