"""What the live dashboard costs: server throughput with and without dashboards connected
to /v1/engine/stats/stream, plus the cost of one statistics sample measured directly.

1. Throughput, A/B: one `pagoda serve` subprocess; `pagoda bench serve` runs the same
   workload (random prompts, ignore_eos, fixed concurrency) alternately without (A)
   and with (B) `--dashboards` stream clients reading in this process, in ABBA order
   `--rounds` times, so slow drift of a shared machine hits both arms alike. Prints
   every run, the median and best of each arm and B/A - 1 (target: within -1%).
2. One sample, directly (`--sample-calls`): an in-process AsyncEngine with the same
   model, a RequestLog full to its caps (the worst case for the percentile sort), and
   the StatsHub's own sample(): microseconds per sample, its share of one core at the
   stream's 4 samples/s, and what it holds the engine thread for (one get_stats()).

    python -m benchmarks.dashboard_overhead            # CPU, embedded SmolLM2
    python -m benchmarks.dashboard_overhead --smoke    # a tiny run: checks it works
    python -m benchmarks.dashboard_overhead --device cuda --model llama-3.1-8b \
        --load-format dummy --max-model-len 2048 --server-args "--tokenizer SMOLLM2.gguf" \
        --num-prompts 512 --input-len 1024 --output-len 128 --max-concurrency 256 \
        --rounds 3                                               # a GPU (a preset shape
                                                                 # has no tokenizer of its own)

Writes JSON to bench_results/dashboard-overhead.json (or --output).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import tempfile
import threading
import time

from benchmarks.harness.results import write_result
from benchmarks.harness.server import bench_serve, serve

STREAM_PATH = "/v1/engine/stats/stream"


class Dashboard(threading.Thread):
    """A dashboard client: reads the stats stream until stopped, counting samples."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples = 0
        self.stopping = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        # urllib, not httpx: the GPU machines have only the standard library for this.
        import urllib.request

        try:
            # No read timeout: on a saturated machine a sample can wait for a long step.
            with urllib.request.urlopen(self.url + STREAM_PATH) as response:
                for line in response:
                    if line.strip() == b"event: stats":
                        self.samples += 1
                    if self.stopping.is_set():
                        return
        except Exception as exc:  # reported by the caller
            self.error = exc


def serve_throughput(url: str, args, result_dir: str, name: str) -> float:
    """One `pagoda bench serve` run; its output throughput (tokens/s)."""
    report = bench_serve(
        url,
        [
            "--dataset-name",
            "random",
            "--num-prompts",
            str(args.num_prompts),
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--random-range-ratio",
            "0",
            "--ignore-eos",
            "--max-concurrency",
            str(args.max_concurrency),
            "--num-warmups",
            "0",
            "--log-level",
            "WARNING",
        ],
        result_dir,
        name,
    )
    return float(report["output_throughput"])


def _model_flags(args) -> list[str]:
    return [*(["--model", args.model] if args.model else []), "--load-format", args.load_format]


def run_ab(args) -> dict:
    flags = [
        "--device",
        args.device,
        "--max-model-len",
        str(args.max_model_len),
        *_model_flags(args),
        *shlex.split(args.server_args),
    ]
    log = os.path.join(tempfile.gettempdir(), "pagoda-dashboard-overhead-server.log")
    runs: dict[str, list[float]] = {"without": [], "with": []}
    samples = []
    with serve(flags, log) as server, tempfile.TemporaryDirectory() as result_dir:
        url = server.url
        serve_throughput(url, args, result_dir, "warmup.json")  # first-request costs, caches
        order = ["without", "with", "with", "without"] * args.rounds
        for i, arm in enumerate(order):
            dashboards = [Dashboard(url) for _ in range(args.dashboards if arm == "with" else 0)]
            for d in dashboards:
                d.start()
            tok_s = serve_throughput(url, args, result_dir, f"run{i}.json")
            for d in dashboards:
                d.stopping.set()
                d.join(timeout=5)
                if d.error is not None:
                    raise RuntimeError(f"the dashboard stream failed: {d.error!r}")
                samples.append(d.samples)
            runs[arm].append(tok_s)
            print(
                f"  run {i + 1:2d} {arm:>7} dashboard: {tok_s:8.1f} output tok/s"
                + (f"  ({dashboards[0].samples} samples read)" if dashboards else ""),
                flush=True,
            )
    summary = {
        arm: {"median": statistics.median(v), "best": max(v), "runs": v} for arm, v in runs.items()
    }
    summary["median_change"] = summary["with"]["median"] / summary["without"]["median"] - 1
    summary["best_change"] = summary["with"]["best"] / summary["without"]["best"] - 1
    summary["samples_read_per_dashboard_run"] = samples
    return summary


async def _measure_sample(args) -> dict:
    from pagoda.config import EngineArgs
    from pagoda.engine.async_engine import AsyncEngine, RequestTimings
    from pagoda.entrypoints.openai.stats_stream import StatsHub
    from pagoda.metrics.recent import RequestLog

    engine = AsyncEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            load_format=args.load_format,
            device=args.device,
            max_model_len=args.max_model_len,
        )
    )
    engine.start()
    await engine.wait_ready()
    log = RequestLog()
    now = time.monotonic()
    for i in range(4000):  # the window's cap, with the ITL cap reached too
        log.observe(
            RequestTimings(
                f"r{i}",
                now - 2.0 - i * 1e-4,
                now - 1.5,
                now - 1.0,
                0.01,
                100,
                64,
                "stop",
                [0.02 + (i % 7) * 1e-3] * 63,
            )
        )
    hub = StatsHub(engine, log, "m", is_draining=lambda: False)
    held: list[float] = []

    def timed_stats(llm_engine):
        start = time.perf_counter()
        stats = llm_engine.get_stats()
        held.append(time.perf_counter() - start)
        return stats

    costs, percentile_costs = [], []
    for _ in range(args.sample_calls):
        start = time.perf_counter()
        await hub.sample()
        costs.append(time.perf_counter() - start)
        log._cache = None  # as if requests kept finishing: the sort is redone
        start = time.perf_counter()
        log.percentiles(time.monotonic())
        percentile_costs.append(time.perf_counter() - start)
        await engine.call_in_loop(timed_stats)
    await engine.shutdown()
    per_s = 1.0 / hub.interval_s
    sample_us = statistics.median(costs) * 1e6
    percentile_us = statistics.median(percentile_costs) * 1e6
    # The percentiles are recomputed at most once a second; the rest runs every sample.
    core_share = (sample_us * per_s + percentile_us) / 1e6
    return {
        "sample_us_median": sample_us,
        "percentiles_full_window_us_median": percentile_us,
        "engine_thread_get_stats_us_median": statistics.median(held) * 1e6,
        "samples_per_s": per_s,
        "one_core_share_worst_case": core_share,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights of a preset shape")
    ap.add_argument("--server-args", default="", help="more `pagoda serve` flags, one string")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--dashboards", type=int, default=1, help="stream clients in the B arm")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (4 runs each)")
    ap.add_argument("--sample-calls", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="a tiny run that checks the script works")
    ap.add_argument(
        "--output", "--out", dest="output", default="bench_results/dashboard-overhead.json"
    )
    args = ap.parse_args()
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len, args.max_concurrency = 4, 16, 4, 4
        args.rounds, args.sample_calls = 1, 10
    print(
        f"A/B: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
        f"concurrency {args.max_concurrency}, {args.dashboards} dashboard(s) in B",
        flush=True,
    )
    ab = run_ab(args)
    print(f"without: median {ab['without']['median']:.1f}  best {ab['without']['best']:.1f} tok/s")
    print(f"with:    median {ab['with']['median']:.1f}  best {ab['with']['best']:.1f} tok/s")
    print(
        f"change:  median {ab['median_change'] * 100:+.2f}%  best {ab['best_change'] * 100:+.2f}%"
    )
    sample = asyncio.run(_measure_sample(args))
    print(
        f"one sample: {sample['sample_us_median']:.0f} us (engine thread held "
        f"{sample['engine_thread_get_stats_us_median']:.0f} us); percentiles over a full window "
        f"{sample['percentiles_full_window_us_median']:.0f} us once a second; worst case "
        f"{sample['one_core_share_worst_case'] * 100:.3f}% of one core"
    )
    result = {
        "benchmark": "dashboard_overhead",
        "device": args.device,
        "args": {k: v for k, v in vars(args).items() if k != "output"},
        "throughput": ab,
        "sample": sample,
    }
    write_result(args.output, result)


if __name__ == "__main__":
    main()
