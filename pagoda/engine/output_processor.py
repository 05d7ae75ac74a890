"""OutputProcessor: turns the scheduler's per-step EngineCoreOutputs into RequestOutputs.

Owns, per user request: the detokenizer of each sample (with n > 1 the engine runs
n child core requests that belong to one user request), the accumulated token ids
and logprobs, stop-string detection (which the scheduler cannot do: it has no text),
the output kind ("cumulative", "delta" for streaming, "final_only") and the
request's timing (arrival, first scheduled, first token, last token, finish) in
`RequestOutput.metrics`.

`process_outputs` returns the RequestOutputs to emit this step plus the child ids
the scheduler must abort because a stop string ended them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Literal

from pagoda.core.outputs import EngineCoreOutput, TokenLogprobs
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from pagoda.sampling_params import SamplingParams

OutputKind = Literal["cumulative", "delta", "final_only"]
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclasses.dataclass
class _SampleState:
    """One child core request: sample `index` of its user request."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: object = None
    # How much of token_ids / logprobs earlier "delta" outputs already carried.
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    samples: dict[str, _SampleState]  # child id -> state
    arrival_time: float
    # The earliest first-admission time of its samples, as the scheduler reports it.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob]] | None = None  # positions 1.. of the prompt
    prompt_logprobs_sent: bool = False
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples.values())

    @property
    def prompt_logprobs_complete(self) -> bool:
        return (
            self.prompt_logprobs is not None
            and len(self.prompt_logprobs) >= len(self.prompt_token_ids) - 1
        )


class OutputProcessor:
    """Per-request output state between the scheduler and the user."""

    def __init__(self, tokenizer: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self._requests: dict[str, _RequestState] = {}
        self._child_to_request: dict[str, str] = {}
        self._token_text_cache: dict[int, str] = {}

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind = "cumulative",
        child_ids: list[str] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Registers a user request whose samples run as core requests `child_ids` (in index order)."""
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        child_ids = [request_id] if child_ids is None else list(child_ids)
        if len(child_ids) != params.n:
            raise ValueError(f"child_ids must hold n={params.n} ids, got {len(child_ids)}")
        if len(set(child_ids)) != len(child_ids) or any(
            c in self._child_to_request for c in child_ids
        ):
            raise ValueError(f"child_ids must be unique and unused, got {child_ids}")
        samples = {
            child_id: _SampleState(
                index=index,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for index, child_id in enumerate(child_ids)
        }
        self._requests[request_id] = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            output_kind=output_kind,
            samples=samples,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
        )
        for child_id in child_ids:
            self._child_to_request[child_id] = request_id

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets a user request; returns its child ids that had not finished yet."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        for child_id in state.samples:
            self._child_to_request.pop(child_id, None)
        return [child_id for child_id, sample in state.samples.items() if not sample.finished]

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ one step

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Applies one step's outputs; returns (RequestOutputs to emit, child ids to abort)."""
        now = self.clock()
        # request id -> children with new tokens or newly finished (dict: keeps arrival order)
        touched: dict[str, set[str]] = {}
        ids_to_abort: list[str] = []
        for core_output in core_outputs:
            request_id = self._child_to_request.get(core_output.req_id)
            if request_id is None:
                continue  # aborted earlier, or output after a stop string ended it
            state = self._requests[request_id]
            sample = state.samples[core_output.req_id]
            if sample.finished:
                continue
            if self._apply(state, sample, core_output, now):
                ids_to_abort.append(core_output.req_id)
            if core_output.new_token_ids or sample.finished:
                touched.setdefault(request_id, set()).add(core_output.req_id)

        request_outputs = []
        for request_id, changed_children in touched.items():
            state = self._requests[request_id]
            if state.finished:
                state.finished_time = now
            output = self._make_request_output(state, changed_children)
            if output is not None:
                request_outputs.append(output)
            if state.finished:
                self._forget(state)
        return request_outputs, ids_to_abort

    def _apply(
        self, state: _RequestState, sample: _SampleState, core_output: EngineCoreOutput, now: float
    ) -> bool:
        """Updates one sample; returns True when a stop string ended it while the core had not."""
        new_ids = core_output.new_token_ids
        scheduled = core_output.first_scheduled_time
        if scheduled is not None and (
            state.first_scheduled_time is None or scheduled < state.first_scheduled_time
        ):
            state.first_scheduled_time = scheduled
        if new_ids:
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
            sample.token_ids.extend(new_ids)
        state.num_cached_tokens = max(state.num_cached_tokens, core_output.num_cached_tokens)
        if core_output.new_logprobs and sample.logprobs is not None:
            for position in core_output.new_logprobs:
                sample.logprobs.append(self._to_logprob_dict(position, state.params.detokenize))
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + position.logprobs[
                    0
                ]
        if core_output.prompt_logprobs and sample.index == 0:  # the samples share one prompt
            state.prompt_logprobs = (state.prompt_logprobs or []) + [
                self._to_logprob_dict(p, state.params.detokenize)
                for p in core_output.prompt_logprobs
            ]

        # A token id (eos / stop_token_ids) that ended generation: its text is not output.
        stop_terminated = core_output.finish_reason == "stop" and not isinstance(
            core_output.stop_reason, str
        )
        stop_string = sample.detokenizer.update(new_ids, stop_terminated=stop_terminated)
        if stop_string is None and core_output.finished:
            stop_string = sample.detokenizer.finish()
        if stop_string is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_string
            return not core_output.finished
        if core_output.error is not None:
            state.error = core_output.error
            sample.finish_reason = core_output.finish_reason or "error"
        elif core_output.finished:
            sample.finish_reason, sample.stop_reason = (
                core_output.finish_reason,
                core_output.stop_reason,
            )
        return False

    def _forget(self, state: _RequestState) -> None:
        del self._requests[state.request_id]
        for child_id in state.samples:
            self._child_to_request.pop(child_id, None)

    # ------------------------------------------------------------------ building outputs

    def _make_request_output(
        self, state: _RequestState, changed_children: set[str]
    ) -> RequestOutput | None:
        finished = state.finished
        if state.output_kind == "final_only" and not finished:
            return None
        delta = state.output_kind == "delta"
        if delta:
            children = [c for c, s in state.samples.items() if c in changed_children]
        else:
            children = list(state.samples)
        made = (self._make_completion(state.samples[c], delta) for c in children)
        completions = [c for c in made if c is not None]
        if not completions and not finished:
            return None
        completions.sort(key=lambda c: c.index)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=self._take_prompt_logprobs(state, delta),
            num_cached_tokens=state.num_cached_tokens,
            metrics=self._metrics(state),
            error=state.error,
        )

    def _make_completion(self, sample: _SampleState, delta: bool) -> CompletionOutput | None:
        """The sample's output: everything so far, or (delta) only what is new since last time."""
        if not delta:
            return CompletionOutput(
                index=sample.index,
                text=sample.detokenizer.visible_text(),
                token_ids=list(sample.token_ids),
                cumulative_logprob=sample.cumulative_logprob,
                logprobs=list(sample.logprobs) if sample.logprobs is not None else None,
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            )
        text = sample.detokenizer.get_delta_text()
        token_ids = sample.token_ids[sample.num_sent_tokens :]
        if not text and not token_ids and not sample.finished:
            return None  # nothing new to say (e.g. a prefill chunk)
        sample.num_sent_tokens = len(sample.token_ids)
        logprobs = None
        if sample.logprobs is not None:
            logprobs = sample.logprobs[sample.num_sent_logprobs :]
            sample.num_sent_logprobs = len(sample.logprobs)
        return CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _take_prompt_logprobs(self, state: _RequestState, delta: bool) -> PromptLogprobs | None:
        """[None, position 1, ...] once every prompt position has arrived; in delta mode only once."""
        if not state.prompt_logprobs_complete or (delta and state.prompt_logprobs_sent):
            return None
        state.prompt_logprobs_sent = True
        logprobs: PromptLogprobs = [None]
        logprobs.extend(state.prompt_logprobs or ())
        return logprobs

    def _metrics(self, state: _RequestState) -> dict:
        return {
            "arrival_time": state.arrival_time,
            "first_scheduled_time": state.first_scheduled_time,
            "first_token_time": state.first_token_time,
            "last_token_time": state.last_token_time,
            "finished_time": state.finished_time,
            "num_generation_tokens": sum(len(s.token_ids) for s in state.samples.values()),
        }

    # ------------------------------------------------------------------ logprobs

    def _to_logprob_dict(self, position: TokenLogprobs, detokenize: bool) -> dict[int, Logprob]:
        """{token id: Logprob}: the chosen token first (its true rank), then the top-n (ranks 1..n)."""
        ranks = [position.sampled_rank] + list(range(1, len(position.token_ids)))
        result: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(position.token_ids, position.logprobs, ranks):
            if token_id not in result:  # the chosen token may also be among the top-n
                decoded = self._token_text(token_id) if detokenize else None
                result[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=decoded)
        return result

    def _token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text_cache[token_id] = text
        return text
