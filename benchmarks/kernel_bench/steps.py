"""The `steps` mode: decode steps of one engine under named kernel-config variants, A/B in
one process.

A kernel tile that wins alone can lose in the step (its PDL predecessor, the kernels
sharing its SMs), and machines differ by more than most changes gain, so only an A/B
inside one run decides. The engine is built once (dummy weights, --batch sequences);
then for each round and each variant in turn: the model runner takes the variant's
KernelConfigs (ModelRunner.use_kernel_configs: the layers' configs and a new attention
backend), captures its CUDA graphs again, runs --batch greedy requests of --prompt
tokens for --tokens tokens and records the median time between the steps that decode
all of them (at batch 1: the gap between tokens). Variants take turns within a round, so
drift of clocks and power lands on all of them. Beside each: the step's roofline, the
bytes it must stream (the weights it touches: at batch B the experts B tokens reach
under uniform routing, and the KV cache) over the copy bandwidth measured in the same
run. Prints each variant's median over the rounds with its spread.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.harness.variants import add_variant_args, configs_for, describe, variant_names


def add_args(p) -> None:
    p.add_argument("--preset", default="llama-3.1-8b")
    add_variant_args(p, multiple=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens a request")
    p.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step's token budget (default: 512 at batch 1, else the engine's)",
    )
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")


def streamed_bytes(arch, batch: int, context: int, weight_bytes: float, kv_bytes: int) -> float:
    """Bytes one decode step of `batch` rows of `context` tokens reads: every dense
    weight (weight_bytes a parameter; the LM head in bf16), the experts `batch` tokens are
    expected to reach under uniform top-k routing (and the shared ones), the KV cache
    (kv_bytes an entry)."""
    from pagoda.model.layers.moe.deepseek_moe import is_moe_layer

    h, moe = arch.hidden_size, arch.moe
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    params = arch.num_hidden_layers * (h * (q + 2 * kv) + q * h)
    for layer in range(arch.num_hidden_layers):
        if moe is not None and is_moe_layer(arch, layer):
            expert = 3 * h * moe.moe_intermediate_size
            reached = moe.num_experts * (
                1 - (1 - moe.num_experts_per_tok / moe.num_experts) ** batch
            )
            params += (reached + moe.n_shared_experts) * expert + moe.num_experts * h
        else:
            params += 3 * h * arch.intermediate_size
    kv_read = batch * context * 2 * arch.num_hidden_layers * kv * kv_bytes
    return params * weight_bytes + arch.vocab_size * h * 2 + kv_read


def decode_ms(engine, prompts: list[list[int]], tokens: int) -> float:
    """Median host time (ms) between consecutive steps that each gave every one of the
    greedy requests (one per prompt, all added at once) a new token."""
    from pagoda import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    tag = time.perf_counter_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"v{tag}-{i}", prompt, params, output_kind="delta")
    arrivals = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if len(prompts) == sum(1 for o in outs if o.outputs[0].token_ids):
            arrivals.append(time.perf_counter())
    if len(arrivals) < 2:
        raise RuntimeError(
            f"only {len(arrivals)} steps decoded all {len(prompts)} requests: "
            "raise --tokens (or the token budget, for a large --batch)"
        )
    return statistics.median(b - a for a, b in zip(arrivals, arrivals[1:])) * 1e3


def use_variant(runner, name: str, max_model_len: int) -> float:
    """The runner on variant `name`'s configs, its CUDA graphs captured again; seconds."""
    import torch

    start = time.perf_counter()
    runner.graph_runner = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    runner.use_kernel_configs(configs_for(name, runner.device))
    runner.graph_runner = runner.capture_cuda_graphs(runner.model, runner.backend, max_model_len)
    return time.perf_counter() - start


def run_steps(args, run) -> dict:
    import numpy as np

    from benchmarks.harness.workloads import random_prompts
    from pagoda import LLM
    from pagoda.model.presets import get_preset

    names = variant_names(args)
    for name in names:
        print(describe(name))
    if args.max_num_batched_tokens is None and args.batch == 1:
        args.max_num_batched_tokens = 512  # few mixed graphs to capture again per variant
    smoke = dict(device="cpu", dtype="float32", kv_cache_memory=1 << 24) if run.smoke else {}
    preset = "tiny-llama" if run.smoke else args.preset
    llm = LLM(
        preset,
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        skip_tokenizer_init=True,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        **{"dtype": "bfloat16", **smoke},
    )
    engine = llm.llm_engine
    runner = getattr(engine.executor, "runner", None)
    if runner is None:
        raise SystemExit(
            "steps needs the in-process executor (one device): it captures the "
            "model runner's graphs again between variants"
        )
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [args.prompt] * args.batch, engine.model_info.vocab_size)
    decode_ms(engine, prompts[:1], 8)  # first use of the sampler and the step loop
    samples = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names:
            capture_s = use_variant(runner, name, args.max_model_len)
            ms = decode_ms(engine, prompts, args.tokens)
            samples[name].append(ms)
            print(
                f"round {round_index} {name:<28} {ms:.4f} ms/step (capture {capture_s:.1f} s)",
                flush=True,
            )
    use_variant(runner, "default", args.max_model_len)
    engine.shutdown()
    context = args.prompt + args.tokens // 2
    nbytes = streamed_bytes(
        get_preset(preset),
        args.batch,
        context,
        1 if args.quantization == "fp8" else 2,
        1 if args.kv_cache_dtype.startswith("fp8") else 2,
    )
    bw = run.ceilings.get("copy_bytes_per_s")
    roofline_ms = nbytes / bw * 1e3 if bw else float("nan")
    rows = [
        {
            "variant": name,
            "overrides": describe(name),
            "ms_per_step": values,
            "median_ms": statistics.median(values),
            "spread_ms": max(values) - min(values),
            "roofline_ms": roofline_ms,
            "of_roofline": roofline_ms / statistics.median(values),
        }
        for name, values in samples.items()
    ]
    print(
        f"\n{'variant':<28}{'ms/step':>10}{'spread':>8}{'roofline':>10}  "
        f"(median over {args.rounds} rounds)"
    )
    for row in rows:
        print(
            f"{row['variant']:<28}{row['median_ms']:>10.4f}{row['spread_ms']:>8.4f}"
            f"{row['roofline_ms']:>10.4f}"
        )
    return {"streamed_bytes": nbytes, "rows": rows}
