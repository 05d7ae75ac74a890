"""StepPlan: what one Scheduler.schedule() call has decided (the requests scheduled,
their token counts and new blocks, draft tokens, preemptions), undone piecewise when a
request is preempted, and the SchedulerOutput diff built from it: a request the worker
holds no state for goes out whole, one it holds only with what changed."""

from __future__ import annotations

from collections.abc import Callable

from pagoda.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.core.request import Request


class StepPlan:
    """What one schedule() call has decided so far; undone piecewise on preemption."""

    def __init__(self, token_budget: int) -> None:
        self.token_budget = token_budget
        self.scheduled: list[Request] = []  # in scheduling order
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_block_ids: dict[str, list[int]] = {}
        self.spec_tokens: dict[str, list[int]] = {}
        self.preempted: list[Request] = []

    def record(self, request: Request, num_tokens: int, new_block_ids: list[int]) -> None:
        self.scheduled.append(request)
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_block_ids[request.request_id] = list(new_block_ids)
        self.token_budget -= num_tokens

    def unschedule(self, request: Request) -> None:
        """Forgets a request scheduled earlier in this step (it is being preempted)."""
        rid = request.request_id
        self.scheduled.remove(request)
        self.token_budget += self.num_scheduled_tokens.pop(rid)
        self.new_block_ids.pop(rid)
        self.spec_tokens.pop(rid, None)

    def build_output(
        self,
        num_tokens_sent: dict[str, int],
        get_block_ids: Callable[[str], list[int]],
        finished_req_ids: set[str],
        trimmed_block_tables: dict[str, int],
    ) -> SchedulerOutput:
        """The diff for the worker. num_tokens_sent (request id -> tokens the worker
        holds; absent: it holds no state) is updated to what this output sends."""
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for request in self.scheduled:
            rid = request.request_id
            num_sent = num_tokens_sent.get(rid)
            if num_sent is None:
                new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=list(request.prompt_token_ids),
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=get_block_ids(rid),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            else:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=rid,
                        new_token_ids=request.all_token_ids[num_sent:],
                        new_block_ids=self.new_block_ids[rid],
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            num_tokens_sent[rid] = request.num_tokens
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=dict(self.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=self.spec_tokens,
            finished_req_ids=finished_req_ids,
            preempted_req_ids={r.request_id for r in self.preempted},
            trimmed_block_tables=trimmed_block_tables,
        )
