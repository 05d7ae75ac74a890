"""fp8 kv: the FP8 KV cache against the model-dtype cache (auto). Speed and capacity, each
cache dtype in its own process: the pool's token capacity and the decode step as served
beside the roofline. Quality on a small random Llama: fp8 with scales 1.0 and with
calibrated per-layer scales against auto."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from benchmarks.fp8_bench.common import common_prefix, save_random_llama
from benchmarks.harness.processes import run_json_child, write_child_result
from benchmarks.harness.rooflines import measure_ceilings, model_bytes_and_flops, roofline_decode_ms
from benchmarks.harness.timing import engine_step_timing
from benchmarks.harness.workloads import decode_ready

E4M3_MAX = 448.0


def kv_speed(args, kv_dtype: str) -> dict:
    """One engine with kv_cache_dtype kv_dtype: pool capacity and decode step time."""
    import torch

    from pagoda import LLM, SamplingParams

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    llm = LLM(
        args.preset,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=kv_dtype,
        skip_tokenizer_init=True,
    )
    engine = llm.llm_engine
    runner = engine.executor.runner
    kv = engine.kv_cache_config
    result = {
        "kv_cache_dtype": kv_dtype,
        "cache_torch_dtype": str(runner.kv_dtype),
        "num_blocks": kv.num_blocks,
        "block_size": kv.block_size,
        "token_capacity": kv.num_blocks * kv.block_size,
        "pool_bytes": kv.total_bytes,
    }
    rng = np.random.default_rng(0)
    vocab = engine.model_info.vocab_size
    params = SamplingParams(max_tokens=args.steps + 16, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", rng.integers(0, vocab, args.context).tolist(), params)
    while not decode_ready(engine):
        engine.step()
    for _ in range(4):  # settle: the first decode steps may compile
        engine.step()
    timing = engine_step_timing(engine, runner, args.batch, args.steps, sync)
    result.update(
        step_ms=timing["step_ms"],
        step_ms_median=statistics.median(timing["step_ms"]),
        replay_ms=timing.get("replay_ms"),
    )
    engine.shutdown()
    return result


def kv_roofline(args, entry_bytes: int, ceilings: dict) -> dict:
    """A decode step reads the weights (less the embedding) and every context's K/V."""
    if not ceilings:
        return {}
    from pagoda.model.presets import get_preset

    info = model_bytes_and_flops(get_preset(args.preset))
    info["kv_bytes_per_token"] = info["kv_bytes_per_token"] // 2 * entry_bytes
    bound = roofline_decode_ms(info, ceilings, args.batch, args.context + args.steps)
    weight_bytes = info["weight_bytes"] - info["embedding_bytes"]
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": bound["bytes_read"] - weight_bytes,
        "roofline_ms": bound["memory_ms"],
    }


def quality_llm(path: str, args, kv_dtype: str):
    from pagoda import LLM

    return LLM(
        path,
        dtype=args.dtype,
        device=args.device,
        kv_cache_dtype=kv_dtype,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        kv_cache_memory=1 << 28,
        enable_prefix_caching=False,
    )


def run_prompts(llm, prompts, max_tokens: int):
    """(greedy outputs, teacher-forced next-token logprobs of each prompt) of one engine."""
    from pagoda import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    return (
        [list(o.outputs[0].token_ids) for o in outs],
        [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs],
    )


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


def kv_compare(ref, other) -> dict:
    (ref_tokens, ref_lp), (tokens, lp) = ref, other
    diffs = [abs(a - b) for ra, rb in zip(ref_lp, lp) for a, b in zip(ra, rb)]
    prefix = [common_prefix(a, b) / len(a) for a, b in zip(ref_tokens, tokens)]
    return {
        "logprob_abs_diff_max": max(diffs),
        "logprob_abs_diff_mean": sum(diffs) / len(diffs),
        "num_logprobs": len(diffs),
        "greedy_identical": sum(a == b for a, b in zip(ref_tokens, tokens)),
        "greedy_prompts": len(tokens),
        "greedy_common_prefix_mean": sum(prefix) / len(prefix),
    }


def kv_quality(args) -> dict:
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        shape = (
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=512,
            )
            if args.smoke
            else dict(
                hidden_size=512,
                intermediate_size=1408,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=8192,
            )
        )
        save_random_llama(
            path,
            shape,
            2 if args.smoke else 4,
            args.dtype,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            bos_token_id=1,
            eos_token_id=2,
        )
        hi = min(args.max_model_len - args.quality_tokens, 48 if args.smoke else 512)
        prompts = [
            rng.integers(3, shape["vocab_size"], int(n)).tolist()
            for n in rng.integers(hi // 4, hi, args.quality_prompts)
        ]
        auto = quality_llm(path, args, "auto")
        ref = run_prompts(auto, prompts, args.quality_tokens)
        pool = auto.llm_engine.executor.runner.kv_pool  # per layer (max |K|, max |V|)
        amax = [(float(c[0].abs().max()), float(c[1].abs().max())) for c in pool.caches]
        auto.llm_engine.shutdown()
        scaled = os.path.join(tmp, "scaled")
        with_scales(path, scaled, amax)
        result = {
            "model": "random-init LlamaForCausalLM (transformers default init)",
            "kv_amax_per_layer": amax,
            "prompt_lens": [len(p) for p in prompts],
        }
        for name, model in (("fp8_scale_1", path), ("fp8_calibrated", scaled)):
            llm = quality_llm(model, args, "fp8")
            result[name] = kv_compare(ref, run_prompts(llm, prompts, args.quality_tokens))
            llm.llm_engine.shutdown()
        return result


def run_kv(args) -> dict:
    if args.speed_child is not None:
        write_child_result(args.child_out, kv_speed(args, args.speed_child))
        return {}
    start = time.perf_counter()
    runs = {}
    for kv in ("auto", "fp8"):  # each in a fresh process: the previous engine's memory is gone
        argv = [
            "kv",
            "--speed-child",
            kv,
            *(
                f"--{k.replace('_', '-')}={getattr(args, k)}"
                for k in (
                    "preset",
                    "dtype",
                    "device",
                    "batch",
                    "context",
                    "steps",
                    "max_model_len",
                    "kv_cache_memory",
                )
                if getattr(args, k) is not None
            ),
        ]
        runs[kv] = run_json_child("benchmarks.fp8", argv)
        if "error" in runs[kv]:
            raise SystemExit(f"the {kv} speed run failed: {runs[kv]['error']}")
    ceilings = measure_ceilings(args.device)
    entry_bytes = {"auto": 4 if args.dtype == "float32" else 2, "fp8": 1}
    for kv, run in runs.items():
        run["roofline"] = kv_roofline(args, entry_bytes[kv], ceilings)
    auto, fp8 = runs["auto"], runs["fp8"]
    summary = {
        "speedup_step": auto["step_ms_median"] / fp8["step_ms_median"],
        "speedup_replay": (
            auto["replay_ms"] / fp8["replay_ms"]
            if auto.get("replay_ms") and fp8.get("replay_ms")
            else None
        ),
        "capacity_ratio": fp8["token_capacity"] / auto["token_capacity"],
    }
    quality = kv_quality(args)
    print(f"\n{args.preset}, batch {args.batch}, context {args.context}, {args.dtype} weights")
    print(f"{'kv cache':<10}{'tokens':>12}{'step ms':>10}{'replay ms':>11}{'roofline ms':>13}")
    for kv, run in runs.items():
        print(
            f"{kv:<10}{run['token_capacity']:>12}{run['step_ms_median']:>10.3f}"
            f"{run.get('replay_ms') or float('nan'):>11.3f}"
            f"{run['roofline'].get('roofline_ms', float('nan')):>13.3f}"
        )
    print(
        f"fp8 vs auto: step {summary['speedup_step']:.2f}x faster, "
        f"{summary['capacity_ratio']:.2f}x the tokens"
    )
    for name in ("fp8_scale_1", "fp8_calibrated"):
        q = quality[name]
        print(
            f"quality {name}: next-token logprob |diff| max {q['logprob_abs_diff_max']:.4f} "
            f"mean {q['logprob_abs_diff_mean']:.4f} over {q['num_logprobs']}; greedy "
            f"identical {q['greedy_identical']}/{q['greedy_prompts']}, common prefix "
            f"{q['greedy_common_prefix_mean']:.0%}"
        )
    return {
        "runs": runs,
        "summary": summary,
        "quality": quality,
        "seconds": time.perf_counter() - start,
    }
