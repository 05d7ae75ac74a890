"""get_executor_class: which Executor runs a configuration's workers."""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor
from pagoda.executor.multiproc import MultiprocExecutor
from pagoda.executor.uniproc import UniProcExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for the parallel config: one in-process worker at tp size 1, one
    worker process per rank above ("mp", the default distributed_executor_backend);
    one Ray actor per rank, at any tp size, with "ray" (an optional dependency: a
    ValueError saying how to install it when it is missing)."""
    backend = getattr(config.parallel, "distributed_executor_backend", None) or "mp"
    if backend == "ray":
        from pagoda.executor.ray_executor import RayExecutor, require_ray  # Ray: optional

        require_ray()
        return RayExecutor
    if backend not in ("mp", "uni"):
        raise ValueError(
            f"distributed_executor_backend must be 'mp', 'ray' or 'uni', got {backend!r}"
        )
    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor
    if backend == "uni":
        raise ValueError(
            "distributed_executor_backend='uni' runs one worker in process: "
            "it needs tensor_parallel_size 1"
        )
    return MultiprocExecutor
