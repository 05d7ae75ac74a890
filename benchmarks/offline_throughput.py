"""Offline throughput on the CPU: Pagoda vs Hugging Face transformers `generate`, one run.

Same model (the embedded SmolLM2-135M GGUF, dequantized to fp32), same prompts (~32
tokens), 128 new tokens each with EOS ignored, greedy, torch threads fixed. Prints a
table and writes JSON.

    .venv/bin/python benchmarks/offline_throughput.py --threads 2 --out bench_results/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    base = ("The history of the city begins with a small settlement by the river, where "
            "farmers and traders met every season to exchange grain, tools and stories about")
    ids = tokenizer(base).input_ids
    prompts = []
    for i in range(count):
        words = tokenizer(f" Story number {i}: ").input_ids
        prompts.append((words + ids)[:length])
    return prompts


def run_pagoda(prompts, max_tokens: int, batch: int) -> dict:
    from pagoda import LLM, SamplingParams
    llm = LLM(max_num_seqs=max(batch, 1), max_model_len=1024)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "pagoda", "seconds": elapsed, "output_tokens": tokens,
            "output_tok_per_s": tokens / elapsed,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def run_transformers(model_dir: str, gguf_name: str, prompts, max_tokens: int, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_name,
                                                 dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # EOS ignored: exactly max_tokens each
    pad = 0
    start = None
    tokens = 0
    outs = []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=pad)
            new = gen[:, width:]
            tokens += new.numel()
            outs += new.tolist()
    elapsed = time.perf_counter() - start
    return {"engine": "transformers", "seconds": elapsed, "output_tokens": tokens,
            "output_tok_per_s": tokens / elapsed, "token_ids": outs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--num-prompts-batch1", type=int, default=4,
                        help="prompts run one at a time for the batch-1 point")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench_results/offline_cpu.json")
    args = parser.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from pagoda.model.tokenizer import embedded_model_path, load_tokenizer
    gguf = embedded_model_path()
    tokenizer = load_tokenizer(str(gguf))
    results = []
    for batch in [int(b) for b in args.batches.split(",")]:
        count = args.num_prompts_batch1 if batch == 1 else batch
        prompts = make_prompts(tokenizer, count, args.prompt_len)
        row = {"batch": batch, "num_prompts": count}
        row["pagoda"] = run_pagoda(prompts, args.max_tokens, batch)
        if not args.skip_transformers:
            row["transformers"] = run_transformers(str(gguf.parent), gguf.name, prompts,
                                                   args.max_tokens, batch)
            same = sum(a == b for a, b in zip(row["pagoda"]["token_ids"],
                                              row["transformers"]["token_ids"]))
            row["identical_outputs"] = f"{same}/{count}"
            row["speedup"] = (row["pagoda"]["output_tok_per_s"]
                              / row["transformers"]["output_tok_per_s"])
        for engine in ("pagoda", "transformers"):
            row.get(engine, {}).pop("token_ids", None)
        results.append(row)
        peer = row.get("transformers", {}).get("output_tok_per_s", float("nan"))
        print(f"batch {batch:3d}: pagoda {row['pagoda']['output_tok_per_s']:8.1f} tok/s   "
              f"transformers {peer:8.1f} tok/s   speedup {row.get('speedup', float('nan')):.2f}x   "
              f"identical {row.get('identical_outputs', '-')}")
    report = {"benchmark": "offline_throughput_cpu", "date": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__},
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "results": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
