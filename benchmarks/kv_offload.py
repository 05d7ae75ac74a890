"""KV offloading: a multi-turn chat workload whose working set is several times the GPU KV
pool (conversations visited turn by turn: each comes back after all the others pushed it
out of GPU memory), with offloading off (recompute) and on, in one run.

    python -m benchmarks.kv_offload serve                # H200: Llama-3.1-8B shape, 2,048 blocks
    python -m benchmarks.kv_offload steps
    # write-through's step cost on the CPU: with and without it, interleaved
    python -m benchmarks.kv_offload steps --smoke --modes inline,evict-only --rounds 5 \
        --disk-gib 0.5 --gpu-blocks 512
    python -m benchmarks.kv_offload disk --dir /tmp --size-gib 2
    python -m benchmarks.kv_offload serve --smoke        # CPU, embedded SmolLM2, small scale
    # serve split under a time limit: the three runs, then the restart probe on the same workdir
    python -m benchmarks.kv_offload serve --workdir /tmp/kvo --no-restart --out a.json
    python -m benchmarks.kv_offload serve --workdir /tmp/kvo --restart-only --out b.json

serve   Through a real `pagoda serve` per configuration (off, a CPU tier, a small CPU tier
        over a disk tier), each measured by `pagoda bench serve --dataset-name multi-turn`:
        TTFT P50/P99 of the first turns and of the revisited turns (turn >= 2), output
        throughput, and the server's per-tier figures (hit rate, hits skipped because
        recompute was expected to be faster, bytes, load GB/s: bytes over device-timed
        copies). Before the runs the disk's read ceiling is measured in the work directory
        (the disk mode), so the disk tier's load figure is stated against it. Then a
        server restarted on the warm disk directory against one on an empty one: the
        first request's TTFT and which path it took (loaded from disk, or disk hits
        recomputed because the cost model, pagoda/kv_offload/planning/cost.py, expected
        recompute to be faster) with the estimates it weighed. The probe's prompt is the
        bench run's last turn of conversation 0 (same generator, tokenizer and seed).
steps   In-process (benchmarks/kv_offload_steps.py), one engine per mode in a process of
        its own: offloading off, asynchronous CPU-tier loads, inline loads (the default),
        and evict-only (write-through off); TTFT and steps to the first token of the
        revisited turns, the busy steps' wall time, output tok/s, the tiers' figures.
        `--disk-gib` adds a disk tier, `--gpu-blocks` sizes the GPU pool, `--rounds`
        repeats the modes interleaved.
disk    The disk's own read ceiling: a file written, read back cold (its pages dropped from
        the page cache) one stream at a time and with the disk tier's reader threads, then
        hot, and crc32 (the tier's checksum) on one thread (harness/rooflines.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import urllib.request

from benchmarks.harness.results import write_result
from benchmarks.harness.rooflines import describe_disk_ceiling, disk_read_ceiling
from benchmarks.harness.server import bench_serve, get_json, serve
from benchmarks.kv_offload_steps import STEP_MODES, percentile, run_steps

WORKLOAD = dict(
    conversations=48,
    turns=4,
    first_len=2048,
    turn_len=256,
    output_len=128,
    concurrency=8,
    cpu_gib=32.0,
)
SMOKE_WORKLOAD = dict(
    conversations=10,
    turns=3,
    first_len=256,
    turn_len=32,
    output_len=16,
    concurrency=2,
    cpu_gib=0.25,
)
SERVE = dict(
    model=[
        "--model",
        "llama-3.1-8b",
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--num-gpu-blocks-override",
        "2048",
    ],
    small_cpu_gib=4.0,
    disk_gib=40.0,
    pool_tokens=2048 * 16,
    kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
    ceiling_gib=2.0,
    env={},
)
SMOKE_SERVE = dict(
    model=["--device", "cpu", "--max-model-len", "512", "--num-gpu-blocks-override", "48"],
    small_cpu_gib=0.04,
    disk_gib=0.5,
    pool_tokens=48 * 16,
    kv_bytes_per_token=30 * 3 * 64 * 2 * 4,
    ceiling_gib=0.0625,
    # one intra-op thread per server: on a small shared CPU a spinning
    # thread pool only loses time
    env={"OMP_NUM_THREADS": "1"},
)


# ================================================================ serve ============
def tokenizer_path(args) -> str:
    from pagoda.model.tokenizer import embedded_model_path

    return args.tokenizer or str(embedded_model_path())


def summarize_serve(report: dict, p: dict) -> dict:
    ttfts = report["requests"]["ttft_ms"]
    n = p["conversations"]
    first = [t for i, t in enumerate(ttfts) if t is not None and i < n]
    revisited = [t for i, t in enumerate(ttfts) if t is not None and i >= n]
    server = report.get("server_metrics") or {}
    return {
        "completed": report["completed"],
        "failed": report["failed"],
        "first_turn_ttft_ms": {"p50": percentile(first, 50), "p99": percentile(first, 99)},
        "revisited_ttft_ms": {
            "p50": percentile(revisited, 50),
            "p99": percentile(revisited, 99),
            "mean": statistics.fmean(revisited) if revisited else None,
        },
        "output_throughput": report["output_throughput"],
        "request_throughput": report.get("request_throughput"),
        "prefix_cache_hit_rate": server.get("prefix_cache_hit_rate"),
        "preemptions": server.get("preemptions"),
        "kv_offload": server.get("kv_offload"),
    }


def probe_ttft(url: str, prompt: str) -> float:
    """Seconds from sending one streamed completion to its first token."""
    import json

    model = get_json(f"{url}/v1/models")["data"][0]["id"]
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]" and b'"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the probe's stream ended without a token")


def probe_path(url: str) -> dict:
    """What the server's tiers did so far (after its one probe request): the disk tier's
    hits, blocks loaded and skipped, and the cost model's estimates."""
    from pagoda.bench.server_metrics import TIER_SEP, parse_prometheus

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        values = parse_prometheus(response.read().decode(errors="replace"))

    def disk(base: str):
        return values.get(f"pagoda:{base}{TIER_SEP}disk")

    hits, skipped = (
        disk("kv_offload_hits_total") or 0.0,
        disk("kv_offload_skipped_blocks_total") or 0.0,
    )
    path = (
        "recompute (no disk hit)"
        if not hits
        else "recompute (disk hits skipped: recompute expected faster)"
        if skipped >= hits
        else "partly loaded from disk"
        if skipped
        else "loaded from disk"
    )
    return {
        "path": path,
        "disk_hits": hits,
        "disk_skipped_blocks": skipped,
        "disk_bytes_loaded": disk("kv_offload_loaded_bytes_total") or 0.0,
        "est_disk_load_gb_per_s": (disk("kv_offload_est_load_bytes_per_second") or 0.0) / 1e9,
        "est_prefill_tokens_per_s": values.get("pagoda:kv_offload_est_prefill_tokens_per_second"),
    }


def restart_probe(args, p: dict, flags: list[str], warm_dir: str, workdir: str) -> dict:
    """First-request TTFT of a server on the warm disk directory vs on an empty one, and
    the path each took."""
    from pagoda.bench.datasets import multi_turn_requests
    from pagoda.bench.tokenizers import LocalTokenizer

    samples = multi_turn_requests(
        LocalTokenizer(tokenizer_path(args)),
        p["conversations"],
        p["turns"],
        p["first_len"],
        p["turn_len"],
        p["output_len"],
        seed=0,
    )
    prompt = samples[(p["turns"] - 1) * p["conversations"]].prompt  # conversation 0, last turn
    result = {}
    cold_dir = os.path.join(workdir, "cold-disk")
    shutil.rmtree(cold_dir, ignore_errors=True)
    for name, directory in (("warm", warm_dir), ("cold", cold_dir)):
        disk = [
            "--kv-offloading-size",
            str(p["small_cpu_gib"]),
            "--kv-offloading-disk-path",
            directory,
            "--kv-offloading-disk-size",
            str(p["disk_gib"]),
        ]
        with serve(
            flags + disk, os.path.join(workdir, f"server-restart-{name}.log"), extra_env=p["env"]
        ) as server:
            result[f"{name}_first_request_ttft_s"] = probe_ttft(server.url, prompt)
            result[f"{name}_path"] = probe_path(server.url)
    result["speedup"] = result["cold_first_request_ttft_s"] / result["warm_first_request_ttft_s"]
    return result


def serve_configurations(args, p: dict, flags: list[str], disk_dir: str, workdir: str) -> dict:
    """One server per wanted configuration (off, cpu, cpu+disk), each benchmarked."""
    configurations = {
        "off": [],
        "cpu": ["--kv-offloading-size", str(p["cpu_gib"])],
        "cpu+disk": [
            "--kv-offloading-size",
            str(p["small_cpu_gib"]),
            "--kv-offloading-disk-path",
            disk_dir,
            "--kv-offloading-disk-size",
            str(p["disk_gib"]),
        ],
    }
    wanted = [] if args.restart_only else args.configs.split(",")
    bench_flags = [
        "--dataset-name",
        "multi-turn",
        "--multi-turn-num-conversations",
        str(p["conversations"]),
        "--multi-turn-turns",
        str(p["turns"]),
        "--multi-turn-first-len",
        str(p["first_len"]),
        "--multi-turn-turn-len",
        str(p["turn_len"]),
        "--multi-turn-output-len",
        str(p["output_len"]),
        "--num-prompts",
        str(p["conversations"] * p["turns"]),
        "--max-concurrency",
        str(p["concurrency"]),
        "--tokenizer",
        tokenizer_path(args),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--metrics-interval",
        "1",
    ]
    runs = {}
    for name, extra in configurations.items():
        if name not in wanted:
            continue
        slug = name.replace("+", "-")
        with serve(
            flags + extra, os.path.join(workdir, f"server-{slug}.log"), extra_env=p["env"]
        ) as server:
            report = bench_serve(
                server.url, [*bench_flags, "--label", name], workdir, f"{slug}.json", quiet=False
            )
        runs[name] = row = summarize_serve(report, p)
        print(
            f"{name}: revisited TTFT p50 {row['revisited_ttft_ms']['p50']:.1f} ms, "
            f"p99 {row['revisited_ttft_ms']['p99']:.1f} ms, "
            f"{row['output_throughput']:.1f} output tok/s",
            flush=True,
        )
        for tier, t in (row["kv_offload"] or {}).items():
            print(
                f"  tier {tier}: hits {t.get('hits')}, skipped (recompute faster) "
                f"{t.get('skipped_blocks')}, hit rate {t.get('hit_rate')}, "
                f"load {t.get('load_gb_per_s')} GB/s",
                flush=True,
            )
    return runs


def run_serve(args) -> dict:
    from pagoda.kv_offload.disk_tier import DEFAULT_IO_THREADS

    p = {**(SMOKE_WORKLOAD if args.smoke else WORKLOAD), **(SMOKE_SERVE if args.smoke else SERVE)}
    flags = list(p["model"])
    if "--load-format" in flags:  # a preset has no tokenizer: the embedded one fits its vocab
        flags += ["--tokenizer", tokenizer_path(args)]
    workdir = args.workdir or tempfile.mkdtemp(prefix="pagoda-kv-offload-")
    os.makedirs(workdir, exist_ok=True)
    disk_dir = os.path.join(workdir, "disk")
    if not args.restart_only:
        shutil.rmtree(disk_dir, ignore_errors=True)
    final_len = p["first_len"] + (p["turns"] - 1) * (p["turn_len"] + p["output_len"])
    working_set = p["conversations"] * final_len
    print(
        f"working set {working_set} tokens = {working_set / p['pool_tokens']:.1f}x the GPU "
        f"pool ({p['pool_tokens']} tokens, "
        f"{p['pool_tokens'] * p['kv_bytes_per_token'] / 2**30:.2f} GiB)"
    )
    ceiling = None
    if not args.no_ceiling and not args.restart_only:
        ceiling = disk_read_ceiling(
            workdir, int(p["ceiling_gib"] * 2**30), DEFAULT_IO_THREADS, p["kv_bytes_per_token"] * 16
        )
        print(describe_disk_ceiling(ceiling), flush=True)
    runs = serve_configurations(args, p, flags, disk_dir, workdir)
    restart = None if args.no_restart else restart_probe(args, p, flags, disk_dir, workdir)
    off = runs["off"]["revisited_ttft_ms"]["p50"] if "off" in runs else None
    ratios = {
        name: off / run["revisited_ttft_ms"]["p50"]
        for name, run in runs.items()
        if off and run["revisited_ttft_ms"]["p50"]
    }
    cpu_tier = ((runs.get("cpu") or {}).get("kv_offload") or {}).get("cpu") or {}
    disk_tier = ((runs.get("cpu+disk") or {}).get("kv_offload") or {}).get("disk") or {}
    print(
        "revisited-turn P50 TTFT speedup vs recompute: "
        + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    )
    print(f"CPU tier load bandwidth: {cpu_tier.get('load_gb_per_s')} GB/s")
    if disk_tier:
        print(
            f"disk tier load bandwidth: {disk_tier.get('load_gb_per_s')} GB/s "
            f"(hits {disk_tier.get('hits')}, skipped {disk_tier.get('skipped_blocks')})"
        )
    if ceiling is not None:
        print(describe_disk_ceiling(ceiling))
    if restart is not None:
        warm = restart["warm_path"]
        print(
            f"restart first-request TTFT: warm {restart['warm_first_request_ttft_s'] * 1000:.1f} "
            f"ms, cold {restart['cold_first_request_ttft_s'] * 1000:.1f} ms "
            f"({restart['speedup']:.2f}x); warm path: {warm['path']} (disk hits "
            f"{warm['disk_hits']:.0f}, skipped {warm['disk_skipped_blocks']:.0f}, est. disk "
            f"{warm['est_disk_load_gb_per_s']:.2f} GB/s, est. prefill "
            f"{warm['est_prefill_tokens_per_s'] or 0:.0f} tokens/s)"
        )
    return {
        "mode": "smoke" if args.smoke else "gpu",
        "params": p,
        "working_set_tokens": working_set,
        "working_set_over_pool": working_set / p["pool_tokens"],
        "runs": runs,
        "revisited_p50_speedup_vs_off": ratios,
        "cpu_load_gb_per_s": cpu_tier.get("load_gb_per_s"),
        "disk_ceiling": ceiling,
        "disk_load_gb_per_s": disk_tier.get("load_gb_per_s"),
        "restart": restart,
    }


# ================================================================ disk =============
def run_disk(args) -> dict:
    ceiling = disk_read_ceiling(
        args.dir, int(args.size_gib * 2**30), args.threads, int(args.piece_mib * 2**20)
    )
    print(describe_disk_ceiling(ceiling))
    return ceiling


# ================================================================ command line =====
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)

    def mode(name: str, help_text: str):
        p = modes.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--out",
            "--output",
            dest="out",
            default=f"bench_results/kv-offload-{name}.json",
            help="JSON result file",
        )
        return p

    p = mode("serve", "through `pagoda serve`: off, CPU tier, CPU + disk tiers; restart probe")
    p.add_argument("--smoke", action="store_true", help="CPU, embedded SmolLM2, small scale")
    p.add_argument("--workdir", default=None, help="logs, bench results, disk tier")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for the dummy preset (default: the embedded SmolLM2's)",
    )
    p.add_argument(
        "--configs",
        default="off,cpu,cpu+disk",
        help="comma-separated subset of off,cpu,cpu+disk (to split a run)",
    )
    p.add_argument("--no-restart", action="store_true", help="skip the warm-vs-cold restart probe")
    p.add_argument(
        "--no-ceiling", action="store_true", help="skip measuring the disk's read ceiling"
    )
    p.add_argument(
        "--restart-only",
        action="store_true",
        help="only the restart probe, on --workdir's disk tier left by an earlier cpu+disk run",
    )
    p = mode("steps", "in-process: steps and ms from arrival to load, schedule, first token")
    p.add_argument("--smoke", action="store_true", help="CPU, embedded SmolLM2, small scale")
    p.add_argument("--modes", default=",".join(STEP_MODES), help=f"some of {','.join(STEP_MODES)}")
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode, interleaved")
    p.add_argument(
        "--disk-gib", type=float, default=0.0, help="a disk tier below the CPU tier (0: none)"
    )
    p.add_argument("--gpu-blocks", type=int, default=0, help="GPU pool blocks (0: the preset's)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--disk-dir", default=None, help=argparse.SUPPRESS)
    p = mode("disk", "the disk's read ceiling (cold, parallel, hot) and crc32's rate")
    p.add_argument("--dir", default=".", help="a directory on the disk to measure")
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--piece-mib", type=float, default=2.0, help="bytes per parallel read")
    p.add_argument(
        "--threads", type=int, default=None, help="reader threads (default: the disk tier's)"
    )
    args = parser.parse_args(argv)
    if args.mode == "disk" and args.threads is None:
        from pagoda.kv_offload.disk_tier import DEFAULT_IO_THREADS

        args.threads = DEFAULT_IO_THREADS
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "steps":
        result = run_steps(args, SMOKE_WORKLOAD if args.smoke else WORKLOAD)
    else:
        result = {"serve": run_serve, "disk": run_disk}[args.mode](args)
    if getattr(args, "child", None):
        return
    write_result(args.out, {"benchmark": f"kv_offload {args.mode}", "args": vars(args), **result})


if __name__ == "__main__":
    main()
