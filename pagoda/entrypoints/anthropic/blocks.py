"""One choice's output as Anthropic content blocks: whole, or as stream events.

Owns `MessageBlocks`, fed the deltas the chat pipeline makes of each output
(chat_output.ChatChoiceOutput: reasoning_content, content, tool_calls) and returning
the stream events they open, extend and close (content_block_start, _delta, _stop)
while it keeps the finished blocks for a whole response, so a stream and a whole
response agree block for block. Thinking is a `thinking` block, the answer a `text`
block, each call a `tool_use` block (its arguments streamed as input_json_delta).
Whitespace before a tool call makes no text block of its own. Also owns
`stop_reason_of`, which maps the engine's finish onto Anthropic's stop_reason.
"""

from __future__ import annotations

import json
from typing import Any

Event = tuple[str, dict[str, Any]]


class MessageBlocks:
    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []  # the finished blocks, in order
        self._open: dict[str, Any] | None = None
        self._arguments = ""  # the open tool_use block's JSON text so far
        self._pending_space = ""  # whitespace not yet known to start a text block
        self.has_tool_use = False

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        """The events of one chat delta (any of reasoning_content, content, tool_calls)."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._extend("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if "id" in call:  # a new call (a named call then streams its arguments)
                events += self._close()
                events += self._start(
                    {"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"]}
                )
                self.has_tool_use = True
            arguments = function.get("arguments") or ""
            if arguments and self._open is not None and self._open["type"] == "tool_use":
                self._arguments += arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def finish(self) -> list[Event]:
        """The events that end the content: held whitespace (without calls), the last
        block's stop; an empty text block when the output made none."""
        events: list[Event] = []
        if self._pending_space and not self.has_tool_use:
            events += self._extend("text", self._pending_space)
        self._pending_space = ""
        events += self._close()
        if not self.blocks:
            events += self._start({"type": "text"})
            events += self._close()
        return events

    def _text(self, text: str) -> list[Event]:
        if self._open is None or self._open["type"] != "text":
            text = self._pending_space + text
            if not text.strip():
                self._pending_space = text
                return []
            self._pending_space = ""
        return self._extend("text", text)

    def _extend(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._start({"type": kind})
        assert self._open is not None
        self._open[kind] += text
        delta_type = "thinking_delta" if kind == "thinking" else "text_delta"
        events.append(self._delta({"type": delta_type, kind: text}))
        return events

    def _start(self, block: dict[str, Any]) -> list[Event]:
        kind = block["type"]
        if kind == "text":
            block["text"] = ""
        elif kind == "thinking":
            # Anthropic signs thinking for its own multi-turn checks; nothing signs it here.
            block.update(thinking="", signature="")
        else:
            block["input"] = {}
            self._arguments = ""
        self._open = block
        start = {"type": "content_block_start", "index": len(self.blocks), "content_block": block}
        return [("content_block_start", json.loads(json.dumps(start)))]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": len(self.blocks), "delta": delta},
        )

    def _close(self) -> list[Event]:
        block = self._open
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = _arguments_object(self._arguments)
        self._open = None
        self.blocks.append(block)
        index = len(self.blocks) - 1
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]


def _arguments_object(text: str) -> dict[str, Any]:
    """The call's arguments; {} when the output ended before the JSON closed (max_tokens)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_id(call_id: str) -> str:
    """Anthropic's id style for a call id of the chat pipeline (call_<hex>)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason_of(
    finish_reason: str | None, stop_reason: object, has_tool_use: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_tool_use:
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None
