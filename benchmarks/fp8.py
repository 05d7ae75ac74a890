"""FP8 weights and FP8 KV cache beside the speed figures: their error against float32, and
the FP8 KV cache's capacity and decode step against the model-dtype cache, in one run.

    python -m benchmarks.fp8 quality                   # GPU (FP8 needs compute 8.9+)
    python -m benchmarks.fp8 kv                        # GPU: Llama-3.1-8B shape, batch 256
    python -m benchmarks.fp8 quality --smoke           # CPU, tiny shapes (float variants only)
    python -m benchmarks.fp8 kv --smoke                # CPU, tiny shapes, a few seconds

quality  Two models: "llama-8b-layers", a random-init transformers Llama with the
         Llama-3.1-8B layer shape and 2 layers saved as bf16 safetensors, with FP8
         checkpoints written from it (compressed-tensors per channel, and 128x128 blocks,
         by pagoda.model.quant.fp8_export); and "smollm2", the embedded SmolLM2-135M GGUF
         (real weights). Variants, each a fresh LLM: float32 (the reference), bfloat16,
         fp8 online (--quantization fp8, also with --quantize-lm-head), each FP8
         checkpoint, and bf16 weights with --kv-cache-dtype fp8. Against float32: the
         |logprob| error of each prompt's actual next tokens (teacher forcing), mean and
         max; the share of 32-token greedy continuations identical to float32's, their
         mean common prefix, and the |logprob| error of the decode steps inside it.
         transformers' own bf16 run of the same checkpoint gives a peer's error for scale.
kv       Speed and capacity (dummy weights of the preset): for each cache dtype (auto,
         fp8), in its own process (each pool sized from the same free memory), the KV
         pool's token capacity, then `--batch` requests of `--context` random tokens
         stepped until all decode, and the decode step timed as served (engine step wall
         time with CUDA graphs, and the bare replay of the decode graph), beside the
         roofline (weights + KV bytes read) / measured copy bandwidth. Quality: a small
         random-init Llama served with auto, with fp8 (scales 1.0, as a checkpoint without
         scales) and with fp8 under calibrated scales (per layer amax / 448 of K and of V
         from the auto run's cache, saved as self_attn.k_scale / v_scale): next-token
         logprob difference (max, mean) and greedy agreement against auto.
"""

from __future__ import annotations

import argparse

from benchmarks.fp8_bench.kv import run_kv
from benchmarks.fp8_bench.quality import run_quality
from benchmarks.harness.results import write_result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)
    p = modes.add_parser("quality", help="FP8 weights / KV: error against float32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--models", default="llama-8b-layers,smollm2")
    p.add_argument(
        "--variants",
        default=None,
        help="';'-separated variant names (as printed) to run beside float32 (the "
        "reference); default: all",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes (on the CPU: float only)")
    p.add_argument("--out", "--output", dest="out", default="bench_results/fp8-quality.json")
    p = modes.add_parser("kv", help="FP8 KV cache against auto: capacity, decode step, quality")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="bytes of KV cache (default: the GPU memory profile)",
    )
    p.add_argument("--quality-prompts", type=int, default=8)
    p.add_argument("--quality-tokens", type=int, default=32)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny-llama, float32, a few steps (checks the mode runs)",
    )
    p.add_argument("--out", "--output", dest="out", default="bench_results/fp8-kv.json")
    p.add_argument("--speed-child", choices=("auto", "fp8"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode == "kv" and args.smoke:
        args.preset, args.dtype, args.device = "tiny-llama", "float32", "cpu"
        args.batch, args.context, args.steps, args.max_model_len = 4, 48, 3, 256
        args.kv_cache_memory = args.kv_cache_memory or 1 << 22
        args.quality_prompts, args.quality_tokens = 3, 8
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    result = (run_quality if args.mode == "quality" else run_kv)(args)
    if getattr(args, "speed_child", None):
        return
    write_result(
        args.out, {"benchmark": f"fp8 {args.mode}", "args": vars(args), **result}, indent=1
    )


if __name__ == "__main__":
    main()
