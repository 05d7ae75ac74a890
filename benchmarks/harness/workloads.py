"""Workload pieces shared by the engine benchmarks: random token prompts, stepping an
engine while noting when each token reached the host, and model directories made from
a config alone (for --load-format dummy)."""

from __future__ import annotations

import json
import os
import tempfile
import time


def uniform_lengths(rng, n: int, lo: int, hi: int) -> list[int]:
    """n lengths uniform in [lo, hi] (numpy Generator rng)."""
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_prompts(rng, lengths: list[int], vocab: int) -> list[list[int]]:
    """One prompt of random token ids per length, drawn from [10, vocab - 10)."""
    return [[int(t) for t in rng.integers(10, vocab - 10, size=n)] for n in lengths]


def token_arrival_times(engine) -> list[float]:
    """Steps the engine to the end; the host time at which each new token arrived
    (requests added with output_kind="delta")."""
    arrivals = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            arrivals.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    return arrivals


def decode_ready(engine) -> bool:
    """Nothing waits and every running request is past its prompt."""
    sched = engine.scheduler
    return not sched.num_waiting and all(
        r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
    )


def config_dir(config: dict, prefix: str = "pagoda-bench-model-") -> str:
    """A new temporary directory holding config.json = config (a model for
    --load-format dummy: random weights of that shape)."""
    path = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path
