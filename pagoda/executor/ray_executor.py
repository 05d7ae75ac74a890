"""RayExecutor: one Ray actor per tensor-parallel rank (vLLM's "ray" backend), for
ranks on several machines of a Ray cluster (or on this one).

Owns the engine-process side of the actors: joining or starting a Ray cluster, the
placement group that reserves one bundle per rank ({"GPU": 1} on CUDA, {"CPU": 1} on
CPU), the actors (`ray_worker.RayWorker`), the calls to them, noticing that one failed
or died, and releasing it all. The workers are the same as the "mp" backend's
(`worker_setup`), joined in a torch.distributed group whose rendezvous is rank 0's
node IP and a port free there.

How a step flows: `execute_model` sends the SchedulerOutput (pickled once) to every
actor and returns; `sample_tokens` does the same with StepExtras and returns a future;
its `.result()` asks every actor for that step's output and waits for rank 0's (the
others answer None). Ray is an optional dependency: `pip install 'pagoda[ray]'`.

Invariants:
- Every call the executor made and has not seen answered is in `_owed`, and every
  actor has a `watch` call that fails only when it dies: a wait waits on all of them
  together (`ray.wait`), so a failure or a death anywhere wakes it as its own reply
  would. One thread waits at a time (`_lock`).
- Any failure is terminal, as in the "mp" backend: an actor's exception (with its
  traceback), an actor's death, a reply that does not come within the limit
  (`timeouts`). The executor is then dead: waiting calls, later calls and
  `check_health()` raise ExecutorDeadError naming the rank.
- Nothing outlives the executor: `shutdown()` (also run by a finalizer) kills the
  actors, waits until Ray reports them dead, removes the placement group, and stops
  the Ray runtime if this executor started it. The actors are owned by this process:
  Ray ends them if it dies.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput, StepExtras
from pagoda.executor.base import Executor, ExecutorDeadError
from pagoda.executor.mp_protocol import Reply
from pagoda.executor.multiproc import WorkerStartupError
from pagoda.executor.ray_worker import WATCH_GROUP, RayWorker
from pagoda.executor.timeouts import ExecutorTimeouts, remaining
from pagoda.executor.worker_setup import WorkerFactory, WorkerSpec, choose_workers

RAY_INSTALL_HINT = "pip install 'pagoda[ray]'"
# The object store of a Ray runtime this executor starts: the calls' arguments and
# replies are small (scheduler diffs, sampled ids), the weights never pass through it.
LOCAL_OBJECT_STORE_BYTES = 128 << 20
# How long shutdown waits for Ray to report the killed actors dead.
KILL_WAIT_S = 30.0


def require_ray():
    """The ray module, or a ValueError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ValueError(
            f"distributed_executor_backend='ray' needs Ray, which is not "
            f"installed: {RAY_INSTALL_HINT}"
        ) from exc
    return ray


@dataclass
class _Call:
    """A call to every rank whose replies are awaited: the refs still owed, by rank."""

    method: str
    seqs: list[int]  # each rank's number for this call
    results: list
    refs: dict[int, Any] = field(default_factory=dict)
    deadline: float = math.inf
    limit: str = ""


class _RayResources:
    """What the executor holds in Ray; `stop()` releases it (idempotent). Kept apart
    from the executor so that the executor's finalizer can hold it."""

    def __init__(self, ray) -> None:
        self.ray = ray
        self.started_ray = False  # this executor called ray.init
        self.placement_group = None
        self.actors: list = []
        self.watch_refs: list = []

    def stop(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            return  # Ray was shut down already (e.g. at interpreter exit): all gone
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        if self.watch_refs:  # each fails once Ray knows its actor is dead
            try:
                ray.wait(self.watch_refs, num_returns=len(self.watch_refs), timeout=KILL_WAIT_S)
            except Exception:  # noqa: BLE001 - best effort
                pass
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001 - best effort
                pass
        self.actors, self.watch_refs, self.placement_group = [], [], None
        if self.started_ray:
            self.started_ray = False
            ray.shutdown()


class _StepFuture:
    """One step's output: rank 0's answer to result(seq of its sample_tokens)."""

    def __init__(self, executor: RayExecutor, call: _Call) -> None:
        self._executor = executor
        self._call = call
        self._output: _Call | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._ask_results(self._call)
        output = self._executor._wait(self._output, ranks=(0,))[0]
        self._executor._warm = True  # a step completed: later replies get the step limit
        return output


class RayExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        worker_factory: WorkerFactory | None = None,
        world_size: int | None = None,
    ) -> None:
        """worker_factory(config, model_path, rank) builds each rank's worker in its
        actor (default: ModelRunner); it must pickle (a module-level callable).
        world_size: the number of actors (default: tensor_parallel_size)."""
        self._ray = require_ray()
        super().__init__(config, model_path)
        worker_factory, self.world_size = choose_workers(
            config, model_path, worker_factory, world_size
        )
        self.timeouts = ExecutorTimeouts.from_env()
        self._warm = False
        self._dead_reasons: list[str] = []
        self._failed_ranks: set[int] = set()
        self._shut_down = False
        self._seqs: list = []
        self._owed: dict[Any, tuple[_Call, int]] = {}  # ref -> its call and rank
        self._watch: dict[Any, int] = {}  # an actor's watch ref -> its rank
        self.pids: list[int] = []
        self._lock = threading.Lock()
        self._resources = _RayResources(self._ray)
        self._finalizer = weakref.finalize(self, self._resources.stop)
        try:
            self._start(worker_factory)
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up ---------------------------------------------------------------------
    def _start(self, worker_factory: WorkerFactory) -> None:
        from pagoda.distributed.parallel_state import MULTICAST_OFF_ENV, keep_multicast_off

        keep_multicast_off()  # this process; the actors get it from their runtime_env
        device = self.config.device.device
        self._resources.started_ray = _connect(self._ray, self.world_size, device)
        placement = _place(self._ray, self.world_size, device, self.timeouts.startup_s)
        self._resources.placement_group = placement
        self._make_actors(placement, device, dict(MULTICAST_OFF_ENV))
        call = self._send_each("rendezvous_address", lambda rank: () if rank == 0 else None)
        ip, port = self._wait_started(call, (0,))[0]
        backend = "nccl" if device == "cuda" else "gloo"
        layout: list[tuple[str | None, int | None]] = [(None, None)] * self.world_size
        if device == "cuda":
            call = self._send_each("node_and_gpus", lambda rank: ())
            layout = cuda_layout(self._wait_started(call, range(self.world_size)))
        specs = [
            WorkerSpec(
                rank,
                self.world_size,
                self.config,
                self.model_path,
                f"tcp://{_url_host(ip)}:{port}",
                backend,
                worker_factory,
                device_index=layout[rank][1],
                cuda_visible_devices=layout[rank][0],
            )
            for rank in range(self.world_size)
        ]
        call = self._send_each("start", lambda rank: (specs[rank],))
        self.pids = list(self._wait_started(call, range(self.world_size)))

    def _make_actors(self, placement, device: str, env: dict[str, str]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = self._ray.remote(concurrency_groups={WATCH_GROUP: 1})(RayWorker)
        for rank in range(self.world_size):
            actor = actor_class.options(
                num_cpus=0 if device == "cuda" else 1,
                num_gpus=1 if device == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env},
            ).remote()
            self._resources.actors.append(actor)
            self._seqs.append(itertools.count())
            watch = actor.watch.options(concurrency_group=WATCH_GROUP).remote()
            self._resources.watch_refs.append(watch)
            self._watch[watch] = rank

    def _wait_started(self, call: _Call, ranks: Sequence[int]) -> list[Any]:
        try:
            return self._wait(call, ranks)
        except ExecutorDeadError as exc:
            raise WorkerStartupError(
                f"the Ray actors of the {self.world_size} "
                f"tensor-parallel ranks failed to start:\n{exc}"
            ) from None

    @property
    def actors(self) -> list:
        """The actor handles by rank (for tests and diagnostics)."""
        return list(self._resources.actors)

    # ---- sending ----------------------------------------------------------------------
    def _send_each(self, method: str, args_of) -> _Call:
        """Calls actor method `method` with (seq, *args_of(rank)) on every rank whose
        args_of is not None (seq: the next number of that actor's sequence); returns the
        call, its refs registered in _owed."""
        self._raise_if_dead()
        call = _Call(
            method,
            [-1] * self.world_size,
            [None] * self.world_size,
            deadline=time.monotonic() + self.timeouts.limit(self._warm),
            limit=self.timeouts.describe(self._warm),
        )
        for rank, actor in enumerate(self._resources.actors):
            args = args_of(rank)
            if args is None:
                continue
            seq = call.seqs[rank] = next(self._seqs[rank])
            ref = getattr(actor, method).remote(seq, *args)
            call.refs[rank] = ref
            self._owed[ref] = (call, rank)
        return call

    def _send(self, method: str, args: Sequence[Any], kwargs: dict | None, reply: str) -> _Call:
        request = pickle.dumps(
            (method, tuple(args), kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL
        )  # once, for every rank
        call = self._send_each("call", lambda rank: (request, reply))
        call.method = method
        return call

    def _ask_results(self, sampled: _Call) -> _Call:
        """Asks every rank for the output of the sample_tokens call `sampled`; due by
        the deadline of that call."""
        call = self._send_each("result", lambda rank: (sampled.seqs[rank],))
        call.method, call.deadline, call.limit = sampled.method, sampled.deadline, sampled.limit
        return call

    # ---- receiving --------------------------------------------------------------------
    def _wait(self, call: _Call, ranks: Sequence[int]) -> list[Any]:
        """Waits until `ranks` answered `call`; returns its results by rank. Raises
        ExecutorDeadError if the executor dies first or the call's deadline passes."""
        while any(rank in call.refs for rank in ranks):
            self._raise_if_dead()
            with self._lock:
                if any(rank in call.refs for rank in ranks):
                    self._receive(remaining(call.deadline, time.monotonic()))
                    if call.refs and time.monotonic() >= call.deadline:
                        self._note_overdue(call)
        self._raise_if_dead()  # a failed answer is taken off call.refs too
        return call.results

    def _receive(self, timeout: float | None) -> None:
        """Takes every answer (or death) that is ready, waiting up to `timeout` for one."""
        if self._shut_down:
            return
        refs = [*self._owed, *self._watch]
        ready, _ = self._ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            if ref in self._watch:
                self._take_death(self._watch.pop(ref), ref)
        for ref in ready:
            if ref in self._owed:
                self._take_answer(ref)

    def _take_answer(self, ref) -> None:
        call, rank = self._owed.pop(ref)
        del call.refs[rank]
        try:
            call.results[rank] = self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            self._take_death(rank, None, exc)
        except Exception as exc:  # noqa: BLE001 - the worker's exception, with traceback
            # Ray's RayTaskError text: the exception and the worker's traceback.
            self._fail(
                rank, f"tensor-parallel worker rank {rank} failed in {call.method!r}:\n{exc}"
            )

    def _take_death(self, rank: int, watch_ref, exc: BaseException | None = None) -> None:
        if exc is None:
            try:
                self._ray.get(watch_ref)
            except Exception as error:  # noqa: BLE001 - the reason Ray gives
                exc = error
        pid = self.pids[rank] if rank < len(self.pids) else "unknown"
        self._fail(rank, f"tensor-parallel worker rank {rank} (pid {pid}) died: {_death_text(exc)}")

    def _note_overdue(self, call: _Call) -> None:
        ranks = sorted(call.refs)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        self._set_dead(
            f"tensor-parallel worker {who} (of {self.world_size}) sent no reply "
            f"to {call.method!r} within {call.limit}: stuck in a collective or "
            f"on its device?"
        )

    def _fail(self, rank: int, reason: str) -> None:
        if rank in self._failed_ranks or self._shut_down:
            return  # its failure was recorded; or it was killed by shutdown
        self._failed_ranks.add(rank)
        self._set_dead(reason)

    def _set_dead(self, reason: str) -> None:
        """Records a failure; every one noticed before shutdown is kept, in order."""
        self._dead_reasons.append(reason)

    def _raise_if_dead(self) -> None:
        if self._dead_reasons:
            raise ExecutorDeadError("\n".join(self._dead_reasons))

    # ---- the Executor interface -------------------------------------------------------
    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> list[Any]:
        call = self._send(method, args, kwargs, Reply.ALL)
        return list(self._wait(call, range(self.world_size)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Sends the step to every rank; a failure surfaces at the next wait."""
        self._send("execute_model", (scheduler_output,), None, Reply.ERRORS_ONLY)

    def sample_tokens(self, step_extras: StepExtras | None = None) -> _StepFuture:
        call = self._send("sample_tokens", (step_extras or StepExtras(),), None, Reply.RANK0_FUTURE)
        return _StepFuture(self, call)

    def check_health(self) -> None:
        """Raises ExecutorDeadError if an actor failed or died (checked without waiting)."""
        if self._lock.acquire(blocking=False):  # else a waiter is watching them
            try:
                self._raise_if_dead()
                self._receive(timeout=0)
            finally:
                self._lock.release()
        self._raise_if_dead()

    def shutdown(self) -> None:
        """Kills the actors, removes the placement group, stops a Ray runtime this
        executor started (idempotent; the finalizer runs once)."""
        if not self._dead_reasons:
            self._set_dead("the executor was shut down")
        self._shut_down = True
        self._owed.clear()
        self._watch.clear()
        self._finalizer()


def _connect(ray, world_size: int, device: str) -> bool:
    """Joins the Ray cluster this process already uses, or the one RAY_ADDRESS names, or
    starts a local one; returns True if this called ray.init (shutdown undoes it)."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return True
    # A local runtime: one CPU per rank at least (a bundle each on a CPU run), the
    # GPUs Ray detects, a small object store, no dashboard.
    num_cpus = max(os.cpu_count() or 1, world_size if device != "cuda" else 1)
    ray.init(
        num_cpus=num_cpus, object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False
    )
    return True


def _place(ray, world_size: int, device: str, timeout_s: float):
    """A placement group of one bundle per rank, packed on as few nodes as possible;
    refused at once if the cluster does not have that many GPUs (CPUs) in all."""
    from ray.util.placement_group import placement_group, remove_placement_group

    resource = "GPU" if device == "cuda" else "CPU"
    total = ray.cluster_resources().get(resource, 0)
    if total < world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} needs {world_size} {resource}(s) "
            f"in the Ray cluster, which has {total:g}"
        )
    group = placement_group([{resource: 1}] * world_size, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=None if math.isinf(timeout_s) else timeout_s)
    if not ready:
        remove_placement_group(group)
        raise WorkerStartupError(
            f"Ray could not reserve {world_size} bundle(s) of "
            f"{{{resource!r}: 1}} within {timeout_s:g} s (in use by "
            f"other jobs?)"
        )
    return group


def cuda_layout(placements: Sequence[tuple[str, list[str]]]) -> list[tuple[str, int]]:
    """For each rank's (node id, its GPU ids) the CUDA_VISIBLE_DEVICES it should run with
    (every GPU of the group on its node, in id order) and its own device's index there.
    Each rank must hold exactly one GPU."""
    on_node: dict[str, list[str]] = {}
    for rank, (node, gpus) in enumerate(placements):
        if len(gpus) != 1:
            raise RuntimeError(
                f"Ray gave tensor-parallel rank {rank} the GPUs {gpus}; each rank needs exactly one"
            )
        on_node.setdefault(node, []).extend(gpus)
    for gpus in on_node.values():
        gpus.sort(key=lambda g: (len(g), g))  # numeric order for plain indices
    return [(",".join(on_node[node]), on_node[node].index(gpus[0])) for node, gpus in placements]


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip  # an IPv6 address goes in brackets


def _death_text(exc: BaseException | None) -> str:
    """Ray's reason for an actor's death, on one line."""
    if exc is None:
        return "its actor ended"
    text = " ".join(str(exc).split())
    marker = "The actor is dead because"
    if marker in text:
        text = text[text.index(marker) :]
    return text[:400]
