"""What the server does with `tools` according to the model's chat template.

The probe (tool_template.py) on real templates rendered by the embedded tokenizer:
SmolLM2's own drops tools; a Qwen/Hermes-style one renders them with `<tool_call>`
calls (parser hermes), a Llama 3.1-style one with bare JSON calls (llama3_json), a
Mistral-style one in a format no parser reads. Then through real servers: the
default server (SmolLM2) serves a request with tools, tool_choice 'auto' included,
with an `x-pagoda-warning` header and one log line; --strict-tool-template answers
400; a server given a Hermes-style template turns 'auto' on by itself and parses the
calls.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers.server_harness import launch_server

from pagoda.entrypoints.openai.tool_template import (
    TemplateToolSupport,
    probe_template,
    resolve_auto_tool_choice,
)

CHAT = "/v1/chat/completions"
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather now",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}},
                "required": ["city"],
            },
        },
    }
]

_TURNS = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """{%- if tools %}<|im_start|>system
Functions: {{ tools | tojson }}<|im_end|>
{% endif %}{%- for message in messages %}
{%- if message.tool_calls %}{%- set call = message.tool_calls[0].function %}<|im_start|>assistant
{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Its instructions quote the Hermes format; its calls are written in another.
MISTRAL_TEMPLATE = """{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }} (no <tool_call> tags)
[/AVAILABLE_TOOLS]
{%- endif %}{%- for message in messages %}
{%- if message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}
{%- else %}[INST]{{ message.content }}[/INST]{% endif %}{%- endfor %}"""

RAISING_TEMPLATE = """{{ raise_exception('only user turns') }}"""


def _probe(tokenizer, template):
    from pagoda.model.tokenizer import apply_chat_template

    def render(messages, tools, add_generation_prompt):
        ids = apply_chat_template(tokenizer, messages, add_generation_prompt, template, None, tools)
        return tokenizer.decode(ids, skip_special_tokens=False)

    return probe_template(render)


@pytest.mark.parametrize(
    "template, renders, parser",
    [
        (None, False, None),  # SmolLM2-135M-Instruct's own template
        (_TURNS, False, None),
        (HERMES_TEMPLATE, True, "hermes"),
        (LLAMA3_TEMPLATE, True, "llama3_json"),
        (MISTRAL_TEMPLATE, True, None),
        (RAISING_TEMPLATE, False, None),
    ],
)
def test_probe_finds_whether_tools_render_and_the_call_format(tokenizer, template, renders, parser):
    assert _probe(tokenizer, template) == TemplateToolSupport(renders, parser)


@pytest.mark.parametrize(
    "enable, flag_parser, support, parser, as_text, refused",
    [
        (True, "llama3_json", TemplateToolSupport(True, "hermes"), "llama3_json", False, False),
        (False, None, TemplateToolSupport(True, "hermes"), "hermes", False, False),
        (False, None, TemplateToolSupport(False, None), None, True, False),
        (False, None, TemplateToolSupport(True, None), None, False, True),
        (False, "llama3_json", TemplateToolSupport(True, None), "llama3_json", False, False),
        (False, "hermes", TemplateToolSupport(False, None), None, True, False),
        (True, "hermes", TemplateToolSupport(False, None), "hermes", False, False),
    ],
)
def test_auto_tool_choice_resolution(enable, flag_parser, support, parser, as_text, refused):
    auto = resolve_auto_tool_choice(enable, flag_parser, support)
    assert auto.parser == parser
    assert auto.answers_as_text is as_text
    assert (auto.refusal is not None) is refused
    if refused:
        assert "--tool-call-parser hermes or llama3_json" in auto.refusal


# The default server (SmolLM2's template drops tools): tests/server/conftest.py.


def _warning(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers["x-pagoda-warning"]


def test_tools_the_template_drops_are_served_with_a_warning(http, main_server):
    plain = http.post(CHAT, json={"messages": WEATHER_ASK, "max_tokens": 4, "temperature": 0})
    assert plain.status_code == 200 and "x-pagoda-warning" not in plain.headers
    # The OpenAI default: tools without tool_choice is 'auto'.
    body = {"messages": WEATHER_ASK, "tools": TOOLS, "max_tokens": 4, "temperature": 0}
    auto = http.post(CHAT, json=body)
    warning = _warning(auto)
    assert "does not render tools" in warning and "'auto' answers in plain text" in warning
    choice = auto.json()["choices"][0]
    assert isinstance(choice["message"]["content"], str) and not choice["message"]["tool_calls"]
    # The template drops them: the prompt is the same as without tools.
    assert auto.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    with http.stream("POST", CHAT, json={**body, "stream": True}) as stream:
        assert _warning(stream) == warning
        assert "data: [DONE]" in stream.read().decode()
    log = main_server.log_text()
    assert log.count("a request carries tools, but this model's chat template") == 1


def test_required_tool_choice_still_makes_a_valid_call_with_the_warning(http):
    body = {"messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 48}
    response = http.post(CHAT, json={**body, "temperature": 0})
    _warning(response)
    message = response.json()["choices"][0]["message"]
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)


@pytest.fixture(scope="module")
def strict_server():
    server = launch_server(
        "--max-model-len",
        "256",
        "--strict-tool-template",
        "--disable-uvicorn-access-log",
    )
    yield server
    server.stop()


def test_strict_tool_template_refuses_tools_the_template_drops(strict_server):
    with httpx.Client(base_url=strict_server.url, timeout=60) as client:
        refused = client.post(CHAT, json={"messages": WEATHER_ASK, "tools": TOOLS})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "tools" and "--strict-tool-template" in error["message"]
        assert "does not render tools" in error["message"]
        served = client.post(CHAT, json={"messages": WEATHER_ASK, "max_tokens": 2})
        assert served.status_code == 200 and "x-pagoda-warning" not in served.headers
    assert (
        "tool calling: the chat template drops tools: requests with tools get a 400 "
        "(--strict-tool-template)" in strict_server.log_text()
    )


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("hermes-template") / "template.jinja"
    template.write_text(HERMES_TEMPLATE)
    server = launch_server(
        "--max-model-len",
        "512",
        "--chat-template",
        str(template),
        "--disable-uvicorn-access-log",
    )
    yield server
    server.stop()


def test_auto_tool_choice_is_on_when_the_template_shows_a_parser(hermes_server):
    log = hermes_server.log_text()
    assert (
        "tool calling: the chat template renders tools; tool_choice 'auto' on, parser hermes "
        "(chosen from the chat template)" in log
    )
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    with openai.OpenAI(
        base_url=f"{hermes_server.url}/v1", api_key="none", timeout=120.0, max_retries=0
    ) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct",
            messages=WEATHER_ASK,
            tools=TOOLS,  # no tool_choice: 'auto', with no flag on the command line
            max_tokens=48,
            temperature=0,
            extra_body={"structured_outputs": {"choice": [call]}},
        )
    assert "x-pagoda-warning" not in raw.headers
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [parsed] = choice.message.tool_calls
    assert parsed.function.name == "get_weather"
    assert json.loads(parsed.function.arguments) == {"city": "Paris"}
