"""KV offloading through a real `pagoda serve`: a multi-turn chat workload whose working
set is several times the GPU KV pool, run with offloading off (recompute), to a CPU
tier, and to a small CPU tier over a disk tier, in one run; then a server restarted
on the warm disk directory against one started on an empty one (first-request TTFT).

Each configuration starts its own server and runs `pagoda bench serve --dataset-name
multi-turn` (conversations visited turn by turn: every conversation comes back after
all the others pushed it out of GPU memory). Reported per configuration: TTFT P50/P99
of the first turns and of the revisited turns (turn >= 2), output throughput, and the
server's per-tier figures (hit rate, hits skipped because recompute was expected to be
faster, bytes, load GB/s: bytes over device-timed copies). Before the runs, the disk's
own read ceiling is measured in the work directory (benchmarks/disk_ceiling.py: a file
written, then read back with its cached pages dropped, and again from the page cache),
so the disk tier's load figure is stated against it.

The restart probe reports which path each server's first request took: blocks loaded
from the disk tier, or disk hits recomputed because the cost model expected recompute
to be faster (pagoda/kv_offload/planning/cost.py), and the estimates it weighed.

    # H200, Llama-3.1-8B shape (dummy bf16 weights), GPU pool capped at 32k tokens:
    python benchmarks/kv_offload.py --output benchmarks/results/h200-kv-offload.json
    # split under a 10-minute limit: the three runs, then the restart probe on the same workdir
    python benchmarks/kv_offload.py --workdir /tmp/kvo --no-restart --output a.json
    python benchmarks/kv_offload.py --workdir /tmp/kvo --restart-only --output b.json
    # the disk's read ceiling alone: python benchmarks/disk_ceiling.py --dir /tmp --size-gib 2
    # CPU smoke test, embedded SmolLM2 at a small scale:
    python benchmarks/kv_offload.py --smoke --output benchmarks/results/cpu-kv-offload-smoke.json

The prompts are regenerated here with the same generator, tokenizer and seed as the
bench run, so the restart probe sends exactly the last turn of conversation 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing the package

from disk_ceiling import describe as describe_ceiling  # noqa: E402  (benchmarks/)
from disk_ceiling import measure as measure_disk_ceiling  # noqa: E402
from serve_process import start_server, stop_server  # noqa: E402
from result_file import write_json  # noqa: E402  (benchmarks/)

GPU = dict(model=["--model", "llama-3.1-8b", "--load-format", "dummy", "--dtype", "bfloat16",
                  "--max-model-len", "8192", "--num-gpu-blocks-override", "2048"],
           conversations=48, turns=4, first_len=2048, turn_len=256, output_len=128,
           concurrency=8, cpu_gib=32.0, small_cpu_gib=4.0, disk_gib=40.0,
           pool_tokens=2048 * 16, kv_bytes_per_token=32 * 8 * 128 * 2 * 2, ceiling_gib=2.0,
           env={})
SMOKE = dict(model=["--device", "cpu", "--max-model-len", "512",
                    "--num-gpu-blocks-override", "48"],
             conversations=10, turns=3, first_len=256, turn_len=32, output_len=16,
             concurrency=2, cpu_gib=0.25, small_cpu_gib=0.04, disk_gib=0.5,
             pool_tokens=48 * 16, kv_bytes_per_token=30 * 3 * 64 * 2 * 4, ceiling_gib=0.0625,
             # one intra-op thread per server: on a small shared CPU a spinning thread
             # pool only loses time
             env={"OMP_NUM_THREADS": "1"})


def percentile(values: list[float], q: float):
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


_TOKENIZER: list[str] = []  # --tokenizer, once parsed


def tokenizer_path() -> str:
    if _TOKENIZER:
        return _TOKENIZER[0]
    from pagoda.model.tokenizer import embedded_model_path
    return str(embedded_model_path())


def configurations(p: dict, disk_dir: str) -> dict[str, list[str]]:
    return {
        "off": [],
        "cpu": ["--kv-offloading-size", str(p["cpu_gib"])],
        "cpu+disk": ["--kv-offloading-size", str(p["small_cpu_gib"]),
                     "--kv-offloading-disk-path", disk_dir,
                     "--kv-offloading-disk-size", str(p["disk_gib"])],
    }


def run_bench(url: str, p: dict, result_dir: str, name: str) -> dict:
    filename = f"{name.replace('+', '-')}.json"
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "serve", "--base-url", url,
               "--dataset-name", "multi-turn", "--multi-turn-num-conversations", str(p["conversations"]),
               "--multi-turn-turns", str(p["turns"]), "--multi-turn-first-len", str(p["first_len"]),
               "--multi-turn-turn-len", str(p["turn_len"]),
               "--multi-turn-output-len", str(p["output_len"]),
               "--num-prompts", str(p["conversations"] * p["turns"]),
               "--max-concurrency", str(p["concurrency"]), "--tokenizer", tokenizer_path(),
               "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
               "--metrics-interval", "1", "--save-result", "--result-dir", result_dir,
               "--result-filename", filename, "--label", name]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (REPO_ROOT, os.environ.get("PYTHONPATH")) if x)}
    subprocess.run(command, check=True, cwd=REPO_ROOT, env=env)
    with open(os.path.join(result_dir, filename)) as f:
        return json.load(f)


def summarize(report: dict, p: dict) -> dict:
    ttfts = report["requests"]["ttft_ms"]
    n = p["conversations"]
    first = [t for i, t in enumerate(ttfts) if t is not None and i < n]
    revisited = [t for i, t in enumerate(ttfts) if t is not None and i >= n]
    server = report.get("server_metrics") or {}
    return {
        "completed": report["completed"], "failed": report["failed"],
        "first_turn_ttft_ms": {"p50": percentile(first, 50), "p99": percentile(first, 99)},
        "revisited_ttft_ms": {"p50": percentile(revisited, 50), "p99": percentile(revisited, 99),
                              "mean": statistics.fmean(revisited) if revisited else None},
        "output_throughput": report["output_throughput"],
        "request_throughput": report.get("request_throughput"),
        "prefix_cache_hit_rate": server.get("prefix_cache_hit_rate"),
        "preemptions": server.get("preemptions"),
        "kv_offload": server.get("kv_offload"),
    }


def probe_ttft(url: str, prompt: str) -> float:
    """Seconds from sending one streamed completion to its first token."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]" and b'"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the probe's stream ended without a token")


def probe_prompt(p: dict) -> str:
    from pagoda.bench.datasets import multi_turn_requests
    from pagoda.bench.tokenizers import LocalTokenizer
    samples = multi_turn_requests(LocalTokenizer(tokenizer_path()), p["conversations"], p["turns"],
                                  p["first_len"], p["turn_len"], p["output_len"], seed=0)
    return samples[(p["turns"] - 1) * p["conversations"]].prompt  # conversation 0, last turn


def probe_path(url: str) -> dict:
    """What the server's tiers did so far (after its one probe request): the disk tier's
    hits, blocks loaded and skipped, and the cost model's estimates."""
    from pagoda.bench.server_metrics import TIER_SEP, parse_prometheus
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        values = parse_prometheus(response.read().decode(errors="replace"))

    def disk(base: str):
        return values.get(f"pagoda:{base}{TIER_SEP}disk")

    hits, skipped = disk("kv_offload_hits_total") or 0.0, disk("kv_offload_skipped_blocks_total") or 0.0
    if not hits:
        path = "recompute (no disk hit)"
    elif skipped >= hits:
        path = "recompute (disk hits skipped: recompute expected faster)"
    elif skipped:
        path = "partly loaded from disk"
    else:
        path = "loaded from disk"
    return {"path": path, "disk_hits": hits, "disk_skipped_blocks": skipped,
            "disk_bytes_loaded": disk("kv_offload_loaded_bytes_total") or 0.0,
            "est_disk_load_gb_per_s": (disk("kv_offload_est_load_bytes_per_second") or 0.0) / 1e9,
            "est_prefill_tokens_per_s": values.get("pagoda:kv_offload_est_prefill_tokens_per_second")}


def restart_probe(p: dict, flags: list[str], warm_dir: str, workdir: str) -> dict:
    """First-request TTFT of a server on the warm disk directory vs on an empty one, and
    the path each took."""
    prompt = probe_prompt(p)
    result = {}
    cold_dir = os.path.join(workdir, "cold-disk")
    shutil.rmtree(cold_dir, ignore_errors=True)
    for name, directory in (("warm", warm_dir), ("cold", cold_dir)):
        disk = ["--kv-offloading-size", str(p["small_cpu_gib"]), "--kv-offloading-disk-path",
                directory, "--kv-offloading-disk-size", str(p["disk_gib"])]
        proc, url = start_server(flags + disk, os.path.join(workdir, f"server-restart-{name}.log"),
                                 extra_env=p["env"])
        try:
            result[f"{name}_first_request_ttft_s"] = probe_ttft(url, prompt)
            result[f"{name}_path"] = probe_path(url)
        finally:
            stop_server(proc)
    result["speedup"] = result["cold_first_request_ttft_s"] / result["warm_first_request_ttft_s"]
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, embedded SmolLM2, small scale")
    parser.add_argument("--output", default=None, help="JSON file to write")
    parser.add_argument("--workdir", default=None, help="logs, bench results, disk tier")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for the dummy preset (default: the embedded SmolLM2's)")
    parser.add_argument("--configs", default="off,cpu,cpu+disk",
                        help="comma-separated subset of off,cpu,cpu+disk (to split a run)")
    parser.add_argument("--no-restart", action="store_true",
                        help="skip the warm-vs-cold restart probe")
    parser.add_argument("--no-ceiling", action="store_true",
                        help="skip measuring the disk's read ceiling")
    parser.add_argument("--restart-only", action="store_true",
                        help="only the restart probe, on --workdir's disk tier left by an "
                             "earlier cpu+disk run")
    return parser.parse_args()


def run_configurations(p: dict, flags: list[str], disk_dir: str, workdir: str,
                       wanted: list[str]) -> dict:
    """One server per wanted configuration (off, cpu, cpu+disk), each benchmarked and summarized."""
    runs = {}
    for name, extra in configurations(p, disk_dir).items():
        if name not in wanted:
            continue
        proc, url = start_server(flags + extra, os.path.join(workdir, f"server-{name.replace('+', '-')}.log"),
                                 extra_env=p["env"])
        try:
            runs[name] = summarize(run_bench(url, p, workdir, name), p)
        finally:
            stop_server(proc)
        print(f"{name}: revisited TTFT p50 {runs[name]['revisited_ttft_ms']['p50']:.1f} ms, "
              f"p99 {runs[name]['revisited_ttft_ms']['p99']:.1f} ms, "
              f"{runs[name]['output_throughput']:.1f} output tok/s", flush=True)
        for tier, row in (runs[name]["kv_offload"] or {}).items():
            print(f"  tier {tier}: hits {row.get('hits')}, skipped (recompute faster) "
                  f"{row.get('skipped_blocks')}, hit rate {row.get('hit_rate')}, "
                  f"load {row.get('load_gb_per_s')} GB/s", flush=True)
    return runs


def print_summary(result: dict, disk_tier: dict) -> None:
    """The run's headline figures; disk_tier: the cpu+disk run's disk-tier row (or {})."""
    ratios, ceiling, restart = (result["revisited_p50_speedup_vs_off"], result["disk_ceiling"],
                                result["restart"])
    print(f"revisited-turn P50 TTFT speedup vs recompute: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"CPU tier load bandwidth: {result['cpu_load_gb_per_s']} GB/s")
    if disk_tier:
        print(f"disk tier load bandwidth: {disk_tier.get('load_gb_per_s')} GB/s "
              f"(hits {disk_tier.get('hits')}, skipped {disk_tier.get('skipped_blocks')})")
    if ceiling is not None:
        print(describe_ceiling(ceiling))
    if restart is not None:
        print(f"restart first-request TTFT: warm {restart['warm_first_request_ttft_s'] * 1000:.1f} "
              f"ms, cold {restart['cold_first_request_ttft_s'] * 1000:.1f} ms "
              f"({restart['speedup']:.2f}x); warm path: {restart['warm_path']['path']} "
              f"(disk hits {restart['warm_path']['disk_hits']:.0f}, skipped "
              f"{restart['warm_path']['disk_skipped_blocks']:.0f}, est. disk "
              f"{restart['warm_path']['est_disk_load_gb_per_s']:.2f} GB/s, est. prefill "
              f"{restart['warm_path']['est_prefill_tokens_per_s'] or 0:.0f} tokens/s)")


def main() -> int:
    args = parse_args()
    from pagoda.kv_offload.disk_tier import DEFAULT_IO_THREADS
    p = SMOKE if args.smoke else GPU
    flags = list(p["model"])
    if "--load-format" in flags:  # a preset has no tokenizer: the embedded one fits its vocab
        if args.tokenizer:
            _TOKENIZER.append(args.tokenizer)
        flags += ["--tokenizer", tokenizer_path()]
    workdir = args.workdir or tempfile.mkdtemp(prefix="pagoda-kv-offload-")
    os.makedirs(workdir, exist_ok=True)
    disk_dir = os.path.join(workdir, "disk")
    if not args.restart_only:
        shutil.rmtree(disk_dir, ignore_errors=True)
    final_len = p["first_len"] + (p["turns"] - 1) * (p["turn_len"] + p["output_len"])
    working_set = p["conversations"] * final_len
    print(f"working set {working_set} tokens = {working_set / p['pool_tokens']:.1f}x the GPU "
          f"pool ({p['pool_tokens']} tokens, {p['pool_tokens'] * p['kv_bytes_per_token'] / 2**30:.2f} GiB)")
    ceiling = None
    if not args.no_ceiling and not args.restart_only:
        ceiling = measure_disk_ceiling(workdir, int(p["ceiling_gib"] * 2**30), DEFAULT_IO_THREADS,
                                       p["kv_bytes_per_token"] * 16)
        print(describe_ceiling(ceiling), flush=True)
    wanted = [] if args.restart_only else args.configs.split(",")
    runs = run_configurations(p, flags, disk_dir, workdir, wanted)
    restart = None if args.no_restart else restart_probe(p, flags, disk_dir, workdir)
    off = runs["off"]["revisited_ttft_ms"]["p50"] if "off" in runs else None
    ratios = {name: off / run["revisited_ttft_ms"]["p50"] for name, run in runs.items()
              if off and run["revisited_ttft_ms"]["p50"]}
    cpu_tier = ((runs.get("cpu") or {}).get("kv_offload") or {}).get("cpu") or {}
    disk_tier = ((runs.get("cpu+disk") or {}).get("kv_offload") or {}).get("disk") or {}
    result = {
        "date": datetime.now(timezone.utc).isoformat(), "machine": platform.node(),
        "mode": "smoke" if args.smoke else "gpu", "params": p,
        "working_set_tokens": working_set, "working_set_over_pool": working_set / p["pool_tokens"],
        "runs": runs, "revisited_p50_speedup_vs_off": ratios,
        "cpu_load_gb_per_s": cpu_tier.get("load_gb_per_s"), "disk_ceiling": ceiling,
        "disk_load_gb_per_s": disk_tier.get("load_gb_per_s"), "restart": restart,
    }
    print_summary(result, disk_tier)
    if args.output:
        write_json(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
