"""What the completion and chat handlers share: the serving context, request checks,
sampling-parameter building, and SSE framing.

Every check a client can fail happens here before the engine sees the request and
raises APIError with a 4xx that names the parameter: model name, unsupported
parameters, n and logprobs caps, prompt length against max_model_len, token ids
against the vocabulary, and SamplingParams' own validation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any

from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.openai.admission import AdmissionController
from pagoda.entrypoints.openai.errors import APIError, bad_request, from_value_error
from pagoda.entrypoints.openai.tool_template import (
    AutoToolChoice,
    TemplateToolSupport,
    probe_template,
    resolve_auto_tool_choice,
)
from pagoda.metrics.prometheus import ServerMetrics
from pagoda.model.tokenizer import apply_chat_template, encode
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerSettings:
    served_model_names: list[str]
    max_n: int = 16
    max_logprobs: int = 20
    max_num_queued_requests: int | None = 1024
    max_queued_tokens: int | None = None
    max_request_body_bytes: int = 4 << 20
    api_key: str | None = None
    metrics_public: bool = False
    enable_debug_routes: bool = False
    log_requests: bool = False
    # tool_choice "auto": the parser that finds calls in free text (tool_parsers.py).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # Tools the chat template drops: 400 when set, else served with x-pagoda-warning.
    strict_tool_template: bool = False
    enable_web_ui: bool = True
    # /docs and /redoc load their scripts from a CDN: off unless asked for.
    enable_api_docs: bool = False


class ServingContext:
    """The engine client plus the server's settings, admission and metrics."""

    def __init__(
        self, engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.admission = AdmissionController(
            settings.max_num_queued_requests, settings.max_queued_tokens
        )
        self._tool_support: TemplateToolSupport | None = None
        self._warned: set[str] = set()

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """Logs a warning the first time `key` comes up: a condition every request of
        a kind meets would otherwise fill the log."""
        if key not in self._warned:
            self._warned.add(key)  # the event loop is one thread: no lock needed
            logger.warning(message, *args)

    def tool_support(self) -> TemplateToolSupport:
        """What the chat template does with tools, probed once: the template is fixed
        for the server's life."""
        if self._tool_support is None:
            engine = self.require_ready()
            tokenizer = engine.tokenizer
            if tokenizer is None:
                self._tool_support = TemplateToolSupport(False, None)
            else:
                template = engine.config.model.chat_template

                def render(messages, tools, add_generation_prompt):
                    ids = apply_chat_template(
                        tokenizer, messages, add_generation_prompt, template, None, tools
                    )
                    return tokenizer.decode(ids, skip_special_tokens=False)

                self._tool_support = probe_template(render)
        return self._tool_support

    def auto_tool_choice(self) -> AutoToolChoice:
        settings = self.settings
        return resolve_auto_tool_choice(
            settings.enable_auto_tool_choice, settings.tool_call_parser, self.tool_support()
        )

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def require_ready(self) -> Any:
        """The loaded LLMEngine (read-only facts only), or 503 while loading/draining."""
        if self.engine.is_draining:
            raise APIError(503, "the server is shutting down", code="server_draining")
        if not self.engine.is_ready:
            raise APIError(
                503,
                "the model is still loading; retry shortly",
                code="model_loading",
                headers={"Retry-After": "5"},
            )
        return self.engine.engine

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.settings.served_model_names:
            return self.model_name
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves "
            f"{', '.join(self.settings.served_model_names)}",
            param="model",
            code="model_not_found",
        )

    def tokenizer(self):
        tokenizer = self.require_ready().tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids", param="prompt")
        return tokenizer


def encode_text(
    ctx: ServingContext, text: str, param: str, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of `text` as LLM.generate makes them; text the tokenizer cannot take -> 400."""
    try:
        return encode(ctx.tokenizer(), text, add_special_tokens)
    except APIError:
        raise
    except Exception as exc:  # e.g. a lone UTF-16 surrogate from a JSON escape
        raise bad_request(
            f"{param} cannot be tokenized: {type(exc).__name__}", param=param
        ) from None


def reject_unsupported(problems: list[tuple[str, str]]) -> None:
    if problems:
        param, message = problems[0]
        raise bad_request(message, param=param)


def check_caps(ctx: ServingContext, n: int, num_logprobs: int | None, logprobs_param: str) -> None:
    if n > ctx.settings.max_n:
        raise bad_request(
            f"n is {n}, but this server allows at most {ctx.settings.max_n} (--max-n)", param="n"
        )
    if num_logprobs is not None and num_logprobs > ctx.settings.max_logprobs:
        raise bad_request(
            f"{logprobs_param} is {num_logprobs}, but this server returns at most "
            f"{ctx.settings.max_logprobs} (--max-logprobs)",
            param=logprobs_param,
        )


def check_prompt(ctx: ServingContext, token_ids: list[int], param: str) -> None:
    try:
        ctx.require_ready().validate_prompt(token_ids)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


def check_room(ctx: ServingContext, prompt_len: int, max_tokens: int | None, param: str) -> None:
    """OpenAI's rule: prompt + requested output must fit the context (400 names all numbers)."""
    limit = ctx.require_ready().max_model_len
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, but {prompt_len + max_tokens} "
            f"were requested ({prompt_len} in the prompt, {max_tokens} for the completion): "
            f"shorten the prompt or lower {param}",
            param=param,
        )


def build_sampling_params(
    ctx: ServingContext, req, max_tokens: int | None, logprobs: int | None, **constraints: Any
) -> SamplingParams:
    """SamplingParams from the request's fields; a bad value -> 400 naming the field.
    constraints: structured_outputs and thinking_token_budget, as the handler resolved them."""
    values: dict[str, Any] = dict(
        constraints,
        n=req.n,
        max_tokens=max_tokens,
        logprobs=logprobs,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            values[name] = value
    if req.logit_bias:
        values["logit_bias"] = _parse_logit_bias(req.logit_bias)
    try:
        params = SamplingParams(**values)
        params.validate_for_vocab(ctx.require_ready().model_info.vocab_size)
    except (ValueError, TypeError) as exc:
        raise from_value_error(exc) from None
    return params


def _parse_logit_bias(logit_bias: dict[str, float]) -> dict[int, float]:
    parsed = {}
    for key, value in logit_bias.items():
        try:
            parsed[int(key)] = value
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return parsed


def new_request_id(prefix: str) -> str:
    # Always server-made: a client-chosen id could collide with (and abort) another request.
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    error = (
        exc if isinstance(exc, APIError) else APIError(500, f"internal error: {type(exc).__name__}")
    )
    body = error.body()
    body["error"]["code"] = body["error"]["code"] or str(error.status_code)
    return sse(body)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def now() -> int:
    return int(time.time())
