"""`pagoda bench plot`: PNG figures from `bench serve` / `bench sweep` result files.

Owns three figures (matplotlib, Agg backend, no display needed):

- `latency_cdf.png`: cumulative distributions of TTFT, TPOT and E2E latency, one
  line per result file.
- `throughput_vs_rate.png`: output tok/s against the offered load.
- `p99_ttft_vs_rate.png`: P99 TTFT against the offered load.

The offered load on the x axis is the request rate when every file has a finite one,
else the max concurrency when every file has one, else the files in rate order.
Lines are grouped by each file's `label` (one engine or setup per line).
"""

from __future__ import annotations

import argparse
import math
import os

from pagoda.bench.report import load_report

CDF_METRICS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "E2E latency (ms)"))


def add_plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="result JSON files of bench serve or sweep")
    p.add_argument("--output-dir", default=".", help="where the PNG files go")
    p.add_argument("--dpi", type=int, default=120)


def _rate(report: dict) -> float:
    rate = report.get("request_rate")
    return math.inf if rate in (None, "inf") else float(rate)


def load_axis(reports: list[dict]) -> tuple[str, list[float], list[str] | None]:
    """(axis title, x per report, tick labels or None) for the vs-load figures."""
    rates = [_rate(r) for r in reports]
    if all(math.isfinite(x) for x in rates):
        return "request rate (req/s)", rates, None
    concurrencies = [r.get("max_concurrency") for r in reports]
    if all(c is not None for c in concurrencies):
        return "max concurrency", [float(c) for c in concurrencies], None
    order = sorted(set(rates))
    return (
        "request rate (req/s)",
        [float(order.index(x)) for x in rates],
        ["inf" if math.isinf(x) else f"{x:g}" for x in order],
    )


def _serve_reports(paths: list[str]) -> list[dict]:
    reports = [load_report(p) for p in paths]
    for path, report in zip(paths, reports):
        if report["kind"] != "serve":
            raise ValueError(
                f"{path}: plot takes bench serve/sweep results, not kind {report['kind']!r}"
            )
    return reports


def _line_name(report: dict, reports: list[dict]) -> str:
    same_label = sum(1 for r in reports if r["label"] == report["label"])
    if same_label == 1:
        return report["label"]
    rate = report.get("request_rate")
    return f"{report['label']} rate={rate} conc={report.get('max_concurrency')}"


def plot_latency_cdf(reports: list[dict], path: str, dpi: int = 120) -> str:
    import matplotlib.pyplot as plt  # matplotlib: plots only

    fig, axes = plt.subplots(1, len(CDF_METRICS), figsize=(5 * len(CDF_METRICS), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], CDF_METRICS):
        for report in reports:
            values = sorted(v for v in report["requests"].get(key, []) if v is not None)
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, fractions, where="post", label=_line_name(report, reports))
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle("Latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_vs_load(reports: list[dict], key: str, ylabel: str, path: str, dpi: int = 120) -> str:
    import matplotlib.pyplot as plt  # matplotlib: plots only

    xlabel, xs, ticks = load_axis(reports)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["label"] for r in reports):
        points = sorted(
            (x, r.get(key))
            for x, r in zip(xs, reports)
            if r["label"] == label and r.get(key) is not None
        )
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if ticks is not None:
        ax.set_xticks(range(len(ticks)), ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def write_plots(reports: list[dict], output_dir: str, dpi: int = 120) -> list[str]:
    import matplotlib  # matplotlib: plots only

    matplotlib.use("Agg")
    os.makedirs(output_dir, exist_ok=True)
    return [
        plot_latency_cdf(reports, os.path.join(output_dir, "latency_cdf.png"), dpi),
        plot_vs_load(
            reports,
            "output_throughput",
            "output tokens/s",
            os.path.join(output_dir, "throughput_vs_rate.png"),
            dpi,
        ),
        plot_vs_load(
            reports,
            "p99_ttft_ms",
            "P99 TTFT (ms)",
            os.path.join(output_dir, "p99_ttft_vs_rate.png"),
            dpi,
        ),
    ]


def main_plot(args) -> list[str]:
    paths = write_plots(_serve_reports(args.files), args.output_dir, args.dpi)
    for path in paths:
        print(f"wrote {path}")
    return paths
