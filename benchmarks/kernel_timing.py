"""Timing of one kernel call for the kernel micro-benchmarks, on the GPU or (smoke runs)
in Triton's CPU interpreter."""

from __future__ import annotations

import time


def time_us(fn, smoke: bool) -> float:
    """Median device time of fn() in µs (triton.testing.do_bench); under the interpreter
    (smoke) a rough wall time of one call, only to show that it runs."""
    if smoke:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench
    return do_bench(fn, return_mode="median") * 1e3
