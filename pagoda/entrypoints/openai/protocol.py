"""Pydantic models of the OpenAI API as Pagoda serves it (request bodies and responses).

Every request model forbids unknown fields: a parameter Pagoda does not know is a
400 that names it, never silently ignored. Parameters OpenAI defines but Pagoda does
not implement (functions, suffix, best_of != n, ...)
are declared so the schema documents them, and `unsupported_parameters()` names the
ones a request actually set. Numeric fields are bounded here so no value can reach
the engine that it cannot handle (e.g. a seed beyond 64 bits, NaN, infinity).
vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, structured_outputs, thinking_token_budget, ...) are accepted as top-level
fields, as vLLM does.
Fields that only mean something on OpenAI's platform (store, metadata, user, ...)
are declared too, and `ignored_fields()` names the ones a request set: they are
accepted and ignored, never used (ignored_fields.py).
A chat content part other than text (image_url, input_audio, file, ...) is one
sentence naming its type, not pydantic's error per member of the content union.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from pagoda.entrypoints.openai.ignored_fields import PLATFORM_FIELDS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Bounds that keep every integer representable in the engine's int64 tensors.
_MAX_TOKENS_BOUND = 2**31 - 1


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


_IGNORED = "accepted and ignored: it only means something on OpenAI's platform"


class StreamOptions(StrictModel):
    include_usage: bool = False
    include_obfuscation: Any | None = Field(None, description=_IGNORED)


class SamplingRequestFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="a served model name (default: the only one)")
    n: int = Field(1, ge=1, le=1024, description="completions per prompt (capped by --max-n)")
    temperature: float | None = Field(None, ge=0.0, le=1e6, description="0 means greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=_MAX_TOKENS_BOUND, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # Bounded away from 0: dividing logits by a tiny penalty overflows them to inf.
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100]"
    )
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_MAX_TOKENS_BOUND)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI platform fields (ignored_fields.PLATFORM_FIELDS); any value is accepted.
    store: Any | None = Field(None, description=_IGNORED)
    metadata: Any | None = Field(None, description=_IGNORED)
    service_tier: Any | None = Field(None, description=_IGNORED)
    user: Any | None = Field(None, description=_IGNORED)
    safety_identifier: Any | None = Field(None, description=_IGNORED)
    prompt_cache_key: Any | None = Field(None, description=_IGNORED)
    prompt_cache_retention: Any | None = Field(None, description=_IGNORED)
    priority: int = Field(
        0,
        ge=INT64_MIN,
        le=INT64_MAX,
        description="lower runs first with --scheduling-policy priority",
    )
    best_of: int | None = Field(None, ge=1, le=1024, description="only best_of == n is supported")
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's: exactly one of json (a schema), regex, choice, grammar "
        "(EBNF), json_object; and disable_any_whitespace",
    )
    thinking_token_budget: int | None = Field(
        None,
        ge=0,
        le=_MAX_TOKENS_BOUND,
        description="thinking tokens after which </think> is forced (needs --reasoning-parser)",
    )

    def common_unsupported(self) -> list[tuple[str, str]]:
        problems = []
        if self.best_of is not None and self.best_of != self.n:
            problems.append(("best_of", "best_of different from n is not supported"))
        if self.stream_options is not None and not self.stream:
            problems.append(("stream_options", "stream_options is only allowed with stream=true"))
        return problems

    def ignored_fields(self) -> list[str]:
        """The fields this request set that are accepted and ignored, in a stable order."""
        names = [name for name in PLATFORM_FIELDS if name in self.model_fields_set]
        options = self.stream_options
        if options is not None and "include_obfuscation" in options.model_fields_set:
            names.append("stream_options.include_obfuscation")
        return names


class CompletionRequest(SamplingRequestFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, a list of texts, token ids, or a list of token-id lists"
    )
    max_tokens: int | None = Field(16, ge=1, le=_MAX_TOKENS_BOUND)
    logprobs: int | None = Field(None, ge=0, le=1024, description="top logprobs per token (cap 20)")
    echo: bool = False
    suffix: str | None = None

    def unsupported_parameters(self) -> list[tuple[str, str]]:
        problems = self.common_unsupported()
        if self.suffix is not None:
            problems.append(("suffix", "suffix (insertion) is not supported"))
        if self.echo and self.logprobs is not None:
            problems.append(("echo", "echo together with logprobs is not supported"))
        return problems


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


_TEXT_PART = "{'type': 'text', 'text': '...'}"


def _content_error(message: str, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError("invalid_content", message, ctx)


def _text_parts_only(content: Any) -> Any:
    """Checks a message's content whole, so each problem is one sentence (for a part
    that is not text: its type, and that only 'text' is read) rather than pydantic's
    error per member of the content union."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _content_error("content must be a string, a list of content parts or null")
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise _content_error(
                "content part {index} must be an object with a 'type', such as {example}",
                index=index,
                example=_TEXT_PART,
            )
        if kind != "text":
            raise _content_error(
                "content part type '{kind}' is not supported by this model: it reads "
                "only 'text' parts (part {index}; send text as a string or as {example})",
                kind=kind,
                index=index,
                example=_TEXT_PART,
            )
        if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise _content_error(
                "content part {index} of type 'text' must be exactly {example}",
                index=index,
                example=_TEXT_PART,
            )
    return content


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[
        str | list[TextContentPart] | None,
        BeforeValidator(_text_parts_only),
        Field(description="a string or a list of text parts (text only: no images or audio)"),
    ] = None
    name: str | None = None
    # An assistant turn's calls, and a tool turn's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(
        None, description='{"name": ..., "schema": {...}, "strict": ...} for type json_schema'
    )


class ChatCompletionRequest(SamplingRequestFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, le=_MAX_TOKENS_BOUND, description="deprecated alias of max_completion_tokens"
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=_MAX_TOKENS_BOUND)
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, le=1024, description="needs logprobs=true (cap 20)"
    )
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='extra chat template variables, e.g. {"enable_thinking": false}'
    )
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="none, auto (default with tools), required, or "
        '{"type": "function", "function": {"name": ...}}',
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: tool_choice required makes one call at most"
    )
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None,
        description="a thinking_token_budget of 512, 2048 or 8192 tokens "
        "(needs --reasoning-parser; thinking_token_budget wins)",
    )
    # Declared so they are documented and rejected by name when used.
    modalities: list[str] | None = Field(None, description="only ['text']")
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    def unsupported_parameters(self) -> list[tuple[str, str]]:
        problems = self.common_unsupported()
        if self.modalities is not None and self.modalities != ["text"]:
            problems.append(
                ("modalities", f"modalities {self.modalities} are not supported (only ['text'])")
            )
        if self.functions:
            problems.append(("functions", "functions (function calling) are not supported"))
        if self.function_call not in (None, "none"):
            problems.append(
                (
                    "function_call",
                    "function_call other than 'none' is not supported (use tools and tool_choice)",
                )
            )
        if self.top_logprobs is not None and not self.logprobs:
            problems.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            problems.append(
                ("max_tokens", "max_tokens and max_completion_tokens disagree; send one")
            )
        for message in self.messages:
            if message.role == "tool" and not message.tool_call_id:
                problems.append(
                    (
                        "messages",
                        "a message of role 'tool' needs the tool_call_id of the call it answers",
                    )
                )
            if message.tool_calls is not None and message.role != "assistant":
                problems.append(("messages", "only assistant messages carry tool_calls"))
            for call in message.tool_calls or []:
                function = call.get("function")
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    problems.append(
                        (
                            "messages",
                            "each of an assistant's tool_calls needs a function with a name",
                        )
                    )
        return problems

    def ignored_fields(self) -> list[str]:
        names = super().ignored_fields()
        # Without tools there is no call to parallelise: accepted and ignored.
        if "parallel_tool_calls" in self.model_fields_set and not self.tools:
            names.append("parallel_tool_calls")
        return names


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(StrictModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses
# Documented shapes (the handlers build the same JSON directly for speed).


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(None, description="with --reasoning-parser")
    tool_calls: list[dict[str, Any]] | None = Field(None, description="with tools")


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
