"""Server vs offline throughput: the same requests through `pagoda serve` (concurrent
streams) and through `LLM.generate`, measured in one run on one machine.

Workload (defaults): 32 requests, ~32-token prompts (token ids, so both sides see the
same tokens), 128 output tokens each (ignore_eos, greedy). The server runs as a
subprocess on 127.0.0.1 with the same engine arguments; a client in this process
opens all streams at once (aiohttp). The two measurements alternate `--repeats`
times; background load on a shared machine only ever slows a run down, so the
best run of each side is the headline figure (the JSON keeps every run, and the
ratio of each back-to-back pair).

    .venv/bin/python benchmarks/server_vs_offline.py --output results/server_vs_offline.json

Prints both throughputs (output tokens/s) and server/offline; writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing the package

from serve_process import start_server, stop_server  # noqa: E402  (benchmarks/)
from result_file import write_json  # noqa: E402  (benchmarks/)

PARAGRAPH = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each "
             "step as the waves broke against the rocks below. Ships passed in the distance, "
             "their lights flickering like small stars that had fallen into the sea, and the "
             "keeper wrote their names in a worn leather book beside the great lamp.")


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids (sliding windows of a text)."""
    ids = tokenizer.encode(PARAGRAPH * 4, add_special_tokens=False)
    if len(ids) < count + length:
        raise ValueError("the source text is too short for this many prompts")
    return [ids[i:i + length] for i in range(count)]


def run_offline(llm, prompts, max_tokens: int) -> dict:
    from pagoda import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


async def _one_stream(session, url: str, model: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    last = None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                last = line
    usage = json.loads(last[6:])["usage"]
    return usage["completion_tokens"]


async def _run_streams(url: str, model: str, prompts, max_tokens: int) -> dict:
    import aiohttp
    connector = aiohttp.TCPConnector(limit=len(prompts) + 4)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(_one_stream(session, url, model, p, max_tokens) for p in prompts))
        elapsed = time.perf_counter() - start
    total = sum(tokens)
    return {"seconds": elapsed, "output_tokens": total, "output_tokens_per_s": total / elapsed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="alternating measurements of each side")
    ap.add_argument("--output", default="server_vs_offline.json", help="where to write the JSON")
    ap.add_argument("--server-log", default="/tmp/pagoda-bench-server.log")
    args = ap.parse_args(argv)

    from pagoda import LLM
    engine_flags = ["--max-model-len", str(args.max_model_len)]
    llm = LLM(max_model_len=args.max_model_len)
    prompts = make_prompts(llm.get_tokenizer(), args.num_requests, args.prompt_len)
    proc, url = start_server(engine_flags, args.server_log)
    offline_runs, server_runs = [], []
    try:
        model = json.loads(_get(f"{url}/v1/models"))["data"][0]["id"]
        # Warm both sides (first-call allocations, lazy imports) with a small request.
        run_offline(llm, prompts[:2], 4)
        asyncio.run(_run_streams(url, model, prompts[:2], 4))
        for _ in range(args.repeats):
            offline_runs.append(run_offline(llm, prompts, args.max_tokens))
            print(f"offline: {offline_runs[-1]['output_tokens_per_s']:.1f} output tok/s", flush=True)
            server_runs.append(asyncio.run(_run_streams(url, model, prompts, args.max_tokens)))
            print(f"server:  {server_runs[-1]['output_tokens_per_s']:.1f} output tok/s", flush=True)
    finally:
        exit_code = stop_server(proc)
        del llm
        gc.collect()
    expected = args.num_requests * args.max_tokens
    for run in offline_runs + server_runs:
        if run["output_tokens"] != expected:
            raise RuntimeError(f"expected {expected} output tokens, got {run['output_tokens']}")
    offline = max(r["output_tokens_per_s"] for r in offline_runs)
    server = max(r["output_tokens_per_s"] for r in server_runs)
    pair_ratios = [s["output_tokens_per_s"] / o["output_tokens_per_s"]
                   for o, s in zip(offline_runs, server_runs)]
    result = {
        "benchmark": "server_vs_offline",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                     "max_tokens": args.max_tokens, "concurrency": args.num_requests,
                     "greedy": True, "ignore_eos": True, "model": "SmolLM2-135M-Instruct (embedded)",
                     "engine_flags": engine_flags},
        "offline_runs": offline_runs, "server_runs": server_runs,
        "offline_output_tokens_per_s": offline, "server_output_tokens_per_s": server,
        "offline_median_output_tokens_per_s": statistics.median(
            r["output_tokens_per_s"] for r in offline_runs),
        "server_median_output_tokens_per_s": statistics.median(
            r["output_tokens_per_s"] for r in server_runs),
        "server_over_offline": server / offline, "pair_ratios": pair_ratios,
        "server_exit_code": exit_code,
    }
    write_json(args.output, result)
    print(f"offline LLM.generate: {offline:.1f} output tok/s (best of {len(offline_runs)})")
    print(f"server, {args.num_requests} streams: {server:.1f} output tok/s (best of {len(server_runs)})")
    print(f"server / offline = {server / offline:.3f}  (target >= 0.85); back-to-back pairs: "
          f"{', '.join(f'{r:.3f}' for r in pair_ratios)}; JSON: {args.output}")
    return 0


def _get(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


if __name__ == "__main__":
    sys.exit(main())
