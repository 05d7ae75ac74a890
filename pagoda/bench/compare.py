"""`pagoda bench compare A.json B.json ...`: an A/B table of benchmark results.

Owns the comparison: the first file is the baseline; every other file gets, per
metric, its value, the difference (other - baseline) and the ratio (other /
baseline), and a verdict "better" / "worse" by the metric's direction (throughput up
is better, latency down is better). Output as a text table, Markdown, or JSON.
"""

from __future__ import annotations

import argparse
import json
import os

from pagoda.bench.report import load_report

# Metrics shown by default, per report kind, with the direction that is better.
HIGHER_IS_BETTER = {
    "completed",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "requests_per_second",
    "tokens_per_second",
    "output_tokens_per_second",
}
DEFAULT_METRICS = {
    "serve": [
        "completed",
        "failed",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "p99_e2el_ms",
    ],
    "throughput": [
        "elapsed_time",
        "requests_per_second",
        "tokens_per_second",
        "output_tokens_per_second",
    ],
    "latency": [
        "prefill_latency_ms.mean",
        "prefill_latency_ms.p99",
        "decode_step_latency_ms.mean",
        "decode_step_latency_ms.p50",
        "decode_step_latency_ms.p99",
        "e2e_latency_ms.mean",
    ],
}
NEUTRAL = {"max_concurrent_requests"}  # a count of what happened, not a goal
# An offline throughput run read with a serve run's key names, so the server can be
# compared with the engine it wraps (same requests, same engine limits).
THROUGHPUT_AS_SERVE = {
    "requests_per_second": "request_throughput",
    "output_tokens_per_second": "output_throughput",
    "tokens_per_second": "total_token_throughput",
    "elapsed_time": "duration",
}
MIXED_METRICS = ["request_throughput", "output_throughput", "total_token_throughput", "duration"]


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="result JSON files; the first is the baseline")
    p.add_argument(
        "--metrics",
        default=None,
        help="comma-separated keys (dots reach into objects, e.g. server_metrics.preemptions)",
    )
    p.add_argument("--format", choices=("table", "markdown", "json"), default="table")
    p.add_argument("--output", default=None, help="also write the comparison to this file")


def metric_value(report: dict, key: str):
    value = report
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def verdict(key: str, base: float | None, other: float | None) -> str:
    if base is None or other is None or base == other or key in NEUTRAL:
        return ""
    higher_better = key.split(".")[0] in HIGHER_IS_BETTER  # every other metric is a cost
    return "better" if (other > base) == higher_better else "worse"


def compare_reports(reports: list[dict], labels: list[str], keys: list[str] | None = None) -> dict:
    """{"labels": [...], "rows": [{"metric", "values", "deltas", "ratios", "verdicts"}]}."""
    if len(reports) < 2:
        raise ValueError("compare needs at least two result files")
    kinds = {r["kind"] for r in reports}
    if len(kinds) == 1:
        keys = keys or DEFAULT_METRICS[reports[0]["kind"]]
    elif kinds == {"serve", "throughput"}:
        reports = [_as_serve_keys(r) for r in reports]
        keys = keys or MIXED_METRICS
    else:
        raise ValueError(
            f"cannot compare reports of kinds {', '.join(sorted(kinds))} "
            "(serve and throughput reports mix; latency reports only with each other)"
        )
    rows = []
    for key in keys:
        values = [metric_value(r, key) for r in reports]
        if all(v is None for v in values):
            continue
        base = values[0]
        deltas = [None if base is None or v is None else v - base for v in values[1:]]
        ratios = [None if not base or v is None else v / base for v in values[1:]]
        rows.append(
            {
                "metric": key,
                "values": values,
                "deltas": deltas,
                "ratios": ratios,
                "verdicts": [verdict(key, base, v) for v in values[1:]],
            }
        )
    return {"labels": labels, "rows": rows}


def _as_serve_keys(report: dict) -> dict:
    if report["kind"] != "throughput":
        return report
    return {
        **report,
        **{serve: report[own] for own, serve in THROUGHPUT_AS_SERVE.items() if own in report},
    }


def _num(value, signed: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not signed:
        return str(value)
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def _cells(table: dict) -> tuple[list[str], list[list[str]]]:
    labels = table["labels"]
    head = ["metric", labels[0]]
    for label in labels[1:]:
        head += [label, "delta", "ratio", ""]
    body = []
    for row in table["rows"]:
        cells = [row["metric"], _num(row["values"][0])]
        for v, d, r, w in zip(row["values"][1:], row["deltas"], row["ratios"], row["verdicts"]):
            cells += [_num(v), _num(d, signed=True), "-" if r is None else f"{r:.3f}x", w]
        body.append(cells)
    return head, body


def format_table(table: dict) -> str:
    head, body = _cells(table)
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [head] + body
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(line.rstrip() for line in lines)


def format_markdown(table: dict) -> str:
    head, body = _cells(table)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _label(report: dict, path: str, seen: set) -> str:
    label = report.get("label") or os.path.splitext(os.path.basename(path))[0]
    if label in seen:  # two runs of the same setup: tell them apart by file name
        label = f"{label} ({os.path.basename(path)})"
    seen.add(label)
    return label


def main_compare(args) -> str:
    reports = [load_report(path) for path in args.files]
    seen: set = set()
    labels = [_label(r, p, seen) for r, p in zip(reports, args.files)]
    keys = [k.strip() for k in args.metrics.split(",") if k.strip()] if args.metrics else None
    table = compare_reports(reports, labels, keys)
    if args.format == "json":
        text = json.dumps(table, indent=2)
    elif args.format == "markdown":
        text = format_markdown(table)
    else:
        text = format_table(table)
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return text
