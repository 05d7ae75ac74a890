"""In-process executor: one worker (a ModelRunner) in the engine's process, tp size 1.

collective_rpc calls the worker's method directly; an exception reaches the engine as
it is (the engine fails the requests of that step and keeps serving). The executor is
dead only once shut down: there is no other process whose loss it could observe.
Shutting down releases the worker in this process (its weights and KV pool).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor, ExecutorDeadError


class UniProcExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        worker_factory: Callable[[EngineConfig, str], Any] | None = None,
    ) -> None:
        """worker_factory(config, model_path) builds the worker (default: ModelRunner)."""
        super().__init__(config, model_path)
        if worker_factory is None:
            from pagoda.worker.model_runner import ModelRunner

            worker_factory = ModelRunner
        self.runner = worker_factory(config, model_path)
        self._dead_reason: str | None = None

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> list[Any]:
        self.check_health()
        return [getattr(self.runner, method)(*args, **(kwargs or {}))]

    def check_health(self) -> None:
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)

    def shutdown(self) -> None:
        """Releases the worker (idempotent): its own shutdown() where it has one (the
        ModelRunner drops its weights, KV pool, graphs and offload tiers), then the
        reference, so nothing of it outlives the executor."""
        self._dead_reason = "the executor was shut down"
        runner, self.runner = self.runner, None
        release = getattr(runner, "shutdown", None)
        if release is not None:
            release()
