"""Argument types shared by the `pagoda bench` subcommands, and the dataset flags that
both the load generator (`bench serve`) and the offline runs (`throughput`, `latency`)
take."""

from __future__ import annotations

import argparse

from pagoda.bench.datasets import DATASETS


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def add_dataset_args(p: argparse.ArgumentParser, with_seed: bool = True) -> None:
    """Dataset flags; `with_seed=False` where the engine flags already define --seed."""
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON or custom JSONL file")
    g.add_argument("--num-prompts", type=positive_int, default=1000)
    g.add_argument(
        "--random-input-len",
        "--input-len",
        dest="random_input_len",
        type=positive_int,
        default=1024,
    )
    g.add_argument(
        "--random-output-len",
        "--output-len",
        dest="random_output_len",
        type=positive_int,
        default=128,
    )
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are drawn uniformly from len * [1 - r, 1 + r], 0 <= r < 1",
    )
    g.add_argument(
        "--random-prefix-len",
        type=nonnegative_int,
        default=0,
        help="tokens of one shared prefix before every random prompt",
    )
    g.add_argument("--prefix-repetition-prefix-len", type=positive_int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=positive_int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=positive_int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=positive_int, default=128)
    g.add_argument(
        "--sharegpt-output-len",
        type=positive_int,
        default=None,
        help="fix every output length instead of using the conversation's reply",
    )
    g.add_argument(
        "--custom-output-len",
        type=positive_int,
        default=256,
        help="output length of custom lines without 'output_tokens'",
    )
    g.add_argument(
        "--multi-turn-num-conversations",
        type=positive_int,
        default=16,
        help="conversations of the multi-turn dataset (requests go turn by turn "
        "over all of them, so each comes back after all the others)",
    )
    g.add_argument(
        "--multi-turn-turns", type=positive_int, default=4, help="turns per conversation"
    )
    g.add_argument(
        "--multi-turn-first-len",
        type=positive_int,
        default=1024,
        help="tokens of a conversation's first prompt",
    )
    g.add_argument(
        "--multi-turn-turn-len",
        type=positive_int,
        default=128,
        help="tokens of each later user message",
    )
    g.add_argument(
        "--multi-turn-output-len",
        type=positive_int,
        default=128,
        help="tokens asked per turn (and of the reply stand-in in the history)",
    )
    if with_seed:
        g.add_argument("--seed", type=int, default=0)
