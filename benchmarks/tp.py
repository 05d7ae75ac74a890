"""Tensor parallelism on one host: the same dummy-weight workloads at several
tensor-parallel sizes, the all-reduce by message size, and the executor backends' cost.
Each engine runs in a process of its own; NVLink multicast stays off
(pagoda.distributed.parallel_state.keep_multicast_off).

    python -m benchmarks.tp compare --configs llama-3.1-8b:1,llama-3.1-8b:2,llama-3.1-70b:2 --allreduce
    python -m benchmarks.tp allreduce --tp 2 --hidden 4096
    python -m benchmarks.tp executors --preset llama-3.1-8b --tp 2
    python -m benchmarks.tp executors --smoke        # CPU, tiny model, seconds

compare    Per configuration (preset:tp, or preset:tp:nccl for NCCL carrying every
           all-reduce, i.e. --disable-custom-all-reduce): batch-1 decode ms/token (median
           gap between tokens reaching the host, 128-token prompt) and 256 requests x 1024
           in / 128 out (output tok/s), beside the roofline of a batch-1 step per rank:
           (weight bytes / tp) / measured copy bandwidth; with --allreduce, the allreduce
           mode's figures for each tp > 1.
allreduce  All-reduce time over tp GPUs of one process each, for 1, 4, 16, 64, 128 and 512
           tokens' bf16 hidden states: NCCL and Pagoda's one-shot path
           (pagoda/distributed/fast_all_reduce.py), eager and inside a CUDA graph (median
           per call), and the one-shot result's largest error against NCCL's.
executors  The tensor-parallel executor's own cost: the same model and tp through the "mp"
           backend (one process per GPU, pipes) and "ray" (one actor per GPU): start-up
           seconds, batch-1 ms/token (where a per-step RPC overhead shows most) and
           `--batch` x `--static-in` / `--static-out` (output tok/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.harness.processes import run_json_child, write_child_result
from benchmarks.harness.results import write_result
from benchmarks.harness.rooflines import measure_ceilings, model_bytes_and_flops
from benchmarks.harness.timing import capture_graph, cuda_event_ms, graph_replay_ms
from benchmarks.harness.workloads import random_prompts, token_arrival_times

TOKENS = (1, 4, 16, 64, 128, 512)
CALLS_PER_GRAPH = 20


def batch1_and_static(llm, args, prompt_len: int) -> dict:
    """Batch-1 ms/token (median gap between tokens reaching the host, after a warm-up) and
    args.batch x args.static_in / args.static_out through LLM.generate (output tok/s)."""
    import numpy as np

    from pagoda import SamplingParams

    engine = llm.llm_engine
    vocab, rng = engine.model_info.vocab_size, np.random.default_rng(0)
    greedy = dict(temperature=0, ignore_eos=True)
    prompt = random_prompts(rng, [prompt_len], vocab)[0]
    llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, **greedy), use_tqdm=False
    )
    engine.add_request(
        "lat", prompt, SamplingParams(max_tokens=args.latency_tokens, **greedy), output_kind="delta"
    )
    arrivals = token_arrival_times(engine)
    result = {
        "batch1_ms_per_token": statistics.median(b - a for a, b in zip(arrivals, arrivals[1:]))
        * 1e3
    }
    prompts = random_prompts(rng, [args.static_in] * args.batch, vocab)
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=args.static_out, **greedy),
        use_tqdm=False,
    )
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["static"] = {
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / seconds,
    }
    return result


# ================================================================ compare ==========
def compare_child(config: str, args) -> dict:
    from pagoda import LLM

    preset, tp, *flags = config.split(":")
    t0 = time.perf_counter()
    llm = LLM(
        preset,
        load_format="dummy",
        dtype="bfloat16",
        tensor_parallel_size=int(tp),
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        disable_custom_all_reduce="nccl" in flags,
    )
    engine = llm.llm_engine
    result = {
        "preset": preset,
        "tp": int(tp),
        "all_reduce": "nccl" if "nccl" in flags else "auto",
        "startup_s": time.perf_counter() - t0,
        "num_kv_blocks": engine.num_blocks,
    }
    result.update(batch1_and_static(llm, args, 128))
    engine.shutdown()
    return result


def run_compare(args) -> dict:
    import torch

    from pagoda.model.presets import get_preset

    report = {"ceilings": measure_ceilings(torch.device("cuda")), "configs": []}
    for config in args.configs.split(","):
        preset, tp, *_ = config.split(":")
        arch = get_preset(preset)
        info = model_bytes_and_flops(arch)
        per_rank = (info["weight_bytes"] - info["embedding_bytes"]) / int(tp)
        entry = {
            "config": config,
            "roofline_batch1_ms": per_rank / report["ceilings"]["copy_bytes_per_s"] * 1e3,
        }
        if int(tp) > 1 and args.allreduce and "nccl" not in config:
            entry["allreduce"] = run_json_child(
                "benchmarks.tp",
                ["allreduce", "--tp", tp, "--hidden", str(arch.hidden_size)],
                timeout=300,
            )
        entry["result"] = run_json_child(
            "benchmarks.tp",
            [
                "compare",
                "--child",
                config,
                "--max-model-len",
                str(args.max_model_len),
                "--batch",
                str(args.batch),
                "--latency-tokens",
                str(args.latency_tokens),
                "--static-in",
                str(args.static_in),
                "--static-out",
                str(args.static_out),
            ],
            timeout=args.child_timeout,
        )
        report["configs"].append(entry)
        print(json.dumps(entry)[:600], flush=True)
    print(f"\n{'config':<22}{'batch-1 ms/tok':>16}{'roofline ms':>13}{'static tok/s':>14}")
    for e in report["configs"]:
        r = e["result"]
        print(
            f"{e['config']:<22}{r.get('batch1_ms_per_token', float('nan')):>16.2f}"
            f"{e['roofline_batch1_ms']:>13.2f}"
            f"{r.get('static', {}).get('output_tok_per_s', float('nan')):>14.0f}"
        )
    return report


# ================================================================ allreduce ========
def _time_path(reduce, x) -> dict:
    """Eager and graph-replay time of reduce(x) (a function returning the sum), us per call."""
    import torch

    for _ in range(10):
        reduce(x)
    torch.cuda.synchronize()
    eager = statistics.median(cuda_event_ms(lambda: reduce(x), 100, 0)) * 1e3
    graph = capture_graph(lambda: reduce(x), CALLS_PER_GRAPH)
    return {
        "eager_us": round(eager, 2),
        "graph_us": round(graph_replay_ms(graph, 30, 0) * 1e3 / CALLS_PER_GRAPH, 2),
    }


def _allreduce_rank(rank: int, tp: int, hidden: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from pagoda.distributed import parallel_state as ps

    torch.cuda.set_device(rank)
    ps.init_distributed(rank, tp, f"tcp://127.0.0.1:{port}", "nccl")
    fast = ps._fast_all_reduce

    def nccl(x):
        dist.all_reduce(x)
        return x

    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
        row = {"tokens": tokens, "bytes": x.numel() * 2}
        if fast is not None:
            saved, fast.max_bytes = fast.max_bytes, fast.buffer.numel() * 2
            if fast.can_reduce(x):
                expected = x.clone()
                dist.all_reduce(expected)
                row["one_shot_max_abs_err"] = (fast.all_reduce(x) - expected).abs().max().item()
                row["one_shot"] = _time_path(fast.all_reduce, x)
            fast.max_bytes = saved
        row["nccl"] = _time_path(nccl, x)  # last: it sums x in place, over and over
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), file=sys.stderr, flush=True)
    if rank == 0:
        write_child_result(
            out,
            {
                "tp": tp,
                "hidden": hidden,
                "one_shot_available": fast is not None,
                "default_one_shot_max_bytes": fast.max_bytes if fast else 0,
                "sizes": rows,
            },
        )
    ps.destroy_distributed()


def run_allreduce(args) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    from benchmarks.harness.server import free_port
    from pagoda.distributed.parallel_state import keep_multicast_off

    keep_multicast_off()  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = args.child_out or f"{tmp}/allreduce.json"
        mp.spawn(
            _allreduce_rank,
            args=(args.tp, args.hidden, free_port(), out),
            nprocs=args.tp,
            join=True,
        )
        if args.child_out:
            return {}
        with open(out) as f:
            return json.load(f)


# ================================================================ executors ========
def executor_child(backend: str, args) -> dict:
    from pagoda import LLM

    memory = {"kv_cache_memory": 1 << 24} if args.device == "cpu" else {}
    t0 = time.perf_counter()
    llm = LLM(
        args.preset,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tp,
        distributed_executor_backend=backend,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        skip_tokenizer_init=True,
        **memory,
    )
    result = {"backend": backend, "startup_s": time.perf_counter() - t0}
    try:
        result.update(batch1_and_static(llm, args, 64))
    finally:
        llm.llm_engine.shutdown()
    return result


def run_executors(args) -> dict:
    results = []
    for backend in args.backends.split(","):
        argv = [
            "executors",
            "--child",
            backend,
            *(
                f"--{k.replace('_', '-')}={getattr(args, k)}"
                for k in (
                    "preset",
                    "tp",
                    "device",
                    "dtype",
                    "max_model_len",
                    "batch",
                    "latency_tokens",
                    "static_in",
                    "static_out",
                )
            ),
        ]
        result = {"backend": backend, **run_json_child("benchmarks.tp", argv, args.child_timeout)}
        results.append(result)
        print(json.dumps(result)[:600], flush=True)
    print(f"\n{args.preset} tp {args.tp} on {args.device}")
    print(f"{'backend':<10}{'start-up s':>12}{'batch-1 ms/tok':>16}{'static tok/s':>14}")
    for r in results:
        print(
            f"{r['backend']:<10}{r.get('startup_s', float('nan')):>12.1f}"
            f"{r.get('batch1_ms_per_token', float('nan')):>16.2f}"
            f"{r.get('static', {}).get('output_tok_per_s', float('nan')):>14.0f}"
        )
        if "error" in r:
            print(f"  {r['backend']} failed: {r['error']} {r.get('stderr_tail', '')[-400:]}")
    return {"results": results}


# ================================================================ command line =====
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)

    def mode(name: str, help_text: str):
        p = modes.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--out",
            "--output",
            dest="out",
            default=f"bench_results/tp-{name}.json",
            help="JSON result file",
        )
        p.add_argument("--child", default=None, help=argparse.SUPPRESS)
        p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
        return p

    def workload(p, batch: int = 256) -> None:
        p.add_argument("--max-model-len", type=int, default=2304)
        p.add_argument("--batch", type=int, default=batch)
        p.add_argument("--latency-tokens", type=int, default=128)
        p.add_argument("--static-in", type=int, default=1024)
        p.add_argument("--static-out", type=int, default=128)

    p = mode("compare", "the same workloads at several tensor-parallel sizes")
    p.add_argument("--configs", default="llama-3.1-8b:1,llama-3.1-8b:2")
    workload(p)
    p.add_argument(
        "--allreduce",
        action="store_true",
        help="also time the all-reduce by message size for each tp > 1",
    )
    p.add_argument("--child-timeout", type=float, default=1500.0)
    p = mode("allreduce", "NCCL and one-shot all-reduce by message size, eager and in a graph")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p = mode("executors", "the mp and ray executor backends at the same tp")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--backends", default="mp,ray")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    workload(p)
    p.add_argument("--child-timeout", type=float, default=1500.0)
    p.add_argument(
        "--smoke", action="store_true", help="CPU, tiny-llama, a few tokens: checks the mode runs"
    )
    args = parser.parse_args(argv)
    if getattr(args, "smoke", False):
        args.preset, args.device, args.dtype, args.max_model_len = (
            "tiny-llama",
            "cpu",
            "float32",
            256,
        )
        args.batch, args.latency_tokens, args.static_in, args.static_out = 4, 8, 16, 8
        args.child_timeout = min(args.child_timeout, 300.0)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        child = compare_child if args.mode == "compare" else executor_child
        write_child_result(args.child_out, child(args.child, args))
        return
    run = {"compare": run_compare, "allreduce": run_allreduce, "executors": run_executors}[
        args.mode
    ]
    result = run(args)
    if args.child_out:
        return
    write_result(args.out, {"benchmark": f"tp {args.mode}", "args": vars(args), **result}, indent=1)


if __name__ == "__main__":
    main()
