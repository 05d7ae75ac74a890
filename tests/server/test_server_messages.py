"""Anthropic's Messages API (`POST /v1/messages`) on a real `pagoda serve`, through the
official `anthropic` client: create and stream (text_stream, raw SSE events in
Anthropic's order), stop_sequences and max_tokens stops, tool_use blocks from
tool_choice any / tool that always validate against input_schema, a tool_result turn,
thinking blocks with a budget, errors in Anthropic's shape with their status codes,
the API key as x-api-key or Bearer, and the route's requests in /metrics. A few
checks of the translation that need no server come first.

Most tests use the session's server (the embedded SmolLM2, an API key); tools and
thinking run on a second one with a tokenizer copy that has <think> tags and a
template that renders tools (think_tokenizer.py) and --reasoning-parser qwen3.
"""

from __future__ import annotations

import json
import pathlib
import sys

import anthropic
import httpx
import jsonschema
import pytest
from helpers.server_harness import API_KEY as KEY
from helpers.server_harness import launch_server, metric_value

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from helpers.think_tokenizer import make_think_tokenizer  # noqa: E402

from pagoda.entrypoints.anthropic.blocks import MessageBlocks  # noqa: E402
from pagoda.entrypoints.anthropic.errors import error_event  # noqa: E402
from pagoda.entrypoints.anthropic.protocol import MessagesRequest  # noqa: E402
from pagoda.entrypoints.anthropic.translate import to_chat_request  # noqa: E402
from pagoda.entrypoints.openai.errors import APIError  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"name": "get_weather", "description": "weather now", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
GREEDY = {"temperature": 0}


# ----------------------------------------------------------------------------- no server


def _translate(has_reasoning_parser: bool = False, **fields):
    fields.setdefault("messages", ASK)
    request = MessagesRequest(model=MODEL, max_tokens=16, **fields)
    return to_chat_request(request, has_reasoning_parser)


def test_translation_maps_turns_tools_and_choice():
    chat, ignored = _translate(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_time",
                        "input": {"zone": "UTC"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"},
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        metadata={"user_id": "u"},
    )
    roles = [(m.role, m.content) for m in chat.messages]
    assert roles == [
        ("system", "Be brief."),
        ("user", "Weather?"),
        ("assistant", "Checking."),
        ("tool", "12:00"),
        ("user", "And now?"),
    ]
    call = chat.messages[2].tool_calls[0]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"zone": "UTC"}
    assert chat.messages[3].tool_call_id == "toolu_1"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0]["function"]["parameters"] == WEATHER
    assert ignored == ["cache_control", "metadata"]
    named, _ = _translate(tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    assert named.tool_choice == {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "--reasoning-parser"),
        ({"container": "c", "mcp_servers": []}, "'container', 'mcp_servers'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]: image blocks are not supported",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, "server tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Red"}]}, "prefill"),
    ],
)
def test_translation_refuses_with_the_reason(fields, words):
    with pytest.raises(APIError) as info:
        _translate(**fields)
    assert info.value.status_code == 400 and words in info.value.message


def test_blocks_hold_whitespace_before_a_call_and_parse_its_input():
    blocks = MessageBlocks()
    events = blocks.feed({"content": "\n"})
    call = {"index": 0, "id": "call_1", "function": {"name": "get_time", "arguments": '{"zone"'}}
    events += blocks.feed({"tool_calls": [call]})
    events += blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": ': "UTC"}'}}]})
    events += blocks.finish()
    assert [name for name, _ in events] == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
    ]
    assert blocks.blocks == [
        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}
    ]


def test_a_failed_stream_ends_with_an_error_event():
    event = error_event(APIError(503, "the server is shutting down", code="server_draining"))
    name, data = event.strip().split("\n")
    assert name == "event: error"
    assert json.loads(data[len("data: ") :]) == {
        "type": "error",
        "error": {
            "type": "overloaded_error",
            "message": "the server is shutting down",
            "param": None,
            "code": "server_draining",
        },
    }


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(main_server):
    return main_server


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=120.0, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def parser_client(tmp_path_factory):
    """A client of a second server: --reasoning-parser, a template that renders tools (so
    tool requests leave the session server's logged-once tool warning to its own tests),
    no API key."""
    tokenizer = make_think_tokenizer(tmp_path_factory.mktemp("think-tokenizer"))
    server = launch_server(
        "--max-model-len",
        "512",
        "--tokenizer",
        str(tokenizer),
        "--reasoning-parser",
        "qwen3",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    )
    try:
        with anthropic.Anthropic(
            base_url=server.url, api_key="none", timeout=120.0, max_retries=0
        ) as c:
            yield c
    finally:
        server.stop()


def create(client, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 8)
    # Sampling fields through extra_body: recent clients no longer take them as arguments.
    kwargs["extra_body"] = {"temperature": 0, **kwargs.get("extra_body", {})}
    return client.messages.create(model=MODEL, **kwargs)


def test_create_shape_and_usage(server, client):
    out = create(client)
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant"
    assert out.model == MODEL
    assert [block.type for block in out.content] == ["text"] and out.content[0].text
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert out.usage.output_tokens == 8
    count = httpx.post(
        f"{server.url}/tokenize", json={"messages": ASK}, headers=server.headers
    ).json()["count"]
    assert out.usage.input_tokens == count
    raw = client.messages.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=1, metadata={"user_id": "u"}
    )
    assert raw.headers["x-pagoda-ignored-fields"] == "metadata"


def _sse_events(server, body: dict) -> list[tuple[str, dict]]:
    events = []
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_stream_equals_create_and_events_come_in_order(server, client):
    whole = create(client, max_tokens=32)
    with client.messages.stream(
        model=MODEL, messages=ASK, max_tokens=32, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    # The answer ends before the limit: the end of turn, its token counted.
    assert whole.stop_reason == final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens < 32
    body = {"model": MODEL, "messages": ASK, "max_tokens": 32, "temperature": 0, "stream": True}
    events = _sse_events(server, body)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == text
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_stop_sequence_ends_the_message(client):
    text = create(client, max_tokens=24).content[0].text
    word = text.split()[2]
    prefix = text[: text.index(word)]
    out = create(client, max_tokens=24, stop_sequences=[word])
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", word)
    assert out.content[0].text == prefix
    with client.messages.stream(
        model=MODEL, messages=ASK, max_tokens=24, extra_body=GREEDY, stop_sequences=[word]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)


@pytest.mark.parametrize(
    "tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}], ids=["any", "tool"]
)
def test_tool_use_blocks_validate(parser_client, tool_choice):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(messages=ask, max_tokens=64, tools=TOOLS, tool_choice=tool_choice)
    out = create(parser_client, **kwargs)
    uses = [block for block in out.content if block.type == "tool_use"]
    assert uses and out.stop_reason == "tool_use"
    for use in uses:
        assert use.id.startswith("toolu_")
        jsonschema.validate(use.input, SCHEMA_OF[use.name])
    if tool_choice["type"] == "tool":
        assert [use.name for use in uses] == ["get_time"]
    with parser_client.messages.stream(model=MODEL, extra_body=GREEDY, **kwargs) as stream:
        final = stream.get_final_message()
    streamed = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert streamed == [(use.name, use.input) for use in uses]
    assert final.stop_reason == "tool_use"


def test_tool_result_turn_is_rendered(server, client):
    turns = [
        {"role": "user", "content": "What time is it in UTC?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_7", "name": "get_time", "input": {"zone": "UTC"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_7", "content": "12:00"}],
        },
    ]
    out = create(client, messages=turns)
    assert out.content[0].type == "text" and out.stop_reason in ("max_tokens", "end_turn")
    chat = [
        turns[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "toolu_7",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "toolu_7"},
    ]
    count = httpx.post(
        f"{server.url}/tokenize", json={"messages": chat}, headers=server.headers
    ).json()["count"]
    assert out.usage.input_tokens == count  # rendered as the chat route renders it


def test_thinking_blocks_with_a_budget(parser_client):
    ask = [{"role": "user", "content": "Hello"}]
    kwargs = dict(messages=ask, max_tokens=12, thinking={"type": "enabled", "budget_tokens": 5})
    out = create(parser_client, **kwargs)
    assert [block.type for block in out.content] == ["thinking", "text"]
    assert out.content[0].thinking and out.content[1].text
    with parser_client.messages.stream(model=MODEL, extra_body=GREEDY, **kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in out.content]


def test_thinking_needs_a_reasoning_parser(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, thinking={"type": "enabled", "budget_tokens": 4})
    assert "--reasoning-parser" in info.value.body["error"]["message"]


def test_errors_are_anthropic_shaped(server, client):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, extra_body={"container": "c"})
    assert "'container'" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-x", messages=ASK, max_tokens=4)
    assert info.value.body["error"]["type"] == "not_found_error"
    missing = httpx.post(
        f"{server.url}/v1/messages", json={"model": MODEL, "messages": ASK}, headers=server.headers
    )
    assert missing.status_code == 400
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]


def test_api_key_as_x_api_key_or_bearer(server):
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as info:
            create(bad, max_tokens=1)
    assert info.value.body["error"]["type"] == "authentication_error"
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1}
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        headers["anthropic-version"] = "2023-06-01"
        response = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_route_is_counted_in_metrics(server, client):
    def metrics() -> str:
        return httpx.get(f"{server.url}/metrics", headers=server.headers).text

    before = metrics()
    create(client, max_tokens=2)
    with pytest.raises(anthropic.BadRequestError):
        create(client, extra_body={"container": "c"})
    after = metrics()
    length = 'finished_reason="length"'
    rejected = 'status="400"'
    assert metric_value(after, "pagoda:request_success_total", length) == (
        metric_value(before, "pagoda:request_success_total", length) + 1
    )
    assert metric_value(after, "pagoda:http_rejected_requests_total", rejected) == (
        metric_value(before, "pagoda:http_rejected_requests_total", rejected) + 1
    )
