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
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime

import aiohttp

from benchmarks.harness.results import write_result
from benchmarks.harness.server import ServerProcess
from benchmarks.soak_bench.client import (
    FAILURES,
    PROMPTS,
    Result,
    Spec,
    describe,
    make_spec,
    run_request,
)
from benchmarks.soak_bench.report import print_table, summarize

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
        "failures": [describe(r) for r in results if r.outcome in FAILURES][:20],
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
