"""`pagoda bench throughput` and `pagoda bench latency`: the offline engine, no server.

Owns the two offline measurements (vLLM's `bench throughput` / `bench latency`):

- throughput: every prompt of a dataset through `LLM.generate` at once; requests/s,
  total tok/s and output tok/s over the wall time of the call. Output lengths are
  exact (`ignore_eos`), as in vLLM.
- latency: a fixed batch of `--batch-size` prompts of `--input-len` tokens driven
  step by step through `llm.llm_engine.step()`. Prefill latency = from the first
  step until every request has its first token; decode step latency = each later
  step (every request decoding one token); e2e = the whole batch. Each iteration
  uses fresh random prompts so the prefix cache cannot help.

Prompts are token-id lists (exact lengths; also works with dummy weights and no
tokenizer). Only `pagoda` (LLM, SamplingParams), numpy and the stdlib are imported,
lazily: no server stack (fastapi, pydantic) is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from pagoda import LLM, SamplingParams
from pagoda.bench import metrics as m
from pagoda.bench.arguments import add_dataset_args
from pagoda.bench.datasets import SampleRequest, draw_lengths, samples_from_args
from pagoda.bench.report import header, validate_report
from pagoda.bench.tokenizers import LocalTokenizer, corpus_token_pool
from pagoda.entrypoints.cli_args import add_engine_args, engine_args_from_namespace

LATENCY_PERCENTILES = (50, 90, 99)


def _add_common(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    g = p.add_argument_group("report")
    g.add_argument("--output-json", default=None, help="write the result JSON here")
    g.add_argument("--label", default=None, help="name of this run in reports")
    g.add_argument("--disable-tqdm", action="store_true")


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    add_dataset_args(p, with_seed=False)  # the engine flags define --seed


def add_latency_args(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    g = p.add_argument_group("batch")
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--input-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-iters-warmup", type=int, default=1)
    g.add_argument("--num-iters", type=int, default=5)


def _make_llm(args):
    return LLM(**vars(engine_args_from_namespace(args)))


def _token_pool(llm) -> list[int]:
    """Corpus tokens when the model has a tokenizer, else the whole vocabulary."""
    tokenizer = llm.get_tokenizer()
    if tokenizer is not None:
        return corpus_token_pool(LocalTokenizer("engine", tokenizer))
    return list(range(llm.llm_engine.model_info.vocab_size))


def random_token_prompts(
    pool: list[int], lengths: list[int], rng: np.random.Generator, prefix: list[int] | None = None
) -> list[list[int]]:
    prefix = prefix or []
    return [prefix + [int(pool[i]) for i in rng.integers(0, len(pool), size=n)] for n in lengths]


def offline_samples(args, llm) -> list[SampleRequest]:
    """The dataset as token-id prompts (random, prefix-repetition) or text (sharegpt, custom)."""
    name = args.dataset_name
    rng = np.random.default_rng(args.seed)
    if name == "random":
        pool = _token_pool(llm)
        prefix = random_token_prompts(pool, [args.random_prefix_len], rng)[0]
        ins = draw_lengths(
            args.random_input_len,
            args.random_range_ratio,
            args.num_prompts,
            rng,
            "random_input_len",
        )
        outs = draw_lengths(
            args.random_output_len,
            args.random_range_ratio,
            args.num_prompts,
            rng,
            "random_output_len",
        )
        prompts = random_token_prompts(pool, ins, rng, prefix)
        return [SampleRequest(p, len(p), n) for p, n in zip(prompts, outs)]
    if name == "prefix-repetition":
        pool = _token_pool(llm)
        prefixes = random_token_prompts(
            pool, [args.prefix_repetition_prefix_len] * args.prefix_repetition_num_prefixes, rng
        )
        samples = []
        for i in range(args.num_prompts):
            p = random_token_prompts(
                pool, [args.prefix_repetition_suffix_len], rng, prefixes[i % len(prefixes)]
            )[0]
            samples.append(SampleRequest(p, len(p), args.prefix_repetition_output_len))
        return [samples[i] for i in rng.permutation(len(samples))]
    tokenizer = llm.get_tokenizer()
    wrapped = LocalTokenizer("engine", tokenizer) if tokenizer is not None else None
    return samples_from_args(args, wrapped)


def engine_info(llm) -> dict:
    """What the engine resolved: device, dtype, context length, KV pool size."""
    engine = llm.llm_engine
    config = engine.config
    return {
        "device": config.device.device,
        "dtype": config.model.dtype,
        "max_model_len": engine.max_model_len,
        "num_kv_blocks": engine.num_blocks,
        "block_size": config.cache.block_size,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "startup_seconds": getattr(engine, "startup_seconds", None),
    }


def _write(result: dict, path: str | None) -> None:
    validate_report(result)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, allow_nan=False)
        print(f"saved {path}")


def main_throughput(args) -> dict:

    llm = _make_llm(args)
    samples = offline_samples(args, llm)
    params = [
        SamplingParams(
            n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=s.expected_output_len
        )
        for s in samples
    ]
    start = time.perf_counter()
    outputs = llm.generate([s.prompt for s in samples], params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = header("throughput", args.label or f"pagoda:{args.model or 'embedded'}", args)
    result.update(
        {
            "model_id": args.model or "embedded",
            "engine": engine_info(llm),
            "dataset_name": args.dataset_name,
            "num_prompts": len(samples),
            "elapsed_time": elapsed,
            "total_prompt_tokens": prompt_tokens,
            "total_output_tokens": output_tokens,
            "total_num_tokens": prompt_tokens + output_tokens,
            "requests_per_second": len(samples) / elapsed,
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_second": output_tokens / elapsed,
        }
    )
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s "
        f"({len(samples)} prompts, {prompt_tokens} prompt + {output_tokens} output tokens "
        f"in {elapsed:.2f} s)"
    )
    _write(result, args.output_json)
    return result


def run_batch_steps(engine, prompts: list[list[int]], params) -> tuple[float, list[float], float]:
    """Drive one batch to completion: (prefill seconds, decode step seconds, e2e seconds)."""
    ids = [engine.add_request(None, p, params) for p in prompts]
    pending_first = set(ids)
    prefill: float | None = None
    decode_steps: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if prefill is None:
            for out in outputs:
                if out.outputs and out.outputs[0].token_ids:
                    pending_first.discard(out.request_id)
            if not pending_first:
                prefill = now - start
        else:
            decode_steps.append(now - step_start)
    return (
        prefill if prefill is not None else time.perf_counter() - start,
        decode_steps,
        time.perf_counter() - start,
    )


def _check_latency_args(args, llm) -> None:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be >= 0, got {args.num_iters_warmup}")
    engine = llm.llm_engine
    if args.batch_size > engine.config.scheduler.max_num_seqs:
        raise ValueError(
            f"batch_size {args.batch_size} is larger than max_num_seqs "
            f"{engine.config.scheduler.max_num_seqs}: the batch would not run at once"
        )
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(
            f"input_len + output_len = {args.input_len + args.output_len} exceeds "
            f"max_model_len {engine.max_model_len}"
        )


def main_latency(args) -> dict:

    llm = _make_llm(args)
    _check_latency_args(args, llm)
    pool, rng = _token_pool(llm), np.random.default_rng(args.seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    prefills, steps, e2es = [], [], []
    for i in range(args.num_iters_warmup + args.num_iters):
        prompts = random_token_prompts(pool, [args.input_len] * args.batch_size, rng)
        prefill, decode, e2e = run_batch_steps(llm.llm_engine, prompts, params)
        if i >= args.num_iters_warmup:
            prefills.append(prefill * 1000.0)
            steps.extend(x * 1000.0 for x in decode)
            e2es.append(e2e * 1000.0)
    result = header("latency", args.label or f"pagoda:{args.model or 'embedded'}", args)
    step_stats = m.distribution(steps, LATENCY_PERCENTILES)
    result.update(
        {
            "model_id": args.model or "embedded",
            "engine": engine_info(llm),
            "batch_size": args.batch_size,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_iters": args.num_iters,
            "prefill_latency_ms": m.distribution(prefills, LATENCY_PERCENTILES),
            "decode_step_latency_ms": step_stats,
            "e2e_latency_ms": m.distribution(e2es, LATENCY_PERCENTILES),
            "decode_tokens_per_second": (
                args.batch_size * 1000.0 / step_stats["mean"] if step_stats["mean"] else None
            ),
            "prefill_latencies_ms": prefills,
            "e2e_latencies_ms": e2es,
        }
    )
    print(
        f"Prefill latency (batch {args.batch_size} x {args.input_len} tokens): "
        f"mean {result['prefill_latency_ms']['mean']:.2f} ms"
    )
    print(
        f"Decode step latency: mean {step_stats['mean'] or 0:.2f} ms, "
        f"p50 {step_stats['p50'] or 0:.2f} ms, p99 {step_stats['p99'] or 0:.2f} ms "
        f"({result['decode_tokens_per_second'] or 0:.1f} tok/s)"
    )
    print(f"End-to-end latency: mean {result['e2e_latency_ms']['mean']:.2f} ms")
    _write(result, args.output_json)
    return result
