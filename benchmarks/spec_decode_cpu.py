"""Speculative decoding on CPU: the embedded SmolLM2-135M at batch 1, greedy.

Two workloads, each run with speculation off and on in the same process:
- grounded: edit/summarise a given text, so the answer copies the prompt: n-gram
  (prompt lookup) drafts, adaptive budget on (the default) and off;
- chat: free questions: layer-skip self-speculation (the target's first layers draft).
Prints per configuration: output tok/s, speedup over off, acceptance rate (accepted /
drafted), mean accepted length (tokens per verify step, the bonus included) and
whether the greedy output equals off's (it must). Writes JSON to --output.
`--async-scheduling on` runs every configuration with async scheduling, `both` adds
the layer-skip configurations with it to the synchronous ones (a layer-skip request
is scheduled optimistically then: core/optimistic_drafts.py).

    python benchmarks/spec_decode_cpu.py --output benchmarks/results/cpu-spec-decode.json
    python benchmarks/spec_decode_cpu.py --async-scheduling both --requests 3 --max-tokens 64
    python benchmarks/spec_decode_cpu.py --skip-ngram --confidence 0.3 0.5 0.7
    python benchmarks/spec_decode_cpu.py --smoke      # seconds: one short prompt each
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing the package
from result_file import write_json  # noqa: E402  (benchmarks/)

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
TASKS = ["Correct any mistakes in the text below and return the whole corrected text.",
         "Rewrite the text below exactly, as it is, in one paragraph.",
         "Summarise the text below, keeping its sentences as they are."]
QUESTIONS = ["Write a short story about a robot who learns to paint.",
             "Explain how a bicycle works to a ten year old.",
             "What are three good habits for staying healthy?",
             "Describe a walk along a beach at sunset."]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
LAYER_SKIP = {"method": "layer_skip", "num_layers": 29, "num_speculative_tokens": 2}


def grounded_messages(count: int) -> list[list[dict]]:
    out = []
    for i in range(count):
        text, task = TEXTS[i % len(TEXTS)], TASKS[i % len(TASKS)]
        out.append([{"role": "user", "content": f"{task}\n\n{text}"}])
    return out


def chat_messages(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]


def run_config(config, conversations, max_tokens: int) -> dict:
    """Batch 1: each conversation alone, greedy; tok/s over the timed requests.
    config: (speculative config or None, async scheduling)."""
    from pagoda import LLM, SamplingParams
    spec, async_scheduling = config
    llm = LLM(max_model_len=1024, kv_cache_memory=64 << 20, speculative_config=spec,
              async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    llm.chat(conversations[0], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    engine = llm.llm_engine
    before = engine.get_stats().spec_decode
    outputs, tokens, seconds = [], 0, 0.0
    for conversation in conversations:
        start = time.perf_counter()
        out = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
        outputs.append(out.token_ids)
    result = {"config": spec, "async_scheduling": async_scheduling, "output_tokens": tokens, "seconds": seconds,
              "tok_per_s": tokens / seconds, "outputs": outputs}
    after = engine.get_stats().spec_decode
    if after is not None:
        drafted = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
        accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        steps = after.num_drafts - (before.num_drafts if before else 0)
        result.update(draft_tokens=drafted, accepted_tokens=accepted, verify_steps=steps,
                      acceptance_rate=accepted / drafted if drafted else None,
                      mean_accepted_length=1 + accepted / steps if steps else None)
    engine.shutdown()
    return result


def compare(name: str, conversations, configs: dict, max_tokens: int) -> dict:
    runs = {label: run_config(spec, conversations, max_tokens) for label, spec in configs.items()}
    off = runs["off"]
    print(f"\n== {name}: {len(conversations)} requests, batch 1, {max_tokens} tokens max")
    print(f"{'config':<22}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'mean len':>10}  same as off")
    for label, run in runs.items():
        run["speedup"] = run["tok_per_s"] / off["tok_per_s"]
        run["same_as_off"] = run["outputs"] == off["outputs"]
        rate, length = run.get("acceptance_rate"), run.get("mean_accepted_length")
        print(f"{label:<22}{run['tok_per_s']:>8.1f}{run['speedup']:>8.2f}x"
              f"{'' if rate is None else f'{rate:.2f}':>8}"
              f"{'' if length is None else f'{length:.2f}':>10}  {run['same_as_off']}")
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
        configs.update({f"off{suffix}": (None, on), f"layer_skip adaptive{suffix}": (LAYER_SKIP, on),
                        f"layer_skip k=2 always{suffix}": ({**LAYER_SKIP, "adaptive": False}, on)})
        if confidences:
            configs[f"k=4 always{suffix}"] = (
                {**LAYER_SKIP, "adaptive": False, "num_speculative_tokens": 4}, on)
        for threshold in confidences:
            configs[f"adaptive conf {threshold}{suffix}"] = (
                {**LAYER_SKIP, "draft_confidence_threshold": threshold}, on)
            for k in (2, 4):
                configs[f"k={k} conf {threshold}{suffix}"] = (
                    {**LAYER_SKIP, "adaptive": False, "num_speculative_tokens": k,
                     "draft_confidence_threshold": threshold}, on)
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6, help="requests per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--async-scheduling", choices=["off", "on", "both"], default="off",
                        help="async scheduling for every run (on), or layer-skip both ways")
    parser.add_argument("--confidence", type=float, nargs="*", default=[],
                        help="layer-skip draft confidence thresholds to compare")
    parser.add_argument("--skip-ngram", action="store_true", help="the layer-skip workload only")
    parser.add_argument("--smoke", action="store_true", help="one short request each: checks it runs")
    parser.add_argument("--output", default=None, help="JSON results file")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.max_tokens = 1, 8
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    on = args.async_scheduling == "on"
    results = {
        "benchmark": "spec_decode_cpu", "machine": platform.platform(),
        "processor": platform.processor(), "torch_threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "async_scheduling": args.async_scheduling,
    }
    if not args.skip_ngram:
        results["grounded_ngram"] = compare("grounded (n-gram)", grounded_messages(args.requests), {
            "off": (None, on), "ngram adaptive": (NGRAM, on),
            "ngram k=4 always": ({**NGRAM, "adaptive": False}, on),
        }, args.max_tokens)
    results["chat_layer_skip"] = compare(
        "chat (layer skip, 29 of 30 layers)", chat_messages(args.requests),
        layer_skip_configs(args.async_scheduling, args.confidence), args.max_tokens)
    if args.output:
        write_json(args.output, results)


if __name__ == "__main__":
    main()
