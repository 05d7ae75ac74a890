"""LLMEngine: the synchronous step loop that ties tokenizer, scheduler, executor and
output processor together.

add_request() turns a prompt into one core Request per sample (n > 1 makes n), step()
runs schedule -> execute -> update -> process outputs once. Requests are never dropped:
when KV blocks run out the scheduler preempts and recomputes.

With async scheduling (the default on CUDA) step() schedules and launches step N, then
waits for step N-1's sampled ids and processes them while step N runs on the device:
the host's scheduling, input building and output processing overlap the forward
instead of following it. Outputs then arrive one step() call later.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from pagoda.config import EngineArgs, EngineConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import (
    EngineCoreOutput,
    RunnerOutputFuture,
    SchedulerOutput,
    StepExtras,
)
from pagoda.core.request import Request, RequestStatus
from pagoda.engine import trace
from pagoda.engine.engine_setup import (
    build_kv_offload,
    build_scheduler,
    eos_token_id,
    load_engine_tokenizer,
    resolve_max_model_len,
    resolve_model_path,
)
from pagoda.engine.output_processor import OutputKind, OutputProcessor
from pagoda.engine.release import freeze_heap, release_after_shutdown
from pagoda.engine.startup_log import log_startup
from pagoda.executor.base import Executor
from pagoda.executor.factory import get_executor_class
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict


class EngineShutDownError(RuntimeError):
    """The engine was shut down: it takes no requests and runs no steps."""


# What the bookkeeping holds (block pool, requests, offload tiers' indexes, the step in
# flight), dropped by shutdown(); config, tokenizer and model facts stay.
_DROPPED_ON_SHUTDOWN = (
    "scheduler",
    "kv_cache_manager",
    "kv_offload",
    "output_processor",
    "_in_flight",
)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    # Speculative decoding (None when off): pagoda.spec_decode.planning.planner.SpecDecodingStats.
    spec_decode: object | None = None
    structured: object = None  # pagoda.structured.stats.StructuredStatsSnapshot
    # Per KV offload tier (top first), KVOffloadManager.stats(); None: offloading is off.
    kv_offload: list[dict] | None = None
    # For the live dashboard (defaults keep hand-made stats short): requests preempted
    # and waiting to recompute, non-empty steps run and tokens they scheduled (totals),
    # and the capacities those compare to.
    num_preempted: int = 0
    num_steps: int = 0
    scheduled_tokens: int = 0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    block_size: int = 0


ExecutorFactory = Callable[[EngineConfig, str], Executor]


class LLMEngine:
    def __init__(
        self, config: EngineConfig, executor_factory: ExecutorFactory | None = None
    ) -> None:
        """executor_factory(config, model_path) builds the executor (default: the one
        get_executor_class picks for the parallel config)."""
        self.config = config
        start = time.perf_counter()
        self.model_path = resolve_model_path(config.model)
        logger.info("loading %s on %s", self.model_path, config.device.device)
        factory = executor_factory or get_executor_class(config)
        self.executor = factory(config, self.model_path)
        self._shut_down = False
        try:
            self._start(config)
        except BaseException:
            # Threads, the disk tier's lock and worker processes must not outlive a
            # failed start.
            _close(self.executor, getattr(self, "structured", None), config.cache.kv_offloading)
            raise
        # An engine dropped without shutdown() releases the same when it is collected.
        self._finalizer = weakref.finalize(
            self, _close_collected, self.executor, self.structured, config.cache.kv_offloading
        )
        # Everything built so far (the block pool's blocks, the model's modules) lives
        # as long as the engine: freezing it keeps the cyclic GC from walking it on
        # every full collection; with a large block pool one such pause stalls a step
        # (docs/performance.md, "measured reasons"). shutdown() unfreezes.
        freeze_heap(self)
        self.startup_seconds = time.perf_counter() - start
        log_startup(self)  # the summary a user reads before the first request

    def _start(self, config: EngineConfig) -> None:
        """Everything after the executor: model facts, tokenizer, KV cache, scheduler."""
        info = self.executor.model_info
        self.model_info = info
        self.max_model_len = resolve_max_model_len(config, info)
        self.tokenizer = load_engine_tokenizer(config, self.model_path)
        self.eos_token_id = eos_token_id(self.tokenizer, info)
        kv_config = self.executor.determine_kv_cache_config(self.max_model_len)
        self.executor.initialize_kv_cache(kv_config, self.max_model_len)
        self.kv_cache_config = kv_config
        self.num_blocks = kv_config.num_blocks
        # The block manager's blocks are the pool's: the size the layers' specs declare.
        self.kv_cache_manager = KVCacheManager(
            kv_config.num_blocks,
            kv_config.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            recompute_last_hit_block=(
                config.speculative is not None and config.speculative.method == "mtp"
            ),
        )
        self.kv_offload = build_kv_offload(config, self.executor, self.kv_cache_manager)
        self.scheduler = build_scheduler(
            config, info, self.max_model_len, self.kv_cache_manager, self.kv_offload
        )
        planner = self.scheduler.draft_planner
        self.async_scheduling = config.scheduler.async_scheduling
        # Async scheduling: the step launched last, whose outputs are not processed yet.
        self._in_flight: tuple[SchedulerOutput, RunnerOutputFuture, trace.StepClock] | None = None
        self.output_processor = OutputProcessor(self.tokenizer)
        structured = config.structured_outputs
        self.structured = StructuredOutputManager(
            self.tokenizer,
            info.vocab_size,
            structured.reasoning_parser,
            structured.thinking_token_budget,
        )
        if planner is not None:  # grammar masks and forced thinking ends follow kept tokens
            # Through the manager, not the engine: the scheduler must not reference its
            # engine (a cycle would keep a dropped engine from being freed at once).
            wants = self.structured.wants
            planner.never_drafts = lambda request: wants(request.sampling_params)
        # Requests waiting for their grammar's compile: not in the scheduler yet.
        self._held: dict[str, Request] = {}
        self._ids = itertools.count()
        self._children: dict[str, list[str]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_num_scheduled_tokens = 0
        self.num_steps_total = 0  # non-empty steps
        self.scheduled_tokens_total = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    # ---- requests ---------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids, or set tokenizer=")
            from pagoda.model.tokenizer import encode

            return prompt, encode(self.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(
            "a prompt must be a string, a list of token ids, or a dict with "
            "'prompt' or 'prompt_token_ids'"
        )

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long, but max_model_len is "
                f"{self.max_model_len}: the prompt must leave room for at least one generated token"
            )
        vocab = self.model_info.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: OutputKind = "cumulative",
    ) -> str:
        self._check_open()
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        params.validate_for_vocab(self.model_info.vocab_size)
        params = self._finalize_params(params, len(token_ids))
        self.structured.check_params(params)
        constrained = self.structured.wants(params)
        child_ids = (
            [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        )
        self.output_processor.add_request(
            request_id, text, token_ids, params, output_kind, child_ids
        )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for index, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + index)
                # clone() re-runs __post_init__, which resets the engine-filled stop ids.
                child_params.all_stop_token_ids = set(params.all_stop_token_ids)
            request = Request(
                child_id,
                token_ids,
                child_params,
                self.eos_token_id,
                arrival,
                priority,
                group_id=request_id if params.n > 1 else None,
                sample_index=index,
            )
            if constrained and not self.structured.add_request(child_id, child_params, token_ids):
                self._held[child_id] = request  # scheduled once its grammar is compiled
            else:
                self.scheduler.add_request(request)
        self._children[request_id] = child_ids
        self.prompt_tokens_total += len(token_ids) * len(child_ids)
        return request_id

    def _finalize_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params = params.clone(max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        if self.tokenizer is None:
            params.detokenize = False
            if params.stop:
                raise ValueError("stop strings need a tokenizer; this model has none")
        stop_ids = set(params.stop_token_ids or ())
        if self.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(self.eos_token_id)
        params.all_stop_token_ids = stop_ids
        return params

    def abort_request(self, request_ids: str | list[str]) -> None:
        if self._shut_down:
            return  # every request ended with the engine
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            children = self._children.pop(request_id, None)
            if children is None:
                continue
            self.scheduler.abort_requests(children)
            self.output_processor.abort_request(request_id)
            for child_id in children:
                self._held.pop(child_id, None)
                self.structured.remove(child_id)

    def has_unfinished_requests(self) -> bool:
        # A launched step still counts: its outputs must be taken (and those of aborted
        # requests dropped) before a new request could reuse one of its ids.
        # KV offload transfers in flight count too: the loop keeps polling them (an idle
        # step waits briefly for one) so their pins are released without a new request.
        if self._shut_down:
            return False
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or bool(self._held)
            or self.kv_transfers_in_flight()
        )

    def has_work(self) -> bool:
        """Whether step() would do something now; False while the only unfinished
        requests wait for their grammars (the async loop sleeps until one is ready:
        `structured.on_ready` wakes it)."""
        if self._shut_down:
            return False
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or self.structured.has_ready_pending()
            or self.kv_transfers_in_flight()
        )

    def kv_transfers_in_flight(self) -> bool:
        return not self._shut_down and self.kv_offload is not None and self.kv_offload.has_in_flight

    def get_num_unfinished_requests(self) -> int:
        return len(self._children)

    # ---- the step loop ----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, launch the forward, launch the sampling, process results.

        With async scheduling the previous step's results are processed between this
        step's forward launch and its sampling launch: the host works while the device
        runs the forward, and whatever that processing teaches the engine (StepExtras)
        still reaches this step's sampler."""
        self._check_open()
        held_outputs = self._release_held() if self._held else []
        clock = trace.StepClock.start()
        scheduler_output = self.scheduler.schedule()
        clock.lap("step_scheduled")
        self.last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        if self.last_num_scheduled_tokens:
            self.num_steps_total += 1
            self.scheduled_tokens_total += self.last_num_scheduled_tokens
        self.executor.execute_model(scheduler_output)
        clock.lap("step_forward_launched")
        if not self.async_scheduling:
            launched = self.executor.sample_tokens(self._step_extras(scheduler_output))
            clock.lap("step_launched")
            return held_outputs + self._process_step(scheduler_output, launched, clock)
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = held_outputs
        try:
            if previous is not None:
                previous[2].lap("next_step_launched")
                outputs = outputs + self._process_step(*previous)
        finally:
            # Launched even when processing the previous step raised: every launched
            # forward is paired with its sampling, and its output is taken next step.
            # The grammar masks are filled here, after the previous step's tokens were
            # accepted, while the device runs this step's forward.
            launched = self.executor.sample_tokens(self._step_extras(scheduler_output))
            clock.lap("step_launched")
            if not scheduler_output.is_empty:
                self._in_flight = (scheduler_output, launched, clock)
        return outputs

    def _process_step(
        self,
        scheduler_output: SchedulerOutput,
        launched: RunnerOutputFuture,
        clock: trace.StepClock,
    ) -> list[RequestOutput]:
        """Applies one executed step: scheduler update, then detokenize and stop strings."""
        runner_output = launched.result()
        clock.lap("step_result_ready")
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.structured.has_constraints():
            self._advance_constraints(core_outputs)
        clock.lap("step_updated")
        self.generation_tokens_total += sum(len(o.new_token_ids) for o in core_outputs)
        request_outputs, stopped_ids = self.output_processor.process_outputs(core_outputs)
        if stopped_ids:
            self.scheduler.finish_requests(stopped_ids, RequestStatus.FINISHED_STOPPED)
            for child_id in stopped_ids:
                self.structured.remove(child_id)
        for out in request_outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        clock.lap("step_processed")
        clock.first_tokens(request_outputs)
        return request_outputs

    # ---- structured output ------------------------------------------------------------
    def _release_held(self) -> list[RequestOutput]:
        """Schedules held requests whose grammar is ready; fails those whose compile
        failed (their RequestOutput carries the compiler's reason). Idle with nothing
        but held requests, waits for a compile (the async engine never gets here then:
        it steps only when has_work())."""
        if (
            self._in_flight is None
            and not self.scheduler.has_unfinished_requests()
            and not self.structured.has_ready_pending()
        ):
            self.structured.wait_for_pending()
        failed = []
        for child_id, error in self.structured.pop_ready():
            request = self._held.pop(child_id, None)
            if request is None:
                continue  # aborted meanwhile
            if error is None:
                self.scheduler.add_request(request)
            else:
                failed.append(EngineCoreOutput(child_id, [], finish_reason="error", error=error))
        if not failed:
            return []
        outputs, _ = self.output_processor.process_outputs(failed)
        for out in outputs:
            if out.finished:
                self._children.pop(out.request_id, None)
        return outputs

    def _advance_constraints(self, core_outputs: list[EngineCoreOutput]) -> None:
        """Accepts the kept tokens into their requests' grammars / thinking states; a
        request whose tokens its grammar refuses finishes with an error."""
        structured = self.structured
        for out in core_outputs:
            if out.req_id not in structured:
                continue
            error = structured.accept(out.req_id, out.new_token_ids)
            if error is not None and not out.finished:
                self.scheduler.finish_requests([out.req_id], RequestStatus.FINISHED_ERROR)
                out.finish_reason, out.error = "error", error
            if out.finished:
                structured.remove(out.req_id)

    def _step_extras(self, scheduler_output: SchedulerOutput) -> StepExtras | None:
        """This step's grammar bitmasks (None when no request is constrained)."""
        if not self.structured.has_constraints() or not scheduler_output.sampling_req_ids:
            return None
        try:
            return StepExtras(grammar_bitmasks=self.structured.step_bitmasks(scheduler_output))
        except Exception:  # never leave a launched forward unsampled
            logger.exception("filling grammar bitmasks failed; this step samples unmasked")
            return None

    # ---- introspection ----------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        self._check_open()
        stats = self.kv_cache_manager.prefix_cache_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            num_blocks=self.num_blocks,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_preemptions=self.scheduler.num_preemptions_total,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            spec_decode=self._spec_decode_stats(),
            structured=self.structured.stats.snapshot(),
            kv_offload=None if self.kv_offload is None else self.kv_offload.stats(),
            num_preempted=sum(
                1 for r in self.scheduler.waiting if r.status == RequestStatus.PREEMPTED
            ),
            num_steps=self.num_steps_total,
            scheduled_tokens=self.scheduled_tokens_total,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            max_num_seqs=self.scheduler.max_num_seqs,
            block_size=self.kv_cache_config.block_size,
        )

    def _spec_decode_stats(self):
        planner = self.scheduler.draft_planner
        if planner is None:
            return None
        import copy

        return copy.deepcopy(planner.stats)  # a snapshot: the engine thread keeps counting

    def audit_kv_cache(self):
        """The KV accounting audit: the GPU pool, and every offload tier when on."""
        self._check_open()
        if self.kv_offload is not None:
            return self.kv_offload.audit()
        return self.kv_cache_manager.audit()

    def check_health(self) -> None:
        """Raises pagoda.executor.base.ExecutorDeadError when the workers cannot serve."""
        self.executor.check_health()

    @property
    def is_shut_down(self) -> bool:
        return self._shut_down

    def _check_open(self) -> None:
        if self._shut_down:
            raise EngineShutDownError(
                "this engine was shut down (LLM.shutdown()); make a new one to generate again"
            )

    def shutdown(self) -> None:
        """Stops every thread the engine started (grammar compiles, KV offload I/O),
        releases the disk tier's lock and the workers (worker processes end; an
        in-process worker drops its weights, KV pool, graphs and pinned buffers), then
        gives the memory back (release.py). Idempotent; add_request() and step()
        raise EngineShutDownError afterwards. The tokenizer, config and model facts
        stay readable."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            detached = self._finalizer.detach()  # (engine, _close_collected, its args)
            if detached is not None:
                _close(*detached[2])
        finally:
            for name in _DROPPED_ON_SHUTDOWN:
                setattr(self, name, None)
            self._held, self._children = {}, {}
            release_after_shutdown(self)


def _close_collected(
    executor: Executor, structured: StructuredOutputManager | None, kv_offloading: bool
) -> None:
    """The finalizer of an engine collected without shutdown()."""
    try:
        _close(executor, structured, kv_offloading)
    finally:
        release_after_shutdown(None)


def _close(
    executor: Executor, structured: StructuredOutputManager | None, kv_offloading: bool
) -> None:
    """Everything an engine started, stopped: the grammar compile pool, the KV offload
    tiers (their I/O threads, the disk lock, pinned memory), the executor's workers.
    Holds no reference to the engine, so that its finalizer can run it."""
    try:
        if structured is not None:
            structured.shutdown()
        if kv_offloading:
            try:
                executor.collective_rpc("shutdown_kv_offload")
            except Exception:  # noqa: BLE001 - shutting down: the workers may be gone
                logger.exception("closing the KV offload tiers failed")
    finally:
        executor.shutdown()
