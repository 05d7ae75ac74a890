"""Where an engine step's time goes, four ways (dummy weights of a preset unless noted).
Diagnostic programs: they print tables, write JSON and assert nothing.

    python -m benchmarks.profile_step decode --preset qwen3-30b-a3b --batches 1,64
    python -m benchmarks.profile_step static --preset llama-3.1-8b
    python -m benchmarks.profile_step timeline --preset llama-3.1-8b --quantization fp8
    python -m benchmarks.profile_step cpu --threads 2 --batch 1
    python -m benchmarks.profile_step decode --smoke     # each mode has --smoke (static: small flags)

decode    Per batch size: fill the batch with `--context`-token prompts (`--batch1-context`
          at batch 1), step until all decode, then profile `--steps` decode steps eagerly
          (CUDA graphs off, so every kernel is seen): the kernel table of one step (launches,
          device us, share) and coarse groups (GEMM, MoE, attention, norm, ...); and the
          step as served: the engine's step wall time with CUDA graphs and the bare replay
          of the decode graph (CUDA events, median). On the CPU: CPU operators by self time.
static    gpu_compare's static workload (batch x prompt in, `--output` out, greedy) once
          for its wall time with host stage timers, then again under torch.profiler, every
          step in a record_function range: per step the tokens, host ms, device ms of its
          kernels by kind (a kernel belongs to the step whose range launched it, joined by
          the profiler's correlation id, so it holds with async scheduling) and device span;
          over the run, device busy time against wall time.
timeline  One request (or --batch) decodes with CUDA graphs and async scheduling, as served:
          the median gap between tokens without a profiler, then `--steps` steps under
          torch.profiler (no Python stacks): device busy/idle time per step, the largest
          idle gaps with the host work around each, host time per CPU op / runtime call, and
          per kernel its increment after its predecessor (with PDL a kernel starts before
          its predecessor ends). The chrome trace is written too (--trace, gzip).
cpu       The embedded SmolLM2-135M on the CPU (float32 unless --quantization), LLM.generate
          over `--batch` prompts with wall-clock timers around the engine's stages and the
          model's parts (linears, norms, rotary, attention with its KV store, ...); only
          decode steps count. Timers are inclusive and nest ("forward: other" is the Python
          between the parts). A second pass counts torch operators per step. `--skinny`: a
          random model with SmolLM2's depth, heads and vocabulary but 64-wide linears, so
          its step time is the per-step overhead.
"""

from __future__ import annotations

import argparse

from benchmarks.harness.results import write_result
from benchmarks.profile_bench.cpu import run_cpu
from benchmarks.profile_bench.decode import run_decode
from benchmarks.profile_bench.static import run_static
from benchmarks.profile_bench.timeline import run_timeline


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)

    def mode(name: str, help_text: str, preset: str, out: str):
        p = modes.add_parser(name, help=help_text, description=help_text)
        if preset:
            p.add_argument("--preset", default=preset)
            p.add_argument("--quantization", default=None, help="e.g. fp8 (FP8 weights)")
            p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (an FP8 KV cache)")
            p.add_argument("--max-model-len", type=int, default=2304)
        p.add_argument("--out", default=f"bench_results/{out}.json", help="JSON result file")
        return p

    p = mode(
        "decode",
        "per-kernel table of one decode step, and the step as served",
        "qwen3-30b-a3b",
        "profile-decode",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch1-context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=40, help="kernel rows printed")
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny-qwen3-moe, float32, a few steps (checks the mode runs)",
    )
    p = mode(
        "static",
        "the static workload step by step: device time by kernel kind, host stages",
        "llama-3.1-8b",
        "profile-static",
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--output", type=int, default=128, help="output tokens per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p = mode(
        "timeline",
        "a served decode step's device busy/idle time and the host work around each gap",
        "qwen3-30b-a3b",
        "profile-timeline",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens of the timed run")
    p.add_argument("--steps", type=int, default=12, help="decode steps profiled")
    p.add_argument("--trace", default="bench_results/profile-timeline.trace.json.gz")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny-llama, float32")
    p = mode("cpu", "a CPU decode step's engine stages and model op kinds", "", "profile-cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--profiler-steps", type=int, default=8)
    p.add_argument("--quantization", default=None, help="passed to LLM(quantization=...)")
    p.add_argument(
        "--skinny",
        action="store_true",
        help="SmolLM2's depth and heads with 64-wide linears: overhead only",
    )
    p.add_argument("--smoke", action="store_true", help="few tokens: checks it runs")
    args = parser.parse_args(argv)
    if args.mode == "decode" and args.smoke:
        args.preset, args.dtype, args.device = "tiny-qwen3-moe", "float32", "cpu"
        args.batches, args.context, args.batch1_context = "1,2", 8, 8
        args.steps, args.max_model_len, args.kv_cache_memory = 2, 128, 1 << 24
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    run = {"decode": run_decode, "static": run_static, "timeline": run_timeline, "cpu": run_cpu}[
        args.mode
    ]
    result = run(args)
    write_result(
        args.out, {"benchmark": f"profile_step {args.mode}", "args": vars(args), **result}, indent=1
    )


if __name__ == "__main__":
    main()
