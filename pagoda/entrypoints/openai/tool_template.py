"""What a model's chat template does with tools, found by rendering it once.

Owns `probe_template(render)`, which answers two questions with a few renders of a
made-up conversation:
- does the template show the tools to the model? (the prompt with a probe tool
  differs from the prompt without it; SmolLM2's template drops `tools`, Qwen2.5/Qwen3,
  Llama 3.1+ and Hermes-style templates render them);
- how does it write a tool call in an assistant turn? `<tool_call>` tags are the
  Hermes/Qwen format (parser `hermes`), a bare `{"name": ..., "parameters": ...}`
  object is Llama 3's (parser `llama3_json`). A model writes calls the way its
  template does, so that parser reads its calls.
and `resolve_auto_tool_choice(...)`, which decides what `tool_choice: "auto"` (the
OpenAI default with tools) does: with vLLM's `--enable-auto-tool-choice
--tool-call-parser NAME`, that parser; else a template that drops tools answers
"auto" as plain text (the model never sees the tools; the response carries
x-pagoda-warning), and one that renders them gets --tool-call-parser's parser or the
parser of the format it writes, or, when no parser reads that format, a 400 that
says which flag to add.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# The response header that says what the client should know about how its request
# was served: here, that the chat template does not show the model its tools.
WARNING_HEADER = "x-pagoda-warning"

PROBE_NAME = "pagoda_probe_tool"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "A tool that shows whether the chat template renders tools.",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer", "description": "a number"}},
        },
    },
}
_ASK = {"role": "user", "content": "Call the tool."}
_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "call_probe",
            "type": "function",
            "function": {"name": PROBE_NAME, "arguments": {"x": 1}},
        }
    ],
}
_LLAMA3_CALL = re.compile(r'\{\s*"name"\s*:\s*"' + PROBE_NAME + r'"\s*,\s*"parameters"\s*:')

FLAGS_HINT = (
    "--enable-auto-tool-choice --tool-call-parser hermes (Hermes and Qwen templates) "
    "or --tool-call-parser llama3_json (Llama 3.1+ templates)"
)

# render(messages, tools, add_generation_prompt) -> the prompt's text.
Render = Callable[[list[dict], list[dict] | None, bool], str]


@dataclass(frozen=True)
class TemplateToolSupport:
    renders_tools: bool  # the prompt changes when tools are given
    call_parser: str | None  # the parser of the call format the template writes


@dataclass(frozen=True)
class AutoToolChoice:
    parser: str | None  # the parser that finds calls in the output; None: no calls
    source: str  # why: "flags", "chat template", or what is missing
    refusal: str | None = None  # the 400's message while "auto" is refused

    @property
    def answers_as_text(self) -> bool:
        """Whether "auto" is served as plain text: the template drops the tools, so the model
        cannot call one (the response says so in x-pagoda-warning)."""
        return self.parser is None and self.refusal is None


def probe_template(render: Render) -> TemplateToolSupport:
    """Renders the probe conversation with and without a tool, then with a call; a
    template that cannot render it (no template, one that raises) counts as one
    without tools. The call's format is read only in what the call's turn adds: a
    template's instructions may quote another format."""
    try:
        renders_tools = render([_ASK], [_PROBE_TOOL], True) != render([_ASK], None, True)
    except Exception as exc:  # Jinja raises its own errors (e.g. raise_exception)
        logger.debug("chat template probe without tool calls failed: %s", exc)
        return TemplateToolSupport(False, None)
    try:
        before = render([_ASK], [_PROBE_TOOL], False)
        text = render([_ASK, _CALL], [_PROBE_TOOL], False)
    except Exception as exc:  # some templates refuse a call id or format they do not know
        logger.debug("chat template probe with a tool call failed: %s", exc)
        return TemplateToolSupport(renders_tools, None)
    call_turn = text[len(os.path.commonprefix([before, text])) :]
    if "<tool_call>" in call_turn:
        parser = "hermes"
    elif _LLAMA3_CALL.search(call_turn):
        parser = "llama3_json"
    else:
        parser = None
    return TemplateToolSupport(renders_tools, parser)


def resolve_auto_tool_choice(
    enable_auto_tool_choice: bool, tool_call_parser: str | None, support: TemplateToolSupport
) -> AutoToolChoice:
    """tool_choice "auto": both flags' parser whatever the template does; for a template
    that drops tools, plain text (the model cannot call what it does not see); for one
    that renders them, --tool-call-parser or else the parser of the format it writes;
    for one that writes calls in a format no parser reads, off with the 400's message."""
    if enable_auto_tool_choice and tool_call_parser:
        return AutoToolChoice(tool_call_parser, "flags")
    if not support.renders_tools:
        return AutoToolChoice(None, "the chat template does not render tools")
    if tool_call_parser is not None:
        return AutoToolChoice(tool_call_parser, "--tool-call-parser")
    if support.call_parser is not None:
        return AutoToolChoice(support.call_parser, "chat template")
    return AutoToolChoice(
        None,
        "no parser reads the chat template's tool-call format",
        "tool_choice 'auto' is off: this model's chat template shows the tools but writes "
        "calls in a format no tool-call parser is chosen for; start the server with "
        "--tool-call-parser hermes or llama3_json if the model writes calls that way, or "
        "use tool_choice 'required' or a named function (a grammar makes the call)",
    )


def unrendered_tools_warning() -> str:
    """The x-pagoda-warning text of a request whose tools the template drops (ASCII)."""
    return (
        "this model's chat template does not render tools, so the model does not see "
        "them: tool_choice 'auto' answers in plain text; 'required' or a named function "
        "still makes a valid call through a grammar"
    )
