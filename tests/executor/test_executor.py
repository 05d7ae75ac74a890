"""The executor contract, driven by the real engine with a fake worker (no model).

The fake worker learns tokens only from the SchedulerOutput diffs (plus, under async
scheduling, the token its own previous step sampled, as the real worker takes it from
the device) and samples a deterministic function of the tokens so far. The engine's
outputs must equal that function applied directly, with async scheduling on and off,
through the two-call step (execute_model, then sample_tokens); the executor's rpc,
pairing and health checks are asserted exactly.
"""

from __future__ import annotations

import functools

import pytest
from helpers.fake_worker import EOS, VOCAB, FakeWorker, expected, run

from pagoda.config import EngineArgs
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig
from pagoda.core.outputs import ModelInfo, StepExtras
from pagoda.engine.llm_engine import LLMEngine
from pagoda.executor.base import ExecutorDeadError
from pagoda.executor.uniproc import UniProcExecutor


def make_engine(async_scheduling: bool) -> LLMEngine:
    args = EngineArgs(
        model="tiny-llama",
        load_format="dummy",
        device="cpu",
        max_num_batched_tokens=32,
        max_num_seqs=4,
        block_size=8,
        async_scheduling=async_scheduling,
    )
    factory = functools.partial(UniProcExecutor, worker_factory=FakeWorker)
    return LLMEngine(args.create_engine_config(), executor_factory=factory)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_through_the_executor_equals_the_direct_rule(async_scheduling):
    engine = make_engine(async_scheduling)
    worker = engine.executor.runner
    assert engine.model_info == ModelInfo("FakeForCausalLM", VOCAB, 256, EOS)
    assert worker.kv_initialised == (64, 256)
    prompts = [[3 + i + j for j in range(7 + 9 * i)] for i in range(6)]  # chunked: budget 32
    done = run(engine, prompts, max_tokens=12)
    assert done == {str(i): expected(p, 12) for i, p in enumerate(prompts)}
    # Every forward was sampled, once, with StepExtras.
    assert len(worker.launched) == len(worker.extras)
    assert all(isinstance(e, StepExtras) and e.grammar_bitmasks == {} for e in worker.extras)
    assert engine.audit_kv_cache().in_use == 0


def test_collective_rpc_health_and_shutdown():
    engine = make_engine(async_scheduling=False)
    executor = engine.executor
    assert executor.determine_kv_cache_config(100) == KVCacheConfig(
        64, [FullAttentionSpec(8, 2, 16, "float32")] * 2
    )
    assert engine.kv_cache_manager.block_size == 8
    assert executor.collective_rpc("model_info")[0].vocab_size == VOCAB
    engine.check_health()
    engine.shutdown()
    with pytest.raises(ExecutorDeadError, match="shut down"):
        engine.check_health()
    with pytest.raises(ExecutorDeadError):
        executor.collective_rpc("model_info")


def test_invalid_tensor_parallel_size_is_refused_with_a_clear_error():
    # Sizes above 1 are valid config now (tests/model/test_tp_sharding.py); which executor
    # runs them is get_executor_class's decision.
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(
            model="tiny-llama", load_format="dummy", device="cpu", tensor_parallel_size=0
        ).create_engine_config()


def test_disable_custom_all_reduce_flag_reaches_the_parallel_config():
    import argparse

    from pagoda.entrypoints.cli_args import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, wanted in (([], False), (["--disable-custom-all-reduce"], True)):
        ns = parser.parse_args(["--model", "tiny-llama", "--device", "cpu", *argv])
        config = engine_args_from_namespace(ns).create_engine_config()
        assert config.parallel.disable_custom_all_reduce is wanted
