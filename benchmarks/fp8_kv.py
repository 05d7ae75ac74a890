"""FP8 KV cache (--kv-cache-dtype fp8) against the model-dtype cache (auto), in one run.

    python benchmarks/fp8_kv.py                     # H200: Llama-3.1-8B shape, batch 256
    python benchmarks/fp8_kv.py --smoke             # CPU, tiny shapes, a few seconds

Speed and capacity (dummy bf16 weights of the preset, one GPU): for each cache dtype,
in its own process (so each pool is sized from the same free memory), the KV pool's
token capacity, then `--batch` requests of `--context` random prompt tokens stepped
until all decode, and the decode step timed as served (benchmarks/profile_decode.py's
time_graph: the engine's step wall time with CUDA graphs, and the bare replay of the
decode graph). With the roofline: (weights + KV bytes read) / measured copy bandwidth.

Quality: a small random-init transformers Llama saved as safetensors (bf16 on the GPU),
served with auto, with fp8 (scales 1.0, as a checkpoint without scales) and with fp8
under calibrated scales (per layer amax / 448 of K and of V, measured from the auto
run's cache and saved into a copy of the checkpoint as self_attn.k_scale / v_scale).
Figures against auto: the teacher-forced next-token logprobs over the prompts (max and
mean absolute difference) and greedy agreement (identical outputs, common-prefix share).

Prints the figures and writes JSON (`--out`). A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KV_DTYPES = ("auto", "fp8")
E4M3_MAX = 448.0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV cache (default: the GPU memory profile)")
    p.add_argument("--quality-prompts", type=int, default=8)
    p.add_argument("--quality-tokens", type=int, default=32)
    p.add_argument("--out", default="benchmarks/results/fp8_kv.json")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny-llama, float32, a few steps (checks the script runs)")
    # Internal: one speed run in this process, its JSON to this path.
    p.add_argument("--speed-child", choices=KV_DTYPES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.preset, args.dtype, args.device = "tiny-llama", "float32", "cpu"
        args.batch, args.context, args.steps, args.max_model_len = 4, 48, 3, 256
        args.kv_cache_memory = args.kv_cache_memory or 1 << 22
        args.quality_prompts, args.quality_tokens = 3, 8
        args.out = os.path.join(os.path.dirname(args.out), "fp8_kv_smoke.json")
    return args


# ---- speed and capacity -------------------------------------------------------------------

def speed_run(args, kv_dtype: str) -> dict:
    """One engine with kv_cache_dtype kv_dtype: pool capacity and decode step time."""
    import numpy as np
    import torch
    from pagoda import LLM, SamplingParams
    from profile_decode import decode_ready, time_graph

    on_cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=args.batch,
              kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=kv_dtype,
              skip_tokenizer_init=True)
    engine = llm.llm_engine
    runner = engine.executor.runner
    kv = engine.kv_cache_config
    result = {"kv_cache_dtype": kv_dtype, "cache_torch_dtype": str(runner.kv_dtype),
              "num_blocks": kv.num_blocks, "block_size": kv.block_size,
              "token_capacity": kv.num_blocks * kv.block_size, "pool_bytes": kv.total_bytes}
    rng = np.random.default_rng(0)
    vocab = engine.model_info.vocab_size
    params = SamplingParams(max_tokens=args.steps + 16, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(0, vocab, args.context).tolist(), params)
    while not decode_ready(engine):
        engine.step()
    for _ in range(4):  # settle: the first decode steps may compile
        engine.step()
    timing = time_graph(engine, runner, args.batch, args.steps, sync)
    result["step_ms"] = timing["step_ms"]
    result["step_ms_median"] = statistics.median(timing["step_ms"])
    result["replay_ms"] = timing.get("replay_ms")
    engine.shutdown()
    return result


def speed_in_child(args, kv_dtype: str) -> dict:
    """speed_run in a fresh process: the previous engine's memory is gone for sure."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "speed.json")
        argv = [sys.executable, os.path.abspath(__file__), "--speed-child", kv_dtype,
                "--child-out", out]
        for name in ("preset", "dtype", "device", "batch", "context", "steps",
                     "max_model_len", "kv_cache_memory"):
            value = getattr(args, name)
            if value is not None:
                argv += [f"--{name.replace('_', '-')}", str(value)]
        subprocess.run(argv, check=True, cwd=ROOT)
        with open(out) as f:
            return json.load(f)


def ceilings(device: str) -> dict:
    """Measured device-to-device copy bandwidth (bytes read + written per second)."""
    if device != "cuda":
        return {}
    import torch
    src = torch.randn(2**29, device="cuda")  # 2 GiB of float32
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); dst.copy_(src); e.record(); e.synchronize()
        times.append(s.elapsed_time(e))
    return {"copy_bytes_per_s": 2 * src.numel() * 4 / (statistics.median(times) * 1e-3)}


def roofline_ms(args, kv_bytes_per_entry: int, ceiling: dict) -> dict:
    """A decode step reads the weights (less the embedding) and every context's K/V."""
    if not ceiling:
        return {}
    from pagoda.model.arch_config import ArchConfig
    from pagoda.model.presets import get_preset
    arch = get_preset(args.preset)
    h, i, layers = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    weight_bytes = 2 * (layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + arch.vocab_size * h)
    kv_bytes = args.batch * (args.context + args.steps) * 2 * layers * kv * kv_bytes_per_entry
    read = weight_bytes + kv_bytes
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "roofline_ms": read / ceiling["copy_bytes_per_s"] * 1e3}


# ---- quality ------------------------------------------------------------------------------------

def save_quality_model(path: str, dtype: str, smoke: bool) -> None:
    """A random-init transformers Llama (its own default init) saved as safetensors."""
    import torch
    import transformers
    size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512) if smoke else
            dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=8192))
    config = transformers.LlamaConfig(**size, max_position_embeddings=2048, rope_theta=10000.0,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(path, safe_serialization=True)


def quality_llm(path: str, args, kv_dtype: str):
    from pagoda import LLM
    return LLM(path, dtype=args.dtype, device=args.device, kv_cache_dtype=kv_dtype,
               skip_tokenizer_init=True, max_model_len=args.max_model_len,
               kv_cache_memory=1 << 28, enable_prefix_caching=False)


def run_prompts(llm, prompts, max_tokens: int):
    """(greedy outputs, teacher-forced next-token logprobs of each prompt) of one engine."""
    from pagoda import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    return tokens, logprobs


def layer_amax(llm) -> list[tuple[float, float]]:
    """Per layer (max |K|, max |V|) over everything the engine's cache holds."""
    pool = llm.llm_engine.executor.runner.kv_pool
    return [(float(c[0].abs().max()), float(c[1].abs().max())) for c in pool.caches]


def with_scales(src: str, dst: str, amax: list[tuple[float, float]]) -> None:
    """A copy of the checkpoint with self_attn.k_scale / v_scale = amax / 448."""
    import shutil
    import torch
    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for i, (k, v) in enumerate(amax):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(max(k, 1e-6) / E4M3_MAX)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(max(v, 1e-6) / E4M3_MAX)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


def compare(ref, other) -> dict:
    (ref_tokens, ref_lp), (tokens, lp) = ref, other
    diffs = [abs(a - b) for ra, rb in zip(ref_lp, lp) for a, b in zip(ra, rb)]
    prefix = []
    for a, b in zip(ref_tokens, tokens):
        n = 0
        while n < len(a) and a[n] == b[n]:
            n += 1
        prefix.append(n / len(a))
    return {"logprob_abs_diff_max": max(diffs), "logprob_abs_diff_mean": sum(diffs) / len(diffs),
            "num_logprobs": len(diffs),
            "greedy_identical": sum(a == b for a, b in zip(ref_tokens, tokens)),
            "greedy_prompts": len(tokens), "greedy_common_prefix_mean": sum(prefix) / len(prefix)}


def quality(args) -> dict:
    import numpy as np
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        save_quality_model(path, args.dtype, args.smoke)
        vocab = 512 if args.smoke else 8192
        hi = min(args.max_model_len - args.quality_tokens, 48 if args.smoke else 512)
        prompts = [rng.integers(3, vocab, int(n)).tolist()
                   for n in rng.integers(hi // 4, hi, args.quality_prompts)]
        auto = quality_llm(path, args, "auto")
        ref = run_prompts(auto, prompts, args.quality_tokens)
        amax = layer_amax(auto)
        auto.llm_engine.shutdown()
        scaled = os.path.join(tmp, "scaled")
        with_scales(path, scaled, amax)
        result = {"model": "random-init LlamaForCausalLM (transformers default init)",
                  "kv_amax_per_layer": amax, "prompt_lens": [len(p) for p in prompts]}
        for name, model in (("fp8_scale_1", path), ("fp8_calibrated", scaled)):
            llm = quality_llm(model, args, "fp8")
            result[name] = compare(ref, run_prompts(llm, prompts, args.quality_tokens))
            llm.llm_engine.shutdown()
        return result


# ---- main --------------------------------------------------------------------------------------

def main() -> None:
    args = parse_args()
    if args.speed_child is not None:
        with open(args.child_out, "w") as f:
            json.dump(speed_run(args, args.speed_child), f)
        return
    import torch
    start = time.perf_counter()
    runs = {kv: speed_in_child(args, kv) for kv in KV_DTYPES}
    ceiling = ceilings(args.device)
    entry_bytes = {"auto": 4 if args.dtype == "float32" else 2, "fp8": 1}
    for kv, run in runs.items():
        run["roofline"] = roofline_ms(args, entry_bytes[kv], ceiling)
    auto, fp8 = runs["auto"], runs["fp8"]
    summary = {
        "speedup_step": auto["step_ms_median"] / fp8["step_ms_median"],
        "speedup_replay": (auto["replay_ms"] / fp8["replay_ms"]
                           if auto.get("replay_ms") and fp8.get("replay_ms") else None),
        "capacity_ratio": fp8["token_capacity"] / auto["token_capacity"],
    }
    quality_figures = quality(args)
    machine = {"torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    print(f"\n{args.preset}, batch {args.batch}, context {args.context}, {args.dtype} weights")
    print(f"{'kv cache':<10}{'tokens':>12}{'step ms':>10}{'replay ms':>11}{'roofline ms':>13}")
    for kv, run in runs.items():
        replay = run.get("replay_ms") or float("nan")
        roof = run["roofline"].get("roofline_ms", float("nan"))
        print(f"{kv:<10}{run['token_capacity']:>12}{run['step_ms_median']:>10.3f}"
              f"{replay:>11.3f}{roof:>13.3f}")
    print(f"fp8 vs auto: step {summary['speedup_step']:.2f}x faster, "
          f"{summary['capacity_ratio']:.2f}x the tokens")
    for name in ("fp8_scale_1", "fp8_calibrated"):
        q = quality_figures[name]
        print(f"quality {name}: next-token logprob |diff| max {q['logprob_abs_diff_max']:.4f} "
              f"mean {q['logprob_abs_diff_mean']:.4f} over {q['num_logprobs']}; greedy "
              f"identical {q['greedy_identical']}/{q['greedy_prompts']}, common prefix "
              f"{q['greedy_common_prefix_mean']:.0%}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "fp8_kv", "args": vars(args), "machine": machine,
                   "runs": runs, "summary": summary, "quality": quality_figures,
                   "seconds": time.perf_counter() - start}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
