"""What a tensor-parallel worker process does whatever carries the engine's requests to
it (pipes for the "mp" backend, Ray actor calls for "ray"): its start-up (NVLink
multicast off, its CUDA device, joining the group, building the worker object), leaving
the group, and the one rule for what a rank answers to a request.

`mp_worker.py` and `ray_worker.py` each wrap this in their own transport; neither holds
a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from pagoda.config import EngineConfig
from pagoda.executor.mp_protocol import Reply

WorkerFactory = Callable[[EngineConfig, str, int], Any]


def default_worker_factory(config: EngineConfig, model_path: str, rank: int) -> Any:
    """The engine's worker: this rank's ModelRunner (module-level, so it pickles)."""
    from pagoda.worker.model_runner import ModelRunner
    return ModelRunner(config, model_path, rank)


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
    # The CUDA device index of this rank in its process (None: the rank). Ray gives each
    # actor one GPU through CUDA_VISIBLE_DEVICES, so there it is always 0.
    device_index: Optional[int] = None


def build_worker(spec: WorkerSpec) -> Any:
    """Joins the group as spec.rank and builds that rank's worker object."""
    from pagoda.distributed.parallel_state import init_distributed, keep_multicast_off
    keep_multicast_off()  # already in the process's environment; checked again here
    if spec.config.device.device == "cuda":
        import torch
        torch.cuda.set_device(spec.rank if spec.device_index is None else spec.device_index)
    init_distributed(spec.rank, spec.world_size, spec.init_method, spec.backend)
    return spec.worker_factory(spec.config, spec.model_path, spec.rank)


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
