"""Tool-call parsers for `tool_choice: "auto"` (`--tool-call-parser`), streamed or at once.

Owns the parsers that find tool calls in a model's free text, each fed the content
as it streams and returning (content delta, tool calls completed by this delta):
- `hermes` (Hermes, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, text around them is content. A partial `<tool_call>` at the end
  of a delta is held back until it is known to be (or not to be) the tag.
- `llama3_json` (Llama 3.x): the whole output is one or more JSON objects
  `{"name": ..., "parameters": {...}}` separated by `;` (optionally after
  `<|python_tag|>`); an output that does not start with `{` is content.
A call whose JSON does not parse stays in the content: nothing is lost or invented.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_tool_call_id()


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_from_json(obj, arguments_keys=("arguments", "parameters")) -> ParsedToolCall | None:
    """A call from {"name": str, "arguments"|"parameters": object}; None if not that shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Base: feed(delta) -> (content delta, completed calls); finish() -> the same for
    what is left when the output ends."""

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self._buffer += delta
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(self.END)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(self.END) :]
                self._in_call = False
                call = self._parse(body)
                if call is None:
                    content.append(self.START + body + self.END)
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(self.START)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.START) :]
                self._in_call = True
                continue
            keep = _partial_prefix_len(self._buffer, self.START)
            content.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        call = self._parse(rest)  # the output ended before </tool_call>
        return ("", [call]) if call is not None else (self.START + rest, [])

    @staticmethod
    def _parse(body: str) -> ParsedToolCall | None:
        try:
            return tool_call_from_json(json.loads(body.strip()))
        except ValueError:
            return None


class Llama3JsonToolParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "content" or "calls"

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self._buffer += delta
        if self._mode is None:
            head = self._buffer.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
                return "", []  # undecided yet
            self._mode = "calls" if head.startswith(("{", self.PYTHON_TAG)) else "content"
        if self._mode == "content":
            out, self._buffer = self._buffer, ""
            return out, []
        return "", []  # calls are parsed whole at the end

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        text, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return text, []
        calls = self._parse_all(text.strip().removeprefix(self.PYTHON_TAG))
        return ("", calls) if calls else (text, [])

    @staticmethod
    def _parse_all(text: str) -> list[ParsedToolCall]:
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(text):
            while position < len(text) and text[position] in " \t\r\n;":
                position += 1
            if position == len(text):
                break
            try:
                obj, position = decoder.raw_decode(text, position)
            except ValueError:
                return []
            call = tool_call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                return []
            calls.append(call)
        return calls


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def make_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"tool call parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}"
        ) from None


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest proper prefix of tag that text ends with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
