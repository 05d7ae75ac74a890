"""Timers of the benchmark programs.

Device time: `cuda_event_ms` records a CUDA event before and after each call on the
current stream and waits for the second; `graph_replay_ms` does the same around the
replay of a captured CUDA graph (`capture_graph` captures one the way torch asks: warm
calls on a side stream first). Host time: `wall_seconds` / `min_seconds` around a
whole call, and `StageTimer`, which wraps functions and methods in place and sums the
wall time spent in each (nothing in it syncs the device).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict


def cuda_event_ms(fn, repeats: int = 10, warmup: int = 3) -> list[float]:
    """Device milliseconds of each of `repeats` calls of fn(), between two CUDA events on
    the current stream; `warmup` untimed calls first."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def median_cuda_ms(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median of cuda_event_ms."""
    return statistics.median(cuda_event_ms(fn, repeats, warmup))


def capture_graph(fn, calls: int = 1, warmup: int = 3):
    """A CUDA graph of `calls` calls of fn(), captured after `warmup` calls on a side
    stream, and replayed once (so the first timed replay is a warm one)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_replay_ms(graph, repeats: int = 20, warmup: int = 3) -> float:
    """Median device milliseconds of one replay of a captured CUDA graph."""
    return median_cuda_ms(graph.replay, repeats, warmup)


def engine_step_timing(engine, runner, batch: int, steps: int, sync) -> dict:
    """A decode step as served: the engine's step wall time (with CUDA graphs, synced
    around each step) over `steps` steps, and the bare replay of the captured decode
    graph for `batch` rows (the forward's device time without any host work). The
    graph's buffers hold the last step's inputs: a replay recomputes that step (it
    rewrites the same KV slots with the same values)."""
    walls = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        walls.append((time.perf_counter() - start) * 1e3)
    out = {"step_ms": walls}
    graphs = runner.graph_runner
    key = graphs.graph_for(batch, batch) if graphs is not None else None
    if key is not None:
        out["graph_key"] = list(key)
        out["replay_ms"] = graph_replay_ms(graphs.graphs[key], max(steps, 20), 3)
    return out


def wall_seconds(fn) -> float:
    """Host seconds of one call of fn()."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def min_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """The fastest of `repeats` calls of fn() after `warmup` untimed ones, in seconds
    (background load on a shared machine only ever slows a run down)."""
    for _ in range(warmup):
        fn()
    return min(wall_seconds(fn) for _ in range(repeats))


class StageTimer:
    """Inclusive host wall time per named stage. `wrap(owner, attr, label)` replaces
    owner.attr (a function, method or bound method) by a version that adds its time to
    `totals[label]` (seconds) and counts `calls[label]`; while `active` is False the
    wrapper only calls through. `steps` is the count the caller divides by."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = True
        self.steps = 0

    def wrap(self, owner, attr: str, label: str | None = None) -> None:
        inner = getattr(owner, attr)
        label = label or attr
        timer = self

        def timed(*args, **kwargs):
            if not timer.active:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timer.totals[label] += time.perf_counter() - start
                timer.calls[label] += 1

        setattr(owner, attr, timed)

    def wrap_module_forwards(self, model, classes: dict[type, str]) -> None:
        """Times forward() of every submodule that is an instance of a key of classes
        (the first key that matches names it)."""
        for module in model.modules():
            for cls, label in classes.items():
                if isinstance(module, cls):
                    self.wrap(module, "forward", label)
                    break

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        return {k: v / max(self.steps, 1) * 1e3 for k, v in self.totals.items()}


def engine_stage_timer(engine) -> StageTimer:
    """A StageTimer on the stages of an in-process engine's step: schedule, update,
    output processing, step inputs, sampling, graph replay, eager forward, and
    `wait_device` (the host waiting for a step's sampled ids: near 0 when host-bound).
    Nothing syncs the device, so with async scheduling the forward and sampling figures
    are launch times."""
    from pagoda.worker import model_runner, step_output

    timer = StageTimer()
    runner = engine.executor.runner
    timer.wrap(engine.scheduler, "schedule")
    timer.wrap(engine.scheduler, "update_from_output")
    timer.wrap(engine.output_processor, "process_outputs")
    timer.wrap(model_runner, "build_step_inputs")
    timer.wrap(runner, "_sample")
    if runner.graph_runner is not None:
        timer.wrap(runner.graph_runner, "run")
    timer.wrap(step_output.AsyncRunnerOutput, "result", "wait_device")
    timer.wrap(runner.model, "forward", "forward_eager")
    return timer
