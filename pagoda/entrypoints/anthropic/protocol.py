"""Pydantic models of Anthropic's Messages API as Pagoda serves it.

The request's top-level fields are declared here with their bounds; content blocks,
tools, tool_choice and thinking stay plain objects and are checked by translate.py,
which names the exact place of a problem (`messages[1].content[0]`) in one sentence.
A top-level field Pagoda does not implement (container, mcp_servers, ...) is a 400
naming every such field (`unsupported_fields()`), never silently dropped. Fields that
only mean something on Anthropic's platform (metadata, service_tier, cache_control)
are accepted, have no effect, and are listed in `x-pagoda-ignored-fields`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_MAX_TOKENS_BOUND = 2**31 - 1
_IGNORED = "accepted and ignored: it only means something on Anthropic's platform"


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(
        ..., description="a string or content blocks: text, tool_use (assistant), tool_result"
    )


class MessagesRequest(BaseModel):
    # Unknown fields are collected (not refused one by one) so the 400 names them all.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(..., description="a served model name")
    max_tokens: int = Field(..., ge=1, le=_MAX_TOKENS_BOUND)
    messages: list[InputMessage] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = Field(None, description="a string or text blocks")
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=_MAX_TOKENS_BOUND, description="0: off")
    tools: list[dict[str, Any]] | None = Field(
        None, description="custom tools: {name, description, input_schema}"
    )
    tool_choice: dict[str, Any] | None = Field(
        None, description="{type: auto | any | tool | none, name, disable_parallel_tool_use}"
    )
    thinking: dict[str, Any] | None = Field(
        None,
        description="{type: enabled, budget_tokens} | {type: adaptive} | {type: disabled} "
        "(enabled and adaptive need --reasoning-parser)",
    )
    metadata: dict[str, Any] | None = Field(None, description=_IGNORED)
    service_tier: str | None = Field(None, description=_IGNORED)
    cache_control: dict[str, Any] | None = Field(
        None, description="accepted and ignored: the prefix cache matches prompts by content"
    )

    def unsupported_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# ----------------------------------------------------------------------------- responses
# Documented shapes (the handler builds the same JSON directly).


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(..., description="text, thinking and tool_use blocks")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = Field(None, description="the field at fault, as the OpenAI routes say")
    code: str | None = None


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
