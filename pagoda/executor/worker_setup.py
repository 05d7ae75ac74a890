"""What a tensor-parallel worker process does whatever carries the engine's requests to
it (pipes for the "mp" backend, Ray actor calls for "ray"): its start-up (NVLink
multicast off, its CUDA device, joining the group, building the worker object), leaving
the group, and the one rule for what a rank answers to a request.

`mp_worker.py` and `ray_worker.py` each wrap this in their own transport; neither holds
a copy of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.config import EngineConfig
from pagoda.executor.mp_protocol import Reply

WorkerFactory = Callable[[EngineConfig, str, int], Any]


def default_worker_factory(config: EngineConfig, model_path: str, rank: int) -> Any:
    """The engine's worker: this rank's ModelRunner (module-level, so it pickles)."""
    from pagoda.worker.model_runner import ModelRunner

    return ModelRunner(config, model_path, rank)


def choose_workers(
    config: EngineConfig,
    model_path: str,
    worker_factory: WorkerFactory | None,
    world_size: int | None,
) -> tuple[WorkerFactory, int]:
    """The worker factory and the number of ranks an executor starts. By default the
    ModelRunner at tensor_parallel_size ranks, refused before any process starts if the
    model's heads or columns do not split over them (its shape is read without loading
    a weight); tests pass their own factory and world size to run fake workers."""
    tp_size = config.parallel.tensor_parallel_size
    world_size = tp_size if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if worker_factory is not None:
        return worker_factory, world_size
    if world_size != tp_size:
        raise ValueError(
            f"world_size {world_size} differs from tensor_parallel_size "
            f"{tp_size}: the model runner shards by tensor_parallel_size"
        )
    from pagoda.model.loader import load_arch_config
    from pagoda.model.parallel import check_tensor_parallel

    check_tensor_parallel(
        load_arch_config(model_path, config.model.load_format),
        tp_size,
        config.parallel.enable_expert_parallel,
    )
    return default_worker_factory, world_size


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to start (pickled into it)."""

    rank: int
    world_size: int
    config: EngineConfig
    model_path: str
    init_method: str  # "tcp://HOST:PORT", the same for every rank
    backend: str  # "nccl" or "gloo"
    worker_factory: WorkerFactory
    # The CUDA device index of this rank in its process (None: the rank), among the
    # GPUs `cuda_visible_devices` shows it (None: leave CUDA_VISIBLE_DEVICES as it is).
    # Ray gives each actor its own GPU; the executor shows it every GPU of the group on
    # its node instead, so that NCCL can reach them directly (peer to peer).
    device_index: int | None = None
    cuda_visible_devices: str | None = None


def build_worker(spec: WorkerSpec) -> Any:
    """Joins the group as spec.rank and builds that rank's worker object."""
    from pagoda.distributed.parallel_state import init_distributed, keep_multicast_off

    keep_multicast_off()  # already in the process's environment; checked again here
    if spec.config.device.device == "cuda":
        if spec.cuda_visible_devices is not None:  # before CUDA starts in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
        import torch

        torch.cuda.set_device(spec.rank if spec.device_index is None else spec.device_index)
    else:
        share_cpu_threads(spec.world_size)
    from pagoda.model.dtypes import resolve_dtype

    config = spec.config
    init_distributed(
        spec.rank,
        spec.world_size,
        spec.init_method,
        spec.backend,
        custom_all_reduce=not config.parallel.disable_custom_all_reduce,
        dtype=resolve_dtype(config.model.dtype, config.device.device),
    )
    return spec.worker_factory(spec.config, spec.model_path, spec.rank)


def cpu_threads_per_rank(world_size: int, environ=None) -> int | None:
    """On CPU the ranks share the machine's cores: each gets its share (at least one),
    unless OMP_NUM_THREADS sets the count (Ray sets it to an actor's CPUs). None: leave
    torch's setting. Every rank taking all the cores oversubscribes them, and the
    all-reduce then waits on descheduled peers (a step can take 30 times longer)."""
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def share_cpu_threads(world_size: int) -> None:
    threads = cpu_threads_per_rank(world_size)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def leave_group() -> None:
    from pagoda.distributed.parallel_state import destroy_distributed

    try:
        destroy_distributed()
    except Exception:  # noqa: BLE001 - exiting anyway; a peer may already be gone
        pass


def reply_payload(rank: int, reply: str, result: Any) -> Any:
    """What rank sends back for a method's result. RANK0_FUTURE: the result is a future
    (a step's output); every rank waits for it (so a failed step is reported by the
    rank it failed on), and only rank 0 sends the value: the others send None."""
    if reply == Reply.RANK0_FUTURE:
        value = result.result()
        return value if rank == 0 else None
    return result
