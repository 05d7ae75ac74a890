"""A Messages request as a chat completion request, checked on the way.

Owns `to_chat_request(req, has_reasoning_parser)`: the system prompt becomes a system
message; a user turn's text blocks a user message and each tool_result block a tool
message (in their order); an assistant turn's text its content, its tool_use blocks
its tool_calls and its thinking blocks its reasoning_content. Tools become functions
(input_schema as parameters); tool_choice auto / any / tool / none becomes auto /
required / a named function / none, and disable_parallel_tool_use becomes
parallel_tool_calls=false; thinking becomes `enable_thinking` for the chat template
and, with a budget, thinking_token_budget. Every problem is a 400 naming its place:
images and documents, server tools, block fields with an effect Pagoda does not
implement, a final assistant turn (prefill), thinking without --reasoning-parser.
Fields with no effect here (cache_control, metadata, service_tier) are collected in
`ignored` for the response header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pagoda.entrypoints.anthropic.protocol import MessagesRequest
from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage

_PLATFORM_FIELDS = ("metadata", "service_tier", "cache_control")
_TEXT_KEYS = {"type", "text", "cache_control", "citations"}
_BLOCK_KEYS = {
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
}
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}


@dataclass
class _Turns:
    """The chat messages built so far, and the ignored fields met on the way."""

    messages: list[ChatMessage] = field(default_factory=list)
    ignored: set[str] = field(default_factory=set)

    def add(self, role: str, content: str, **extra: Any) -> None:
        self.messages.append(ChatMessage(role=role, content=content, **extra))


def to_chat_request(
    req: MessagesRequest, has_reasoning_parser: bool
) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request, and the names of the fields accepted without effect."""
    unknown = req.unsupported_fields()
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise bad_request(
            f"unsupported parameter(s) for /v1/messages: {names}; Pagoda does not implement them",
            param=unknown[0],
        )
    turns = _Turns()
    turns.ignored.update(name for name in _PLATFORM_FIELDS if name in req.model_fields_set)
    if req.system:
        turns.add("system", _system_text(req.system, turns))
    for index, message in enumerate(req.messages):
        if message.role == "user":
            _user_turn(message.content, f"messages[{index}]", turns)
        else:
            _assistant_turn(message.content, f"messages[{index}]", turns)
    if req.messages[-1].role == "assistant":
        raise bad_request(
            "the last message is an assistant turn (prefill), which this server does not "
            "continue: end the conversation with a user turn",
            param="messages",
        )
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": turns.messages,
        "max_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stream": req.stream,
    }
    fields.update(_tool_fields(req, turns))
    fields.update(_thinking_fields(req, has_reasoning_parser))
    try:
        return ChatCompletionRequest(**fields), sorted(turns.ignored)
    except ValidationError as exc:  # a value the chat request bounds tighter
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg', 'invalid value')}") from None


def _system_text(system: str | list[dict], turns: _Turns) -> str:
    if isinstance(system, str):
        return system
    return "".join(_text_of(block, f"system[{i}]", turns) for i, block in enumerate(system))


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise bad_request(f"{where} must be an object with a 'type'", param=_field(where))
    return kind


def _field(where: str) -> str:
    """The top-level field of a place such as `system[0]` or `messages[1].content[0]`."""
    return where.split("[", 1)[0]


def _unsupported_block(kind: str, where: str) -> Exception:
    if kind in ("image", "document"):
        reason = f"{kind} blocks are not supported: this server reads text only"
    else:
        reason = f"content blocks of type {kind!r} are not supported here"
    return bad_request(f"{where}: {reason}", param=_field(where))


def _check_keys(block: dict, allowed: set[str], where: str, turns: _Turns) -> None:
    extra = sorted(set(block) - allowed)
    if extra:
        names = ", ".join(repr(name) for name in extra)
        raise bad_request(f"{where}: unsupported field(s) {names}", param=_field(where))
    if "cache_control" in block:
        turns.ignored.add("cache_control")


def _text_of(block: Any, where: str, turns: _Turns) -> str:
    kind = _block_type(block, where)
    if kind != "text":
        raise _unsupported_block(kind, where)
    _check_keys(block, _TEXT_KEYS, where, turns)
    if block.get("citations"):
        raise bad_request(f"{where}: citations are not supported", param=_field(where))
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}: a text block needs 'text' (a string)", param=_field(where))
    return block["text"]


def _user_turn(content: str | list[dict], where: str, turns: _Turns) -> None:
    """Text blocks in a row make one user message; each tool_result is a tool message."""
    if isinstance(content, str):
        turns.add("user", content)
        return
    text: list[str] = []
    for index, block in enumerate(content):
        place = f"{where}.content[{index}]"
        if _block_type(block, place) == "tool_result":
            if text:
                turns.add("user", "".join(text))
                text = []
            _tool_result(block, place, turns)
        else:
            text.append(_text_of(block, place, turns))
    if text or not content:
        turns.add("user", "".join(text))


def _tool_result(block: dict, where: str, turns: _Turns) -> None:
    _check_keys(block, _BLOCK_KEYS["tool_result"], where, turns)
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"{where}: a tool_result needs 'tool_use_id'", param="messages")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(
            _text_of(part, f"{where}.content[{i}]", turns) for i, part in enumerate(content)
        )
    elif not isinstance(content, str):
        raise bad_request(
            f"{where}: a tool_result's content is a string or text blocks", param="messages"
        )
    if block.get("is_error"):
        # Chat templates have no error flag for a tool's answer: it is said in the text.
        content = f"Error: {content}"
    turns.add("tool", content, tool_call_id=call_id)


def _assistant_turn(content: str | list[dict], where: str, turns: _Turns) -> None:
    if isinstance(content, str):
        turns.add("assistant", content)
        return
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict] = []
    for index, block in enumerate(content):
        place = f"{where}.content[{index}]"
        kind = _block_type(block, place)
        if kind == "text":
            text.append(_text_of(block, place, turns))
        elif kind == "tool_use":
            calls.append(_tool_use(block, place, turns))
        elif kind == "thinking":
            _check_keys(block, _BLOCK_KEYS["thinking"], place, turns)
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{place}: a thinking block needs 'thinking'", param="messages")
            thinking.append(block["thinking"])
        else:
            raise _unsupported_block(kind, place)
    turns.add(
        "assistant",
        "".join(text),
        tool_calls=calls or None,
        reasoning_content="".join(thinking) or None,
    )


def _tool_use(block: dict, where: str, turns: _Turns) -> dict:
    _check_keys(block, _BLOCK_KEYS["tool_use"], where, turns)
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, dict)):
        raise bad_request(
            f"{where}: a tool_use block needs 'id', 'name' (strings) and 'input' (an object)",
            param="messages",
        )
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": call_id, "type": "function", "function": function}


def _tool_fields(req: MessagesRequest, turns: _Turns) -> dict[str, Any]:
    tools = [_function_tool(tool, i, turns) for i, tool in enumerate(req.tools or [])]
    choice = req.tool_choice
    if choice is None:
        return {"tools": tools or None}
    kind = choice.get("type")
    allowed = {"tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request(
            "tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice"
        )
    extra = sorted(set(choice) - allowed.get(kind, {"type", "disable_parallel_tool_use"}))
    if extra:
        raise bad_request(
            f"tool_choice of type {kind!r} takes no field(s) {', '.join(map(repr, extra))}",
            param="tool_choice",
        )
    if kind != "none" and not tools:
        raise bad_request(f"tool_choice of type {kind!r} needs tools", param="tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if kind == "tool" and choice.get("name") not in names:
        raise bad_request(
            f"tool_choice names the tool {choice.get('name')!r}, which is not in tools",
            param="tool_choice",
        )
    mapped: str | dict = {"auto": "auto", "any": "required", "none": "none"}.get(kind, "")
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    fields: dict[str, Any] = {"tools": tools or None, "tool_choice": mapped}
    if tools and kind != "none":
        fields["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
    return fields


def _function_tool(tool: Any, index: int, turns: _Turns) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object", param="tools")
    if tool.get("type", "custom") not in ("custom", None):
        raise bad_request(
            f"{where}: server tools (type {tool['type']!r}) are not supported; "
            "only custom tools with name, description and input_schema",
            param="tools",
        )
    extra = sorted(set(tool) - _TOOL_KEYS)
    if extra:
        raise bad_request(
            f"{where}: unsupported field(s) {', '.join(map(repr, extra))}", param="tools"
        )
    if "cache_control" in tool:
        turns.ignored.add("cache_control")
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name or not isinstance(schema, dict):
        raise bad_request(
            f"{where} needs a non-empty 'name' and an 'input_schema' object", param="tools"
        )
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _thinking_fields(req: MessagesRequest, has_reasoning_parser: bool) -> dict[str, Any]:
    thinking = req.thinking
    if thinking is None:
        return {}
    kind = thinking.get("type")
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind not in ("enabled", "adaptive"):
        raise bad_request(
            "thinking.type must be 'enabled', 'adaptive' or 'disabled'", param="thinking"
        )
    if not has_reasoning_parser:
        raise bad_request(
            "thinking needs the server started with --reasoning-parser (this one has none)",
            param="thinking",
        )
    if thinking.get("display", "summarized") != "summarized":
        raise bad_request("thinking.display 'omitted' is not supported", param="thinking")
    extra = sorted(set(thinking) - {"type", "budget_tokens", "display"})
    if extra or (kind == "adaptive" and "budget_tokens" in thinking):
        names = ", ".join(map(repr, extra or ["budget_tokens"]))
        raise bad_request(f"thinking of type {kind!r} takes no field(s) {names}", param="thinking")
    fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget:
            raise bad_request("thinking.budget_tokens must be a positive integer", param="thinking")
        if budget >= req.max_tokens:
            raise bad_request(
                f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                f"({req.max_tokens})",
                param="thinking",
            )
        fields["thinking_token_budget"] = budget
    return fields
