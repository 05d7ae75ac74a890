"""The Ray executor on a local Ray cluster, on CPU (gloo): two actors placed by a
placement group run the same workers as the multi-process executor. With fake
workers (mp_fake_worker.py): the real LLMEngine through it equals the direct rule,
every rank sees every step in order, NVLink multicast is off in every actor from its
start; a killed actor, an actor that raises, one that fails to start and one that
stalls surface with the rank, and shutdown leaves no actor process. With real model
runners: tp 2 generates the tp 1 greedy tokens, on a Ray runtime the executor starts
and stops itself.

Skipped without Ray (`pip install 'pagoda[ray]'`). Most tests share one local cluster
(`cluster`); the one that lets the executor start its own shuts that down first.
"""

from __future__ import annotations

import functools
import os
import signal

import psutil
import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'pagoda[ray]'")

from helpers.fake_worker import expected, run  # noqa: E402
from helpers.mp_fake_worker import RankedFakeWorker, recording_executor  # noqa: E402
from helpers.tiny_models import save_tiny_hf_model  # noqa: E402
from test_multiproc_executor import engine_config  # noqa: E402
from test_tp_engine import generate  # noqa: E402

from pagoda.distributed.parallel_state import MULTICAST_OFF_ENV  # noqa: E402
from pagoda.engine.llm_engine import LLMEngine  # noqa: E402
from pagoda.executor.base import ExecutorDeadError  # noqa: E402
from pagoda.executor.multiproc import WorkerStartupError  # noqa: E402
from pagoda.executor.ray_executor import RayExecutor  # noqa: E402
from pagoda.executor.timeouts import TIMEOUT_ENV  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402

GONE_TIMEOUT_S = 60.0
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def _stop_ray_at_the_end():
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def cluster():
    """A local Ray runtime shared by the tests (the executor joins it, never stops it)."""
    if not ray.is_initialized():
        # The actors import the fake worker from this directory (actors' env_vars are
        # merged with these).
        path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
        ray.init(
            num_cpus=2,
            object_store_memory=100 << 20,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )


RecordingExecutor = recording_executor(RayExecutor)


def make_engine(async_scheduling: bool = False, **worker_kwargs) -> LLMEngine:
    factory = functools.partial(
        RecordingExecutor,
        world_size=2,
        worker_factory=functools.partial(RankedFakeWorker, **worker_kwargs),
    )
    return LLMEngine(engine_config(async_scheduling), executor_factory=factory)


def assert_gone(pids: list[int]) -> None:
    """Every process in pids exits (Ray reaps its workers; wait for that, bounded)."""
    assert len(pids) == 2
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=GONE_TIMEOUT_S)
    assert alive == []


def test_engine_through_ray_actors_equals_the_direct_rule(cluster):
    # Async scheduling, each step's output ready only after the next step launched: this
    # passes only if an actor runs step N+1's calls before it is asked for step N's output.
    engine = make_engine(async_scheduling=True, results_after_next_launch=True)
    executor = engine.executor
    try:
        whoami = executor.collective_rpc("whoami")
        assert [w[0] for w in whoami] == [0, 1]
        assert [w[1] for w in whoami] == executor.pids
        assert (
            ray.get([a.multicast_env_at_start.remote() for a in executor.actors])
            == [MULTICAST_OFF_ENV] * 2
        )
        prompts = [[3 + i + j for j in range(7 + 9 * i)] for i in range(6)]  # chunked
        done = run(engine, prompts, max_tokens=12)
        assert done == {str(i): expected(p, 12) for i, p in enumerate(prompts)}
        seen = executor.collective_rpc("steps_seen")
        assert len(executor.sent) > 6 and seen == [executor.sent, executor.sent]
        assert engine.num_blocks == 54  # the fewest blocks of any rank (64, 54)
        engine.check_health()
    finally:
        engine.shutdown()
    assert_gone(executor.pids)
    with pytest.raises(ExecutorDeadError, match="shut down"):
        executor.collective_rpc("whoami")
    engine.shutdown()  # idempotent


def test_a_killed_actor_fails_the_step_in_flight_and_the_executor(cluster):
    engine = make_engine()
    executor = engine.executor
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
        engine.step()
        executor.collective_rpc("set_hang_sampling", ([0],))  # rank 0's result never comes
        executor.execute_model(engine.scheduler.schedule())
        executor.collective_rpc("steps_seen")  # both ranks are past the step's collective
        future = executor.sample_tokens()
        os.kill(executor.pids[1], signal.SIGKILL)
        with pytest.raises(ExecutorDeadError, match=rf"rank 1 \(pid {executor.pids[1]}\) died: "):
            future.result()
        with pytest.raises(ExecutorDeadError, match="rank 1"):
            engine.check_health()
        with pytest.raises(ExecutorDeadError, match="rank 1"):
            engine.step()  # later calls raise at once
    finally:
        engine.shutdown()
    assert_gone(executor.pids)


def test_an_actor_that_raises_in_a_step_fails_the_executor_with_its_traceback(cluster):
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
    finally:
        engine.shutdown()
    assert_gone(executor.pids)


def test_an_actor_that_fails_at_start_up_is_reported_and_its_group_released(cluster):
    with pytest.raises(WorkerStartupError, match=r"(?s)rank 1 failed in 'start'.*refuses to start"):
        make_engine(fail_at_start_rank=1)
    from ray.util import placement_group_table

    assert {g["state"] for g in placement_group_table().values()} <= {"REMOVED"}


def test_sampling_that_never_ends_fails_the_step_naming_the_rank(cluster, monkeypatch):
    monkeypatch.setenv(TIMEOUT_ENV, "3")
    engine = make_engine()
    executor = engine.executor
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
        engine.step()
        executor.collective_rpc("set_hang_sampling", ([0],))
        with pytest.raises(
            ExecutorDeadError,
            match=r"rank 0 \(of 2\) sent no reply to "
            r"'sample_tokens' within 3 s",
        ):
            engine.step()
    finally:
        engine.shutdown()
    assert_gone(executor.pids)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-tp-llama")
    save_tiny_hf_model(path, "llama")  # 4 heads / 2 KV heads: one KV head per rank
    return str(path)


def test_tp2_on_a_ray_runtime_of_its_own_generates_the_tp1_greedy_tokens(tiny_llama):
    """Real model runners (each rank its share of the heads, gloo all-reduces) in two
    actors; Ray is not running, so the executor starts a local runtime and stops it."""
    if ray.is_initialized():
        ray.shutdown()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    reference = generate(tiny_llama, 1, async_scheduling=False)
    tokens = generate(tiny_llama, 2, async_scheduling=True, distributed_executor_backend="ray")
    assert not ray.is_initialized()
    assert tokens == reference
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(started, timeout=GONE_TIMEOUT_S)
    assert alive == []  # Ray's own processes and the actors


@pytest.mark.gpu(2)
def test_tp2_through_ray_on_two_gpus_generates_the_tp1_greedy_tokens(tiny_llama):
    """NCCL between two actors, each shown both GPUs (peer to peer), CUDA graphs, async
    scheduling; float32 weights so the reduction order cannot flip a greedy choice."""
    import gc

    if ray.is_initialized():
        ray.shutdown()
    reference = generate(tiny_llama, 1, async_scheduling=True, device="cuda")
    gc.collect()  # the tp 1 engine's memory on GPU 0 would shrink rank 0's KV budget
    torch.cuda.empty_cache()
    assert (
        generate(
            tiny_llama, 2, async_scheduling=True, device="cuda", distributed_executor_backend="ray"
        )
        == reference
    )
