"""POST /v1/completions: OpenAI's legacy completions, streaming (SSE) and not.

A request may carry several prompts (texts or token-id lists); each runs as one
engine request with `n` samples, and choice i of prompt p has index p * n + i.
`echo` prepends the prompt text. Logprobs use the completions format (tokens,
token_logprobs, top_logprobs, text_offset). `usage` counts each prompt once and
every generated token of every choice.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from pagoda.engine import trace
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.generation import (
    ChoiceResult,
    GenerationJob,
    SSEStream,
    cancel_on_disconnect,
    collect,
    stream_chunks,
)
from pagoda.entrypoints.openai.protocol import CompletionRequest
from pagoda.entrypoints.openai.serving_common import (
    ServingContext,
    build_sampling_params,
    check_caps,
    check_prompt,
    check_room,
    encode_text,
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
from pagoda.outputs import Logprob, RequestOutput

logger = logging.getLogger(__name__)


def _prompt_list(ctx: ServingContext, prompt) -> list[dict]:
    """The request's prompts as engine prompts with token ids (tokenized like LLM.generate)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append({"prompt": item, "prompt_token_ids": encode_text(ctx, item, "prompt")})
        else:
            prompts.append({"prompt": None, "prompt_token_ids": list(item)})
        check_prompt(ctx, prompts[-1]["prompt_token_ids"], "prompt")
    return prompts


async def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> GenerationJob:
    """All of a completion request's checks; raises APIError (4xx) on the first problem."""
    engine = ctx.require_ready()
    model = ctx.check_model(req.model)
    reject_unsupported(req.unsupported_parameters())
    check_caps(ctx, req.n, req.logprobs, "logprobs")
    prompts = _prompt_list(ctx, req.prompt)
    trace.mark("tokenized")
    for p in prompts:
        check_room(ctx, len(p["prompt_token_ids"]), req.max_tokens, "max_tokens")
    params = build_sampling_params(
        ctx,
        req,
        req.max_tokens,
        req.logprobs,
        structured_outputs=structured_outputs_of(req),
        thinking_token_budget=thinking_budget_of(req),
    )
    await check_constraints(engine, req, params)
    ticket = ctx.admission.admit([len(p["prompt_token_ids"]) for p in prompts])
    return GenerationJob(
        new_request_id("cmpl"), model, now(), prompts, params, req.priority, ticket
    )


async def create_completion(ctx: ServingContext, req: CompletionRequest, receive):
    """The JSON response (non-streaming) or an SSEStream (streaming)."""
    job = await prepare_completion(ctx, req)
    trace.mark("prepared")
    if ctx.settings.log_requests:
        logger.info(
            "completion %s: %d prompt(s), %d prompt tokens, %s",
            job.request_id,
            len(job.prompts),
            job.prompt_tokens,
            job.params,
        )
    if req.stream:
        return SSEStream(_stream(ctx, req, job), job.ticket.release)
    try:
        choices = await cancel_on_disconnect(collect(ctx.engine, job), receive)
    finally:
        job.ticket.release()
    return {
        "id": job.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": [_choice_json(ctx, req, job, c) for c in choices],
        "usage": usage(job.prompt_tokens, sum(c.num_tokens for c in choices)),
    }


def _echo_text(ctx: ServingContext, job: GenerationJob, prompt_index: int) -> str:
    prompt = job.prompts[prompt_index]
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    return ctx.tokenizer().decode(prompt["prompt_token_ids"])


def _choice_json(
    ctx: ServingContext, req: CompletionRequest, job: GenerationJob, choice: ChoiceResult
) -> dict:
    text = choice.text
    if req.echo:
        text = _echo_text(ctx, job, choice.prompt_index) + text
    logprobs = (
        completion_logprobs(choice.logprobs, req.logprobs, 0) if req.logprobs is not None else None
    )
    return {
        "index": choice.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
    }


def completion_logprobs(
    positions: list[dict[int, Logprob]] | None, num_top: int, text_offset: int
) -> dict:
    """OpenAI's completions logprobs object for generated positions."""
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for position in positions or []:
        chosen = next(iter(position.values()))  # the sampled token comes first
        token = chosen.decoded_token or ""
        result["tokens"].append(token)
        result["token_logprobs"].append(chosen.logprob)
        top = {
            (lp.decoded_token or ""): lp.logprob
            for lp in position.values()
            if lp.rank is not None and lp.rank <= num_top
        }
        top.setdefault(token, chosen.logprob)
        result["top_logprobs"].append(top)
        result["text_offset"].append(text_offset)
        text_offset += len(token)
    return result


def _stream(ctx: ServingContext, req: CompletionRequest, job: GenerationJob) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = {
        "id": job.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
    }
    offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)

    def choices_of(prompt_index: int, output: RequestOutput) -> list[dict]:
        choices = []
        for completion in output.outputs:
            index = job.choice_index(prompt_index, completion.index)
            text = completion.text
            if index not in offsets and req.echo:
                text = _echo_text(ctx, job, prompt_index) + text
            start = offsets.get(index, 0)
            offsets[index] = start + len(text)
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(
                    completion.logprobs, req.logprobs, start + len(text) - len(completion.text)
                )
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                }
            )
        return choices

    return stream_chunks(ctx.engine, job, head, include_usage, choices_of)
