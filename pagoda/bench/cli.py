"""The `pagoda bench` command line: serve, sweep, throughput, latency, compare, plot.

Owns the flags (vLLM's `bench serve` names, so existing scripts keep working) and
their validation; the work itself lives in the sibling modules, imported lazily so
that `pagoda bench throughput/latency` never pull in the server stack.

The main CLI calls `add_bench_subparsers(subparsers)`; `python -m pagoda.bench ...`
uses `build_bench_parser()` directly.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pagoda.bench.arguments import add_dataset_args, nonnegative_int, positive_float, positive_int
from pagoda.bench.backends import ALIASES, resolve_backend
from pagoda.bench.metrics import GOODPUT_METRICS, LATENCY_METRICS


def parse_metric_names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        if name not in LATENCY_METRICS:
            raise argparse.ArgumentTypeError(
                f"percentile metric must be one of {', '.join(LATENCY_METRICS)}, got {name!r}"
            )
    return names


def parse_percentiles(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    for p in values:
        if not 0 < p <= 100:
            raise argparse.ArgumentTypeError(f"metric percentiles must be in (0, 100], got {p}")
    return values


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    if not items:
        return None
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput takes NAME:MS with NAME one of "
                f"{', '.join(GOODPUT_METRICS)}, got {item!r}"
            )
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(
                f"--goodput {item!r}: {value!r} is not a number of milliseconds"
            ) from None
        if not limit > 0:
            raise ValueError(f"--goodput {item!r}: the limit must be > 0 ms")
        slos[name] = limit
    return slos


def _backend(text: str) -> str:
    # Resolved at parse time: everything downstream (payload, endpoint, report) sees
    # the protocol name, so an alias can never reach a code path as an unknown name.
    try:
        return resolve_backend(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target (the only server this command talks to)")
    g.add_argument(
        "--backend",
        type=_backend,
        default="openai",
        metavar="NAME",
        help="openai: /v1/completions; openai-chat: /v1/chat/completions; "
        f"vLLM's OpenAI-compatible names are aliases of openai ({', '.join(ALIASES)})",
    )
    g.add_argument(
        "--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: --host/--port)"
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--endpoint", default=None, help="path under the base URL (default: by --backend)"
    )
    g.add_argument(
        "--model", default=None, help="model name to send (default: the first of /v1/models)"
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer (HF directory or .gguf); default: the server's /tokenize",
    )
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        help="seconds for one whole request, stream included",
    )
    add_dataset_args(p)
    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=positive_float,
        default=math.inf,
        help="requests per second (inf: all at once)",
    )
    g.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="gamma shape of the arrival gaps; 1.0 is Poisson, lower is burstier",
    )
    g.add_argument("--max-concurrency", type=positive_int, default=None)
    g.add_argument("--num-warmups", type=nonnegative_int, default=0)
    g.add_argument(
        "--max-duration",
        type=positive_float,
        default=None,
        help="seconds; stop sending and cancel what is in flight after this long",
    )
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        help="JSON object merged into every request body",
    )
    g.add_argument("--disable-tqdm", action="store_true")
    g.add_argument(
        "--metrics-interval",
        type=float,
        default=1.0,
        help="seconds between /metrics scrapes during the run (0: before/after only)",
    )
    add_report_args(p)
    g = p.add_argument_group("metrics")
    g.add_argument(
        "--percentile-metrics",
        type=parse_metric_names,
        default=list(LATENCY_METRICS),
        help="comma-separated: ttft,tpot,itl,e2el",
    )
    g.add_argument("--metric-percentiles", type=parse_percentiles, default=[50.0, 90.0, 95.0, 99.0])
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000",
    )


def add_report_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("report")
    g.add_argument("--save-result", action="store_true")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="also keep every inter-token latency and generated text",
    )
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--label", default=None, help="name of this run in reports and plots")


def build_bench_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the bench sub-commands to `parser`; each sets `bench_func`."""
    sub = parser.add_subparsers(
        dest="bench_command", metavar="{serve,sweep,throughput,latency,compare,plot}"
    )
    sub.required = True
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    add_serve_args(p)
    p.set_defaults(bench_func=_run_serve)
    p = sub.add_parser("sweep", help="bench serve at several request rates or concurrencies")
    add_serve_args(p)
    from pagoda.bench.sweep import add_sweep_args  # per subcommand: start-up time

    add_sweep_args(p)
    p.set_defaults(bench_func=_run_sweep)
    from pagoda.bench.offline import (  # per subcommand: start-up time
        add_latency_args,
        add_throughput_args,
    )

    p = sub.add_parser("throughput", help="offline engine throughput (LLM.generate)")
    add_throughput_args(p)
    p.set_defaults(bench_func=_run_throughput)
    p = sub.add_parser("latency", help="offline fixed-batch prefill and per-step decode latency")
    add_latency_args(p)
    p.set_defaults(bench_func=_run_latency)
    p = sub.add_parser("compare", help="A/B table of result JSON files")
    from pagoda.bench.compare import add_compare_args  # per subcommand: start-up time

    add_compare_args(p)
    p.set_defaults(bench_func=_run_compare)
    p = sub.add_parser("plot", help="PNG plots from result JSON files")
    from pagoda.bench.plot import add_plot_args  # per subcommand: start-up time

    add_plot_args(p)
    p.set_defaults(bench_func=_run_plot)
    return parser


def add_bench_subparsers(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on the main CLI's subparsers; sets `func=main_bench`."""
    parser = subparsers.add_parser("bench", help="measure a server or the offline engine")
    build_bench_parser(parser)
    parser.set_defaults(func=main_bench)
    return parser


def _finish_serve_args(args) -> None:
    args.goodput = parse_goodput(args.goodput)


def _run_serve(args):
    from pagoda.bench.serve import main_serve  # per subcommand: start-up time

    _finish_serve_args(args)
    return main_serve(args)


def _run_sweep(args):
    from pagoda.bench.sweep import main_sweep  # per subcommand: start-up time

    _finish_serve_args(args)
    return main_sweep(args)


def _run_throughput(args):
    from pagoda.bench.offline import main_throughput  # per subcommand: start-up time

    return main_throughput(args)


def _run_latency(args):
    from pagoda.bench.offline import main_latency  # per subcommand: start-up time

    return main_latency(args)


def _run_compare(args):
    from pagoda.bench.compare import main_compare  # per subcommand: start-up time

    return main_compare(args)


def _run_plot(args):
    from pagoda.bench.plot import main_plot  # per subcommand: start-up time

    return main_plot(args)


def main_bench(args) -> int:
    """Run the chosen bench sub-command; a bad value exits 2 with its message."""
    try:
        args.bench_func(args)
    except ValueError as err:
        print(f"pagoda bench {args.bench_command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_bench_parser(argparse.ArgumentParser(prog="pagoda bench"))
    return main_bench(parser.parse_args(argv))
