"""The cost of the tensor-parallel executor itself: the same dummy-weight model at the
same tp size through the "mp" backend (one process per GPU, pipes) and the "ray"
backend (one Ray actor per GPU, actor calls), each in its own process, in one run.

    python3 benchmarks/tp_executor_overhead.py --preset llama-3.1-8b --tp 2 \\
        --out benchmarks/results/h200x2-tp-executors.json
    python3 benchmarks/tp_executor_overhead.py --smoke      # CPU, tiny model, seconds

Per backend: start-up seconds, batch-1 decode ms/token (median gap between tokens
reaching the host: where a per-step RPC overhead shows most), and `--batch` requests
of `--static-in` / `--static-out` tokens (output tok/s). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH_DIR))
from result_file import write_json  # noqa: E402  (benchmarks/)


def run_backend(backend: str, args) -> dict:
    """One backend's figures (runs in a child process of its own)."""
    import numpy as np
    from pagoda import LLM, SamplingParams

    memory = {"kv_cache_memory": 1 << 24} if args.device == "cpu" else {}
    t0 = time.perf_counter()
    llm = LLM(args.preset, load_format="dummy", dtype=args.dtype, device=args.device,
              tensor_parallel_size=args.tp, distributed_executor_backend=backend,
              max_model_len=args.max_model_len, max_num_seqs=args.batch,
              skip_tokenizer_init=True, **memory)
    engine = llm.llm_engine
    result = {"backend": backend, "startup_s": time.perf_counter() - t0}
    try:
        rng = np.random.default_rng(0)
        vocab = engine.model_info.vocab_size

        def prompts(n: int, length: int) -> list[dict]:
            return [{"prompt_token_ids": [int(t) for t in rng.integers(10, vocab - 10, length)]}
                    for _ in range(n)]

        warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        llm.generate(prompts(1, 64), warm, use_tqdm=False)
        engine.add_request("lat", prompts(1, 64)[0]["prompt_token_ids"],
                           SamplingParams(max_tokens=args.latency_tokens, temperature=0,
                                          ignore_eos=True), output_kind="delta")
        arrivals = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                arrivals.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        result["batch1_ms_per_token"] = statistics.median(gaps) * 1e3
        params = SamplingParams(max_tokens=args.static_out, temperature=0, ignore_eos=True)
        batch = prompts(args.batch, args.static_in)
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["static"] = {"seconds": seconds, "output_tokens": tokens,
                            "output_tok_per_s": tokens / seconds}
    finally:
        engine.shutdown()
    return result


def child_argv(backend: str, args) -> list[str]:
    skip = ("backends", "out", "child", "child_timeout", "smoke")
    return [sys.executable, os.path.abspath(__file__), "--child", backend,
            *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip]]


def run_child(backend: str, args) -> dict:
    try:
        out = subprocess.run(child_argv(backend, args), capture_output=True, text=True,
                             timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return {"backend": backend, "error": f"timed out after {args.child_timeout:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"backend": backend,
                                                "error": out.stderr[-3000:]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--backends", default="mp,ray")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--latency-tokens", type=int, default=128)
    p.add_argument("--static-in", type=int, default=1024)
    p.add_argument("--static-out", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/tp_executor_overhead.json")
    p.add_argument("--child-timeout", type=float, default=1500.0)
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny-llama, a few tokens: checks the script runs")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.preset, args.device, args.dtype, args.max_model_len = "tiny-llama", "cpu", "float32", 256
        args.batch, args.latency_tokens, args.static_in, args.static_out = 4, 8, 16, 8
        args.child_timeout = min(args.child_timeout, 300.0)
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(run_backend(args.child, args)), flush=True)
        return
    import torch
    report = {"benchmark": "tp_executor_overhead", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "gpus": torch.cuda.device_count()},
              "args": vars(args), "results": []}
    for backend in args.backends.split(","):
        result = run_child(backend, args)
        report["results"].append(result)
        print(json.dumps(result)[:600], flush=True)
    write_json(args.out, report, indent=1)
    print(f"\n{args.preset} tp {args.tp} on {args.device}")
    print(f"{'backend':<10}{'start-up s':>12}{'batch-1 ms/tok':>16}{'static tok/s':>14}")
    for r in report["results"]:
        print(f"{r['backend']:<10}{r.get('startup_s', float('nan')):>12.1f}"
              f"{r.get('batch1_ms_per_token', float('nan')):>16.2f}"
              f"{r.get('static', {}).get('output_tok_per_s', float('nan')):>14.0f}")
        if "error" in r:
            print(f"  {r['backend']} failed: {r['error'][-400:]}")


if __name__ == "__main__":
    main()
