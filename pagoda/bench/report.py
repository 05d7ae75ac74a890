"""Benchmark reports: the versioned JSON schema, the printed table, length buckets.

Owns the result file every `pagoda bench` command writes. Schema version 1:

    schema_version  1
    kind            "serve" | "throughput" | "latency"
    date, label, pagoda_version, config (the command's flags)
    kind "serve": vLLM's flat keys (backend, model_id, num_prompts, request_rate
        ("inf" when unbounded), burstiness, max_concurrency, duration, completed,
        total_input_tokens, total_output_tokens, request_throughput, request_goodput,
        output_throughput, total_token_throughput, max_output_tokens_per_s,
        max_concurrent_requests, {mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms)
        plus failed, cancelled, not_sent, failures {kind: n}, errors (first few),
        server_metrics, buckets (by input and output length), requests (per-request
        arrays: input_lens, output_lens, start_s, ttft_ms, tpot_ms, e2el_ms,
        error_kinds; itls_ms too with --save-detailed).
    kind "throughput" / "latency": see throughput.py and latency.py.

`validate_report` is the schema check that compare and plot run on every file.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Iterable
from importlib.metadata import version

from pagoda.bench import metrics as m

SCHEMA_VERSION = 1
KINDS = ("serve", "throughput", "latency")
MAX_ERRORS_KEPT = 20
_COMMON_KEYS = {"schema_version": int, "kind": str, "date": str, "label": str, "config": dict}
_KIND_KEYS = {
    "serve": {
        "backend": str,
        "model_id": str,
        "num_prompts": int,
        "duration": float,
        "completed": int,
        "failed": int,
        "cancelled": int,
        "not_sent": int,
        "failures": dict,
        "request_throughput": float,
        "output_throughput": float,
        "total_token_throughput": float,
        "max_output_tokens_per_s": float,
        "max_concurrent_requests": int,
        "requests": dict,
        "buckets": list,
        "server_metrics": dict,
    },
    "throughput": {
        "model_id": str,
        "num_prompts": int,
        "elapsed_time": float,
        "requests_per_second": float,
        "tokens_per_second": float,
        "output_tokens_per_second": float,
    },
    "latency": {
        "model_id": str,
        "batch_size": int,
        "input_len": int,
        "output_len": int,
        "prefill_latency_ms": dict,
        "decode_step_latency_ms": dict,
        "e2e_latency_ms": dict,
    },
}


def _pagoda_version() -> str:
    try:
        return version("pagoda")
    except Exception:  # noqa: BLE001 - not installed as a distribution: report unknown
        return "unknown"


def _jsonable(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def config_of(args) -> dict:
    """The command's flags, JSON-safe (callables dropped, inf as "inf")."""
    return {k: _jsonable(v) for k, v in sorted(vars(args).items()) if not callable(v)}


def header(kind: str, label: str, args) -> dict:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "label": label,
        "pagoda_version": _pagoda_version(),
        "config": config_of(args),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def per_request_arrays(results: Iterable[m.RequestResult], detailed: bool) -> dict:
    """One entry per prompt, in dataset order; None where a figure is undefined."""
    results = list(results)
    arrays = {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [m.output_token_count(r) if r.success else None for r in results],
        "start_s": [r.start for r in results],
        "ttft_ms": [_ms(m.ttft(r)) if r.success else None for r in results],
        "tpot_ms": [_ms(m.tpot(r)) if r.success else None for r in results],
        "e2el_ms": [_ms(m.e2el(r)) if r.success else None for r in results],
        "error_kinds": [
            None if r.success else (r.error_kind or ("not_sent" if not r.sent else None))
            for r in results
        ],
    }
    if detailed:
        arrays["itls_ms"] = [[x * 1000.0 for x in m.itls(r)] for r in results]
        arrays["generated_texts"] = [r.generated_text for r in results]
    return arrays


def _bucket_label(n: int | None) -> str:
    """Power-of-two ranges: 0, 1, 2-3, 4-7, ..., 128-255."""
    if n is None:
        return "unknown"
    if n <= 1:
        return str(n)
    low = 1 << (n.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def _bucket_key(label: str) -> tuple:
    return (1, 0) if label == "unknown" else (0, int(label.split("-")[0]))


def length_buckets(results: Iterable[m.RequestResult], percentiles=(50, 99)) -> list[dict]:
    """Sent requests grouped by (input length, requested output length) ranges."""
    groups: dict[tuple[str, str], list[m.RequestResult]] = {}
    for r in results:
        if r.sent:
            key = (_bucket_label(r.prompt_len), _bucket_label(r.expected_output_len))
            groups.setdefault(key, []).append(r)
    rows = []
    for inp, out in sorted(groups, key=lambda k: (_bucket_key(k[0]), _bucket_key(k[1]))):
        members = groups[(inp, out)]
        done = [r for r in members if r.success]
        row = {
            "input_len": inp,
            "output_len": out,
            "count": len(members),
            "completed": len(done),
            "failed": len(members) - len(done),
        }
        for name, fn in (("ttft", m.ttft), ("tpot", m.tpot), ("e2el", m.e2el)):
            values = [x * 1000.0 for x in map(fn, done) if x is not None]
            stats = m.distribution(values, percentiles)
            row[f"mean_{name}_ms"] = stats["mean"]
            for p in percentiles:
                key = m.percentile_key(p)
                row[f"{key}_{name}_ms"] = stats[key]
        rows.append(row)
    return rows


def serve_report(
    args, plan, summary: dict, outcome, tokenizer_name: str, base_url: str, detailed: bool = False
) -> dict:
    """The JSON of one `bench serve` run (see the module docstring for the schema)."""
    label = args.label or f"{args.backend}:{args.model}"
    report = header("serve", label, args)
    errors = [f"{r.error_kind}: {r.error}" for r in outcome.results if r.sent and not r.success]
    report.update(
        {
            "backend": args.backend,
            "model_id": args.model,
            "tokenizer_id": tokenizer_name,
            "base_url": base_url,
            "dataset_name": args.dataset_name,
            "num_prompts": len(outcome.results),
            "request_rate": _jsonable(plan.request_rate),
            "burstiness": plan.burstiness,
            "max_concurrency": plan.max_concurrency,
            "max_duration": plan.max_duration,
            "stopped_by_time_limit": outcome.stopped_by_time_limit,
            "warmup_failures": outcome.warmup_failures,
            "goodput_slos_ms": args.goodput or None,
        }
    )
    report.update(summary)
    report["errors"] = errors[:MAX_ERRORS_KEPT]
    report["server_metrics"] = outcome.server_metrics
    report["buckets"] = length_buckets(outcome.results)
    report["requests"] = per_request_arrays(outcome.results, detailed)
    return report


def validate_report(report: dict, where: str = "report") -> dict:
    """Raise ValueError naming the first missing or mistyped key; return the report."""
    if not isinstance(report, dict):
        raise ValueError(f"{where}: a report is a JSON object")
    version = report.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"{where}: schema_version must be {SCHEMA_VERSION}, got {version!r}")
    kind = report.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    for key, typ in {**_COMMON_KEYS, **_KIND_KEYS[kind]}.items():
        if key not in report:
            raise ValueError(f"{where}: missing key {key!r}")
        value = report[key]
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            if typ is float
            else isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        )
        if not ok:
            raise ValueError(f"{where}: {key!r} must be {typ.__name__}, got {type(value).__name__}")
    return report


def save_report(report: dict, result_dir: str | None, filename: str | None) -> str:
    validate_report(report)
    directory = result_dir or "."
    os.makedirs(directory, exist_ok=True)
    if not filename:
        stamp = report["date"].replace(":", "").replace("-", "")
        safe_label = "".join(c if c.isalnum() or c in "-_." else "_" for c in report["label"])
        filename = f"{report['kind']}-{safe_label}-{stamp}.json"
    path = os.path.join(directory, filename)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, allow_nan=False)
    return path


def load_report(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        try:
            report = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from err
    return validate_report(report, path)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _bucket_lines(buckets: list[dict], width: int) -> list[str]:
    """Per input/output length range: requests, failures, mean TTFT / TPOT (ms)."""
    if len(buckets) < 2:
        return []
    lines = [
        " By input / output length ".center(width, "-"),
        f"{'input':>9} {'output':>9} {'n':>5} {'fail':>4} {'TTFT':>9} {'TPOT':>9}",
    ]
    for b in buckets:
        lines.append(
            f"{b['input_len']:>9} {b['output_len']:>9} {b['count']:>5} {b['failed']:>4} "
            f"{_fmt(b['mean_ttft_ms']):>9} {_fmt(b['mean_tpot_ms']):>9}"
        )
    return lines


def format_serve_table(report: dict) -> str:
    """The human summary printed after a run (vLLM's layout, plus failures by cause)."""
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "=")]

    def row(name: str, value) -> None:
        lines.append(f"{name:<40}{_fmt(value):>10}")

    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    for kind, count in report["failures"].items():
        row(f"  {kind}:", count)
    row("Cancelled at time limit:", report["cancelled"])
    row("Not sent (time limit):", report["not_sent"])
    row("Maximum request concurrency:", report.get("max_concurrency"))
    row("Benchmark duration (s):", report["duration"])
    row("Total input tokens:", report.get("total_input_tokens"))
    row("Total generated tokens:", report.get("total_output_tokens"))
    row("Request throughput (req/s):", report["request_throughput"])
    if report.get("request_goodput") is not None:
        row("Request goodput (req/s):", report["request_goodput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Peak output token throughput (tok/s):", report["max_output_tokens_per_s"])
    row("Peak concurrent requests:", report["max_concurrent_requests"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name, title in titles.items():
        keys = [k for k in report if k.endswith(f"_{name}_ms") and not k.startswith("std_")]
        if not keys:
            continue
        lines.append(f" {title} ".center(width, "-"))
        for key in keys:
            stat = key[: -len(f"_{name}_ms")]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            row(f"{label} {name.upper()} (ms):", report[key])
    lines += _bucket_lines(report.get("buckets") or [], width)
    server = report.get("server_metrics") or {}
    if server.get("available"):
        lines.append(" Server (/metrics) ".center(width, "-"))
        for name in (
            "preemptions",
            "prefix_cache_hit_rate",
            "spec_decode_acceptance_rate",
            "spec_decode_mean_accepted_length",
            "peak_kv_cache_usage",
        ):
            row(f"{name}:", server.get(name))
        for name, value in server.get("peak_memory_bytes", {}).items():
            row(f"peak {name} (MiB):", value / 2**20)
        for tier, figures in (server.get("kv_offload") or {}).items():
            for name in (
                "hit_rate",
                "hits",
                "skipped_blocks",
                "bytes_loaded",
                "bytes_stored",
                "load_gb_per_s",
                "peak_usage",
                "failed_reads",
                "invalid_files",
            ):
                row(f"kv tier {tier} {name}:", figures.get(name))
    lines.append("=" * width)
    return "\n".join(lines)
