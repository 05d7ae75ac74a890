"""Scheduler: which requests run in each step, with how many tokens, and what follows.

Owns the request lifecycle inside the engine core: the waiting queue (FCFS or
priority), the running list, preemption when KV blocks run out, the step's plan and
the SchedulerOutput diff built from it for the worker (core/step_plan.py), and, once
the model has run, appending sampled tokens (the stop checks: core/stop_checks.py) and
freeing finished requests. Stop strings need detokenized text, so the engine's output
processor checks them and calls finish_requests().

Token accounting follows vLLM v1: request.num_computed_tokens advances at the end of
schedule() by the tokens scheduled (they count as computed for the next step; prefix
hits are added when the request is admitted), and update_from_output() takes back the
draft tokens the model rejected.

Async scheduling (vLLM v1's): the engine calls schedule() for step N+1 before
update_from_output() of step N. A request whose step N samples holds one output
placeholder until that update (1 + k with k drafts: speculating requests are
scheduled optimistically, core/optimistic_drafts.py); step N+1 already computes the
placeholder's position (the worker takes the token from step N's sampled ids on the
device). A request whose placeholders would reach max_tokens or max_model_len is not
scheduled again; one that stops on eos or a stop string wastes the one step already
scheduled (its output is dropped). A request preempted while its step is in flight
still receives that step's token.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import create_request_queue
from pagoda.core.step_plan import StepPlan
from pagoda.core.stop_checks import append_until_stop
from pagoda.kv_offload.planning.manager import KVOffloadManager, LoadStart
from pagoda.spec_decode.planning.optimistic import DraftRollback
from pagoda.spec_decode.planning.planner import DraftPlanner


class Scheduler:
    """Continuous batching over a paged KV cache, one token budget per step."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        async_scheduling: bool = False,
        num_lookahead_tokens: int = 0,
        draft_planner: DraftPlanner | None = None,
        kv_offload: KVOffloadManager | None = None,
    ) -> None:
        """num_lookahead_tokens: KV slots reserved past each request's scheduled tokens
        for the drafts a proposer will add next step (speculative decoding; a proposer
        on the worker writes its drafts' KV there). draft_planner: speculative decoding
        (None: off). kv_offload: the KV offload tiers over kv_cache_manager's pool
        (None: off)."""
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(num_lookahead_tokens, int) or num_lookahead_tokens < 0:
            raise ValueError(
                f"num_lookahead_tokens must be an integer >= 0, got {num_lookahead_tokens!r}"
            )
        if not isinstance(long_prefill_token_threshold, int) or long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be an integer >= 0 (0: off), "
                f"got {long_prefill_token_threshold!r}"
            )
        if not enable_chunked_prefill:
            if max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_model_len "
                    f"({max_model_len}) when enable_chunked_prefill is False, or long prompts never run"
                )
            if long_prefill_token_threshold:
                raise ValueError(
                    "long_prefill_token_threshold chunks prompts, so it needs "
                    "enable_chunked_prefill=True"
                )
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.async_scheduling = async_scheduling
        self.num_lookahead_tokens = num_lookahead_tokens
        self.draft_planner = draft_planner
        if draft_planner is not None:
            draft_planner.async_scheduling = async_scheduling
        self.rollback = DraftRollback(kv_cache_manager, num_lookahead_tokens, max_model_len)
        # Tier loads for waiting requests (out of the queue until their blocks are on the
        # GPU), write-through of finished ones' blocks: kv_offload/planning/manager.py.
        self.kv_offload = kv_offload

        self.waiting = create_request_queue(policy)  # validates the policy name
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request
        # Finished since the last schedule(): the worker must drop their state.
        self.finished_req_ids: set[str] = set()
        # req_id -> how many of its tokens the worker holds; absent while the worker
        # holds no state for it (not yet scheduled, or preempted since).
        self._num_tokens_sent: dict[str, int] = {}
        # group_id -> the group's sample 0, while unfinished (n > 1 prompt sharing).
        self._group_leaders: dict[str, Request] = {}
        # Prompt logprobs come again when a preempted request recomputes its prompt:
        # req_id -> entries already emitted, and entries received since the last restart.
        self._prompt_logprobs_emitted: dict[str, int] = {}
        self._prompt_logprobs_received: dict[str, int] = {}
        self.num_preemptions_total = 0

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"a new request must be WAITING, got {request.status.name}")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens but max_model_len is "
                f"{self.max_model_len}: the prompt must be shorter than max_model_len"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.group_id is not None and request.sample_index == 0:
            self._group_leaders[request.group_id] = request

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Aborts requests in any state, freeing their blocks; unknown ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus
    ) -> list[Request]:
        """Finishes unfinished requests with `status` (e.g. a stop string matched);
        returns those finished. Unknown or already finished ids are ignored."""
        if not RequestStatus(status).finished:
            raise ValueError(f"status must be a finished status, got {RequestStatus(status).name}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finished = [
            self.requests[rid] for rid in dict.fromkeys(request_ids) if rid in self.requests
        ]
        waiting = [r for r in finished if r.status != RequestStatus.RUNNING]
        self.waiting.remove_many(waiting)
        for request in finished:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            request.status = RequestStatus(status)
            self._free_request(request)
        return finished

    def _free_request(self, request: Request) -> None:
        """Releases a finished request (already out of running and waiting)."""
        rid = request.request_id
        if self.kv_offload is not None:  # its computed blocks go down to the tiers
            self.kv_offload.request_finished(request)
        self.kv_cache_manager.free(request)
        if self.kv_offload is not None:
            self.kv_offload.abort(request)
        del self.requests[rid]
        self.finished_req_ids.add(rid)
        self._num_tokens_sent.pop(rid, None)
        self.rollback.forget(rid)
        self._prompt_logprobs_emitted.pop(rid, None)
        self._prompt_logprobs_received.pop(rid, None)
        if self.draft_planner is not None:
            self.draft_planner.forget(rid)
        if request.group_id is not None and self._group_leaders.get(request.group_id) is request:
            del self._group_leaders[request.group_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """True while finished ids are still to be sent to the worker by schedule()."""
        return bool(self.finished_req_ids)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ----------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        # The one rule (vLLM v1): there are no prefill and decode phases. Every request
        # tries to bring num_computed_tokens up to num_tokens_with_spec (prompt + output
        # + draft tokens) within one token budget per step. RUNNING requests go first,
        # in order; when the KV cache has no room for one, the lowest-priority /
        # latest-arrived running request is preempted (blocks freed, recomputed later)
        # until it fits, or until it is itself the one preempted. Then, if nothing was
        # preempted, WAITING requests are admitted in queue order while budget, free
        # blocks and max_num_seqs allow, starting after their prefix-cache hit; a prompt
        # larger than the remaining budget is chunked. No request is ever dropped.
        plan = StepPlan(self.max_num_batched_tokens)
        if self.kv_offload is not None:
            # Before any allocation: every block in the prefix cache holds computed KV.
            self.kv_offload.write_through()
            self.waiting.prepend_many(self.kv_offload.take_ready())  # blocks back on the GPU
        # Held for drafts: an empty step (the engine takes the step in flight first).
        if self.draft_planner is None or not self.draft_planner.holds_batch(self.running):
            if self.draft_planner is not None:
                self.draft_planner.plan_step(
                    self.running,
                    bool(self.waiting) and len(self.running) < self.max_num_seqs,
                    self.max_num_batched_tokens,
                )
            self._schedule_running(plan)
            if not plan.preempted:
                self._schedule_waiting(plan)
        finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        output = plan.build_output(
            self._num_tokens_sent,
            self.kv_cache_manager.get_block_ids,
            finished_req_ids,
            self.rollback.take_trims(),
        )
        if self.kv_offload is not None:
            output.kv_transfers = self.kv_offload.take_plan()
            self.kv_offload.step_scheduled(output)  # times steps: the prefill estimate
        # Scheduled tokens count as computed from the next step on.
        for request in plan.scheduled:
            request.num_computed_tokens += plan.num_scheduled_tokens[request.request_id]
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                output.sampling_req_ids.add(request.request_id)
                if self.async_scheduling:  # its tokens if every draft is accepted
                    request.num_output_placeholders += 1 + len(request.spec_token_ids)
        planner = self.draft_planner
        if planner is not None:
            asked = planner.to_propose(
                r for r in plan.scheduled if r.request_id in output.sampling_req_ids
            )
            if planner.host_proposer is None:  # the worker proposes
                output.num_drafts_to_propose = asked
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        for request in list(self.running):
            if plan.token_budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if self.draft_planner is not None:  # nobody waits here: see holds_batch
                self.draft_planner.prepare(request)
            num_new = self._num_new_tokens(request, plan.token_budget)
            if num_new <= 0:
                if self.draft_planner is not None:
                    self.draft_planner.unprepare(request)
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new, plan)
            if new_block_ids is None:
                continue  # the request was preempted itself
            plan.record(request, num_new, new_block_ids)
            self._schedule_drafts(request, num_new, plan)

    def _num_new_tokens(self, request: Request, token_budget: int) -> int:
        placeholders = request.num_output_placeholders
        if placeholders and (
            (
                request.max_tokens is not None
                and request.num_output_tokens + placeholders >= request.max_tokens
            )
            or request.num_tokens + placeholders >= self.max_model_len
        ):
            return 0  # the step in flight samples its last token
        num_new = request.num_tokens_with_spec + placeholders - request.num_computed_tokens
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        # Draft tokens may not take a position beyond max_model_len.
        return min(num_new, token_budget, self.max_model_len - request.num_computed_tokens)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: StepPlan
    ) -> list[int] | None:
        lookahead = self._lookahead(request, num_new)
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, num_lookahead_tokens=lookahead
            )
            if new_block_ids is not None:
                return new_block_ids
            victim = self._lowest_running()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Lookahead slots, none past max_model_len (no draft goes there)."""
        return max(
            0,
            min(
                self.num_lookahead_tokens,
                self.max_model_len - request.num_computed_tokens - num_new,
            ),
        )

    def _lowest_running(self) -> Request:
        """The running request to preempt first: the latest (fcfs), or the largest
        (priority, arrival_time), the latest in the running list on ties."""
        if self.policy == "priority":
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        # num_computed_tokens has not advanced for this step yet (schedule() does that
        # once every decision is made): the blocks this step registered are not valid.
        self.kv_cache_manager.free(request, num_valid_tokens=request.num_computed_tokens)
        if request.request_id in plan.num_scheduled_tokens:
            plan.unschedule(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self.rollback.forget(request.request_id)  # the worker drops its whole table
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._num_tokens_sent.pop(request.request_id, None)
        self._prompt_logprobs_received.pop(request.request_id, None)
        self.waiting.prepend(request)
        plan.preempted.append(request)

    def _schedule_drafts(self, request: Request, num_new: int, plan: StepPlan) -> None:
        """Keeps the draft tokens that fit in this step's num_new, drops the rest."""
        num_drafts = (
            request.num_computed_tokens
            + num_new
            - request.num_tokens
            - request.num_output_placeholders
        )
        if num_drafts > 0:
            del request.spec_token_ids[num_drafts:]
            plan.spec_tokens[request.request_id] = list(request.spec_token_ids)
        elif request.spec_token_ids:
            request.spec_token_ids = []

    def _schedule_waiting(self, plan: StepPlan) -> None:
        skipped: list[Request] = []  # siblings waiting for their group's sample 0
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            # A request preempted while its step was in flight waits for that step's token.
            if request.num_output_placeholders or self._waits_for_group_leader(request):
                skipped.append(self.waiting.pop())
                continue
            if not self._admit(request, plan):
                break
            if plan.preempted:
                break  # it displaced running requests: admit nobody else this step
        self.waiting.prepend_many(skipped)

    def _waits_for_group_leader(self, request: Request) -> bool:
        """With n > 1, samples 1.. wait until sample 0 has computed the shared prompt,
        so they find its blocks in the prefix cache instead of computing it again."""
        if request.group_id is None or request.sample_index == 0:
            return False
        leader = self._group_leaders.get(request.group_id)
        return leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        """Schedules the waiting request at the head of the queue; False if it does not fit."""
        hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        if self.kv_offload is not None:
            started = self.kv_offload.start_load(request, hit_blocks)
            if started == LoadStart.WAIT:
                if self.waiting.pop() is not request:
                    raise RuntimeError(
                        "internal error: the loading request must be the head of the queue"
                    )
                return True  # it waits for its blocks, out of the queue, computing nothing
            if started == LoadStart.INLINE:  # loaded before this step's forward: hits now
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit_tokens
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        if num_new > plan.token_budget:
            if not self.enable_chunked_prefill:
                return False
            num_new = plan.token_budget
        new_block_ids = self._allocate_for_waiting(request, num_new, hit_blocks, plan)
        if new_block_ids is None:
            return False
        if self.waiting.pop() is not request:
            raise RuntimeError("internal error: the admitted request must be the head of the queue")
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        # The manager does not touch num_computed_tokens: the hits count from here on.
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
            request.first_scheduled_time = time.monotonic()
        plan.record(request, num_new, new_block_ids)
        if self.kv_offload is not None:
            self.kv_offload.release(request)  # its load, if any, is over
        return True

    def _allocate_for_waiting(
        self, request: Request, num_new: int, hit_blocks: list, plan: StepPlan
    ) -> list[int] | None:
        """allocate_slots; under the priority policy, preempts strictly lower-priority
        running requests while there is no room."""
        # The hits are not in num_computed_tokens yet (added once admitted).
        lookahead = self._lookahead(
            request, num_new + len(hit_blocks) * self.kv_cache_manager.block_size
        )
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_new, new_computed_blocks=hit_blocks, num_lookahead_tokens=lookahead
            )
            if new_block_ids is not None or self.policy != "priority" or not self.running:
                return new_block_ids
            victim = self._lowest_running()
            if (victim.priority, victim.arrival_time) <= (request.priority, request.arrival_time):
                return None
            self._preempt(victim, plan)

    # ------------------------------------------------------- update_from_output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Applies one step's results; returns an output per request that has news."""
        runner = model_runner_output
        if self.kv_offload is not None:
            self.kv_offload.step_done(scheduler_output)
            if runner.kv_transfers is not None:
                self.kv_offload.apply_report(runner.kv_transfers)
        index_of = {rid: i for i, rid in enumerate(runner.req_ids)}
        outputs: list[EngineCoreOutput] = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue  # finished or aborted since schedule()
            expects_sample = rid in scheduler_output.sampling_req_ids
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid, [])
            if expects_sample and request.num_output_placeholders:
                request.num_output_placeholders -= 1 + len(drafts)
            index = index_of.get(rid)
            sampled = runner.sampled_token_ids[index] if index is not None else []
            error = runner.errors.get(rid) or self._check_sampled(
                request, sampled, drafts, expects_sample
            )
            if error is not None:
                outputs.append(self._finish_with_error(request, error))
                continue
            outputs.extend(self._apply_step(request, sampled, drafts, runner, index))
        for rid, error in runner.errors.items():
            request = self.requests.get(rid)
            if request is not None and rid not in scheduler_output.num_scheduled_tokens:
                outputs.append(self._finish_with_error(request, error))
        return outputs

    @staticmethod
    def _check_sampled(
        request: Request, sampled: list[int], drafts: list[int], expects_sample: bool
    ) -> str | None:
        """A message if the runner's tokens for this request break the contract."""
        if len(sampled) > len(drafts) + 1:
            return (
                f"model runner returned {len(sampled)} tokens for request {request.request_id!r} "
                f"with {len(drafts)} draft tokens scheduled (at most {len(drafts) + 1})"
            )
        if not sampled and expects_sample:
            return (
                f"model runner returned no token for request {request.request_id!r} "
                "although all its tokens were computed"
            )
        if sampled and not expects_sample:
            return (
                f"model runner sampled a token for request {request.request_id!r} "
                "from a prefill chunk short of the end of its tokens"
            )
        return None

    def _apply_step(
        self,
        request: Request,
        sampled: list[int],
        drafts: list[int],
        runner: ModelRunnerOutput,
        index: int | None,
    ) -> list[EngineCoreOutput]:
        rid = request.request_id
        preempted = request.status == RequestStatus.PREEMPTED  # while this step was in flight
        if sampled and not preempted:
            # Accepted drafts + one bonus/sampled token: the rejected drafts' KV is invalid.
            self.rollback.roll_back(request, drafts, sampled)
        if self.draft_planner is not None:
            self.draft_planner.observe(request, drafts, sampled)
        new_token_ids = append_until_stop(request, sampled, self.max_model_len)
        new_logprobs = None
        row_logprobs = (
            runner.logprobs[index] if index is not None and index < len(runner.logprobs) else None
        )
        if row_logprobs is not None:
            new_logprobs = row_logprobs[: len(new_token_ids)]
        prompt_logprobs = None
        if not preempted:  # else they come again when its prompt is recomputed
            prompt_logprobs = self._new_prompt_logprobs(request, runner.prompt_logprobs.get(rid))
        finish_reason = None
        if request.is_finished:
            finish_reason = request.get_finish_reason()
            if preempted:
                self.waiting.remove_many([request])
            else:
                self.running.remove(request)
            self._free_request(request)
        elif sampled:
            if self.draft_planner is not None:
                request.spec_token_ids = self.draft_planner.next_drafts(
                    request, runner.spec_token_ids.get(rid)
                )
            else:
                request.spec_token_ids = list(runner.spec_token_ids.get(rid, ()))
        if not new_token_ids and prompt_logprobs is None and finish_reason is None:
            return []  # a prefill chunk short of the prompt's end
        return [
            EngineCoreOutput(
                req_id=rid,
                new_token_ids=new_token_ids,
                new_logprobs=new_logprobs,
                prompt_logprobs=prompt_logprobs,
                finish_reason=finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                first_scheduled_time=request.first_scheduled_time,
            )
        ]

    def _new_prompt_logprobs(
        self, request: Request, entries: list[TokenLogprobs] | None
    ) -> list[TokenLogprobs] | None:
        """The prompt logprobs not emitted before (a preempted request computes its
        prompt, and so its prompt logprobs, again)."""
        if entries is None:
            return None
        rid = request.request_id
        received = self._prompt_logprobs_received.get(rid, 0)
        emitted = self._prompt_logprobs_emitted.get(rid, 0)
        fresh = entries[max(0, emitted - received) :]
        self._prompt_logprobs_received[rid] = received + len(entries)
        self._prompt_logprobs_emitted[rid] = max(emitted, received + len(entries))
        return fresh or None

    def _finish_with_error(self, request: Request, error: str) -> EngineCoreOutput:
        self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(
            req_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finish_reason(),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
            error=error,
        )
