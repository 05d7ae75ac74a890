"""profile_step cpu: the embedded SmolLM2-135M (or `--skinny`, its depth with 64-wide
linears) on the CPU, LLM.generate with wall-clock timers around the engine's stages and
the model's parts, decode steps only, and a second pass counting torch operators per
step."""

from __future__ import annotations

import platform
import time

from benchmarks.harness.timing import StageTimer
from benchmarks.harness.workloads import config_dir


def instrument_cpu(llm, timers: StageTimer) -> None:
    """Wraps the engine's stages and the model's parts (in-process executor only)."""
    import pagoda.worker.model_runner as mr
    from pagoda.model import llama
    from pagoda.model.layers.activation import SiluAndMul
    from pagoda.model.layers.attention import Attention
    from pagoda.model.layers.embedding import VocabParallelEmbedding
    from pagoda.model.layers.layernorm import RMSNorm
    from pagoda.model.layers.linear import LinearBase

    engine = llm.llm_engine
    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        raise SystemExit("the cpu mode needs the in-process executor")
    for owner, attr, name in (
        (engine.scheduler, "schedule", "scheduler.schedule"),
        (engine.scheduler, "update_from_output", "scheduler.update_from_output"),
        (engine.output_processor, "process_outputs", "output processing (detokenize)"),
        (runner, "execute_model", "runner.execute_model"),
        (runner, "sample_tokens", "runner.sample_tokens"),
        (mr, "apply_scheduler_output", "  input batch update"),
        (mr, "build_step_inputs", "  step inputs (ids, positions, attn common)"),
        (runner.backend, "build_metadata", "  attention plan (build_metadata)"),
        (runner.model, "forward", "  forward"),
        (runner.model, "compute_logits", "  lm head (compute_logits)"),
        (mr, "build_sampling_metadata", "  sampling metadata"),
        (runner, "sampler", "  sampler"),
        (llama, "apply_rotary", "    rotary"),
    ):
        timers.wrap(owner, attr, name)
    if hasattr(llama, "cpu_fused_decode"):  # the whole decode step in one C call, when it applies
        timers.wrap(llama.cpu_fused_decode, "decode_step", "    fused decode step (all layers)")
    if hasattr(llama, "apply_rotary_tables"):  # the CPU form
        timers.wrap(llama, "apply_rotary_tables", "    rotary")
    timers.wrap_module_forwards(
        runner.model.model,
        {
            RMSNorm: "    rmsnorm (+ residual add)",
            Attention: "    attention (+ kv store)",
            SiluAndMul: "    silu_and_mul",
            VocabParallelEmbedding: "    embedding",
            LinearBase: "    linear",
        },
    )


def count_decode_steps_only(llm, timers: StageTimer, decode_steps: list[float]) -> None:
    """Counts a step only when every scheduled request computes one token."""
    engine = llm.llm_engine
    step, schedule = engine.step, engine.scheduler.schedule
    state = {"decode": False}

    def schedule_and_classify():
        out = schedule()
        state["decode"] = bool(out.num_scheduled_tokens) and all(
            n == 1 for n in out.num_scheduled_tokens.values()
        )
        timers.active = state["decode"]
        return out

    engine.scheduler.schedule = schedule_and_classify

    def timed_step():
        snapshot = dict(timers.totals), dict(timers.calls)
        timers.active = True  # the schedule timer itself; reset by the classifier
        start = time.perf_counter()
        outs = step()
        elapsed = time.perf_counter() - start
        if state["decode"]:
            decode_steps.append(elapsed)
        else:  # undo what a non-decode step added
            timers.totals.clear(), timers.calls.clear()
            timers.totals.update(snapshot[0]), timers.calls.update(snapshot[1])
        timers.active = False
        return outs

    engine.step = timed_step


def op_counts(llm, prompts, params, steps: int) -> dict:
    """torch.profiler over `steps` decode steps: operators per step and their self time."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    for prompt in prompts:
        engine.add_request(None, prompt, params)
    for _ in range(3):  # the prompts (one step each at these lengths), then decode
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    table = [
        {
            "op": evt.key,
            "calls_per_step": evt.count / steps,
            "self_ms_per_step": evt.self_cpu_time_total / 1000 / steps,
        }
        for evt in prof.key_averages()
        if evt.key.startswith(("aten::", "mkl"))
    ]
    table.sort(key=lambda r: -r["self_ms_per_step"])
    total_calls = sum(r["calls_per_step"] for r in table if r["op"].startswith("aten::"))
    return {"aten_calls_per_step": total_calls, "top": table[:25]}


# SmolLM2-135M's depth, attention shape and vocabulary; hidden 64 and MLP 64 wide.
SKINNY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 64,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_ORDER = [
    "scheduler.schedule",
    "runner.execute_model",
    "  input batch update",
    "  step inputs",
    "  attention plan",
    "  forward",
    "    embedding",
    "    rmsnorm",
    "    linear",
    "    rotary",
    "    attention",
    "    silu_and_mul",
    "    fused",
    "runner.sample_tokens",
    "  lm head",
    "  sampling metadata",
    "  sampler",
    "scheduler.update_from_output",
    "output processing",
]


def stage_rows(timers: StageTimer, steps: list[float]) -> list[dict]:
    n = len(steps)
    step_ms = 1000 * sum(steps) / n
    rows = [{"stage": "decode step (wall)", "ms_per_step": step_ms, "calls_per_step": 1.0}]
    rank = lambda name: next((i for i, p in enumerate(_ORDER) if name.startswith(p)), len(_ORDER))  # noqa: E731
    for name in sorted(timers.totals, key=rank):
        rows.append(
            {
                "stage": name,
                "ms_per_step": 1000 * timers.totals[name] / n,
                "calls_per_step": timers.calls[name] / n,
            }
        )
    by_name = {r["stage"]: r["ms_per_step"] for r in rows}
    parts = [v for k, v in by_name.items() if k.startswith("    ")]
    if "  forward" in by_name:
        at = max(i for i, r in enumerate(rows) if r["stage"].startswith(("  forward", "    "))) + 1
        rows.insert(
            at,
            {
                "stage": "    forward: other (python between parts)",
                "ms_per_step": by_name["  forward"] - sum(parts),
                "calls_per_step": 0,
            },
        )
    top = [
        "scheduler.schedule",
        "runner.execute_model",
        "runner.sample_tokens",
        "scheduler.update_from_output",
        "output processing (detokenize)",
    ]
    rows.append(
        {
            "stage": "engine: other (step minus the above)",
            "calls_per_step": 0,
            "ms_per_step": step_ms - sum(by_name.get(k, 0.0) for k in top),
        }
    )
    print(f"\n{n} decode steps, mean {step_ms:.2f} ms/step ({1000 / step_ms:.1f} steps/s)")
    for r in rows:
        print(
            f"  {r['stage']:48s} {r['ms_per_step']:8.3f} ms  "
            f"{100 * r['ms_per_step'] / step_ms:5.1f}%  x{r['calls_per_step']:.0f}"
        )
    return rows


def run_cpu(args) -> dict:
    import torch

    from pagoda import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    if args.smoke:
        args.max_tokens, args.profiler_steps = min(args.max_tokens, 16), 2
    kwargs = dict(max_num_seqs=max(args.batch, 1), max_model_len=1024, enable_prefix_caching=False)
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.skinny:
        from pagoda.model.tokenizer import embedded_model_path

        llm = LLM(
            config_dir(SKINNY_CONFIG, "pagoda-skinny-"),
            load_format="dummy",
            tokenizer=str(embedded_model_path()),
            kv_cache_memory=256 << 20,
            **kwargs,
        )
    else:
        llm = LLM(**kwargs)
    vocab = llm.llm_engine.model_info.vocab_size
    prompts = [
        [(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)]
        for i in range(args.batch)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    timers, steps = StageTimer(), []
    timers.active = False
    instrument_cpu(llm, timers)
    count_decode_steps_only(llm, timers, steps)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"generate: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s (timers on)"
    )
    rows = stage_rows(timers, steps)
    ops = op_counts(llm, prompts, params, args.profiler_steps)
    print(
        f"\ntorch.profiler, {args.profiler_steps} decode steps: "
        f"{ops['aten_calls_per_step']:.0f} aten calls per step; top by self time:"
    )
    for r in ops["top"][:15]:
        print(f"  {r['op']:40s} x{r['calls_per_step']:6.0f} {r['self_ms_per_step']:8.3f} ms")
    return {
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "tok_per_s_with_timers": tokens / elapsed,
        "stages": rows,
        "profiler": ops,
    }
