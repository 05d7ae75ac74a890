"""spec_decode cpu: the embedded SmolLM2-135M at batch 1, greedy, speculation off and on:
grounded prompts with n-gram drafts (adaptive budget on and off), chat prompts with
layer-skip self-speculation (and draft-confidence thresholds). Per configuration: tok/s,
speedup over off, acceptance, mean accepted length, and whether the output equals off's."""

from __future__ import annotations

import time

from benchmarks.spec_bench.common import (
    LAYER_SKIP,
    NGRAM,
    chat_messages,
    draft_counts,
    grounded_messages,
    spec_delta,
)


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
