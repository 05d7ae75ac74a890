"""Tensor parallelism on one host: the same dummy-weight workloads at several
tensor-parallel sizes, each configuration in its own process, in one run.

    python3 benchmarks/tp_compare.py --configs llama-3.1-8b:1,llama-3.1-8b:2,llama-3.1-70b:2 \\
        --out tp.json

Per configuration (preset:tp, or preset:tp:nccl for NCCL carrying every all-reduce,
i.e. --disable-custom-all-reduce): batch-1 decode ms/token (median gap between tokens
reaching the host, 128-token prompt) and 256 requests x 1024 in / 128 out (output
tok/s), plus the roofline of a batch-1 step per rank: (weight bytes / tp + KV bytes)
/ measured copy bandwidth, and (--allreduce) all-reduce times from a decode-sized
message up, NCCL and one-shot, eager and inside a CUDA graph, for tp > 1. Prints a table; writes JSON.
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

from gpu_compare import (measure_ceilings, model_bytes_and_flops, random_prompts,  # noqa: E402
                         token_arrival_times)
from result_file import write_json  # noqa: E402  (benchmarks/)


def run_config(preset: str, tp: int, args, nccl_only: bool = False) -> dict:
    import numpy as np
    from pagoda import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(preset, load_format="dummy", dtype="bfloat16", tensor_parallel_size=tp,
              max_model_len=args.max_model_len, max_num_seqs=args.batch,
              disable_custom_all_reduce=nccl_only)
    engine = llm.llm_engine
    result = {"preset": preset, "tp": tp, "all_reduce": "nccl" if nccl_only else "auto",
              "startup_s": time.perf_counter() - t0, "num_kv_blocks": engine.num_blocks}
    vocab, rng = engine.model_info.vocab_size, np.random.default_rng(0)
    prompt = random_prompts(rng, [128], vocab)[0]
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    engine.add_request("lat", prompt, SamplingParams(max_tokens=args.latency_tokens,
                                                     temperature=0, ignore_eos=True),
                       output_kind="delta")
    arrivals = token_arrival_times(engine)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    result["batch1_ms_per_token"] = statistics.median(gaps) * 1e3
    prompts = random_prompts(rng, [args.static_in] * args.batch, vocab)
    params = SamplingParams(max_tokens=args.static_out, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["static"] = {"seconds": seconds, "output_tokens": tokens,
                        "output_tok_per_s": tokens / seconds}
    engine.shutdown()
    return result


def allreduce_times(tp: int, hidden: int) -> dict:
    """All-reduce times of bf16 messages from one decode token's hidden state up, NCCL and
    the one-shot path, eager and in a CUDA graph (benchmarks/tp_allreduce.py)."""
    cmd = [sys.executable, os.path.join(BENCH_DIR, "tp_allreduce.py"), "--tp", str(tp),
           "--hidden", str(hidden)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        return {"error": "timed out after 300 s", "stderr_tail": str(exc.stderr)[-2000:]}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": out.stderr[-2000:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="llama-3.1-8b:1,llama-3.1-8b:2")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--latency-tokens", type=int, default=128)
    p.add_argument("--static-in", type=int, default=1024)
    p.add_argument("--static-out", type=int, default=128)
    p.add_argument("--out", default="bench_results/tp_compare.json")
    p.add_argument("--allreduce", action="store_true",
                   help="also time NCCL all-reduce of one token's hidden state")
    p.add_argument("--child-timeout", type=float, default=1500.0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        preset, tp, *flags = args.child.split(":")
        print(json.dumps(run_config(preset, int(tp), args, nccl_only="nccl" in flags)))
        return
    import torch
    from pagoda.model.presets import get_preset
    report = {"benchmark": "tp_compare", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "torch": torch.__version__,
                          "gpus": torch.cuda.device_count()},
              "args": vars(args), "ceilings": measure_ceilings(torch.device("cuda")),
              "configs": []}
    for config in args.configs.split(","):
        preset, tp, *_ = config.split(":")
        arch = get_preset(preset)
        info = model_bytes_and_flops(arch)
        per_rank = (info["weight_bytes"] - info["embedding_bytes"]) / int(tp)
        entry = {"config": config, "roofline_batch1_ms":
                 per_rank / report["ceilings"]["copy_bytes_per_s"] * 1e3}
        if int(tp) > 1 and args.allreduce and "nccl" not in config:
            entry["allreduce"] = allreduce_times(int(tp), arch.hidden_size)
        argv = [sys.executable, os.path.abspath(__file__), "--child", config,
                *[f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                  if k not in ("configs", "out", "child", "allreduce", "child_timeout")]]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=args.child_timeout)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            entry["result"] = json.loads(lines[-1]) if lines else {"error": out.stderr[-3000:]}
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
            entry["result"] = {"error": f"timed out after {args.child_timeout:.0f} s",
                               "stderr_tail": (err or "")[-3000:]}
        report["configs"].append(entry)
        print(json.dumps(entry)[:600], flush=True)
    write_json(args.out, report, indent=1)
    print(f"\n{'config':<22}{'batch-1 ms/tok':>16}{'roofline ms':>13}{'static tok/s':>14}")
    for e in report["configs"]:
        r = e["result"]
        print(f"{e['config']:<22}{r.get('batch1_ms_per_token', float('nan')):>16.2f}"
              f"{e['roofline_batch1_ms']:>13.2f}"
              f"{r.get('static', {}).get('output_tok_per_s', float('nan')):>14.0f}")


if __name__ == "__main__":
    main()
