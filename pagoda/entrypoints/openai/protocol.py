"""Pydantic models of the OpenAI API as Pagoda serves it (request bodies and responses).

Every request model forbids unknown fields: a parameter Pagoda does not know is a
400 that names it, never silently ignored. Parameters OpenAI defines but Pagoda does
not implement (tools, response_format other than text, suffix, best_of != n, ...)
are declared so the schema documents them, and `unsupported_parameters()` names the
ones a request actually set. Numeric fields are bounded here so no value can reach
the engine that it cannot handle (e.g. a seed beyond 64 bits, NaN, infinity).
vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, ...) are accepted as top-level fields, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Bounds that keep every integer representable in the engine's int64 tensors.
_MAX_TOKENS_BOUND = 2**31 - 1


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingRequestFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = Field(None, description="a served model name (default: the only one)")
    n: int = Field(1, ge=1, le=1024, description="completions per prompt (capped by --max-n)")
    temperature: Optional[float] = Field(None, ge=0.0, le=1e6, description="0 means greedy; default 1")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1, le=_MAX_TOKENS_BOUND, description="0 or -1: off")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    # Bounded away from 0: dividing logits by a tiny penalty overflows them to inf.
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=100.0)
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="token id (as a string) -> bias in [-100, 100]")
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_MAX_TOKENS_BOUND)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, description="an end-user id; recorded nowhere")
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX,
                          description="lower runs first with --scheduling-policy priority")
    best_of: Optional[int] = Field(None, ge=1, le=1024, description="only best_of == n is supported")

    def common_unsupported(self) -> list[tuple[str, str]]:
        problems = []
        if self.best_of is not None and self.best_of != self.n:
            problems.append(("best_of", "best_of different from n is not supported"))
        if self.stream_options is not None and not self.stream:
            problems.append(("stream_options", "stream_options is only allowed with stream=true"))
        return problems


class CompletionRequest(SamplingRequestFields):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="text, a list of texts, token ids, or a list of token-id lists")
    max_tokens: Optional[int] = Field(16, ge=1, le=_MAX_TOKENS_BOUND)
    logprobs: Optional[int] = Field(None, ge=0, le=1024, description="top logprobs per token (cap 20)")
    echo: bool = False
    suffix: Optional[str] = None

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


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Optional[Union[str, list[TextContentPart]]] = None
    name: Optional[str] = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


class ChatCompletionRequest(SamplingRequestFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=_MAX_TOKENS_BOUND,
                                      description="deprecated alias of max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=_MAX_TOKENS_BOUND)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=1024, description="needs logprobs=true (cap 20)")
    add_generation_prompt: bool = True
    # Declared so they are documented and rejected by name when used.
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[ResponseFormat] = None

    def unsupported_parameters(self) -> list[tuple[str, str]]:
        problems = self.common_unsupported()
        if self.tools:
            problems.append(("tools", "tools (function calling) are not supported"))
        if self.tool_choice not in (None, "none"):
            problems.append(("tool_choice", "tool_choice other than 'none' is not supported"))
        if self.parallel_tool_calls:
            problems.append(("parallel_tool_calls", "parallel_tool_calls is not supported"))
        if self.functions:
            problems.append(("functions", "functions (function calling) are not supported"))
        if self.function_call not in (None, "none"):
            problems.append(("function_call", "function_call other than 'none' is not supported"))
        if self.response_format is not None and self.response_format.type != "text":
            problems.append(("response_format", f"response_format type "
                             f"{self.response_format.type!r} is not supported (only 'text')"))
        if self.top_logprobs is not None and not self.logprobs:
            problems.append(("top_logprobs", "top_logprobs needs logprobs=true"))
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            problems.append(("max_tokens", "max_tokens and max_completion_tokens disagree; send one"))
        return problems


class TokenizeCompletionRequest(StrictModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(StrictModel):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class DetokenizeRequest(StrictModel):
    model: Optional[str] = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses
# Documented shapes (the handlers build the same JSON directly for speed).


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: Optional[str] = None
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
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
