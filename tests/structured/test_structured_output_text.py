"""The API side of structured output, without a model: reasoning_content split (tags
printed or skipped, streamed in any pieces), tool-call parsers (hermes, llama3_json,
streamed and whole), tool_choice plans and their grammars, and ChatChoiceOutput."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagoda.entrypoints.openai.chat_output import ChatChoiceOutput
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser
from pagoda.entrypoints.openai.tools import ToolCallOutput, _ArrayElements, plan_tools
from pagoda.structured.reasoning import ReasoningTokens, get_reasoning_parser
from pagoda.structured.reasoning_text import ReasoningSplitter, split_reasoning

# A toy vocabulary: id -> text; 8 and 9 are the tags.
VOCAB = {8: "<think>", 9: "</think>", 1: "Let", 2: " me", 3: " think", 4: "Yes", 5: ".", 6: "\n"}


def decoder(skip_tags: bool):
    def decode(ids):
        return "".join("" if skip_tags and i in (8, 9) else VOCAB[i] for i in ids)

    return decode


def tokens(name: str) -> ReasoningTokens:
    return ReasoningTokens(get_reasoning_parser(name), 8, 9, (9,))


def stream(
    splitter: ReasoningSplitter, ids: list[int], pieces: list[int], decode
) -> tuple[str, str]:
    """Feeds ids in pieces of the given sizes (text as the detokenizer would send it)."""
    reasoning, content, start = [], [], 0
    for size in pieces:
        chunk = ids[start : start + size]
        r, c = splitter.feed(decode(chunk), chunk)
        reasoning.append(r)
        content.append(c)
        start += size
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("skip_tags", [False, True])
@pytest.mark.parametrize("pieces", [[7], [1] * 7, [2, 3, 2], [4, 3]])
def test_qwen3_split_streamed_equals_whole(skip_tags, pieces):
    ids = [8, 1, 2, 3, 9, 4, 5]
    decode = decoder(skip_tags)
    whole = split_reasoning(tokens("qwen3"), [], decode, decode(ids), ids)
    assert whole == ("Let me think", "Yes.")
    assert stream(ReasoningSplitter(tokens("qwen3"), [], decode), ids, pieces, decode) == whole


def test_qwen3_without_thinking_is_all_content():
    decode = decoder(False)
    assert split_reasoning(tokens("qwen3"), [], decode, "Yes.", [4, 5]) == (None, "Yes.")


def test_deepseek_r1_thinks_from_the_start_and_may_never_stop():
    decode = decoder(False)
    assert split_reasoning(tokens("deepseek_r1"), [], decode, "Let me", [1, 2]) == ("Let me", "")
    assert split_reasoning(tokens("deepseek_r1"), [], decode, "Let</think>Yes", [1, 9, 4]) == (
        "Let",
        "Yes",
    )
    # A prompt that closed the section (thinking disabled): all content.
    assert split_reasoning(tokens("deepseek_r1"), [8, 6, 9], decode, "Yes", [4]) == (None, "Yes")


def test_text_lagging_its_tokens_holds_a_partial_tag_back():
    """A stop string's hold-back can send the end tag's id before all of its text."""
    splitter = ReasoningSplitter(tokens("deepseek_r1"), [], decoder(False))
    assert splitter.feed("Let</th", [1, 9]) == ("Let", "")
    assert splitter.feed("ink>Yes", [4]) == ("", "Yes")


# ---- tool parsers ------------------------------------------------------------------------

HERMES_TEXT = (
    'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done'
)


def run_parser(parser, text: str, size: int):
    content, calls = [], []
    for i in range(0, len(text), size):
        c, found = parser.feed(text[i : i + size])
        content.append(c)
        calls += found
    c, found = parser.finish()
    calls += found
    return "".join(content) + c, [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("size", [1, 3, 7, len(HERMES_TEXT)])
def test_hermes_streamed_in_any_pieces(size):
    content, calls = run_parser(HermesToolParser(), HERMES_TEXT, size)
    assert content == "Sure.  done"
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_keeps_what_is_not_a_call():
    assert run_parser(HermesToolParser(), "a <tool_call>{broken</tool_call> b", 4) == (
        "a <tool_call>{broken</tool_call> b",
        [],
    )
    assert run_parser(HermesToolParser(), "1 < 2 and <tool", 2) == ("1 < 2 and <tool", [])
    # The output ended before the closing tag: the call is still whole JSON.
    assert run_parser(HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"x": 1}}', 5) == (
        "",
        [("f", {"x": 1})],
    )


@pytest.mark.parametrize(
    "text,expected",
    [
        ('{"name": "f", "parameters": {"a": 1}}', ("", [("f", {"a": 1})])),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "x"}}',
            ("", [("f", {}), ("g", {"b": "x"})]),
        ),
        ("The answer is 4.", ("The answer is 4.", [])),
        ('{"not": "a call"}', ('{"not": "a call"}', [])),
    ],
)
def test_llama3_json(text, expected):
    assert run_parser(Llama3JsonToolParser(), text, 4) == expected


def test_array_elements_split_on_closing_objects_only():
    text = '[{"name": "f", "parameters": {"s": "}{\\"]"}}, {"name": "g", "parameters": {}}]'
    splitter = _ArrayElements()
    elements = [e for ch in text for e in splitter.feed(ch)]
    assert [json.loads(e)["name"] for e in elements] == ["f", "g"]
    assert json.loads(elements[0])["parameters"] == {"s": '}{"]'}


# ---- plans -------------------------------------------------------------------------------


def tool(name: str, parameters=None) -> dict:
    function = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def request(tools=None, tool_choice=None, parallel=None):
    return SimpleNamespace(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel)


@pytest.mark.parametrize(
    "req,message",
    [
        (request([tool("f")]), "needs the server started with --enable-auto-tool-choice"),
        (request([tool("f")], {"type": "function", "function": {"name": "g"}}), "not in tools"),
        (request(None, "required"), "needs tools"),
        (request([tool("f"), tool("f")], "required"), "distinct function names"),
        (request([{"type": "retrieval"}], "required"), "only tools of type 'function'"),
        (request([tool("f", parameters=[1])], "required"), "must be a JSON schema object"),
        (request([tool("f")], "sometimes"), "tool_choice must be"),
    ],
)
def test_plans_refuse_what_cannot_be_honoured(req, message):
    with pytest.raises(APIError) as info:
        plan_tools(req, enable_auto_tool_choice=False, tool_call_parser=None)
    assert info.value.status_code == 400 and message in str(info.value.body())


def test_plans_and_their_grammars():
    point = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "$defs": {"P": {"type": "integer"}},
    }
    plan = plan_tools(
        request([tool("f", point), tool("g")], "required", parallel=False), False, None
    )
    schema = plan.structured_outputs().json
    assert schema["maxItems"] == 1 and schema["$defs"] == {"P": {"type": "integer"}}
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["enum"] for v in variants] == [["f"], ["g"]]
    assert "$defs" not in variants[0]["properties"]["parameters"]
    named = plan_tools(
        request([tool("f", point)], {"type": "function", "function": {"name": "f"}}), False, None
    )
    assert named.mode == "named" and named.structured_outputs().json == point
    assert plan_tools(request([tool("f")], "none"), False, None).structured_outputs() is None
    auto = plan_tools(request([tool("f")]), True, "hermes")
    assert auto.mode == "auto" and auto.parser == "hermes"
    assert plan_tools(request(), False, None).mode == "none"


def test_named_call_streams_its_arguments():
    plan = plan_tools(
        request([tool("f")], {"type": "function", "function": {"name": "f"}}), False, None
    )
    output = ToolCallOutput(plan)
    deltas = [d for piece in ('{"a"', ": 1", "}") for d in output.feed(piece)[1]]
    assert deltas[0]["function"] == {"name": "f", "arguments": '{"a"'} and deltas[0]["id"]
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"a": 1}'
    assert [d["index"] for d in deltas] == [0, 0, 0]
    assert output.finish_reason("stop") == "stop"


def test_chat_choice_output_with_reasoning_and_tools():
    plan = plan_tools(request([tool("f")]), True, "hermes")
    decode = decoder(True)
    out = ChatChoiceOutput(tokens("qwen3"), [], decode, plan)
    ids = [8, 1, 9]
    deltas = [
        out.delta(decode(ids[:2]), ids[:2], False),
        out.delta(decode(ids[2:]), ids[2:], False),
    ]
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    deltas.append(out.delta(call, [4], True))
    assert deltas[0] == {"reasoning_content": "Let"}
    assert deltas[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    message = out.message()
    assert message["content"] is None and message["reasoning_content"] == "Let"
    assert message["tool_calls"][0]["function"]["name"] == "f"
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
