"""A fake worker for the multi-process executor's tests (importable in spawned workers).

It is tests/helpers/fake_worker.py's FakeWorker (tokens only from the SchedulerOutput diffs,
a deterministic next-token rule) plus: its rank, its pid, a digest of every step it
saw, a gloo all-reduce per step that checks every rank runs the same step in lockstep,
a KV block count that shrinks with the rank, and switches to fail or stall at
start-up, fail in a step, stall in a step before its collective (so its peers wait in
the collective forever), never finish a step's sampling, or finish it only after the
next step was launched (async scheduling's overlap, which the worker process must keep).
"""

from __future__ import annotations

import os
import threading

import torch
import torch.distributed as dist

from helpers.fake_worker import FakeWorker
from pagoda.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig
from pagoda.core.outputs import SchedulerOutput, StepExtras
from pagoda.distributed.parallel_state import tp_rank, tp_world_size

SPEC = FullAttentionSpec(8, 2, 16, "float32")


def step_digest(out: SchedulerOutput) -> tuple:
    """What identifies a step: scheduled tokens per request, new requests, forgotten ones."""
    return (
        tuple(sorted(out.num_scheduled_tokens.items())),
        tuple(sorted(r.req_id for r in out.scheduled_new_reqs)),
        tuple(sorted(out.finished_req_ids | out.preempted_req_ids)),
    )


def recording_executor(base: type) -> type:
    """`base` (an Executor class) that remembers the steps it sent (step_digest), to
    compare with what each rank saw."""

    class RecordingExecutor(base):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.sent: list[tuple] = []

        def execute_model(self, scheduler_output) -> None:
            self.sent.append(step_digest(scheduler_output))
            super().execute_model(scheduler_output)

    return RecordingExecutor


class _Never:
    """A step output that never arrives (a device that hangs)."""

    def result(self):
        threading.Event().wait()


class _AfterNextLaunch:
    """A step output that is ready only once the next step was launched: a worker
    whose main loop waited for it before receiving the next step would deadlock."""

    def __init__(self, done, next_launched: threading.Event) -> None:
        self.done = done
        self.next_launched = next_launched

    def result(self):
        self.next_launched.wait()
        return self.done.result()


class RankedFakeWorker(FakeWorker):
    def __init__(
        self,
        config,
        model_path: str,
        rank: int,
        fail_at_start_rank: int = -1,
        results_after_next_launch: bool = False,
        stall_at_start_ranks: tuple[int, ...] = (),
    ) -> None:
        if rank == fail_at_start_rank:
            raise ValueError(f"fake worker rank {rank} refuses to start")
        if rank in stall_at_start_ranks:
            threading.Event().wait()  # a load that never ends
        super().__init__(config, model_path)
        assert (tp_rank(), tp_world_size()) == (rank, tp_world_size())
        self.rank = rank
        self.seen: list[tuple] = []
        self.hang_sampling = False
        self.fail_next_step = False
        self.stall_next_step = False
        self.results_after_next_launch = results_after_next_launch
        self.next_launched: threading.Event = threading.Event()

    # ---- what the tests ask every rank ------------------------------------------------
    def whoami(self) -> tuple[int, int, bool]:
        return self.rank, os.getpid(), "NCCL_NVLS_ENABLE" in os.environ

    def num_threads(self) -> int:
        return torch.get_num_threads()

    def steps_seen(self) -> list[tuple]:
        return self.seen

    def set_hang_sampling(self, ranks: list[int]) -> None:
        self.hang_sampling = self.rank in ranks

    def set_fail_next_step(self, ranks: list[int]) -> None:
        self.fail_next_step = self.rank in ranks

    def set_stall_next_step(self, ranks: list[int]) -> None:
        self.stall_next_step = self.rank in ranks

    # ---- the worker interface ---------------------------------------------------------
    def determine_kv_cache_config(self, max_model_len: int) -> KVCacheConfig:
        return KVCacheConfig(64 - 10 * self.rank, [SPEC] * 2)

    def execute_model(self, out: SchedulerOutput) -> None:
        if self.fail_next_step:
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if self.stall_next_step:
            threading.Event().wait()  # never reaches the collective below
        self.next_launched.set()  # the previous step's output may now be ready
        self.seen.append(step_digest(out))
        if tp_world_size() > 1:  # every rank is at the same step with the same batch
            mine = torch.tensor([len(self.seen), out.total_num_scheduled_tokens])
            total = mine.clone()
            dist.all_reduce(total)
            assert total.tolist() == (mine * tp_world_size()).tolist(), (mine, total)
        super().execute_model(out)

    def sample_tokens(self, extras: StepExtras):
        done = super().sample_tokens(extras)
        if self.hang_sampling:
            return _Never()
        if self.results_after_next_launch and not self.launched[-1].is_empty:
            self.next_launched = threading.Event()
            return _AfterNextLaunch(done, self.next_launched)
        return done
