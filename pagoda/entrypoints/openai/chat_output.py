"""One chat choice's output as OpenAI shapes it: reasoning_content, content, tool_calls.

Owns `ChatChoiceOutput`, fed each delta (text and token ids) of one choice: the
reasoning parser (if the server has one) splits the thinking from the answer, and
the answer goes through the request's tool mode (tools.ToolCallOutput). Streaming
takes `delta()` per output; a whole response feeds everything and takes `message()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagoda.entrypoints.openai.tools import ToolCallOutput, ToolPlan, tool_calls_json
from pagoda.structured.reasoning import ReasoningTokens
from pagoda.structured.reasoning_text import ReasoningSplitter


class ChatChoiceOutput:
    def __init__(
        self,
        reasoning: ReasoningTokens | None,
        prompt_token_ids: Sequence[int],
        decode: Callable[[list[int]], str],
        plan: ToolPlan | None,
    ) -> None:
        self.splitter = (
            ReasoningSplitter(reasoning, prompt_token_ids, decode)
            if reasoning is not None
            else None
        )
        self.tools = ToolCallOutput(plan) if plan is not None and plan.mode != "none" else None
        self.has_tools = plan is not None
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.finished = False

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict:
        """The chunk's delta for this output: any of reasoning_content, content, tool_calls."""
        if self.splitter is not None:
            reasoning, content = self.splitter.feed(text, token_ids)
        else:
            reasoning, content = "", text
        calls: list[dict] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                rest, more = self.tools.finish()
                content += rest
                calls += more
        self.finished = finished
        self.reasoning_parts.append(reasoning)
        self.content_parts.append(content)
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return self.tools.finish_reason(reason) if self.tools is not None else reason

    def message(self) -> dict:
        """The whole response's message, once every delta was fed."""
        content = "".join(self.content_parts)
        calls = self.tools.calls if self.tools is not None else []
        message: dict = {
            "role": "assistant",
            "content": None if calls and not content.strip() else content,
        }
        if self.splitter is not None:
            message["reasoning_content"] = (
                "".join(self.reasoning_parts) if self.splitter.thinking else None
            )
        if self.has_tools:
            message["tool_calls"] = tool_calls_json(calls)
        return message
