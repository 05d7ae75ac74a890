"""TTFT at concurrency 1 through a real `pagoda serve`, with the server's stage trace.

Starts `pagoda serve` (the flags after `--` are passed through) with
PAGODA_TTFT_TRACE pointing at a JSONL file, then runs `pagoda bench serve`'s own
Python API at concurrency 1 for three workloads:

- short:  64-token prompts
- long:   2,112-token prompts (nothing cached)
- cached: 2,112-token prompts whose 2,048-token prefix is shared (cached after warm-up)

and prints, per workload, the client's TTFT and TPOT medians and the median time of
each server stage from HTTP arrival (pagoda/engine/trace.py names the stages).
Writes everything (every trace included) to --output.

    # GPU (no network needed):
    python -m benchmarks.ttft --output bench_results/ttft-h200.json -- \
        --model llama-3.1-8b --load-format dummy
    # CPU, a tiny random model with the embedded tokenizer:
    python -m benchmarks.ttft --tiny-cpu --output bench_results/ttft-cpu.json

A preset model has no tokenizer; unless `--tokenizer` is among the server flags, the
embedded SmolLM2 GGUF's tokenizer is used (its ids fit any preset's vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from benchmarks.harness.results import write_result
from benchmarks.harness.server import serve
from benchmarks.harness.workloads import config_dir

# name -> (random input len, shared prefix len); prompt length = input + prefix
WORKLOADS = {"short": (64, 0), "long": (2112, 0), "cached": (64, 2048)}

TINY_CONFIG = {  # ~1 ms forward on CPU, so the host-side overheads show
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def server_flags(args) -> list[str]:
    flags = list(args.server_args)
    if args.tiny_cpu:
        flags = [
            "--model",
            config_dir(TINY_CONFIG, "tiny-llama-"),
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--max-model-len",
            "4096",
            *flags,
        ]
    if "--tokenizer" not in flags and "--load-format" in flags:
        from pagoda.model.tokenizer import embedded_model_path

        flags += ["--tokenizer", str(embedded_model_path())]
    return flags


def bench_args(args, url: str, name: str):
    from pagoda.bench.cli import _finish_serve_args, build_bench_parser

    input_len, prefix_len = WORKLOADS[name]
    argv = [
        "serve",
        "--base-url",
        url,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-prefix-len",
        str(prefix_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--num-warmups",
        str(args.num_warmups),
        "--max-concurrency",
        "1",
        "--ignore-eos",
        "--seed",
        str(args.seed),
        "--metrics-interval",
        str(args.metrics_interval),
        "--disable-tqdm",
        "--label",
        name,
    ]
    parsed = build_bench_parser(argparse.ArgumentParser()).parse_args(argv)
    _finish_serve_args(parsed)
    return parsed


def read_traces(path: str, start: int) -> tuple[list[dict], int]:
    if not os.path.exists(path):
        return [], start
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [json.loads(line) for line in lines[start:]], len(lines)


def stage_medians(traces: list[dict]) -> dict[str, float]:
    """Median ms from arrival of every stage, in the order of those medians."""
    by_stage: dict[str, list[float]] = {}
    for t in traces:
        for stage, ms in t["ms"].items():
            by_stage.setdefault(stage, []).append(ms)
    medians = {stage: statistics.median(v) for stage, v in by_stage.items()}
    return dict(sorted(medians.items(), key=lambda kv: kv[1]))


def run_workload(args, url: str, trace_path: str, seen: int, name: str) -> tuple[dict, int]:
    from pagoda.bench.serve import main_serve

    report = main_serve(bench_args(args, url, name))
    traces, seen_after = read_traces(trace_path, seen)
    traces = traces[args.num_warmups :]  # the warm-up requests come first
    keys = (
        "completed",
        "failed",
        "median_ttft_ms",
        "mean_ttft_ms",
        "p90_ttft_ms",
        "median_tpot_ms",
        "median_itl_ms",
        "median_e2el_ms",
    )
    return {
        "workload": name,
        "prompt_len": sum(WORKLOADS[name]),
        "bench": {k: report.get(k) for k in keys},
        "server_metrics": report.get("server_metrics"),
        "stage_median_ms": stage_medians(traces),
        "gaps_median_ms": gap_medians(traces, (report.get("requests") or {}).get("ttft_ms")),
        "traces": traces,
    }, seen_after


def gap_medians(traces: list[dict], client_ttfts) -> dict:
    """Where client and server disagree: empty-text chunks, and time outside the server.

    At concurrency 1 the traces and the client's requests are in the same order.
    """

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    empty = [
        t["ms"]["first_text"] - t["ms"]["first_body"]
        for t in traces
        if "first_text" in t["ms"] and "first_body" in t["ms"]
    ]
    outside = []
    if client_ttfts and len(client_ttfts) == len(traces):
        outside = [
            c - t["ms"]["first_text"]
            for c, t in zip(client_ttfts, traces)
            if c is not None and "first_text" in t["ms"]
        ]
    return {
        "first_body_to_first_text": median(empty),
        "requests_with_empty_first_chunk": sum(1 for e in empty if e > 0),
        "client_ttft_minus_server_first_text": median(outside),
    }


def print_summary(results: list[dict]) -> None:
    for r in results:
        b = r["bench"]
        print(
            f"\n== {r['workload']} ({r['prompt_len']} prompt tokens): TTFT median "
            f"{b['median_ttft_ms']:.2f} ms (p90 {b['p90_ttft_ms']:.2f}), TPOT median "
            f"{(b['median_tpot_ms'] or float('nan')):.2f} ms, {b['completed']} requests"
        )
        print(f"   gaps (median ms): {json.dumps(r['gaps_median_ms'])}")
        previous = 0.0
        for stage, ms in r["stage_median_ms"].items():
            print(f"   {stage:<22} {ms:9.3f} ms   (+{ms - previous:8.3f})")
            previous = ms


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output", "--out", dest="output", default="bench_results/ttft.json")
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)}",
    )
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--num-warmups", type=int, default=3)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument(
        "--metrics-interval",
        type=float,
        default=1.0,
        help="the bench client's /metrics scrape period, as users run it (0: off)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tiny-cpu",
        action="store_true",
        help="serve a tiny random Llama on CPU (the embedded tokenizer)",
    )
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: flags for pagoda serve")
    args = p.parse_args(argv)
    if args.server_args and args.server_args[0] == "--":
        args.server_args = args.server_args[1:]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    workdir = tempfile.mkdtemp(prefix="pagoda-ttft-")
    trace_path, log_path = os.path.join(workdir, "trace.jsonl"), os.path.join(workdir, "serve.log")
    flags = server_flags(args)
    results, seen = [], 0
    with serve(flags, log_path, {"PAGODA_TTFT_TRACE": trace_path}) as server:
        for name in names:
            result, seen = run_workload(args, server.url, trace_path, seen, name)
            results.append(result)
    print_summary(results)
    out = {
        "benchmark": "ttft",
        "server_flags": flags,
        "config": {k: v for k, v in vars(args).items() if k != "server_args"},
        "results": results,
    }
    write_result(args.output, out, indent=1)
    print(f"\nsaved {args.output} (server log: {log_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
