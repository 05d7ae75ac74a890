"""POST /v1/messages: Anthropic's Messages API over the chat pipeline.

The request is translated into a chat request (translate.py) and prepared by the
chat handler's own `prepare_chat` (template, tools and their grammars, reasoning,
checks, admission), so both routes render, constrain and refuse alike. The output
goes through the chat pipeline's ChatChoiceOutput (reasoning split, tool calls) and
then into Anthropic's content blocks (blocks.py). A stream is SSE with named events
in Anthropic's order: message_start, a ping, per block content_block_start /
content_block_delta / content_block_stop, then message_delta (stop_reason, usage)
and message_stop; a failure after the headers is an `event: error`.
`usage.input_tokens` counts the whole prompt (prefix-cache hits included).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pagoda.engine import trace
from pagoda.entrypoints.anthropic.blocks import MessageBlocks, stop_reason_of
from pagoda.entrypoints.anthropic.errors import error_event
from pagoda.entrypoints.anthropic.protocol import MessagesRequest
from pagoda.entrypoints.anthropic.translate import to_chat_request
from pagoda.entrypoints.openai.generation import (
    GenerationJob,
    SSEStream,
    cancel_on_disconnect,
    collect,
    run_generation,
)
from pagoda.entrypoints.openai.ignored_fields import HEADER as IGNORED_HEADER
from pagoda.entrypoints.openai.serving_chat import choice_outputs, prepare_chat
from pagoda.entrypoints.openai.serving_common import ServingContext
from pagoda.entrypoints.openai.tool_template import WARNING_HEADER
from pagoda.entrypoints.openai.tools import ToolPlan

logger = logging.getLogger(__name__)

# Accepted fields with no effect here -> why (logged once per process per name).
_IGNORED_REASONS = {
    "metadata": "tags (user_id) for Anthropic's abuse monitoring",
    "service_tier": "Anthropic's capacity tier",
    "cache_control": "marks Anthropic's prompt-cache breakpoints; Pagoda's prefix cache "
    "matches prompts by content",
}
_warned: set[str] = set()


def _ignored_headers(names: list[str]) -> dict[str, str]:
    for name in names:
        if name not in _warned:
            _warned.add(name)  # the event loop is one thread: no lock needed
            logger.warning(
                "ignoring the /v1/messages field %r: %s; it has no effect here (logged once; "
                "each response lists ignored fields in %s)",
                name,
                _IGNORED_REASONS.get(name, ""),
                IGNORED_HEADER,
            )
    return {IGNORED_HEADER: ", ".join(names)} if names else {}


async def create_message(
    ctx: ServingContext, req: MessagesRequest, receive
) -> tuple[dict | SSEStream, dict[str, str]]:
    """The Message (non-streaming) or an SSEStream, and the headers to add to it."""
    engine = ctx.require_ready()
    chat_req, ignored = to_chat_request(req, engine.structured.reasoning is not None)
    job, plan = await prepare_chat(ctx, chat_req)
    trace.mark("prepared")
    headers = _ignored_headers(ignored)
    if plan.warning:
        headers[WARNING_HEADER] = plan.warning
    if ctx.settings.log_requests:
        logger.info(
            "messages %s: %d prompt tokens, %s", job.request_id, job.prompt_tokens, job.params
        )
    head = {
        "id": "msg_" + job.request_id.split("-", 1)[1],
        "type": "message",
        "role": "assistant",
        "model": job.model,
    }
    if req.stream:
        return SSEStream(_stream(ctx, job, plan, head), job.ticket.release), headers
    try:
        choices = await cancel_on_disconnect(collect(ctx.engine, job), receive)
    finally:
        job.ticket.release()
    choice = choices[0]
    blocks = MessageBlocks()
    delta = choice_outputs(ctx, job, plan)(0).delta(choice.text, choice.token_ids, True)
    blocks.feed(delta)
    blocks.finish()
    reason, sequence = stop_reason_of(choice.finish_reason, choice.stop_reason, blocks.has_tool_use)
    return {
        **head,
        "content": blocks.blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": job.prompt_tokens, "output_tokens": choice.num_tokens},
    }, headers


def _event(name: str, data: dict[str, Any]) -> str:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {payload}\n\n"


async def _stream(
    ctx: ServingContext, job: GenerationJob, plan: ToolPlan, head: dict[str, Any]
) -> AsyncIterator[str]:
    output = choice_outputs(ctx, job, plan)(0)
    blocks = MessageBlocks()
    num_tokens = 0
    finish_reason: str | None = None
    stop_reason: object = None
    try:
        message = {
            **head,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": job.prompt_tokens, "output_tokens": 0},
        }
        yield _event("message_start", {"type": "message_start", "message": message})
        yield _event("ping", {"type": "ping"})
        async with contextlib.aclosing(run_generation(ctx.engine, job)) as outputs:
            async for _, request_output in outputs:
                for completion in request_output.outputs:
                    num_tokens += len(completion.token_ids)
                    finished = completion.finish_reason is not None
                    delta = output.delta(completion.text, completion.token_ids, finished)
                    for name, data in blocks.feed(delta):
                        yield _event(name, data)
                    if finished:
                        finish_reason, stop_reason = (
                            completion.finish_reason,
                            completion.stop_reason,
                        )
        for name, data in blocks.finish():
            yield _event(name, data)
        reason, sequence = stop_reason_of(finish_reason, stop_reason, blocks.has_tool_use)
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": num_tokens},
            },
        )
        yield _event("message_stop", {"type": "message_stop"})
    except Exception as exc:  # the headers are sent: report in-band
        logger.warning("stream %s failed: %s", job.request_id, exc)
        yield error_event(exc)
    finally:
        job.ticket.release()
