"""An engine that lets go: what an engine started ends with it, in one process.

Every feature that owns a resource is built, used and shut down three times in one
process: KV offload tiers on CPU and disk (I/O threads, the disk directory's lock,
the CPU tier's slots), a draft model (speculative decoding), structured output (the
grammar compile pool), the server's engine loop and its dashboard stream (AsyncEngine
and StatsHub), and tensor parallelism 2 on CPU (worker processes). After each round
the process has the threads and child processes it had before, the disk directory is
unlocked (the next round reopens it and finds the blocks kept), and resident memory
after the third round is within 10% of its level after the first.

The rest pins the API: shutdown() is idempotent and generate() after it raises a
clear error; `with LLM(...)` and `del llm` release the same; the disk tier's lock
error names this process and LLM.shutdown() when the holder is this process, and a
lock left by a dead process is taken over.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import subprocess
import sys
import threading
import weakref

import psutil
import pytest
from helpers.tiny_models import save_tiny_servable_model

from pagoda import LLM, SamplingParams
from pagoda.config import EngineArgs
from pagoda.engine.async_engine import AsyncEngine
from pagoda.engine.llm_engine import EngineShutDownError
from pagoda.entrypoints.openai.stats_stream import StatsHub
from pagoda.kv_offload.disk_tier import LOCK_NAME, DiskTierError
from pagoda.metrics.recent import RequestLog
from pagoda.structured.params import StructuredOutputsParams

MIB = 1 << 20
GIB = 1 << 30
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 4000 + 5 for j in range(40 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny servable target (4 heads, 2 KV heads: splits over 2 ranks) and a smaller
    draft over the same vocabulary (the embedded SmolLM2 tokenizer's)."""
    root = tmp_path_factory.mktemp("shutdown")
    save_tiny_servable_model(root / "target", seed=0, num_hidden_layers=2)
    save_tiny_servable_model(
        root / "draft",
        seed=1,
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return str(root / "target"), str(root / "draft")


def child_pids() -> set[int]:
    """This process's descendants but multiprocessing's resource tracker, which the first
    spawned process starts for the life of the interpreter (not the engine's)."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(_cmdline(p))
    }


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / MIB


def lock_is_free(directory) -> bool:
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing the descriptor drops a lock it took
    return True


def tier_args(target: str, draft: str, disk) -> dict:
    """Every resource-owning feature of a tp-1 engine: CPU and disk tiers behind a pool
    small enough that blocks go down, and a draft model."""
    return dict(
        model=target,
        device="cpu",
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=10,
        max_num_seqs=4,
        kv_offloading_size=4 * MIB / GIB,
        kv_offloading_disk_path=str(disk),
        kv_offloading_disk_size=8 * MIB / GIB,
        kv_offloading_bandwidth="cpu=inf,disk=inf",
        speculative_config={"model": draft, "num_speculative_tokens": 2, "adaptive": False},
    )


async def serve_round(target: str, draft: str, disk) -> int:
    """The server's engine (loop thread) and its dashboard stream over every tier-1
    feature: plain requests and a grammar-constrained one, a stats event read, then the
    hub (its stream ends, its sampler task too) and the engine shut down. Returns the
    disk blocks the engine started with."""
    engine = AsyncEngine.from_engine_args(EngineArgs.from_kwargs(**tier_args(target, draft, disk)))
    engine.start()
    try:
        await engine.wait_ready()
        tiers = (await engine.get_stats()).kv_offload
        kept = next(t for t in tiers if t["tier"] == "disk")["blocks"]
        hub = StatsHub(engine, RequestLog(), "tiny", is_draining=lambda: False, interval_s=0.01)
        body, close_stream = await hub.stream()
        try:
            assert (await anext(body)).startswith("event: info")
            for index, prompt in enumerate(PROMPTS):
                async for _ in engine.generate({"prompt_token_ids": prompt}, GREEDY, f"p{index}"):
                    pass
            constrained = SamplingParams(
                max_tokens=8,
                temperature=0,
                structured_outputs=(StructuredOutputsParams(choice=["yes", "no"])),
            )
            text = "".join(
                [
                    o.outputs[0].text
                    async for o in engine.generate(
                        {"prompt_token_ids": PROMPTS[0][:8]}, constrained, "choice"
                    )
                ]
            )
            assert text in ("yes", "no")
            assert (await anext(body)).startswith("event: stats")
        finally:
            await hub.close()
            close_stream()
        assert all(item.startswith("event: ") for item in [i async for i in body])  # it ends
    finally:
        await engine.shutdown()
    assert asyncio.all_tasks() == {asyncio.current_task()}  # no sampler task left
    return kept


def tp2_round(target: str, how: str) -> None:
    """Two worker processes (gloo on CPU), released by `with`, by `del`, or by shutdown()."""

    def make() -> LLM:
        return LLM(
            target,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            max_model_len=128,
            kv_cache_memory=1 << 21,
            skip_tokenizer_init=True,
        )

    if how == "with":
        with make() as llm:
            llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
    elif how == "del":
        llm = make()
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
        del llm
        gc.collect()
    else:
        llm = make()
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY, use_tqdm=False)
        llm.shutdown()


def test_every_resource_owning_feature_lets_go_three_times(checkpoints, tmp_path):
    target, draft = checkpoints
    disk = tmp_path / "kv-disk"
    threads, children = set(threading.enumerate()), child_pids()
    rss, kept = [], []
    for how in ("with", "del", "shutdown"):
        kept.append(asyncio.run(serve_round(target, draft, disk)))
        tp2_round(target, how)
        gc.collect()
        extra = set(threading.enumerate()) - threads
        assert not extra, f"threads left after round {how!r}: {sorted(t.name for t in extra)}"
        assert child_pids() == children, f"child processes left after round {how!r}"
        assert lock_is_free(disk)
        rss.append(rss_mib())
    assert kept[0] == 0 and kept[1] > 0 and kept[2] > 0  # the directory came back each time
    assert rss[2] <= 1.10 * rss[0], f"resident MiB after each round: {rss}"


@pytest.fixture(scope="module")
def small_llm_args(checkpoints):
    return dict(
        model=checkpoints[0],
        device="cpu",
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=1 << 21,
    )


def test_shutdown_is_idempotent_and_generate_after_it_says_why(small_llm_args):
    llm = LLM(**small_llm_args)
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    llm.shutdown()
    llm.shutdown()
    assert llm.is_shut_down
    for call in (
        lambda: llm.generate("Hi", GREEDY),
        lambda: next(llm.stream("Hi")),
        lambda: llm.chat([{"role": "user", "content": "Hi"}]),
        lambda: llm.llm_engine.step(),
    ):
        with pytest.raises(EngineShutDownError, match="shut down"):
            call()
    assert llm.get_tokenizer() is not None  # facts stay readable
    assert not llm.llm_engine.has_unfinished_requests()


def test_with_block_and_del_release_the_engine(small_llm_args, tmp_path):
    disk = dict(
        kv_offloading_size=1 * MIB / GIB,
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=2 * MIB / GIB,
    )
    threads = set(threading.enumerate())
    with LLM(**small_llm_args, **disk) as llm:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    assert llm.is_shut_down and lock_is_free(tmp_path)
    assert set(threading.enumerate()) == threads
    llm = LLM(**small_llm_args, **disk)  # the directory is free again
    engine = weakref.ref(llm.llm_engine)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    del llm
    assert engine() is None  # nothing references an engine but its LLM: freed at once
    assert lock_is_free(tmp_path)
    assert set(threading.enumerate()) == threads


def test_the_lock_error_names_this_process_and_shutdown(small_llm_args, tmp_path):
    disk = dict(
        kv_offloading_size=1 * MIB / GIB,
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=2 * MIB / GIB,
    )
    first = LLM(**small_llm_args, **disk)
    try:
        with pytest.raises(DiskTierError, match=r"in use by this process.*LLM\.shutdown\(\)"):
            LLM(**small_llm_args, **disk)
    finally:
        first.shutdown()
    LLM(**small_llm_args, **disk).shutdown()  # and free once the first is shut down


def test_a_lock_left_by_a_dead_process_is_taken_over(small_llm_args, tmp_path):
    """Another live process holding the lock is named; once it died (SIGKILL: no clean-up)
    its lock file keeps its pid, but the OS dropped its flock: the next engine takes the
    directory."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({os.path.join(str(tmp_path), LOCK_NAME)!r}, os.O_RDWR | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "os.write(fd, str(os.getpid()).encode())\n"
                "print('locked', flush=True)\n"
                "time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    disk = dict(
        kv_offloading_size=1 * MIB / GIB,
        kv_offloading_disk_path=str(tmp_path),
        kv_offloading_disk_size=2 * MIB / GIB,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DiskTierError, match=rf"another Pagoda server \(pid {holder.pid}\)"):
            LLM(**small_llm_args, **disk)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    with LLM(**small_llm_args, **disk) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
