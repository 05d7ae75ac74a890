"""In-process executor: one ModelRunner in this process (tensor parallel size 1)."""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.step_output import AsyncRunnerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.runner = ModelRunner(config, model_path)

    @property
    def arch(self):
        return self.runner.arch

    def determine_num_blocks(self, max_model_len: int) -> int:
        return self.runner.determine_num_blocks(max_model_len)

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncRunnerOutput:
        """Launches the step; the caller gets its output with .result()."""
        return self.runner.execute_model_async(scheduler_output)
