"""The multi-process executor with fake workers (mp_fake_worker.py) in 2 processes on CPU,
joined in a gloo group: the real LLMEngine through it equals the direct rule, every
rank sees every step in order, KV sizing takes the fewest blocks, and failures (a
worker killed, raising, failing to start, the engine process dying) surface with the
rank and leave no process behind.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import os
import select
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
from helpers.fake_worker import expected, run
from helpers.mp_fake_worker import RankedFakeWorker, recording_executor

from pagoda.config import EngineArgs
from pagoda.core.kv_cache_spec import KVCacheConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.executor.base import ExecutorDeadError
from pagoda.executor.multiproc import MultiprocExecutor, WorkerStartupError
from pagoda.executor.worker_setup import cpu_threads_per_rank
from pagoda.sampling_params import SamplingParams

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_config(async_scheduling: bool = False):
    return EngineArgs(
        model="tiny-llama",
        load_format="dummy",
        device="cpu",
        max_num_batched_tokens=32,
        max_num_seqs=4,
        block_size=8,
        async_scheduling=async_scheduling,
    ).create_engine_config()


RecordingExecutor = recording_executor(MultiprocExecutor)


def make_engine(async_scheduling: bool = False, **worker_kwargs) -> LLMEngine:
    factory = functools.partial(
        RecordingExecutor,
        world_size=2,
        shutdown_timeout_s=5.0,
        worker_factory=functools.partial(RankedFakeWorker, **worker_kwargs),
    )
    return LLMEngine(engine_config(async_scheduling), executor_factory=factory)


def assert_all_gone(processes) -> None:
    assert len(processes) == 2
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    for p in processes:
        assert not p.is_alive() and p.exitcode is not None
        assert p.pid not in children


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_through_two_processes_equals_the_direct_rule(async_scheduling):
    # Under async scheduling each step's output is ready only after the next step was
    # launched on that rank: this passes only if a worker's main loop receives and
    # launches step N+1 while step N's output is awaited (off the main loop).
    engine = make_engine(async_scheduling, results_after_next_launch=async_scheduling)
    executor = engine.executor
    try:
        whoami = executor.collective_rpc("whoami")
        assert [w[0] for w in whoami] == [0, 1]
        assert all(w[2] for w in whoami), "multicast stays off in every worker"
        assert {w[1] for w in whoami} == {p.pid for p in executor.processes}
        threads = cpu_threads_per_rank(2)  # each rank its share of the cores
        assert executor.collective_rpc("num_threads") == [threads or torch.get_num_threads()] * 2
        prompts = [[3 + i + j for j in range(7 + 9 * i)] for i in range(6)]  # chunked
        done = run(engine, prompts, max_tokens=12)
        assert done == {str(i): expected(p, 12) for i, p in enumerate(prompts)}
        # Every rank saw every step, in the order the engine sent them.
        seen = executor.collective_rpc("steps_seen")
        assert len(executor.sent) > 6 and seen == [executor.sent, executor.sent]
        assert engine.audit_kv_cache().in_use == 0
        # rank 0 holds 64 blocks, rank 1 54: one block id must mean the same on both.
        assert engine.num_blocks == 54
        assert executor.determine_kv_cache_config(100) == KVCacheConfig(
            54, engine.kv_cache_config.layer_specs
        )
        engine.check_health()
    finally:
        engine.shutdown()
    assert_all_gone(executor.processes)
    with pytest.raises(ExecutorDeadError, match="shut down"):
        engine.check_health()
    with pytest.raises(ExecutorDeadError, match="shut down"):
        executor.collective_rpc("whoami")
    engine.shutdown()  # idempotent


def test_a_killed_worker_fails_the_step_in_flight_and_the_executor():
    engine = make_engine()
    executor = engine.executor
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
        engine.step()
        executor.collective_rpc("set_hang_sampling", ([0],))  # rank 0's result never comes
        executor.execute_model(engine.scheduler.schedule())
        executor.collective_rpc("steps_seen")  # both ranks are past the step's collective
        future = executor.sample_tokens()
        os.kill(executor.processes[1].pid, signal.SIGKILL)
        with pytest.raises(ExecutorDeadError, match=r"rank 1 \(pid \d+\) died: killed by SIGKILL"):
            future.result()
        with pytest.raises(ExecutorDeadError, match="rank 1"):
            engine.check_health()
        with pytest.raises(ExecutorDeadError, match="rank 1"):
            engine.step()  # later calls raise at once
    finally:
        engine.shutdown()
    assert_all_gone(executor.processes)
    with pytest.raises(ExecutorDeadError, match="rank 1"):  # the first reason stays
        engine.check_health()


def test_a_worker_that_raises_in_a_step_fails_the_executor_with_its_traceback():
    engine = make_engine(async_scheduling=True)
    executor = engine.executor
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
        engine.step()
        executor.collective_rpc("set_fail_next_step", ([1],))
        with pytest.raises(
            ExecutorDeadError,
            match=r"(?s)rank 1 failed in 'execute_model'.*injected failure on rank 1",
        ):
            for _ in range(3):
                engine.step()
        with pytest.raises(ExecutorDeadError, match="rank 1"):
            engine.check_health()
    finally:
        engine.shutdown()
    assert_all_gone(executor.processes)


def test_a_rank_that_fails_at_start_up_is_reported_and_nothing_is_left(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(
        WorkerStartupError, match=r"(?s)worker rank 1 \(of 2\) failed to start.*refuses to start"
    ):
        make_engine(fail_at_start_rank=1)
    after = psutil.Process().children(recursive=True)
    left = [
        p for p in after if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert left == []


def test_async_engine_fails_its_requests_and_stops_when_a_worker_dies():
    from pagoda.engine.async_engine import AsyncEngine

    async def scenario() -> tuple[list[BaseException], AsyncEngine]:
        engine = AsyncEngine(lambda: make_engine(async_scheduling=True))
        engine.start()
        await engine.wait_ready()
        executor = engine.engine.executor
        # No step can complete without rank 1 (each one all-reduces over both ranks).
        os.kill(executor.processes[1].pid, signal.SIGKILL)

        async def consume(i: int):
            params = SamplingParams(max_tokens=50, temperature=0)
            async for _ in engine.generate([1, 2, 3 + i], params, str(i)):
                pass

        results = await asyncio.gather(*(consume(i) for i in range(3)), return_exceptions=True)
        await engine.shutdown()
        return results, engine

    results, engine = asyncio.run(scenario())
    assert all(isinstance(r, Exception) for r in results), results
    assert any("rank 1" in str(r) for r in results), results
    assert not engine.is_running  # the loop stopped: /health answers 503
    assert_all_gone(engine.engine.executor.processes)


ENGINE_SCRIPT = textwrap.dedent("""
    import functools, os, signal, sys
    from helpers.mp_fake_worker import RankedFakeWorker
    from pagoda.config import EngineArgs
    from pagoda.executor.multiproc import MultiprocExecutor
    config = EngineArgs(model="tiny-llama", load_format="dummy", device="cpu").create_engine_config()
    if __name__ == "__main__":
        ex = MultiprocExecutor(config, "unused", world_size=2,
                               worker_factory=functools.partial(RankedFakeWorker))
        print(" ".join(str(p.pid) for p in ex.processes), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _wait_exit(pid: int, timeout: float) -> bool:
    """Waits for an adopted orphan to exit (a pidfd becomes readable), then reaps it."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if not select.select([fd], [], [], timeout)[0]:
            return False
        os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
        return True
    finally:
        os.close(fd)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl subreaper, pidfd")
def test_workers_exit_when_the_engine_process_dies(tmp_path):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_CHILD_SUBREAPER = 36
    # The workers' orphans are adopted by this process, so it can wait for them.
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    pids: list[int] = []
    try:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])
        )
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        pids = [int(p) for p in proc.stdout.split()]
        assert len(pids) == 2
        assert all(_wait_exit(pid, timeout=30) for pid in pids)
    finally:
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
                _wait_exit(pid, timeout=10)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def test_the_executor_class_follows_the_parallel_config():
    from types import SimpleNamespace

    from pagoda.executor.factory import get_executor_class
    from pagoda.executor.uniproc import UniProcExecutor

    def config(tp: int, backend=None):
        parallel = SimpleNamespace(tensor_parallel_size=tp)
        if backend is not None:
            parallel.distributed_executor_backend = backend
        return SimpleNamespace(parallel=parallel)

    assert get_executor_class(config(1)) is UniProcExecutor
    assert get_executor_class(config(2)) is MultiprocExecutor
    assert get_executor_class(config(2, "mp")) is MultiprocExecutor
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        get_executor_class(config(2, "dask"))


@pytest.mark.parametrize("tp", [1, 2])
def test_ray_is_chosen_at_any_size_and_its_absence_is_a_clear_error(tp, monkeypatch):
    from types import SimpleNamespace

    from pagoda.config import EngineArgs
    from pagoda.executor.factory import get_executor_class

    config = SimpleNamespace(
        parallel=SimpleNamespace(tensor_parallel_size=tp, distributed_executor_backend="ray")
    )
    if importlib.util.find_spec("ray") is not None:
        from pagoda.executor.ray_executor import RayExecutor

        assert get_executor_class(config) is RayExecutor
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    hint = r"needs Ray, which is not installed: pip install 'pagoda\[ray\]'"
    with pytest.raises(ValueError, match=hint):
        get_executor_class(config)
    # The engine refuses at start-up, before it loads anything.
    args = EngineArgs(
        model="tiny-llama",
        load_format="dummy",
        device="cpu",
        tensor_parallel_size=tp,
        distributed_executor_backend="ray",
    )
    with pytest.raises(ValueError, match=hint):
        LLMEngine(args.create_engine_config())


def test_the_cli_reports_a_missing_ray_in_one_line(monkeypatch, capsys, smollm2_gguf):
    from pagoda.entrypoints.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)
    code = main(
        [
            "generate",
            "hi",
            "--model",
            "tiny-llama",
            "--load-format",
            "dummy",
            "--tokenizer",
            str(smollm2_gguf),
            "--device",
            "cpu",
            "--tensor-parallel-size",
            "2",
            "--distributed-executor-backend",
            "ray",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    # The engine's distributed_executor_backend='ray', as the CLI user typed it.
    assert err.endswith(
        "error: --distributed-executor-backend ray needs Ray, which is not "
        "installed: pip install 'pagoda[ray]'\n"
    ), err


def test_cpu_ranks_share_the_cores_unless_omp_num_threads_says():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cpu_threads_per_rank(1, {}) == cores
    assert cpu_threads_per_rank(2, {}) == max(1, cores // 2)
    assert cpu_threads_per_rank(4 * cores, {}) == 1
    assert cpu_threads_per_rank(2, {"OMP_NUM_THREADS": "3"}) is None


def test_the_model_runner_is_not_started_in_a_group_of_another_size():
    with pytest.raises(ValueError, match="world_size 2 differs from tensor_parallel_size 1"):
        MultiprocExecutor(engine_config(), "unused", world_size=2)
