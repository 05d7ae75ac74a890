"""The Executor interface: where the workers live and how the engine drives them.

The engine talks to its model only through this (and through `pagoda.core` types):
initialise, size and build the KV cache, launch a step's forward, launch its sampling
and get a future for its output, call a method on every worker, check health, shut
down. The in-process executor (`uniproc`) runs tp size 1; `multiproc` runs one worker
process per GPU (tensor parallelism); `ray_executor` one Ray actor per rank, placed on
the machines of a Ray cluster (`factory.get_executor_class` picks one). Everything goes through `collective_rpc`-like calls
whose arguments (SchedulerOutput, StepExtras) are plain picklable data.

A worker is any object with the methods named below (`ModelRunner` is the one the
engine builds): `model_info()`, `determine_kv_cache_config(max_model_len)`,
`initialize_kv_cache(kv_config, max_model_len)`, `execute_model(scheduler_output)`,
`sample_tokens(step_extras) -> RunnerOutputFuture`. Each rank's worker builds its own
share of the model (`TensorParallel(rank, size)`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_spec import KVCacheConfig
from pagoda.core.outputs import ModelInfo, RunnerOutputFuture, SchedulerOutput, StepExtras


class ExecutorDeadError(RuntimeError):
    """The executor's workers can no longer run steps (shut down, or failed mid-step)."""


class Executor(ABC):
    """Drives the workers of one engine. Steps come in two calls, so that what the
    engine learns after the forward is launched (StepExtras) still reaches sampling:
    `execute_model(out)` launches the forward, `sample_tokens(extras)` launches the
    sampling and returns a future of the step's ModelRunnerOutput. Both return
    without waiting for the device."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.config = config
        self.model_path = model_path

    # ---- what each implementation provides -------------------------------------------
    @abstractmethod
    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> list[Any]:
        """Calls `method(*args, **kwargs)` on every worker; returns their results by rank."""

    @abstractmethod
    def check_health(self) -> None:
        """Raises ExecutorDeadError when the workers can no longer serve steps."""

    @abstractmethod
    def shutdown(self) -> None:
        """Releases the workers (idempotent)."""

    # ---- the engine's calls, in terms of collective_rpc ------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self.collective_rpc("model_info")[0]

    def determine_kv_cache_config(self, max_model_len: int) -> KVCacheConfig:
        """The KV pool every worker allocates: rank 0's layer specs (each rank stores
        its share of the heads, at the same block size) and the fewest blocks any rank
        can hold, so that one block id means the same tokens on every rank."""
        configs = self.collective_rpc("determine_kv_cache_config", (max_model_len,))
        num_blocks = min(c.num_blocks for c in configs)
        return KVCacheConfig(num_blocks, configs[0].layer_specs)

    def initialize_kv_cache(self, kv_config: KVCacheConfig, max_model_len: int) -> None:
        """Every worker allocates its pool with kv_config's block count (its own specs)."""
        self.collective_rpc("initialize_kv_cache", (kv_config, max_model_len))

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Launches the step's forward on every worker."""
        self.collective_rpc("execute_model", (scheduler_output,))

    def sample_tokens(self, step_extras: StepExtras | None = None) -> RunnerOutputFuture:
        """Launches the step's sampling; rank 0's output is the step's."""
        return self.collective_rpc("sample_tokens", (step_extras or StepExtras(),))[0]
