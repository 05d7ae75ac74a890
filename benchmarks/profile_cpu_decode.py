"""Where a CPU decode step's time goes: engine stages and model op kinds, per step.

    .venv/bin/python benchmarks/profile_cpu_decode.py --threads 2 --batch 1
    .venv/bin/python benchmarks/profile_cpu_decode.py --threads 2 --batch 32
    .venv/bin/python benchmarks/profile_cpu_decode.py --threads 1 --skinny   # overhead only
    .venv/bin/python benchmarks/profile_cpu_decode.py --smoke     # seconds: checks it runs

Runs LLM.generate (the embedded SmolLM2-135M, float32 unless --quantization says
otherwise) over `--batch` prompts of `--prompt-len` tokens, `--max-tokens` out, greedy,
EOS ignored, with wall-clock timers wrapped around the engine's stages (scheduler,
input preparation, attention metadata, forward, logits, sampling metadata, sampler,
scheduler update, output processing) and around the model's small parts (linears,
norms with their residual add, rotary, attention with its KV store, activation,
embedding). Timers are inclusive and nest: "forward" contains the op kinds, whose
remainder is "forward: other" (the Python between the parts). Only decode steps (every
row one token) are counted. A second pass profiles a few decode steps with
torch.profiler and counts the torch operators per step. Prints a table; writes JSON.
A diagnostic program: it asserts nothing, and its timers cost a few microseconds each.

`--skinny` runs a random model (dummy weights) with SmolLM2's depth, heads, head size
and vocabulary but a hidden size and MLP width of 64: its linears cost next to nothing,
so its step time is the per-step overhead a quantized SmolLM2 is left with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from datetime import datetime, timezone

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from result_file import write_json  # noqa: E402  (benchmarks/)


class StageTimers:
    """Inclusive wall time per named stage, summed over the counted steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = False

    def wrap(self, owner, attr: str, name: str) -> None:
        """Replaces owner.attr (a function or method) by a timed version."""
        inner = getattr(owner, attr)
        timers = self

        def timed(*args, **kwargs):
            if not timers.active:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timers.seconds[name] += time.perf_counter() - start
                timers.calls[name] += 1
        setattr(owner, attr, timed)

    def wrap_module_forwards(self, model, classes: dict[type, str]) -> None:
        """Times forward() of every submodule that is an instance of a key of classes
        (the first key that matches names it)."""
        for module in model.modules():
            for cls, name in classes.items():
                if isinstance(module, cls):
                    self.wrap(module, "forward", name)
                    break


def instrument(llm, timers: StageTimers) -> None:
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
        raise SystemExit("profile_cpu_decode needs the in-process executor")
    timers.wrap(engine.scheduler, "schedule", "scheduler.schedule")
    timers.wrap(engine.scheduler, "update_from_output", "scheduler.update_from_output")
    timers.wrap(engine.output_processor, "process_outputs", "output processing (detokenize)")
    timers.wrap(runner, "execute_model", "runner.execute_model")
    timers.wrap(runner, "sample_tokens", "runner.sample_tokens")
    timers.wrap(mr, "apply_scheduler_output", "  input batch update")
    timers.wrap(mr, "build_step_inputs", "  step inputs (ids, positions, attn common)")
    timers.wrap(runner.backend, "build_metadata", "  attention plan (build_metadata)")
    timers.wrap(runner.model, "forward", "  forward")
    timers.wrap(runner.model, "compute_logits", "  lm head (compute_logits)")
    timers.wrap(mr, "build_sampling_metadata", "  sampling metadata")
    timers.wrap(runner, "sampler", "  sampler")
    if hasattr(llama, "cpu_fused_decode"):  # the whole decode step in one C call, when it applies
        timers.wrap(llama.cpu_fused_decode, "decode_step", "    fused decode step (all layers)")
    timers.wrap(llama, "apply_rotary", "    rotary")
    if hasattr(llama, "apply_rotary_tables"):  # the CPU form
        timers.wrap(llama, "apply_rotary_tables", "    rotary")
    timers.wrap_module_forwards(runner.model.model, {
        RMSNorm: "    rmsnorm (+ residual add)", Attention: "    attention (+ kv store)",
        SiluAndMul: "    silu_and_mul", VocabParallelEmbedding: "    embedding", LinearBase: "    linear"})


def attach_step_filter(llm, timers: StageTimers, decode_steps: list[float]) -> None:
    """Counts a step only when every scheduled request computes one token."""
    engine = llm.llm_engine
    step, schedule = engine.step, engine.scheduler.schedule
    state = {"decode": False}

    def schedule_and_classify():
        out = schedule()
        state["decode"] = bool(out.num_scheduled_tokens) and all(
            n == 1 for n in out.num_scheduled_tokens.values())
        timers.active = state["decode"]
        return out
    engine.scheduler.schedule = schedule_and_classify

    def timed_step():
        snapshot = dict(timers.seconds), dict(timers.calls)
        timers.active = True  # the schedule timer itself; reset by the classifier
        start = time.perf_counter()
        outs = step()
        elapsed = time.perf_counter() - start
        if state["decode"]:
            decode_steps.append(elapsed)
        else:  # undo what a non-decode step added
            timers.seconds.clear(), timers.calls.clear()
            timers.seconds.update(snapshot[0]), timers.calls.update(snapshot[1])
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
    table = []
    for evt in prof.key_averages():
        if evt.key.startswith("aten::") or evt.key.startswith("mkl"):
            table.append({"op": evt.key, "calls_per_step": evt.count / steps,
                          "self_ms_per_step": evt.self_cpu_time_total / 1000 / steps})
    table.sort(key=lambda r: -r["self_ms_per_step"])
    total_calls = sum(r["calls_per_step"] for r in table if r["op"].startswith("aten::"))
    return {"aten_calls_per_step": total_calls, "top": table[:25]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--profiler-steps", type=int, default=8)
    parser.add_argument("--quantization", default=None,
                        help="passed to LLM(quantization=...) when given")
    parser.add_argument("--skinny", action="store_true",
                        help="SmolLM2's depth and heads with 64-wide linears: overhead only")
    parser.add_argument("--smoke", action="store_true", help="few tokens: checks it runs")
    parser.add_argument("--out", default="benchmarks/results/cpu-profile-decode.json")
    return parser.parse_args()


# SmolLM2-135M's depth, attention shape and vocabulary; hidden 64 and MLP 64 wide.
SKINNY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "intermediate_size": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


def skinny_model_dir() -> str:
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="pagoda-skinny-"), "model")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SKINNY_CONFIG, f)
    return path


def make_llm(args):
    from pagoda import LLM
    kwargs = dict(max_num_seqs=max(args.batch, 1), max_model_len=1024,
                  enable_prefix_caching=False)
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.skinny:
        from pagoda.model.tokenizer import embedded_model_path
        return LLM(skinny_model_dir(), load_format="dummy", tokenizer=str(embedded_model_path()),
                   kv_cache_memory=256 << 20, **kwargs)
    return LLM(**kwargs)


_ORDER = ["scheduler.schedule", "runner.execute_model", "  input batch update",
          "  step inputs", "  attention plan", "  forward", "    embedding", "    rmsnorm",
          "    linear", "    rotary", "    attention", "    silu_and_mul", "    fused",
          "runner.sample_tokens", "  lm head", "  sampling metadata", "  sampler",
          "scheduler.update_from_output", "output processing"]


def _stage_rank(name: str) -> int:
    return next((i for i, prefix in enumerate(_ORDER) if name.startswith(prefix)), len(_ORDER))


def print_table(timers: StageTimers, steps: list[float]) -> list[dict]:
    n = len(steps)
    step_ms = 1000 * sum(steps) / n
    rows = [{"stage": "decode step (wall)", "ms_per_step": step_ms, "calls_per_step": 1.0}]
    for name in sorted(timers.seconds, key=_stage_rank):
        seconds = timers.seconds[name]
        rows.append({"stage": name, "ms_per_step": 1000 * seconds / n,
                     "calls_per_step": timers.calls[name] / n})
    by_name = {r["stage"]: r["ms_per_step"] for r in rows}
    parts = [v for k, v in by_name.items() if k.startswith("    ")]
    if "  forward" in by_name:
        at = max(i for i, r in enumerate(rows) if r["stage"].startswith(("  forward", "    "))) + 1
        rows.insert(at, {"stage": "    forward: other (python between parts)",
                         "ms_per_step": by_name["  forward"] - sum(parts), "calls_per_step": 0})
    top = ["scheduler.schedule", "runner.execute_model", "runner.sample_tokens",
           "scheduler.update_from_output", "output processing (detokenize)"]
    rows.append({"stage": "engine: other (step minus the above)", "calls_per_step": 0,
                 "ms_per_step": step_ms - sum(by_name.get(k, 0.0) for k in top)})
    print(f"\n{n} decode steps, mean {step_ms:.2f} ms/step ({1000 / step_ms:.1f} steps/s)")
    for r in rows:
        print(f"  {r['stage']:48s} {r['ms_per_step']:8.3f} ms  "
              f"{100 * r['ms_per_step'] / step_ms:5.1f}%  x{r['calls_per_step']:.0f}")
    return rows


def main() -> None:
    args = parse_args()
    import torch
    torch.set_num_threads(args.threads)
    from pagoda import SamplingParams
    if args.smoke:
        args.max_tokens, args.profiler_steps = min(args.max_tokens, 16), 2
    llm = make_llm(args)
    vocab = llm.llm_engine.model_info.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(args.prompt_len)]
               for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    timers, steps = StageTimers(), []
    instrument(llm, timers)
    attach_step_filter(llm, timers, steps)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"generate: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s "
          f"(timers on)")
    rows = print_table(timers, steps)
    ops = op_counts(llm, prompts, params, args.profiler_steps)
    print(f"\ntorch.profiler, {args.profiler_steps} decode steps: "
          f"{ops['aten_calls_per_step']:.0f} aten calls per step; top by self time:")
    for r in ops["top"][:15]:
        print(f"  {r['op']:40s} x{r['calls_per_step']:6.0f} {r['self_ms_per_step']:8.3f} ms")
    report = {"benchmark": "profile_cpu_decode", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__},
              "args": vars(args), "tok_per_s_with_timers": tokens / elapsed,
              "stages": rows, "profiler": ops}
    write_json(args.out, report)


if __name__ == "__main__":
    main()
