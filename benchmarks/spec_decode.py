"""Speculative decoding, with speculation off and on in the same run, five ways.

    python -m benchmarks.spec_decode cpu                       # embedded SmolLM2, batch 1, CPU
    python -m benchmarks.spec_decode replay                    # GPU, controlled acceptance
    python -m benchmarks.spec_decode draft --draft matched     # GPU, a draft model
    python -m benchmarks.spec_decode mtp                       # GPU, MTP at controlled acceptance
    python -m benchmarks.spec_decode serve                     # through `pagoda serve`
    python -m benchmarks.spec_decode replay --smoke            # cpu/replay/draft/mtp: --smoke

cpu     The embedded SmolLM2-135M at batch 1, greedy, two workloads: grounded (edit or
        summarise a given text, so the answer copies the prompt: n-gram drafts, adaptive
        budget on and off) and chat (free questions: layer-skip self-speculation, the
        target's first 29 of 30 layers draft). Per configuration: output tok/s, speedup
        over off, acceptance (accepted / drafted), mean accepted length (tokens per verify
        step, the bonus included), and whether the greedy output equals off's (it must).
        `--async-scheduling on` runs every configuration with it, `both` adds the
        layer-skip configurations with it; `--confidence T ...` adds draft-confidence
        thresholds.
replay  Llama-3.1-8B shape, dummy weights, at controlled acceptance. Random weights give
        nothing worth drafting, so drafts come from a benchmark-only proposer
        (ReplayProposer, installed in place of an "ngram" engine's host proposer): it
        replays a recorded greedy run of the same target on the same prompts with a chosen
        fraction of draft tokens corrupted. Replay needs greedy tokens that do not depend
        on the step's shape, which random weights do not give (a verify step rounds
        differently from a decode step and flips near-ties), so every layer's o_proj and
        down_proj weights are zeroed: each layer adds exactly 0 to the residual, the next
        token is a function of the current one only, and every kernel still does its full
        work. Batch 1: ms/token at target acceptance 0, 50, 80, 95 % for off, k always and
        adaptive ("acceptance" is vLLM's; "draft_acceptance" the chance that a draft is
        accepted given the ones before were). Throughput at concurrency 1..256 at
        `--target` acceptances: off vs adaptive (and k always); at 0 % adaptive should
        stay within 2 % of off.
draft   A draft model (`--draft`): `matched` is the target's width with `--draft-layers`
        layers sharing its embedding, final norm and LM head, residual branches zeroed in
        both models, so the draft is always right while every kernel does its full work
        (the ceiling of what drafting buys at this draft cost); a preset name (e.g.
        llama-3.2-1b) drafts with random weights, almost always wrong (what drafting costs).
        Batch-1 ms/token and tok/s at each concurrency for off, always and adaptive.
mtp     DeepSeek-V3 shape cut to --layers layers (--experts routed experts) plus its MTP
        layer, random weights written as a safetensors checkpoint, the target's residual
        branches zeroed: the MTP layer runs every step, its drafts replaced by replayed
        ones at target acceptance 0, 50, 80, 95 %. Batch-1 ms/token and speed-up over off
        for each k (--k) always and adaptive, and the MTP layer alone (spec_bench/mtp.py).
serve   Through a real `pagoda serve`, measured by `pagoda bench serve` on the grounded
        prompts (chat-templated, sent as a custom JSONL dataset): TTFT / TPOT percentiles,
        output throughput and the server's acceptance, for off and n-gram. Server flags
        after --server-flags (default: --device cpu).

In every engine mode one engine serves all configurations: "off" detaches the
scheduler's draft planner, "always" turns the adaptive budget off, "adaptive" is the
default. Writes JSON (--out).
"""

from __future__ import annotations

import argparse

from benchmarks.harness.results import write_result
from benchmarks.spec_bench.cpu import run_cpu
from benchmarks.spec_bench.draft import run_draft
from benchmarks.spec_bench.mtp import add_mtp_args, run_mtp
from benchmarks.spec_bench.replay import run_replay
from benchmarks.spec_bench.serve import run_serve


def _add_cpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=6, help="requests per workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--async-scheduling",
        choices=["off", "on", "both"],
        default="off",
        help="async scheduling for every run (on), or layer-skip both ways",
    )
    p.add_argument(
        "--confidence",
        type=float,
        nargs="*",
        default=[],
        help="layer-skip draft confidence thresholds to compare",
    )
    p.add_argument("--skip-ngram", action="store_true", help="the layer-skip workload only")
    p.add_argument("--smoke", action="store_true", help="one short request each: checks it runs")


def _add_engine_args(p: argparse.ArgumentParser, name: str, concurrency: list[int]) -> None:
    """The replay and draft modes' arguments (name: which)."""
    p.add_argument("--model", default="llama-3.1-8b", help="target preset (dummy weights)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-requests", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=concurrency)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, a few tokens")
    if name == "replay":
        p.add_argument(
            "--target",
            type=float,
            nargs="+",
            default=[0.0, 0.8],
            help="target acceptances of the throughput runs",
        )
    else:
        p.add_argument("--draft", default="matched", help="'matched' or a preset name")
        p.add_argument("--draft-layers", type=int, default=2, help="layers of the matched draft")
        p.add_argument(
            "--async-scheduling",
            choices=["on", "off"],
            default=None,
            help="default: the engine's (on for CUDA)",
        )


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument(
        "--server-flags",
        nargs=argparse.REMAINDER,
        default=["--device", "cpu"],
        help="flags for `pagoda serve` (default: --device cpu); the last option",
    )


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
            default=f"bench_results/spec-{name}.json",
            help="JSON result file",
        )
        return p

    _add_cpu_args(mode("cpu", "embedded SmolLM2 at batch 1: n-gram and layer-skip drafts"))
    for name, help_text, conc in (
        (
            "replay",
            "replayed drafts at controlled acceptance (zeroed residual branches)",
            [1, 8, 32, 128, 256],
        ),
        ("draft", "a draft model: matched (always right) or a preset (random)", [1, 8, 32, 128]),
    ):
        _add_engine_args(mode(name, help_text), name, conc)
    add_mtp_args(mode("mtp", "MTP speculation at controlled acceptance (DeepSeek-V3 cut)"))
    _add_serve_args(mode("serve", "through `pagoda serve`, measured by `pagoda bench serve`"))
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    modes = {"cpu": run_cpu, "replay": run_replay, "draft": run_draft, "mtp": run_mtp}
    result = {**modes, "serve": run_serve}[args.mode](args)
    write_result(args.out, {"benchmark": f"spec_decode {args.mode}", "args": vars(args), **result})


if __name__ == "__main__":
    main()
