"""spec_decode serve: a real `pagoda serve`, measured by `pagoda bench serve` on the
chat-templated grounded prompts (a custom JSONL dataset), speculation off and n-gram:
TTFT / TPOT percentiles, output throughput and the server's acceptance."""

from __future__ import annotations

import json
import os
import tempfile

from benchmarks.harness.server import bench_serve, serve
from benchmarks.spec_bench.common import NGRAM, grounded_messages

REPORTED = (
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "output_throughput",
    "completed",
    "failed",
)


def run_serve(args) -> dict:
    from pagoda.model.tokenizer import apply_chat_template, embedded_model_path, load_tokenizer

    workdir = tempfile.mkdtemp(prefix="spec-serve-")
    dataset = os.path.join(workdir, "grounded.jsonl")
    tokenizer = load_tokenizer(embedded_model_path())
    with open(dataset, "w", encoding="utf-8") as f:  # chat-templated grounded prompts
        for messages in grounded_messages(args.num_prompts):
            prompt = tokenizer.decode(apply_chat_template(tokenizer, messages, True, None, None))
            f.write(json.dumps({"prompt": prompt, "output_tokens": args.output_tokens}) + "\n")
    rows = []
    for name, spec in {"off": None, "ngram": NGRAM}.items():
        flags = list(args.server_flags)
        if spec is not None:
            flags += ["--speculative-config", json.dumps(spec)]
        with serve(flags, os.path.join(workdir, f"{name}.log")) as server:
            for concurrency in args.concurrency:
                label = f"{name}-c{concurrency}"
                report = bench_serve(
                    server.url,
                    [
                        "--dataset-name",
                        "custom",
                        "--dataset-path",
                        dataset,
                        "--num-prompts",
                        str(args.num_prompts),
                        "--max-concurrency",
                        str(concurrency),
                        "--temperature",
                        "0",
                        "--seed",
                        "0",
                        "--label",
                        label,
                    ],
                    workdir,
                    f"{label}.json",
                )
                metrics = report.get("server_metrics") or {}
                rows.append(
                    {
                        "config": name,
                        "concurrency": concurrency,
                        **{key: report.get(key) for key in REPORTED},
                        "acceptance": metrics.get("spec_decode_acceptance_rate"),
                        "mean_accepted_length": metrics.get("spec_decode_mean_accepted_length"),
                    }
                )
    print(
        f"\n{'config':>8}{'conc':>6}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
        f"{'tok/s':>9}{'accept':>8}{'mean len':>9}"
    )
    for row in rows:
        print(
            f"{row['config']:>8}{row['concurrency']:>6}{row['p50_ttft_ms']:>10.1f}"
            f"{row['p99_ttft_ms']:>8.1f}{row['p50_tpot_ms']:>10.1f}{row['p99_tpot_ms']:>8.1f}"
            f"{row['output_throughput']:>9.1f}{row['acceptance'] or 0:>8.2f}"
            f"{row['mean_accepted_length'] or 0:>9.2f}"
        )
    return {
        "server_flags": args.server_flags,
        "speculative_config": NGRAM,
        "num_prompts": args.num_prompts,
        "output_tokens": args.output_tokens,
        "rows": rows,
    }
