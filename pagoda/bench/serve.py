"""`pagoda bench serve`: the asyncio load generator against one OpenAI-compatible server.

Owns the shape of a run: optional warmup requests (not measured), arrivals on a
schedule (all at once for `--request-rate inf`, else gamma-distributed gaps with
mean 1/rate and shape `--burstiness`; 1.0 is a Poisson process), at most
`--max-concurrency` requests in flight, and two bounds that always end the run by
themselves: the number of prompts and `--max-duration` seconds. Requests still in
flight at the time limit are cancelled and reported as `cancelled`; prompts not yet
sent are reported as `not_sent`. Every URL it touches is the given base URL plus a
path (the endpoint, /tokenize, /detokenize, /metrics): it never targets anything else.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import numpy as np

from pagoda.bench import metrics as m
from pagoda.bench import report as rep
from pagoda.bench.client import BACKENDS, Target, stream_request
from pagoda.bench.datasets import SampleRequest, samples_from_args
from pagoda.bench.server_metrics import MetricsWatcher
from pagoda.bench.tokenizers import LocalTokenizer, ServerTokenizer


@dataclass
class LoadPlan:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    max_duration: float | None = None  # seconds; None: bounded by the prompt count alone
    seed: int = 0
    show_progress: bool = True
    metrics_interval: float = 1.0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate!r}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups!r}")
        if self.max_duration is not None and not self.max_duration > 0:
            raise ValueError(f"max_duration must be > 0 seconds, got {self.max_duration!r}")


@dataclass
class RunOutcome:
    results: list[m.RequestResult]
    duration: float
    stopped_by_time_limit: bool
    warmup_failures: dict[str, int]
    server_metrics: dict


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of n requests; the first is sent at 0."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    return [0.0] + [float(x) for x in np.cumsum(gaps[:-1])]


def resolve_url(base_url: str, endpoint: str) -> str:
    """base URL + endpoint path; anything that could point elsewhere is refused."""
    parsed = urllib.parse.urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"base_url must be an http(s) URL with a host, got {base_url!r}")
    if not endpoint.startswith("/") or endpoint.startswith("//") or "://" in endpoint:
        raise ValueError(f"endpoint must be a path starting with '/', got {endpoint!r}")
    return base_url.rstrip("/") + endpoint


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm  # progress bars only

    return tqdm(total=total, unit="req")


async def _timed_batch(
    session: aiohttp.ClientSession,
    target: Target,
    samples: list[SampleRequest],
    offsets: list[float],
    plan: LoadPlan,
    clock: Callable[[], float],
    on_done: Callable[[], None],
) -> tuple[list[m.RequestResult], bool]:
    """Send `samples` at `offsets` until all are done or `plan.max_duration` runs out.

    Returns the results (one per sample, in order) and whether the time limit hit.
    """
    results = [m.RequestResult(s.prompt_len, s.expected_output_len) for s in samples]
    semaphore = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    tasks: list[asyncio.Task] = []

    async def one(i: int) -> None:
        if semaphore is None:
            await stream_request(session, target, samples[i], results[i], clock)
        else:
            async with semaphore:  # the request's clock starts once it is really sent
                await stream_request(session, target, samples[i], results[i], clock)
        on_done()

    async def schedule() -> None:
        for i, offset in enumerate(offsets):
            delay = offset - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)

    try:
        async with asyncio.timeout(plan.max_duration):
            await schedule()
        return results, False
    except TimeoutError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        now = clock()
        for r in results:
            if r.sent and not r.finished:
                r.end, r.success, r.error_kind = now, False, m.CANCELLED
                r.error = f"still in flight when --max-duration {plan.max_duration} s ran out"
        return results, True


async def run_load(
    target: Target, samples: list[SampleRequest], plan: LoadPlan, base_url: str
) -> RunOutcome:
    """Warm up, then run the measured load, scraping /metrics around it."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        warmup_failures: dict[str, int] = {}
        if plan.num_warmups:
            warm = [samples[i % len(samples)] for i in range(plan.num_warmups)]
            start = time.perf_counter()
            warm_results, _ = await _timed_batch(
                session,
                target,
                warm,
                [0.0] * len(warm),
                plan,
                lambda: time.perf_counter() - start,
                lambda: None,
            )
            warmup_failures = m.failure_counts(warm_results)
        watcher = MetricsWatcher(session, base_url, target.headers(), plan.metrics_interval)
        await watcher.start()
        offsets = arrival_offsets(len(samples), plan.request_rate, plan.burstiness, plan.seed)
        bar = _progress(len(samples), plan.show_progress)
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731 - the run clock
        try:
            results, stopped = await _timed_batch(
                session,
                target,
                samples,
                offsets,
                plan,
                clock,
                bar.update if bar else (lambda: None),
            )
        finally:
            if bar is not None:
                bar.close()
        duration = clock()
        server = await watcher.stop()
    return RunOutcome(results, duration, stopped, warmup_failures, server)


def base_url_from_args(args) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    return f"http://{args.host}:{args.port}"


def _api_key(args) -> str | None:
    return args.api_key or os.environ.get("OPENAI_API_KEY") or None


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model id of GET /v1/models, for runs without --model."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(base_url + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            models = json.loads(response.read()).get("data") or []
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise ValueError(f"--model not given and GET {base_url}/v1/models failed: {err}") from None
    if not models or "id" not in models[0]:
        raise ValueError(f"--model not given and {base_url}/v1/models lists no model")
    return models[0]["id"]


def make_target(args, base_url: str) -> Target:
    if args.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    endpoint = args.endpoint or BACKENDS[args.backend]
    sampling = {"temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    if args.top_k is not None:
        sampling["top_k"] = args.top_k
    sampling.update(args.extra_body or {})
    api_key = _api_key(args)
    return Target(
        resolve_url(base_url, endpoint),
        args.backend,
        args.model,
        api_key,
        args.request_timeout,
        args.ignore_eos,
        sampling,
    )


def make_tokenizer(args, base_url: str):
    """--tokenizer (local files) if given, else the server's /tokenize; None if neither works."""
    if args.tokenizer:
        return LocalTokenizer(args.tokenizer), None
    try:
        return ServerTokenizer(base_url, args.model, _api_key(args)), None
    except RuntimeError as err:
        return None, str(err)


def plan_from_args(
    args, request_rate: float | None = None, max_concurrency: int | None = None
) -> LoadPlan:
    return LoadPlan(
        request_rate=args.request_rate if request_rate is None else request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency if max_concurrency is None else max_concurrency,
        num_warmups=args.num_warmups,
        max_duration=args.max_duration,
        seed=args.seed,
        show_progress=not args.disable_tqdm,
        metrics_interval=args.metrics_interval,
    )


def prepare(args) -> tuple[str, Target, list[SampleRequest], str]:
    """Base URL, target, the dataset, and the name of the tokenizer that measured it."""
    base_url = base_url_from_args(args)
    resolve_url(base_url, "/")
    if not args.model:
        args.model = discover_model(base_url, _api_key(args))
    target = make_target(args, base_url)
    tokenizer, why_not = make_tokenizer(args, base_url)
    try:
        samples = samples_from_args(args, tokenizer)
    except ValueError as err:
        if tokenizer is None and why_not:
            raise ValueError(f"{err} (server tokenizer unavailable: {why_not})") from err
        raise
    return base_url, target, samples, tokenizer.name if tokenizer is not None else "none"


def measure(
    args,
    base_url: str,
    target: Target,
    samples: list[SampleRequest],
    tokenizer_name: str,
    plan: LoadPlan,
) -> dict:
    """One measured run -> its report (printed, and saved with --save-result)."""

    outcome = asyncio.run(run_load(target, samples, plan, base_url))
    summary = m.summarize(
        outcome.results,
        outcome.duration,
        args.percentile_metrics,
        args.metric_percentiles,
        args.goodput,
    )
    result = rep.serve_report(
        args, plan, summary, outcome, tokenizer_name, base_url, detailed=args.save_detailed
    )
    print(rep.format_serve_table(result))
    if args.save_result:
        path = rep.save_report(result, args.result_dir, args.result_filename)
        print(f"saved {path}")
    return result


def main_serve(args) -> dict:
    base_url, target, samples, tokenizer_name = prepare(args)
    return measure(args, base_url, target, samples, tokenizer_name, plan_from_args(args))
