"""The executors' hang guard: a rank that does not answer within the limit
(PAGODA_EXECUTOR_TIMEOUT_S after the first step, PAGODA_EXECUTOR_STARTUP_TIMEOUT_S
before) makes the executor dead with an error naming the rank, instead of hanging the
engine forever; shutdown still leaves no process. Fake workers (mp_fake_worker.py)
that stall in a given rank: sampling that never ends, a step that never reaches its
collective (its peer then waits in the collective), a start-up that never ends.
"""

from __future__ import annotations

import functools
import math

import psutil
import pytest
from helpers.mp_fake_worker import RankedFakeWorker
from test_multiproc_executor import assert_all_gone, engine_config

from pagoda.engine.llm_engine import LLMEngine
from pagoda.executor.base import ExecutorDeadError
from pagoda.executor.multiproc import MultiprocExecutor, WorkerStartupError
from pagoda.executor.timeouts import STARTUP_TIMEOUT_ENV, TIMEOUT_ENV, ExecutorTimeouts, remaining
from pagoda.sampling_params import SamplingParams


def test_limits_come_from_the_environment_and_bad_values_are_refused():
    assert ExecutorTimeouts.from_env({}) == ExecutorTimeouts(300.0, 1800.0)
    timeouts = ExecutorTimeouts.from_env({TIMEOUT_ENV: "2.5", STARTUP_TIMEOUT_ENV: "inf"})
    assert timeouts == ExecutorTimeouts(2.5, math.inf)
    assert (timeouts.limit(warm=True), timeouts.limit(warm=False)) == (2.5, math.inf)
    assert timeouts.describe(warm=True) == "2.5 s (PAGODA_EXECUTOR_TIMEOUT_S)"
    assert timeouts.describe(warm=False) == "inf s (PAGODA_EXECUTOR_STARTUP_TIMEOUT_S)"
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(ValueError, match=f"{TIMEOUT_ENV} must be a positive number.*{bad!r}"):
            ExecutorTimeouts.from_env({TIMEOUT_ENV: bad})
    assert remaining(math.inf, 5.0) is None
    assert remaining(7.0, 5.0) == 2.0 and remaining(7.0, 9.0) == 0.0


def make_engine(monkeypatch, step_timeout: str = "3", **worker_kwargs) -> LLMEngine:
    """Two fake ranks; every reply after the first step is due within step_timeout s
    (generous enough for a healthy reply on a busy machine)."""
    monkeypatch.setenv(TIMEOUT_ENV, step_timeout)
    factory = functools.partial(
        MultiprocExecutor,
        world_size=2,
        shutdown_timeout_s=1.0,
        worker_factory=functools.partial(RankedFakeWorker, **worker_kwargs),
    )
    return LLMEngine(engine_config(), executor_factory=factory)


def start_one_request(engine: LLMEngine) -> None:
    """One request, one step done: the executor is warm (the step limit applies)."""
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    engine.step()


def test_sampling_that_never_ends_fails_the_step_naming_the_rank(monkeypatch):
    engine = make_engine(monkeypatch)
    executor = engine.executor
    try:
        start_one_request(engine)
        executor.collective_rpc("set_hang_sampling", ([0],))
        with pytest.raises(
            ExecutorDeadError,
            match=r"rank 0 \(of 2\) sent no reply to "
            r"'sample_tokens' within 3 s "
            r"\(PAGODA_EXECUTOR_TIMEOUT_S\)",
        ):
            engine.step()
        with pytest.raises(ExecutorDeadError, match="rank 0"):
            engine.check_health()
    finally:
        engine.shutdown()
    assert_all_gone(executor.processes)


def test_a_rank_stuck_before_a_collective_fails_the_step_naming_both_ranks(monkeypatch):
    # Rank 1 never reaches the step's all-reduce; rank 0 waits in it: neither answers.
    engine = make_engine(monkeypatch)
    executor = engine.executor
    try:
        start_one_request(engine)
        executor.collective_rpc("set_stall_next_step", ([1],))
        with pytest.raises(ExecutorDeadError, match=r"ranks 0, 1 \(of 2\) sent no reply"):
            engine.step()
    finally:
        engine.shutdown()  # the stuck processes are terminated
    assert_all_gone(executor.processes)


def test_ranks_that_never_finish_starting_are_named(monkeypatch):
    # Every rank stalls: how long a healthy rank takes to start on a busy machine is
    # unbounded, so a test cannot count on one being ready within the limit.
    monkeypatch.setenv(STARTUP_TIMEOUT_ENV, "2")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(
        WorkerStartupError,
        match=r"ranks 0, 1 \(of 2\) not ready within 2 s "
        r"\(PAGODA_EXECUTOR_STARTUP_TIMEOUT_S\)",
    ):
        make_engine(monkeypatch, stall_at_start_ranks=(0, 1))
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert left == []


def test_a_bad_limit_is_refused_before_any_process_starts(monkeypatch):
    with pytest.raises(ValueError, match=TIMEOUT_ENV):
        make_engine(monkeypatch, step_timeout="never")
