"""`pagoda bench sweep`: `bench serve` at several request rates or concurrencies.

Owns the loop over load points. The dataset is built once (same prompts at every
point); each point is a full `bench serve` run whose report is saved as
`<label>-rate<R>.json` or `<label>-conc<C>.json` in `--result-dir`, then a summary
`sweep-<label>.json` lists every point's headline figures, and `--plot` writes the
PNGs of `pagoda bench plot` next to them.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from pagoda.bench import report as rep
from pagoda.bench.plot import write_plots
from pagoda.bench.serve import measure, plan_from_args, prepare

SUMMARY_KEYS = (
    "request_rate",
    "max_concurrency",
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "max_output_tokens_per_s",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def _float_list(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of numbers > 0 (inf allowed), got {text!r}"
        )
    return values


def _int_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers >= 1, got {text!r}")
    return values


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep (exactly one of)")
    g.add_argument("--request-rates", type=_float_list, default=None, help="e.g. 1,2,4,8,inf")
    g.add_argument("--max-concurrencies", type=_int_list, default=None, help="e.g. 1,4,16,64")
    g.add_argument("--plot", action="store_true", help="write the PNG figures after the sweep")


def sweep_points(args) -> list[tuple[str, float, object]]:
    """(file tag, request rate, max concurrency) per point."""
    if (args.request_rates is None) == (args.max_concurrencies is None):
        raise ValueError("sweep takes exactly one of --request-rates and --max-concurrencies")
    if args.request_rates is not None:
        return [
            (f"rate{'inf' if math.isinf(r) else f'{r:g}'}", r, args.max_concurrency)
            for r in args.request_rates
        ]
    return [(f"conc{c}", args.request_rate, c) for c in args.max_concurrencies]


def main_sweep(args) -> list[dict]:

    points = sweep_points(args)
    base_url, target, samples, tokenizer_name = prepare(args)
    args.label = args.label or f"{args.backend}:{args.model}"
    result_dir = args.result_dir or "."
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.label)
    args.save_result = False  # each point is saved below under its own name
    reports, paths = [], []
    for tag, rate, concurrency in points:
        print(f"== sweep point {tag} ==")
        plan = plan_from_args(args, request_rate=rate, max_concurrency=concurrency)
        report = measure(args, base_url, target, samples, tokenizer_name, plan)
        paths.append(rep.save_report(report, result_dir, f"{safe}-{tag}.json"))
        reports.append(report)
    summary = {
        "label": args.label,
        "files": paths,
        "points": [{k: r.get(k) for k in SUMMARY_KEYS} for r in reports],
    }
    summary_path = os.path.join(result_dir, f"sweep-{safe}.json")
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    print(f"saved {summary_path} and {len(paths)} result files")
    if args.plot:
        for path in write_plots(reports, result_dir):
            print(f"wrote {path}")
    return reports
