"""Soak test of `pagoda serve`: Poisson overload with client disconnects and aborts.

Owns one program: it starts a real `pagoda serve` subprocess on 127.0.0.1 (a free
port, the KV-audit debug route on), measures what it can serve with a short
closed-loop calibration, then sends open-loop Poisson arrivals at
`--rate-multiplier` (2) times that rate for `--duration` seconds (600). The
workload mixes short prompts, several max_tokens, streaming and non-streaming,
completions and chat; a share of streams is disconnected mid-stream and a share
of requests is aborted before the first token. Every request ends in exactly one
outcome: completed (200 + a full answer), rejected (429 with Retry-After) or
aborted by its client; anything else (other statuses, a malformed or failed
stream, a connection error, no end within `--request-timeout` = hung) is a failure.

Checks (exit 1 if any fails): no failed request, the server's resident memory
(VmRSS, children included) grows < 5 % from the end of the first minute of load to
the end, the KV audit is clean after the load settles (no block in use, nothing
running, waiting or in flight), /health answers 200, and the server stops cleanly.
The server is always stopped, also on Ctrl-C or an error.

    python -m benchmarks.soak                        # the 10-minute soak
    python -m benchmarks.soak --duration 90 --calibration-seconds 20

Unknown flags go to `pagoda serve` after the soak's own defaults (so they win),
e.g. `--max-num-seqs 16 --max-num-queued-requests 8`. Prints a summary table and
writes JSON (default bench_results/soak-<device>-<date>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime

import aiohttp
import numpy as np

from benchmarks.harness.results import write_result
from benchmarks.harness.server import ServerProcess

PROBE_TIMEOUT = aiohttp.ClientTimeout(total=30)  # /health and /debug/kv_audit calls
# Server flags the soak sets; flags passed through come after them and win. A small
# running batch and queue cap make 2x overload reach admission control (429) quickly.
SERVER_DEFAULTS = (
    "--device",
    "cpu",
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "32",
    "--max-num-queued-requests",
    "32",
    "--shutdown-timeout",
    "30",
    "--enable-debug-routes",
)
OWNED_FLAGS = ("--host", "--port", "--api-key")
PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Count from one to five.",
    "Why is the sky blue?",
    "Describe a cat in one sentence.",
    "What is 7 times 8?",
    "Say hello in Spanish.",
    "Tell me a fun fact.",
    "Name a planet.",
)
MAX_TOKENS = (8, 16, 32, 64)
RSS_GROWTH_LIMIT = 0.05
FAILURES = ("http_error", "bad_429", "malformed", "stream_error", "connection_error", "hung")


# ----------------------------------------------------------------------------- one request


@dataclasses.dataclass
class Spec:
    behaviour: str  # normal | disconnect (mid-stream) | abort (before the first token)
    chat: bool
    stream: bool
    max_tokens: int
    ignore_eos: bool
    temperature: float
    prompt: str
    disconnect_after: int = 0  # content chunks read before closing the connection
    abort_after_s: float = 0.0


@dataclasses.dataclass
class Result:
    spec: Spec
    start: float
    outcome: str = ""  # completed | rejected | aborted | one of FAILURES
    detail: str = ""
    end: float = 0.0
    ttft: float | None = None
    tokens: int | None = None


def make_spec(
    rng: random.Random, disconnect_share: float, abort_share: float, normal_only: bool = False
) -> Spec:
    draw = 1.0 if normal_only else rng.random()
    behaviour = (
        "disconnect"
        if draw < disconnect_share
        else "abort"
        if draw < disconnect_share + abort_share
        else "normal"
    )
    spec = Spec(
        behaviour,
        chat=rng.random() < 0.5,
        stream=rng.random() < 0.5,
        max_tokens=rng.choice(MAX_TOKENS),
        ignore_eos=rng.random() < 0.5,
        temperature=rng.choice((0.0, 0.8)),
        prompt=rng.choice(PROMPTS),
    )
    if behaviour == "disconnect":  # long enough that it is cut mid-stream
        spec.stream, spec.max_tokens, spec.ignore_eos = True, 64, True
        spec.disconnect_after = rng.randint(1, 4)
    elif behaviour == "abort":
        spec.abort_after_s = rng.uniform(0.0, 0.5)
    return spec


def _body(spec: Spec) -> tuple[str, dict]:
    body = {
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "ignore_eos": spec.ignore_eos,
        "stream": spec.stream,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.chat:
        return "/v1/chat/completions", {
            **body,
            "messages": [{"role": "user", "content": spec.prompt}],
        }
    return "/v1/completions", {**body, "prompt": spec.prompt}


def _check_answer(spec: Spec, finish_reason, tokens) -> str:
    """'' for a full answer, else what is wrong with it."""
    if finish_reason not in ("stop", "length"):
        return f"finish_reason {finish_reason!r}"
    if not isinstance(tokens, int) or not 0 <= tokens <= spec.max_tokens:
        return f"completion_tokens {tokens!r} outside [0, {spec.max_tokens}]"
    if (spec.ignore_eos or finish_reason == "length") and tokens != spec.max_tokens:
        return f"{tokens} completion tokens, expected {spec.max_tokens} ({finish_reason})"
    return ""


async def _read_stream(resp: aiohttp.ClientResponse, res: Result) -> None:
    spec, chunks, finish, tokens, done = res.spec, 0, None, None, False
    async for raw in resp.content:
        line = raw.strip()
        if not line:
            continue
        if done or not line.startswith(b"data: "):
            res.outcome, res.detail = "malformed", f"unexpected line {line[:80]!r}"
            return
        if line == b"data: [DONE]":
            done = True
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            res.outcome, res.detail = "malformed", f"not JSON: {line[:80]!r}"
            return
        if "error" in event:
            res.outcome, res.detail = "stream_error", json.dumps(event["error"])[:200]
            return
        for choice in event.get("choices") or []:
            if (choice.get("delta") or {}).get("content") if spec.chat else choice.get("text"):
                chunks += 1
                if res.ttft is None:
                    res.ttft = time.monotonic() - res.start
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            tokens = event["usage"].get("completion_tokens")
        if spec.behaviour == "disconnect" and chunks >= spec.disconnect_after:
            resp.close()  # the client goes away mid-stream
            res.outcome, res.detail = "aborted", "disconnected mid-stream"
            return
    problem = "no [DONE]" if not done else _check_answer(spec, finish, tokens)
    res.tokens = tokens
    res.outcome, res.detail = ("malformed", problem) if problem else ("completed", "")


async def _exchange(session: aiohttp.ClientSession, url: str, res: Result) -> None:
    path, body = _body(res.spec)
    async with session.post(url + path, json=body) as resp:
        if resp.status == 429:
            ok = resp.headers.get("Retry-After", "").isdigit()
            res.outcome, res.detail = ("rejected", "") if ok else ("bad_429", "no Retry-After")
        elif resp.status != 200:
            res.outcome, res.detail = (
                "http_error",
                f"HTTP {resp.status}: {(await resp.text())[:200]}",
            )
        elif res.spec.stream:
            await _read_stream(resp, res)
        else:
            try:
                data = await resp.json()
                choice = data["choices"][0]
                text = choice["message"]["content"] if res.spec.chat else choice["text"]
                res.tokens, finish = data["usage"]["completion_tokens"], choice["finish_reason"]
                problem = "" if isinstance(text, str) else "no text"
                problem = problem or _check_answer(res.spec, finish, res.tokens)
            except (ValueError, KeyError, IndexError, TypeError, aiohttp.ContentTypeError) as exc:
                problem = f"bad JSON answer: {type(exc).__name__}: {exc}"
            res.outcome, res.detail = ("malformed", problem) if problem else ("completed", "")


async def run_request(
    session: aiohttp.ClientSession, url: str, spec: Spec, timeout_s: float
) -> Result:
    """One request to its single outcome (never raises but on cancellation of the caller)."""
    res = Result(spec, start=time.monotonic())
    task = asyncio.create_task(_exchange(session, url, res))
    try:
        if spec.behaviour == "abort":
            await asyncio.wait({task}, timeout=spec.abort_after_s)
            if not task.done():  # the client gives up: cancelling closes the connection
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                res.outcome = "aborted"
                res.detail = (
                    "before the first token" if res.ttft is None else "after the first token"
                )
        if not res.outcome:
            await asyncio.wait_for(task, max(0.0, timeout_s - (time.monotonic() - res.start)))
    except TimeoutError:
        res.outcome, res.detail = "hung", f"no end within {timeout_s:.0f} s"
    except (aiohttp.ClientError, OSError) as exc:
        res.outcome, res.detail = "connection_error", f"{type(exc).__name__}: {exc}"[:200]
    except asyncio.CancelledError:
        task.cancel()
        raise
    res.end = time.monotonic()
    return res


# ----------------------------------------------------------------------------- phases


async def calibrate(session, url: str, args, rng: random.Random) -> dict:
    """Closed loop of normal requests at `concurrency` for `calibration_seconds` (requests
    still in flight then are cancelled): the steady completion rate, (n - 1) completions
    over the time from the first to the last."""
    results: list[Result] = []

    async def worker() -> None:
        while True:
            spec = make_spec(rng, 0.0, 0.0, normal_only=True)
            results.append(await run_request(session, url, spec, args.request_timeout))
            if results[-1].outcome == "rejected":  # the queue cap: honour Retry-After
                await asyncio.sleep(1.0)

    workers = [asyncio.create_task(worker()) for _ in range(args.calibration_concurrency)]
    await asyncio.sleep(args.calibration_seconds)
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    ends = sorted(r.end for r in results if r.outcome == "completed")
    rate = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) >= 2 and ends[-1] > ends[0] else 0.0
    return {
        "seconds": args.calibration_seconds,
        "concurrency": args.calibration_concurrency,
        "completed": len(ends),
        "completed_per_s": rate,
        "outcomes": dict(Counter(r.outcome for r in results)),
        "failures": [_describe(r) for r in results if r.outcome in FAILURES][:20],
    }


async def sample_rss(
    server: ServerProcess, t0: float, samples: list, interval_s: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        rss = server.rss_bytes()
        if rss is not None:
            samples.append((time.monotonic() - t0, rss))
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass


async def send_poisson(
    session, url: str, rate: float, args, rng: random.Random
) -> tuple[list[asyncio.Task], float]:
    """Open-loop Poisson arrivals at `rate`/s for `duration` s (a bounded count); returns
    the requests' tasks (each bounded by --request-timeout) and the seconds of sending."""
    max_requests = int(rate * args.duration * 1.5) + 100
    tasks: list[asyncio.Task] = []
    start = time.monotonic()
    next_at = start
    while len(tasks) < max_requests:
        next_at += rng.expovariate(rate)
        if next_at - start >= args.duration:
            break
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        spec = make_spec(rng, args.disconnect_share, args.abort_share)
        tasks.append(asyncio.create_task(run_request(session, url, spec, args.request_timeout)))
    return tasks, time.monotonic() - start


async def settle(session, url: str, timeout_s: float) -> dict:
    """Polls /debug/kv_audit until clean (or timeout); then /health."""
    start = time.monotonic()
    audit: dict = {}
    while True:
        try:
            async with session.get(f"{url}/debug/kv_audit", timeout=PROBE_TIMEOUT) as r:
                audit = (
                    await r.json()
                    if r.status == 200
                    else {"status": r.status, "body": await r.text()}
                )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            audit = {"error": f"{type(exc).__name__}: {exc}"}
        clean = (
            audit.get("in_use") == 0
            and audit.get("num_running") == 0
            and audit.get("num_waiting") == 0
            and audit.get("num_in_flight") == 0
            and audit.get("free", -1) + audit.get("cached", -1) == audit.get("total")
        )
        if clean or time.monotonic() - start >= timeout_s:
            break
        await asyncio.sleep(0.2)  # audit poll interval
    try:
        async with session.get(f"{url}/health", timeout=PROBE_TIMEOUT) as r:
            health = r.status
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        health = f"{type(exc).__name__}: {exc}"
    return {
        "audit": audit,
        "audit_clean": clean,
        "settle_s": time.monotonic() - start,
        "health_status": health,
    }


async def run_soak(server: ServerProcess, args) -> dict:
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=args.max_connections, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        startup_s = await asyncio.to_thread(server.wait_ready, args.startup_timeout)
        print(
            f"server ready in {startup_s:.1f} s at {server.url} (pid {server.proc.pid})", flush=True
        )
        for chat in (False, True):  # warm-up, not measured
            spec = Spec("normal", chat, False, 4, True, 0.0, PROMPTS[0])
            await run_request(session, server.url, spec, args.request_timeout)
        calibration = await calibrate(session, server.url, args, rng)
        capacity = calibration["completed_per_s"]
        print(
            f"calibration: {capacity:.2f} completed requests/s at concurrency "
            f"{args.calibration_concurrency}",
            flush=True,
        )
        if capacity <= 0:
            print("calibration: fewer than 2 completions; raise --calibration-seconds", flush=True)
            return {"startup_s": startup_s, "calibration": calibration}
        rate = capacity * args.rate_multiplier
        print(f"load: Poisson at {rate:.2f} requests/s for {args.duration:.0f} s", flush=True)
        samples: list = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        sampler = asyncio.create_task(sample_rss(server, t0, samples, args.rss_interval, stop))
        try:
            tasks, sending_s = await send_poisson(session, server.url, rate, args, rng)
            results = list(await asyncio.gather(*tasks))
            load_s = time.monotonic() - t0
            final = await settle(session, server.url, args.settle_timeout)
        finally:
            stop.set()
            await sampler
        end_rss = server.rss_bytes()
        if end_rss is not None:
            samples.append((time.monotonic() - t0, end_rss))
    return {
        "startup_s": startup_s,
        "calibration": calibration,
        "target_rate": rate,
        "sending_s": sending_s,
        "load_s": load_s,
        "results": results,
        "rss_samples": samples,
        **final,
    }


# ----------------------------------------------------------------------------- report


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None  # linear, as pagoda bench


def _describe(r: Result) -> dict:
    s = r.spec
    return {
        "outcome": r.outcome,
        "detail": r.detail,
        "behaviour": s.behaviour,
        "endpoint": "chat" if s.chat else "completions",
        "stream": s.stream,
        "max_tokens": s.max_tokens,
        "latency_s": round(r.end - r.start, 3),
    }


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
        "failures": [_describe(r) for r in results if r.outcome in FAILURES][:50],
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


# ----------------------------------------------------------------------------- main


def parse_args(argv) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="Other flags are passed to `pagoda serve`."
    )
    add = ap.add_argument
    add("--duration", type=float, default=600.0, help="seconds of Poisson load (600)")
    add("--calibration-seconds", type=float, default=30.0, help="closed-loop window (30)")
    add("--calibration-concurrency", type=int, help="default: the server's --max-num-seqs")
    add("--rate-multiplier", type=float, default=2.0, help="offered load / capacity (2)")
    add("--disconnect-share", type=float, default=0.15, help="streams closed mid-stream (0.15)")
    add("--abort-share", type=float, default=0.15, help="aborted before the first token (0.15)")
    add("--request-timeout", type=float, default=300.0, help="no end after this: hung (300 s)")
    add("--rss-interval", type=float, default=5.0, help="seconds between RSS samples (5)")
    add("--settle-timeout", type=float, default=60.0, help="wait for a clean KV audit (60 s)")
    add("--startup-timeout", type=float, default=600.0, help="wait for /health (600 s)")
    add("--max-connections", type=int, default=1000, help="client connection cap (1000)")
    add("--seed", type=int, default=0, help="workload and arrivals seed (0)")
    add(
        "--output",
        "--out",
        dest="output",
        help="JSON path (default bench_results/soak-<device>-<date>.json)",
    )
    add("--server-log", help="the server's log file (default: a temp file)")
    args, server_args = ap.parse_known_args(argv)
    server_args = [a for a in server_args if a != "--"]
    owned = [a for a in server_args if a.split("=")[0] in OWNED_FLAGS]
    if owned:
        ap.error(f"the soak sets {', '.join(OWNED_FLAGS)} itself; remove {owned}")
    if not (args.duration > 0 and args.calibration_seconds > 0 and args.rate_multiplier > 0):
        ap.error("--duration, --calibration-seconds and --rate-multiplier must be > 0")
    if not 0 <= args.disconnect_share + args.abort_share <= 1:
        ap.error("--disconnect-share + --abort-share must be within [0, 1]")
    server_args = [*SERVER_DEFAULTS, *server_args]
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--max-num-seqs", type=int)
    probe.add_argument("--device")
    known, _ = probe.parse_known_args(server_args)
    args.device = known.device
    if args.calibration_concurrency is None:
        args.calibration_concurrency = known.max_num_seqs
    return args, server_args


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args, server_args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so `finally` stops the server
    date = datetime.now(UTC)
    log_path = (
        args.server_log
        or tempfile.NamedTemporaryFile(
            prefix="pagoda-soak-server-", suffix=".log", delete=False
        ).name
    )
    server = ServerProcess(server_args, log_path)
    print(f"server: {' '.join(server.args[1:])}\nserver log: {log_path}", flush=True)
    try:
        run = asyncio.run(run_soak(server, args))
    except KeyboardInterrupt:
        print("interrupted: stopping the server", file=sys.stderr)
        return 130
    finally:
        stopped = server.stop(timeout=60.0)
        print(
            f"server stopped: exit code {stopped['exit_code']}"
            f"{' (killed)' if stopped['killed'] else ''}",
            flush=True,
        )
    summary = summarize(run, stopped, args)
    print_table(summary, run)
    report = {
        "benchmark": "soak",
        "date": date.isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config": vars(args),
        "server_args": server_args,
        "startup_s": run.get("startup_s"),
        "calibration": run.get("calibration"),
        **summary,
        "audit": run.get("audit"),
        "settle_s": run.get("settle_s"),
        "health_status": run.get("health_status"),
        "server_stop": stopped,
        "server_log": {"path": log_path, **server.log_problems()},
        "rss_samples": [[round(t, 1), rss] for t, rss in run.get("rss_samples", [])],
    }
    output = args.output or f"bench_results/soak-{args.device}-{date:%Y-%m-%d}.json"
    write_result(output, report)
    print(f"{'PASS' if summary['passed'] else 'FAIL'}; JSON: {output}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
