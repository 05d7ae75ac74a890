"""profile_step timeline: one request (or a batch) decoding as served (CUDA graphs, async
scheduling): the median gap between tokens without a profiler, then steps under
torch.profiler: device busy and idle time per step, the largest idle gaps with the host
work around each, host time per op / runtime call, and each kernel's increment after its
predecessor. Writes the chrome trace too."""

from __future__ import annotations

import statistics

from benchmarks.harness.traces import chrome_trace, timeline
from benchmarks.harness.workloads import random_prompts, token_arrival_times
from benchmarks.profile_bench.common import profiler_activities


def print_timeline(result: dict) -> None:
    print(
        f"\ntokens: median gap {result['ms_per_token']:.3f} ms "
        f"(batch {result['batch']}, {result['preset']})"
    )
    a = result["profile"]
    if a.get("device_spans"):
        print(
            f"profiled {result['steps']} steps: device busy {a['busy_us_per_step']:.1f} us "
            f"a step, idle {a['idle_us_per_step']:.1f} us, "
            f"{a['gaps_over_5us_per_step']:.1f} gaps > 5 us a step"
        )
        for g in a["largest_gaps"]:
            print(f"  gap {g['us']:8.1f} us  {g['device_before'][:40]} -> {g['device_after'][:40]}")
            print(f"      host ended before: {g['host_ended_before']}")
            print(f"      host spanning:     {g['host_spanning']}")
            print(f"      host started in:   {g['host_started_in_gap'][:6]}")
        print(
            f"\n{'kernel':<42}{'after':<42}{'n/step':>7}{'incr us':>8}{'dur us':>8}{'early us':>9}"
        )
        for r in a["increments"][:20]:
            print(
                f"{r['kernel']:<42}{r['after']:<42}{r['per_step']:>7.1f}"
                f"{r['increment_us']:>8.2f}{r['duration_us']:>8.2f}{r['head_start_us']:>9.2f}"
            )
    print(f"\n{'host op / runtime call':<70}{'cat':>14}{'calls':>7}{'us/step':>10}")
    for r in a["host_table"][:25]:
        print(
            f"{r['name'][:69]:<70}{r['cat'][:13]:>14}{r['per_step']:>7.1f}{r['us_per_step']:>10.1f}"
        )


def run_timeline(args) -> dict:
    import numpy as np
    import torch

    from pagoda import LLM, SamplingParams

    if args.smoke:
        args.max_model_len, args.prompt, args.tokens, args.steps = 256, 16, 8, 4
    extra = (
        dict(device="cpu", dtype="float32", kv_cache_memory=1 << 24)
        if args.smoke
        else dict(dtype="bfloat16")
    )
    preset = "tiny-llama" if args.smoke else args.preset
    llm = LLM(
        preset,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        skip_tokenizer_init=True,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **extra,
    )
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [args.prompt] * args.batch, engine.model_info.vocab_size)
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=8, **greedy),
        use_tqdm=False,
    )  # warm
    for i, p in enumerate(prompts):
        engine.add_request(
            f"t{i}", p, SamplingParams(max_tokens=args.tokens, **greedy), output_kind="delta"
        )
    arrivals = token_arrival_times(engine)
    per_token = [b - a for a, b in zip(arrivals[:: args.batch], arrivals[args.batch :: args.batch])]
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(max_tokens=args.steps + 16, **greedy))
    for _ in range(6):  # prefill and the first decode steps: not profiled
        engine.step()
    on_cuda = torch.cuda.is_available()
    with torch.profiler.profile(activities=profiler_activities(on_cuda)) as prof:
        for _ in range(args.steps):
            engine.step()
        if on_cuda:
            torch.cuda.synchronize()
    trace = chrome_trace(prof, args.trace)
    while engine.has_unfinished_requests():
        engine.step()
    result = {
        "preset": preset,
        "batch": args.batch,
        "steps": args.steps,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "ms_per_token": statistics.median(per_token) * 1e3,
        "profile": timeline(trace, args.steps),
        "trace": args.trace,
    }
    print_timeline(result)
    engine.shutdown()
    return result
