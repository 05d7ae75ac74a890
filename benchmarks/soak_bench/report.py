"""The soak's report: outcome counts, latency percentiles and resident-memory growth of
a run, the checks it must pass, and the summary table."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np

from benchmarks.soak_bench.client import FAILURES, Result, describe

RSS_GROWTH_LIMIT = 0.05


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None  # linear, as pagoda bench


def _rss_growth(samples: list, baseline_s: float, sending_s: float) -> dict:
    """Growth from the first minute of load (`baseline_s`) to the end, the larger of two:
    to the end of the load and to the final sample, after settling. Under load RSS moves
    by a few % between samples, so each figure under load is the median of the samples
    in the `baseline_s / 2` before it."""

    def median(lo: float, hi: float) -> int | None:
        values = [rss for t, rss in samples[:-1] if lo <= t <= hi]
        return int(np.median(values)) if values else None

    if len(samples) < 2:
        return {"rss_1min_bytes": None, "rss_end_bytes": None, "growth": None}
    base = median(baseline_s / 2, baseline_s) or samples[0][1]
    load_end, end = median(sending_s - baseline_s / 2, sending_s), samples[-1][1]
    growth = max((rss - base) / base for rss in (end, load_end) if rss is not None)
    return {
        "baseline_s": baseline_s,
        "rss_1min_bytes": base,
        "rss_load_end_bytes": load_end,
        "rss_end_bytes": end,
        "rss_peak_bytes": max(rss for _, rss in samples),
        "growth": growth,
    }


def summarize(run: dict, stopped: dict, args) -> dict:
    results: list[Result] = run.get("results", [])
    outcomes = Counter(r.outcome for r in results)
    completed = [r for r in results if r.outcome == "completed"]
    reject = [r.end - r.start for r in results if r.outcome == "rejected"]
    aborted = Counter(r.detail for r in results if r.outcome == "aborted")
    ms = lambda xs, q: None if not xs else round(1000 * _pct(xs, q), 1)  # noqa: E731
    e2e, ttft = (
        [r.end - r.start for r in completed],
        [r.ttft for r in completed if r.ttft is not None],
    )
    rss = _rss_growth(
        run.get("rss_samples", []), min(60.0, args.duration / 2), run.get("sending_s", 0.0)
    )
    failures = sum(outcomes[f] for f in FAILURES) + sum(
        n for o, n in run.get("calibration", {}).get("outcomes", {}).items() if o in FAILURES
    )
    checks = {
        "calibrated": run.get("calibration", {}).get("completed_per_s", 0) > 0,
        "every_request_accounted": sum(outcomes.values()) == len(results) and "" not in outcomes,
        "no_failed_requests": failures == 0,
        "rss_growth_below_5pct": rss["growth"] is not None and rss["growth"] < RSS_GROWTH_LIMIT,
        "kv_audit_clean": bool(run.get("audit_clean")),
        "health_ok": run.get("health_status") == 200,
        "server_stopped_cleanly": stopped["exit_code"] == 0 and not stopped["killed"],
    }
    load_s = run.get("sending_s") or 0.0
    return {
        "requests_sent": len(results),
        "outcomes": dict(outcomes),
        "aborted_by_kind": dict(aborted),
        "behaviours": dict(Counter(r.spec.behaviour for r in results)),
        "target_rate": run.get("target_rate"),
        "achieved_rate": len(results) / load_s if load_s else None,
        "completed_per_s": len(completed) / run["load_s"] if run.get("load_s") else None,
        "e2el_p50_ms": ms(e2e, 50),
        "e2el_p99_ms": ms(e2e, 99),
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "reject_p50_ms": ms(reject, 50),
        "reject_p99_ms": ms(reject, 99),
        "rss": rss,
        "failures": [describe(r) for r in results if r.outcome in FAILURES][:50],
        "checks": checks,
        "passed": all(checks.values()),
    }


def print_table(summary: dict, run: dict) -> None:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f} MiB"  # noqa: E731
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    pair = lambda key: f"{fmt(summary[key + '_p50_ms'])} / {fmt(summary[key + '_p99_ms'])} ms"  # noqa: E731
    rss, cal = summary["rss"], run.get("calibration", {})
    rows = [
        ("calibrated capacity", f"{fmt(cal.get('completed_per_s'))} req/s"),
        (
            "target / achieved rate",
            f"{fmt(summary['target_rate'])} / {fmt(summary['achieved_rate'])} req/s",
        ),
        ("completed per s (load + tail)", fmt(summary["completed_per_s"])),
        ("requests sent", str(summary["requests_sent"])),
    ]
    for outcome, n in sorted(summary["outcomes"].items()):
        rows.append((f"  {outcome}", str(n)))
        if outcome == "aborted":
            rows += [(f"    {k}", str(n)) for k, n in sorted(summary["aborted_by_kind"].items())]
    growth = None if rss["growth"] is None else 100 * rss["growth"]
    rows += [
        ("E2EL p50 / p99 (completed)", pair("e2el")),
        ("TTFT p50 / p99 (streams)", pair("ttft")),
        ("429 latency p50 / p99", pair("reject")),
        (
            f"RSS median at {fmt(rss.get('baseline_s'))} s / load end; settled",
            f"{mib(rss['rss_1min_bytes'])} / {mib(rss.get('rss_load_end_bytes'))}; "
            f"{mib(rss['rss_end_bytes'])}",
        ),
        ("RSS growth / peak", f"{fmt(growth)} % / {mib(rss.get('rss_peak_bytes'))}"),
        ("KV audit after settle", json.dumps(run.get("audit"))),
        ("settle time", f"{fmt(run.get('settle_s'))} s"),
    ]
    rows += [(f"check {name}", "PASS" if ok else "FAIL") for name, ok in summary["checks"].items()]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    for failure in summary["failures"][:10]:
        print("failure:", json.dumps(failure))
