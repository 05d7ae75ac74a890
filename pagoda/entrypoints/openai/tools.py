"""Tool calling for /v1/chat/completions: what a request's tools and tool_choice mean.

Owns `plan_tools(req, ...) -> ToolPlan` (the checks, 400 on the first problem)
and `ToolCallOutput`, which turns one choice's content into OpenAI tool calls, whole
or as streamed deltas. The modes, as vLLM has them:
- "none": the tools go to the chat template, the output is plain content;
- "auto" (the default when tools are given): the parser finds calls in free text;
  on with --enable-auto-tool-choice and --tool-call-parser, or without them when the
  chat template renders tools in a format a parser reads; a template that drops the
  tools serves it as "none" (tool_template.py);
- "required": a grammar makes the output a JSON array of {"name", "parameters"}
  objects, each the parameters schema of one of the tools (one call at most when
  parallel_tool_calls is false);
- a named function: a grammar makes the output that tool's arguments object.
So required and named calls always parse against the tool's parameters schema.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from pagoda.entrypoints.openai.errors import bad_request
from pagoda.entrypoints.openai.tool_parsers import (
    ParsedToolCall,
    ToolParser,
    make_tool_parser,
    tool_call_from_json,
)
from pagoda.entrypoints.openai.tool_template import FLAGS_HINT
from pagoda.structured.params import StructuredOutputsParams


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict] = field(default_factory=list)  # the request's tools, checked
    named: str | None = None
    parser: str | None = None  # the tool-call parser for "auto"
    parallel: bool = True
    warning: str | None = None  # said in x-pagoda-warning (tools the template drops)

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.named))
        if self.mode == "required":
            return StructuredOutputsParams(json=self._required_schema())
        return None

    def _parameters(self, name: str) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def _required_schema(self) -> dict:
        """[{"name": <tool>, "parameters": <its schema>}, ...]; each tool's $defs are
        lifted to the root, where their "#/$defs/..." references point."""
        defs: dict[str, Any] = {}
        variants = []
        for tool in self.tools:
            name = tool["function"]["name"]
            params = copy.deepcopy(self._parameters(name))
            for key in ("$defs", "definitions"):
                for def_name, definition in (params.pop(key, None) or {}).items():
                    if defs.setdefault(def_name, definition) != definition:
                        raise bad_request(
                            f"tools define the schema {def_name!r} differently; "
                            "tool_choice 'required' needs one meaning per name",
                            param="tools",
                        )
            variants.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": params,
                    },
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def _check_tool(tool: Any, index: int) -> dict:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"{param}: only tools of type 'function' are supported", param="tools")
    function = tool.get("function")
    if (
        not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
        or not function["name"]
    ):
        raise bad_request(
            f"{param}.function must be an object with a non-empty name", param="tools"
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(
            f"{param}.function.parameters must be a JSON schema object", param="tools"
        )
    return tool


def plan_tools(
    req,
    enable_auto_tool_choice: bool,
    tool_call_parser: str | None,
    auto_refusal: str | None = None,
    auto_as_text: bool = False,
) -> ToolPlan:
    """The request's tool mode; 400 for tools or a tool_choice that cannot be honoured.
    auto_refusal: the message for "auto" while it is off (tool_template.py words it);
    auto_as_text: "auto" is served as "none" (a template that drops the tools)."""
    tools = [_check_tool(t, i) for i, t in enumerate(req.tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in names:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools",
                param="tool_choice",
            )
        return ToolPlan("named", tools, named=name, parallel=parallel)
    if choice not in ("none", "auto", "required"):
        raise bad_request(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
            param="tool_choice",
        )
    if choice != "none" and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "auto" and auto_as_text:
        return ToolPlan("none", tools, parallel=parallel)
    if choice == "auto" and not (enable_auto_tool_choice and tool_call_parser):
        raise bad_request(
            auto_refusal
            or f"tool_choice 'auto' needs the server started with {FLAGS_HINT}; "
            "tool_choice 'required' or a named function works without them",
            param="tool_choice",
        )
    return ToolPlan(
        choice, tools, parser=tool_call_parser if choice == "auto" else None, parallel=parallel
    )


class _ArrayElements:
    """Splits a streamed JSON array of objects into its elements' texts as each closes."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.current: list[str] | None = None

    def feed(self, text: str) -> list[str]:
        done = []
        for ch in text:
            if self.current is not None:
                self.current.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if ch == "{" and self.depth == 2:
                    self.current = ["{"]
            elif ch in "]}":
                self.depth -= 1
                if ch == "}" and self.depth == 1 and self.current is not None:
                    done.append("".join(self.current))
                    self.current = None
        return done


class ToolCallOutput:
    """One choice's content -> (content, tool call deltas), in the plan's mode."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[ParsedToolCall] = []
        self._parser: ToolParser | None = make_tool_parser(plan.parser) if plan.parser else None
        self._elements = _ArrayElements() if plan.mode == "required" else None
        self._named_call: ParsedToolCall | None = None

    def feed(self, content: str) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "named":
            return "", self._feed_named(content)
        if mode == "required":
            calls = []
            for element in self._elements.feed(content):
                call = _required_call(element)
                if call is not None:
                    calls.append(call)
            return "", self._record(calls)
        if self._parser is not None:
            text, calls = self._parser.feed(content)
            return text, self._record(calls)
        return content, []

    def finish(self) -> tuple[str, list[dict]]:
        if self._parser is not None:
            text, calls = self._parser.finish()
            return text, self._record(calls)
        return "", []

    def _feed_named(self, content: str) -> list[dict]:
        if not content:
            return []
        if self._named_call is None:
            self._named_call = ParsedToolCall(self.plan.named, "")
            self.calls.append(self._named_call)
            self._named_call.arguments = content
            return [
                {
                    "index": 0,
                    "id": self._named_call.id,
                    "type": "function",
                    "function": {"name": self.plan.named, "arguments": content},
                }
            ]
        self._named_call.arguments += content
        return [{"index": 0, "function": {"arguments": content}}]

    def _record(self, calls: list[ParsedToolCall]) -> list[dict]:
        deltas = []
        for call in calls:
            deltas.append(
                {
                    "index": len(self.calls),
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
            self.calls.append(call)
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools of its own choice (auto,
        required); a named function's call ends with "stop"."""
        if reason == "stop" and self.calls and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def _required_call(element: str) -> ParsedToolCall | None:
    try:
        return tool_call_from_json(json.loads(element), ("parameters",))
    except ValueError:
        return None


def tool_calls_json(calls: list[ParsedToolCall]) -> list[dict]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
