"""Running one API request's generation: one engine request per prompt, merged, with
cancellation on client disconnect and accumulation into OpenAI choices.

Owns `GenerationJob` (everything a handler decided about a request), `run_generation`
(the merged delta stream), `collect` (the non-streaming result), `stream_chunks` (the
SSE body both streaming handlers send) and `cancel_on_disconnect`. Choice index =
prompt index * n + sample index, as OpenAI numbers the choices of a multi-prompt
completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.engine.async_engine import (
    AsyncEngine,
    EngineDrainingError,
    EngineNotReadyError,
    EngineStepError,
    RequestFailedError,
)
from pagoda.entrypoints.openai.admission import AdmissionTicket
from pagoda.entrypoints.openai.errors import APIError, from_value_error
from pagoda.entrypoints.openai.serving_common import SSE_DONE, sse, sse_error, usage
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GenerationJob:
    request_id: str  # the API response id
    model: str
    created: int
    prompts: list[dict]  # engine prompts: {"prompt_token_ids": [...], "prompt": text or None}
    params: SamplingParams
    priority: int
    ticket: AdmissionTicket

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p["prompt_token_ids"]) for p in self.prompts)

    def engine_request_id(self, prompt_index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{prompt_index}"

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.params.n + sample_index


@dataclasses.dataclass
class SSEStream:
    """A streaming response body plus the clean-up that must run even if it never starts."""

    body: AsyncIterator[str]
    close: Callable[[], None]


@dataclasses.dataclass
class ChoiceResult:
    """One choice, accumulated from its delta outputs."""

    index: int
    prompt_index: int
    text_parts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: object | None = None  # the stop string or stop token id that matched

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, completion: CompletionOutput) -> None:
        self.text_parts.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(completion.logprobs)
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason


async def collect(engine: AsyncEngine, job: GenerationJob) -> list[ChoiceResult]:
    """Runs the job to the end; the choices in index order."""
    choices: dict[int, ChoiceResult] = {}
    async with contextlib.aclosing(run_generation(engine, job)) as outputs:
        async for prompt_index, output in outputs:
            for completion in output.outputs:
                index = job.choice_index(prompt_index, completion.index)
                choice = choices.get(index)
                if choice is None:
                    choice = choices[index] = ChoiceResult(index, prompt_index)
                choice.add(completion)
    return [choices[i] for i in sorted(choices)]


async def stream_chunks(
    engine: AsyncEngine,
    job: GenerationJob,
    head: dict,
    include_usage: bool,
    choices_of: Callable[[int, RequestOutput], list[dict]],
    opening_choices: list[dict] | None = None,
) -> AsyncIterator[str]:
    """The SSE body of a streaming response: one chunk per delta output, then the end.

    Each chunk is `head` plus `choices_of(prompt index, output)` (and `usage: null` with
    include_usage); `opening_choices`, if given, go in a first chunk before any output.
    The end, as OpenAI sends it: with include_usage a chunk with no choices and the
    usage; a failure after the headers went out becomes an in-band error event; always
    `[DONE]` last. The admission ticket is released before `[DONE]`.
    """
    extra = {"usage": None} if include_usage else {}
    completion_tokens = 0
    try:
        if opening_choices is not None:
            yield sse({**head, "choices": opening_choices, **extra})
        async with contextlib.aclosing(run_generation(engine, job)) as outputs:
            async for prompt_index, output in outputs:
                completion_tokens += sum(len(c.token_ids) for c in output.outputs)
                yield sse({**head, "choices": choices_of(prompt_index, output), **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(job.prompt_tokens, completion_tokens)})
    except Exception as exc:  # the headers are sent: report in-band
        logger.warning("stream %s failed: %s", job.request_id, exc)
        yield sse_error(exc)
    finally:
        job.ticket.release()
    yield SSE_DONE


async def run_generation(
    engine: AsyncEngine, job: GenerationJob
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Runs each prompt as one engine request; yields (prompt index, delta output) as they come.

    Closing this iterator early aborts every request still running.
    """
    prompts, params, ticket = job.prompts, job.params, job.ticket
    if len(prompts) == 1:
        async with contextlib.aclosing(
            engine.generate(prompts[0], params, job.engine_request_id(0), job.priority)
        ) as outputs:
            async for output in _translated(outputs):
                ticket.started(0)
                yield 0, output
        return
    merged: asyncio.Queue = asyncio.Queue()
    tasks = [
        asyncio.create_task(
            _pump(engine, prompt, params, job.engine_request_id(i), job.priority, i, merged)
        )
        for i, prompt in enumerate(prompts)
    ]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            ticket.started(index)
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(
    engine: AsyncEngine,
    prompt: dict,
    params: SamplingParams,
    request_id: str,
    priority: int,
    index: int,
    merged: asyncio.Queue,
) -> None:
    try:
        async with contextlib.aclosing(
            engine.generate(prompt, params, request_id, priority)
        ) as outs:
            async for output in _translated(outs):
                merged.put_nowait((index, output))
    except Exception as exc:  # handed to the consumer, which raises it
        merged.put_nowait((index, exc))
    finally:
        merged.put_nowait((index, None))


async def _translated(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Maps engine-side failures onto API errors."""
    try:
        async for output in outputs:
            yield output
    except (EngineNotReadyError, EngineDrainingError) as exc:
        raise APIError(503, str(exc), code="service_unavailable") from None
    except ValueError as exc:  # the engine refused the request: the client's input
        raise from_value_error(exc) from None
    except RequestFailedError as exc:
        raise APIError(
            500, f"the engine failed this request: {exc}", code="request_failed"
        ) from None
    except EngineStepError as exc:  # the whole step failed (e.g. a worker process died)
        raise APIError(500, str(exc), code="engine_step_failed") from None


async def wait_for_disconnect(receive) -> None:
    """Returns when the client goes away (the request body has already been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(coro, receive) -> Any:
    """Runs `coro`; if the client disconnects first, cancels it (aborting its requests)."""
    work = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise APIError(499, "the client closed the request", code="client_closed_request")
    return work.result()
