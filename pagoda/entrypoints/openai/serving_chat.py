"""POST /v1/chat/completions: chat through the model's chat template, streaming or not.

The conversation is rendered with the model's template (or --chat-template) and
tokenized once; the template writes its own special tokens, and the request's
`chat_template_kwargs` become extra template variables (e.g. Qwen3's
`enable_thinking`). Streaming follows
OpenAI: each choice's first chunk carries `delta.role`, later chunks
`delta.content`, the last one `finish_reason`; with stream_options.include_usage
every chunk has `usage: null` and a final chunk with no choices carries the usage.

Tools (tools.py) go to the template; their calls come back as `tool_calls` (deltas
in streams). A template that drops tools (tool_template.py probes it once) gets the
request served with an `x-pagoda-warning` header and a log line, or refused with a
400 under --strict-tool-template. With --reasoning-parser the thinking comes back as
`reasoning_content` (streamed as `delta.reasoning_content`), apart from `content`
(chat_output.py).
Output constraints (response_format, structured_outputs, tool grammars) are compiled
before admission: a refused schema is a 400 (structured_request.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.engine import trace
from pagoda.entrypoints.openai.chat_output import ChatChoiceOutput
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.generation import (
    GenerationJob,
    SSEStream,
    cancel_on_disconnect,
    collect,
    stream_chunks,
)
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagoda.entrypoints.openai.serving_common import (
    ServingContext,
    build_sampling_params,
    check_caps,
    check_prompt,
    check_room,
    new_request_id,
    now,
    reject_unsupported,
    usage,
)
from pagoda.entrypoints.openai.structured_request import (
    check_constraints,
    structured_outputs_of,
    thinking_budget_of,
)
from pagoda.entrypoints.openai.tool_template import WARNING_HEADER, unrendered_tools_warning
from pagoda.entrypoints.openai.tools import ToolPlan, plan_tools
from pagoda.model.tokenizer import apply_chat_template, check_template_kwargs
from pagoda.outputs import Logprob, RequestOutput

logger = logging.getLogger(__name__)


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict]:
    result = []
    for message in messages:
        content = message.content
        if isinstance(content, list):  # text parts only (the protocol rejects other kinds)
            content = "".join(part.text for part in content)
        item = {"role": message.role, "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            item["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
        result.append(item)
    return result


def _template_tool_call(call: dict) -> dict:
    """An assistant's earlier call as chat templates take it: arguments as an object
    (OpenAI sends them as JSON text; templates write them with `tojson`)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the text as sent
    return {**call, "function": function}


def render_chat(
    ctx: ServingContext,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of the conversation; a template that fails on these messages -> 400."""
    engine = ctx.require_ready()
    tokenizer = ctx.tokenizer()
    try:
        check_template_kwargs(tokenizer, template_kwargs or {})
    except ValueError as exc:
        raise bad_request(f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from None
    try:
        return apply_chat_template(
            tokenizer,
            messages_to_dicts(messages),
            add_generation_prompt,
            engine.config.model.chat_template,
            template_kwargs,
            tools,
        )
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    except Exception as exc:  # Jinja raises its own errors (e.g. a template's raise_exception)
        raise bad_request(
            f"the chat template could not render these messages: {exc}", param="messages"
        ) from None


def _plan_tools(ctx: ServingContext, req: ChatCompletionRequest) -> ToolPlan:
    """plan_tools with "auto" as the server resolved it (tool_template.py); tools the
    chat template drops are a 400 under --strict-tool-template, else a warning on the
    plan, said in the response's header and once in the log."""
    if not req.tools:
        return plan_tools(req, False, None)
    auto = ctx.auto_tool_choice()
    plan = plan_tools(req, auto.parser is not None, auto.parser, auto.refusal, auto.answers_as_text)
    if ctx.tool_support().renders_tools:
        return plan
    warning = unrendered_tools_warning()
    if ctx.settings.strict_tool_template:
        raise bad_request(
            f"{warning}; this server (--strict-tool-template) refuses requests with tools",
            param="tools",
        )
    plan.warning = warning
    ctx.warn_once(
        "unrendered_tools",
        "a request carries tools, but %s; each such response carries the header %s "
        "(logged once; --strict-tool-template refuses them with a 400)",
        warning,
        WARNING_HEADER,
    )
    return plan


async def prepare_chat(
    ctx: ServingContext, req: ChatCompletionRequest
) -> tuple[GenerationJob, ToolPlan]:
    """All of a chat request's checks; raises APIError (4xx) on the first problem."""
    engine = ctx.require_ready()
    model = ctx.check_model(req.model)
    reject_unsupported(req.unsupported_parameters())
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    check_caps(ctx, req.n, num_top, "top_logprobs")
    plan = _plan_tools(ctx, req)
    token_ids = render_chat(
        ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs, plan.tools or None
    )
    trace.mark("tokenized")
    check_prompt(ctx, token_ids, "messages")
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_room(ctx, len(token_ids), max_tokens, param)
    params = build_sampling_params(
        ctx,
        req,
        max_tokens,
        num_top,
        structured_outputs=structured_outputs_of(req, plan.structured_outputs()),
        thinking_token_budget=thinking_budget_of(req),
    )
    await check_constraints(engine, req, params)
    ticket = ctx.admission.admit([len(token_ids)])
    prompts = [{"prompt": None, "prompt_token_ids": token_ids}]
    job = GenerationJob(
        new_request_id("chatcmpl"), model, now(), prompts, params, req.priority, ticket
    )
    return job, plan


def choice_outputs(
    ctx: ServingContext, job: GenerationJob, plan: ToolPlan
) -> Callable[[int], ChatChoiceOutput]:
    """choice index -> its ChatChoiceOutput (made on first use)."""
    engine = ctx.require_ready()
    reasoning = engine.structured.reasoning
    tokenizer = engine.tokenizer
    skip = job.params.skip_special_tokens
    prompt_ids = job.prompts[0]["prompt_token_ids"]
    outputs: dict[int, ChatChoiceOutput] = {}

    def get(index: int) -> ChatChoiceOutput:
        if index not in outputs:
            outputs[index] = ChatChoiceOutput(
                reasoning,
                prompt_ids,
                lambda ids: tokenizer.decode(ids, skip_special_tokens=skip),
                plan if plan.tools else None,
            )
        return outputs[index]

    return get


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, receive
) -> tuple[dict | SSEStream, dict[str, str]]:
    """The JSON response (non-streaming) or an SSEStream (streaming), and the headers
    to add to it (x-pagoda-warning)."""
    job, plan = await prepare_chat(ctx, req)
    trace.mark("prepared")
    headers = {WARNING_HEADER: plan.warning} if plan.warning else {}
    if ctx.settings.log_requests:
        logger.info("chat %s: %d prompt tokens, %s", job.request_id, job.prompt_tokens, job.params)
    if req.stream:
        return SSEStream(_stream(ctx, req, job, plan), job.ticket.release), headers
    try:
        choices = await cancel_on_disconnect(collect(ctx.engine, job), receive)
    finally:
        job.ticket.release()
    num_top = req.top_logprobs or 0
    choice_output = choice_outputs(ctx, job, plan)
    result = []
    for c in choices:
        out = choice_output(c.index)
        out.delta(c.text, c.token_ids, finished=True)
        result.append(
            {
                "index": c.index,
                "message": out.message(),
                "logprobs": {"content": chat_logprobs(c.logprobs, num_top)}
                if req.logprobs
                else None,
                "finish_reason": out.finish_reason(c.finish_reason),
            }
        )
    return {
        "id": job.request_id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": result,
        "usage": usage(job.prompt_tokens, sum(c.num_tokens for c in choices)),
    }, headers


def _token_entry(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(positions: list[dict[int, Logprob]] | None, num_top: int) -> list[dict]:
    """OpenAI's chat logprobs `content` list: the sampled token and its top alternatives."""
    result = []
    for position in positions or []:
        chosen = next(iter(position.values()))  # the sampled token comes first
        top = sorted(
            (lp for lp in position.values() if lp.rank is not None and lp.rank <= num_top),
            key=lambda lp: lp.rank,
        )
        result.append({**_token_entry(chosen), "top_logprobs": [_token_entry(lp) for lp in top]})
    return result


def _stream(
    ctx: ServingContext, req: ChatCompletionRequest, job: GenerationJob, plan: ToolPlan
) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = {
        "id": job.request_id,
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": job.model,
    }
    num_top = req.top_logprobs or 0
    choice_output = choice_outputs(ctx, job, plan)

    def choices_of(prompt_index: int, output: RequestOutput) -> list[dict]:
        choices = []
        for completion in output.outputs:
            index = job.choice_index(prompt_index, completion.index)
            out = choice_output(index)
            finished = completion.finish_reason is not None
            delta = out.delta(completion.text, completion.token_ids, finished)
            logprobs = (
                {"content": chat_logprobs(completion.logprobs, num_top)} if req.logprobs else None
            )
            choices.append(
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason(completion.finish_reason),
                }
            )
        return choices

    # OpenAI opens every choice with the role before any content.
    opening = [
        {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for i in range(job.params.n)
    ]
    return stream_chunks(ctx.engine, job, head, include_usage, choices_of, opening)
