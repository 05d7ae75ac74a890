"""Draft-model speculation on the GPU: Llama-3.1-8B shape, dummy bf16 weights, one
H200, with one of two drafts per run (`--draft`):

- `matched`: a draft at the target's width with `--draft-layers` layers that shares the
  target's embedding, final norm and LM head (copied in after start-up), with every
  layer's attention-output and MLP-down weights zeroed in both models. Each layer then
  adds exactly 0 to the residual stream, so both predict the next token as
  argmax(lm_head(norm(embed(t)))): the draft is always right (acceptance ~1), while
  every kernel of both still reads its weights and does its full work (a step costs
  what it costs with real weights). The ceiling of what drafting buys at this draft cost.
- `llama-3.2-1b` (or any preset): random weights, drafts (almost) always wrong: what
  drafting costs, and whether the adaptive budget notices.

One engine per run; "off" detaches the scheduler's planner, "always" turns the
adaptive budget off (k drafts every step), "adaptive" is the default. Reports batch-1
ms per output token and output tok/s at the given concurrencies, with the measured
acceptance. Async scheduling is the engine's default (on for CUDA); `--async-scheduling
on|off` sets it: async, drafting steps are scheduled optimistically (nothing held).

    python3 benchmarks/spec_draft_gpu.py --draft matched --output benchmarks/results/h200-spec-draft-matched.json
    python3 benchmarks/spec_draft_gpu.py --draft llama-3.2-1b --output benchmarks/results/h200-spec-draft-1b.json
    python3 benchmarks/spec_draft_gpu.py --smoke    # CPU, tiny shapes: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing the package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ siblings
from result_file import write_json  # noqa: E402  (benchmarks/)
from spec_decode_gpu import (make_prompts, zero_model_residual_branches,  # noqa: E402
                             zero_residual_branches)

MODES = ("off", "always", "adaptive")


def matched_draft_dir(target: str, num_layers: int) -> str:
    """A directory whose config.json is the target's shape with num_layers layers (the
    engine gives a dummy target's draft random weights of that shape)."""
    from pagoda.model.arch_config import ArchConfig
    from pagoda.model.presets import get_preset
    arch = get_preset(target)
    config = {"architectures": [arch.architecture], "model_type": "llama",
              "hidden_size": arch.hidden_size, "num_hidden_layers": num_layers,
              "num_attention_heads": arch.num_attention_heads,
              "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
              "intermediate_size": arch.intermediate_size, "vocab_size": arch.vocab_size,
              "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
              "rope_scaling": arch.rope_scaling,
              "max_position_embeddings": arch.max_position_embeddings,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    path = tempfile.mkdtemp(prefix="matched-draft-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def match_draft_to_target(engine) -> None:
    """Both models' layers write nothing to the residual stream; the draft reads the
    target's embedding, final norm and LM head."""
    import torch
    zero_residual_branches(engine)
    draft = engine.executor.runner.draft
    if zero_model_residual_branches(draft.model) != 2 * draft.arch.num_hidden_layers:
        raise SystemExit("the matched draft is not a Llama layout")
    theirs = dict(engine.executor.runner.model.named_parameters())
    mine = dict(draft.model.named_parameters())
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            mine[name].copy_(theirs[name])


class Bench:
    def __init__(self, args) -> None:
        from pagoda import LLM
        self.args = args
        draft = matched_draft_dir(args.model, args.draft_layers) if args.draft == "matched" else args.draft
        kwargs = dict(load_format="dummy", max_model_len=args.input_len + args.output_len + 64,
                      max_num_seqs=max(args.concurrency), seed=0,
                      speculative_config={"model": draft, "num_speculative_tokens": args.k})
        if args.smoke:
            kwargs.update(device="cpu", kv_cache_memory=64 << 20)
        if args.async_scheduling is not None:
            kwargs["async_scheduling"] = args.async_scheduling == "on"
        self.llm = LLM(args.model, **kwargs)
        self.engine = self.llm.llm_engine
        if args.draft == "matched":
            match_draft_to_target(self.engine)
        self.planner = self.engine.scheduler.draft_planner
        self.vocab = self.engine.model_info.vocab_size
        info = self.engine.model_info
        self.draft_fraction = info.draft_weight_bytes / info.weight_bytes
        self.async_scheduling = self.engine.async_scheduling

    def configure(self, mode: str, concurrency: int) -> None:
        scheduler = self.engine.scheduler
        scheduler.max_num_seqs = concurrency
        scheduler.draft_planner = None if mode == "off" else self.planner
        self.planner.budget.adaptive = mode == "adaptive"

    def run(self, mode: str, prompts, concurrency: int) -> dict:
        from pagoda import SamplingParams
        self.configure(mode, concurrency)
        params = SamplingParams(max_tokens=self.args.output_len, temperature=0, ignore_eos=True)
        stats = self.planner.stats
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        seconds = time.perf_counter() - start
        steps, drafted, accepted = (a - b for a, b in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"mode": mode, "concurrency": concurrency, "seconds": seconds,
                "output_tokens": tokens, "tok_per_s": tokens / seconds,
                "ms_per_token": 1000 * seconds * concurrency / tokens,  # per stream
                "acceptance": accepted / drafted if drafted else None,
                "mean_accepted_length": 1 + accepted / steps if steps else None,
                "outputs": [o.outputs[0].token_ids for o in outs]}


def sweep(bench: Bench) -> list[dict]:
    args = bench.args
    rows = []
    print(f"\n== {args.model} + draft {args.draft} (k={args.k}, async scheduling "
          f"{'on' if bench.async_scheduling else 'off'}, draft bytes "
          f"{bench.draft_fraction:.3f} of the target's), {args.input_len} in / "
          f"{args.output_len} out")
    print(f"{'conc':>6}{'off':>10}{'always':>10}{'adaptive':>10}{'adapt/off':>10}"
          f"{'accept':>8}{'mean len':>9}   (batch 1: ms/token; else tok/s)")
    bench.run("off", make_prompts(1, args.input_len, bench.vocab, 0), 1)  # warm-up
    for concurrency in args.concurrency:
        count = args.batch1_requests if concurrency == 1 else 2 * concurrency
        prompts = make_prompts(count, args.input_len, bench.vocab, seed=concurrency)
        row = {m: bench.run(m, prompts, concurrency) for m in MODES}
        same = row["off"]["outputs"] == row["always"]["outputs"] == row["adaptive"]["outputs"]
        for r in row.values():
            del r["outputs"]
        rows.append({"concurrency": concurrency, "outputs_equal": same, **row})
        key = "ms_per_token" if concurrency == 1 else "tok_per_s"
        ratio = row["off"][key] / row["adaptive"][key] if concurrency == 1 else \
            row["adaptive"][key] / row["off"][key]
        acc, length = row["always"]["acceptance"], row["always"]["mean_accepted_length"]
        print(f"{concurrency:>6}{row['off'][key]:>10.2f}{row['always'][key]:>10.2f}"
              f"{row['adaptive'][key]:>10.2f}{ratio:>9.2f}x{acc or 0:>8.2f}{length or 0:>9.2f}"
              f"{'' if same else '   OUTPUTS DIFFER'}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="target preset (dummy weights)")
    parser.add_argument("--draft", default="matched", help="'matched' or a preset name")
    parser.add_argument("--draft-layers", type=int, default=2, help="layers of the matched draft")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch1-requests", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--async-scheduling", choices=["on", "off"], default=None,
                        help="default: the engine's (on for CUDA)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, a few tokens")
    parser.add_argument("--output", default=None, help="JSON results file")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.input_len, args.output_len = "tiny-llama", 16, 12
        args.batch1_requests, args.concurrency = 2, [1, 4]
        args.draft_layers = 1
    bench = Bench(args)
    results = {"benchmark": "spec_draft_gpu", "model": args.model, "draft": args.draft,
               "draft_layers": args.draft_layers if args.draft == "matched" else None,
               "k": args.k, "draft_weight_fraction": bench.draft_fraction,
               "async_scheduling": bench.async_scheduling,
               "machine": platform.platform(),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "rows": sweep(bench)}
    import torch
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name()
    if args.output:
        write_json(args.output, results)
    bench.engine.shutdown()


if __name__ == "__main__":
    main()
