"""Structured output, tools and reasoning through a real `pagoda serve` and the official
`openai` client: response_format (json_schema, json_object) and vLLM's
structured_outputs, an uncompilable schema -> 400 with the compiler's reason, tool
calls (required and named always valid, streamed and not; none gives none; auto
through the hermes parser), reasoning_content apart from content with a thinking
budget that holds to the token, and the structured-output metrics.

The server runs the embedded SmolLM2 with a tokenizer copy that has <think> tags
(think_tokenizer.py) and --reasoning-parser qwen3: its template closes the thinking
section in the prompt unless enable_thinking is set, so outputs start in the answer.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import sys

import httpx
import jsonschema
import openai
import pytest
from helpers.server_harness import launch_server, metric_value

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from helpers.structured_schemas import SCHEMAS  # noqa: E402
from helpers.think_tokenizer import make_think_tokenizer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokenizer = make_think_tokenizer(tmp_path_factory.mktemp("think-tokenizer"))
    server = launch_server(
        "--max-model-len",
        "512",
        "--async-scheduling",
        "--max-num-seqs",
        "64",
        "--tokenizer",
        str(tokenizer),
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="none", timeout=300.0, max_retries=0
    ) as c:
        yield c


def chat(client, **kwargs):
    kwargs.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, **kwargs)


def test_json_schemas_validate_at_temperature_0_and_1(client):
    jobs = [(schema, t, seed) for seed, schema in enumerate(SCHEMAS[::3]) for t in (0.0, 1.0)]

    def run(job):
        schema, temperature, seed = job
        return chat(
            client,
            max_tokens=64,
            temperature=temperature,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema},
            },
        )

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (schema, _, _), result in zip(jobs, results):
        choice = result.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert choice.message.reasoning_content is None  # the prompt closed the thinking


def test_streamed_json_equals_whole(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[8]}}
    whole = (
        chat(client, max_tokens=64, temperature=0, response_format=fmt).choices[0].message.content
    )
    chunks = chat(client, max_tokens=64, temperature=0, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    jsonschema.validate(json.loads(whole), SCHEMAS[8])


def test_json_object_regex_and_choice(client):
    out = chat(
        client,
        messages=[{"role": "user", "content": "JSON with your name:"}],
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"  # a free-form object: this prompt's is short
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    regex = client.completions.create(
        model=MODEL,
        prompt="Code: ",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
    )
    text = regex.choices[0].text
    assert len(text) == 6 and text[:2].isupper() and text[2] == "-" and text[3:].isdigit()
    for temperature in (0.0, 1.0):
        picked = chat(
            client,
            max_tokens=8,
            temperature=temperature,
            seed=1,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        assert picked.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize(
    "extra,param,reason",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            },
            "response_format",
            'Unsupported type "nope"',
        ),
        (
            {"structured_outputs": {"regex": "a(b"}},
            "structured_outputs",
            "parenthesis is not closed",
        ),
        ({"structured_outputs": {"json": {"$ref": "#/$defs/gone"}}}, "structured_outputs", "gone"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "needs json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "set only one",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "set only one",
        ),
        ({"thinking_token_budget": -1}, "thinking_token_budget", ""),
    ],
)
def test_constraints_that_cannot_be_honoured_are_400(server, extra, param, reason):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and reason in error["message"]


def _check_calls(calls, allowed_names):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in allowed_names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def _streamed_calls(chunks):
    """Tool calls put back together from OpenAI-format deltas, and the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function.name:
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_calls_are_always_valid(client, seed):
    out = chat(
        client,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=96,
        temperature=1.0,
        seed=seed,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, SCHEMA_OF)
    calls, finish = _streamed_calls(
        chat(
            client,
            messages=WEATHER_ASK,
            tools=TOOLS,
            max_tokens=96,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            stream=True,
        )
    )
    assert finish == "tool_calls" and calls
    for call in calls:
        assert call["id"] and call["name"] in SCHEMA_OF
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA_OF[call["name"]])


def test_one_call_at_most_without_parallel_tool_calls(client):
    out = chat(
        client,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=96,
        temperature=1.0,
        seed=5,
        parallel_tool_calls=False,
    )
    assert len(out.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_named_tool_calls_are_always_valid(client, seed):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(
        client,
        messages=WEATHER_ASK,
        tools=TOOLS,
        tool_choice=named,
        max_tokens=64,
        temperature=1.0,
        seed=seed,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    _check_calls(choice.message.tool_calls, {"get_weather"})
    calls, finish = _streamed_calls(
        chat(
            client,
            messages=WEATHER_ASK,
            tools=TOOLS,
            tool_choice=named,
            max_tokens=64,
            temperature=1.0,
            seed=seed,
            stream=True,
        )
    )
    assert finish == "stop" and len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_tool_choice_none_makes_no_calls_but_tools_reach_the_template(client):
    out = chat(
        client, messages=WEATHER_ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    plain = chat(client, messages=WEATHER_ASK, max_tokens=8, temperature=0)
    message = out.choices[0].message
    assert message.tool_calls == [] and isinstance(message.content, str)
    assert out.choices[0].finish_reason in ("stop", "length")
    # The test template lists the tools' names: the prompt grew by their tokens.
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens


def test_auto_tool_choice_parses_hermes_calls(client):
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    force = {"structured_outputs": {"choice": [call]}}
    out = chat(
        client, messages=WEATHER_ASK, tools=TOOLS, max_tokens=48, temperature=0, extra_body=force
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ] == [("get_time", {"zone": "CET"})]
    calls, finish = _streamed_calls(
        chat(
            client,
            messages=WEATHER_ASK,
            tools=TOOLS,
            max_tokens=48,
            temperature=0,
            extra_body=force,
            stream=True,
        )
    )
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_time", '{"zone": "CET"}')
    ]


def test_thinking_budget_splits_reasoning_from_content(client):
    kwargs = dict(
        messages=[{"role": "user", "content": "Give me a JSON person."}],
        max_tokens=40,
        temperature=0,
        logprobs=True,
        extra_body={"thinking_token_budget": 5, "chat_template_kwargs": {"enable_thinking": True}},
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}},
    )
    out = chat(client, **kwargs)
    message = out.choices[0].message
    tokens = [t.token for t in out.choices[0].logprobs.content]
    assert "</think>" not in tokens[:5] and tokens[5] == "</think>"  # to the token
    assert message.reasoning_content  # the 5 thinking tokens, tags excluded
    jsonschema.validate(json.loads(message.content), SCHEMAS[0])
    kwargs.pop("logprobs")
    chunks = list(chat(client, stream=True, **kwargs))
    streamed_reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_reasoning, streamed_content) == (message.reasoning_content, message.content)


def test_reasoning_effort_is_a_budget(client):
    out = chat(
        client,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert out.choices[0].message.reasoning_content is not None  # it thinks (budget 512)
    assert out.choices[0].message.content == ""


def test_structured_output_metrics(server, client):
    chat(client, max_tokens=16, temperature=0, extra_body={"structured_outputs": {"choice": ["a"]}})
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric_value(text, "pagoda:structured_output_requests_total", 'kind="choice"') >= 1
    assert metric_value(text, "pagoda:grammar_compile_seconds_count") >= 1
    assert metric_value(text, "pagoda:grammar_bitmask_seconds_count") >= 1
