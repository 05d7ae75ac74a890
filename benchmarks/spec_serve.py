"""Speculative decoding through a real `pagoda serve`, measured by `pagoda bench serve`:
TTFT / TPOT percentiles, output throughput and the server's acceptance, with
speculation off and on, in one run.

The workload is input-grounded (edit, rewrite or summarise a given text: the answer
largely copies the prompt), so n-gram drafts have something to find. The prompts are
chat-templated here and sent as a custom JSONL dataset (completions endpoint).

    # CPU, embedded SmolLM2-135M (the default model):
    python benchmarks/spec_serve.py --output benchmarks/results/cpu-spec-serve.json
    # any other server flags after --server-flags, e.g. on a GPU:
    python benchmarks/spec_serve.py --concurrency 1 8 --server-flags --model /models/x
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing the package

from serve_process import start_server, stop_server  # noqa: E402  (benchmarks/)
from spec_decode_cpu import NGRAM, grounded_messages  # noqa: E402
from result_file import write_json  # noqa: E402  (benchmarks/)

CONFIGS = {"off": None, "ngram": NGRAM}
REPORTED = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput",
            "completed", "failed")


def write_dataset(path: str, count: int, output_tokens: int) -> None:
    """Chat-templated grounded prompts, one JSONL row each."""
    from pagoda.model.tokenizer import apply_chat_template, embedded_model_path, load_tokenizer
    tokenizer = load_tokenizer(embedded_model_path())
    with open(path, "w", encoding="utf-8") as f:
        for messages in grounded_messages(count):
            ids = apply_chat_template(tokenizer, messages, True, None, None)
            prompt = tokenizer.decode(ids)
            f.write(json.dumps({"prompt": prompt, "output_tokens": output_tokens}) + "\n")


def run_bench(url: str, dataset: str, args, concurrency: int, workdir: str, name: str) -> dict:
    filename = f"{name}.json"
    command = [sys.executable, "-m", "pagoda.entrypoints.cli", "bench", "serve",
               "--base-url", url, "--dataset-name", "custom", "--dataset-path", dataset,
               "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
               "--temperature", "0", "--seed", "0", "--disable-tqdm", "--save-result",
               "--result-dir", workdir, "--result-filename", filename, "--label", name]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (REPO_ROOT, os.environ.get("PYTHONPATH")) if x)}
    subprocess.run(command, check=True, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL)
    with open(os.path.join(workdir, filename)) as f:
        return json.load(f)


def summarise(result: dict) -> dict:
    row = {key: result.get(key) for key in REPORTED}
    metrics = result.get("server_metrics") or {}
    row["acceptance"] = metrics.get("spec_decode_acceptance_rate")
    row["mean_accepted_length"] = metrics.get("spec_decode_mean_accepted_length")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--output", default=None, help="JSON results file")
    parser.add_argument("--server-flags", nargs=argparse.REMAINDER, default=["--device", "cpu"],
                        help="flags for `pagoda serve` (default: --device cpu)")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="spec-serve-")
    dataset = os.path.join(workdir, "grounded.jsonl")
    write_dataset(dataset, args.num_prompts, args.output_tokens)
    rows = []
    for name, spec in CONFIGS.items():
        flags = list(args.server_flags)
        if spec is not None:
            flags += ["--speculative-config", json.dumps(spec)]
        proc, url = start_server(flags, os.path.join(workdir, f"{name}.log"))
        try:
            for concurrency in args.concurrency:
                result = run_bench(url, dataset, args, concurrency, workdir, f"{name}-c{concurrency}")
                rows.append({"config": name, "concurrency": concurrency, **summarise(result)})
        finally:
            stop_server(proc)
    print(f"\n{'config':>8}{'conc':>6}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
          f"{'tok/s':>9}{'accept':>8}{'mean len':>9}")
    for row in rows:
        print(f"{row['config']:>8}{row['concurrency']:>6}{row['p50_ttft_ms']:>10.1f}"
              f"{row['p99_ttft_ms']:>8.1f}{row['p50_tpot_ms']:>10.1f}{row['p99_tpot_ms']:>8.1f}"
              f"{row['output_throughput']:>9.1f}{row['acceptance'] or 0:>8.2f}"
              f"{row['mean_accepted_length'] or 0:>9.2f}")
    results = {"benchmark": "spec_serve", "server_flags": args.server_flags,
               "speculative_config": NGRAM, "num_prompts": args.num_prompts,
               "output_tokens": args.output_tokens, "machine": platform.platform(),
               "cpu_count": os.cpu_count(),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows}
    if args.output:
        write_json(args.output, results)


if __name__ == "__main__":
    main()
