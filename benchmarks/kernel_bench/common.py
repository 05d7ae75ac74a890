"""What the kernel modes share: the device and dtype of a run (a GPU, or the CPU's
Triton interpreter for --smoke), one kernel timer with three forms, the copy-bandwidth
and matmul ceilings, and a table printer.

Timers (`time_us(fn, run, form)`, microseconds per call):
- "events": triton.testing.do_bench, median, L2 flushed before each call (each layer's
  weights and KV are cold in a real step); Python launches between the events, so a
  call under ~100 us also measures its launch;
- "graph": `calls` back-to-back launches captured in one CUDA graph, replayed; replay
  time / calls (the tail of one launch overlaps the head of the next, as inside the
  engine's step graphs). `rotate` gives each call its own copy of the data it streams,
  so that together they exceed the L2 and every call reads from DRAM;
- the CPU (smoke): the wall time of one call, only to show that the mode runs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Run:
    """A run's device ("cuda", or "cpu" under the interpreter), its 16-bit dtype (bf16 on
    the GPU; float16 in the interpreter, which gets bfloat16 wrong), the timer form, the
    number of calls a graph holds and the measured ceilings ({} on the CPU)."""

    device: str
    dtype: object
    form: str
    calls: int
    smoke: bool
    ceilings: dict


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timer",
        choices=("events", "graph"),
        default="graph",
        help="events: do_bench with L2 flushed; graph: back-to-back launches "
        "replayed from a CUDA graph (see benchmarks/kernel_bench/common.py)",
    )
    p.add_argument("--calls", type=int, default=20, help="launches a timing graph holds")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the CPU's Triton interpreter, tiny shapes: checks the mode runs",
    )


def start_run(args) -> Run:
    """The run's device and ceilings; --smoke turns the interpreter on (before triton is
    first imported: benchmarks/kernels.py calls this before importing any kernel)."""
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    ceilings = {}
    if not smoke:
        from benchmarks.harness.rooflines import measure_ceilings

        ceilings = measure_ceilings(device)
        print(
            f"{torch.cuda.get_device_name()}: copy "
            f"{ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
            f"{ceilings['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s",
            flush=True,
        )
    return Run(
        device,
        torch.float16 if smoke else torch.bfloat16,
        args.timer,
        1 if smoke else args.calls,
        smoke,
        ceilings,
    )


def time_us(fn: Callable, run: Run, form: str | None = None, calls: int | None = None) -> float:
    """Microseconds per call of fn() (module docstring); NaN for a kernel the GPU cannot
    run (out of shared memory or registers)."""
    import triton

    form = form or run.form
    if run.device != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    try:
        fn()
    except triton.runtime.errors.OutOfResources:
        return float("nan")
    if form == "events":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median") * 1e3
    from benchmarks.harness.timing import capture_graph, graph_replay_ms

    calls = calls or run.calls
    graph = capture_graph(fn, calls)
    us = graph_replay_ms(graph, 20, 3) * 1e3 / calls
    del graph
    return us


def rotated(fn: Callable, copies: list) -> Callable:
    """A function that calls fn(copy) on the next of copies each time (for "graph" timing:
    the calls of one replay take turns over them)."""
    state = {"i": 0}

    def call():
        out = fn(copies[state["i"] % len(copies)])
        state["i"] += 1
        return out

    return call


def l2_copies(tensor, run: Run, times: float = 2.0, most: int = 64) -> list:
    """tensor and as many clones as it takes to span `times` the L2 (at most `most`;
    just the tensor on the CPU or with the events timer, which flushes L2 itself)."""
    import torch

    if run.device != "cuda" or run.form == "events":
        return [tensor]
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    count = min(most, max(1, math.ceil(times * l2 / (tensor.numel() * tensor.element_size()))))
    return [tensor] + [tensor.clone() for _ in range(count - 1)]


def tb_per_s(nbytes: float, us: float) -> float:
    return nbytes / us / 1e6 if us == us and us > 0 else float("nan")


def memory_roofline_us(nbytes: float, run: Run) -> float:
    """The bytes' time at the measured copy bandwidth (NaN without ceilings)."""
    bw = run.ceilings.get("copy_bytes_per_s")
    return nbytes / bw * 1e6 if bw else float("nan")


def compute_roofline_us(flops: float, run: Run) -> float:
    """The FLOPs' time at the measured bf16 matmul rate (NaN without ceilings)."""
    rate = run.ceilings.get("bf16_matmul_flops")
    return flops / rate * 1e6 if rate else float("nan")


def print_rows(rows: list[dict], columns: list[str], title: str = "") -> None:
    """rows as a table of the given columns (floats to 2 decimals, missing cells blank)."""
    if title:
        print(f"\n== {title}")
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), flush=True)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.2f}"
    return str(value)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]
