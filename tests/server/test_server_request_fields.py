"""Request fields and bodies against a real `pagoda serve`: OpenAI platform fields are
accepted, ignored, logged once and listed in a response header; unsupported fields
that change generation stay 400; bodies that are not JSON get a 400 naming why;
chat_template_kwargs reach the chat template.
"""

from __future__ import annotations

import httpx
import pytest
from helpers.server_harness import launch_server

HI = [{"role": "user", "content": "hi"}]
HEADER = "x-pagoda-ignored-fields"


def _error(r: httpx.Response, status: int, param=None) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"
    assert body["param"] == param
    return body["message"]


def test_platform_fields_are_ignored_and_listed_in_a_header(http):
    fields = {
        "store": True,
        "metadata": {"run": "7"},
        "user": "u-1",
        "service_tier": "auto",
        "safety_identifier": "s",
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
    }
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == (
        "store, metadata, service_tier, user, safety_identifier, "
        "prompt_cache_key, prompt_cache_retention"
    )
    plain = http.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    )
    assert plain.status_code == 200 and HEADER not in plain.headers


def test_chat_stream_lists_ignored_fields_too(http):
    body = {
        "messages": HI,
        "max_tokens": 2,
        "stream": True,
        "store": False,
        "parallel_tool_calls": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers[HEADER] == "store, stream_options.include_obfuscation, parallel_tool_calls"
        assert "data: [DONE]" in r.read().decode()


def test_each_ignored_field_is_logged_once(http, main_server):
    for _ in range(2):
        r = http.post(
            "/v1/chat/completions",
            json={"messages": HI, "max_tokens": 1, "prompt_cache_key": "x", "metadata": None},
        )
        assert r.status_code == 200 and r.headers[HEADER] == "metadata, prompt_cache_key"
    with open(main_server.log.name, encoding="utf-8", errors="replace") as f:
        log = f.read()
    for name in ("prompt_cache_key", "metadata"):
        assert log.count(f"ignoring the request field {name!r}") == 1, log[-3000:]


@pytest.mark.parametrize(
    "route,extra,param",
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function"}], "parallel_tool_calls": True},
            "tools",
        ),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
        ("/v1/completions", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ],
)
def test_fields_that_change_generation_still_get_400(http, route, extra, param):
    body = {"messages": HI} if "chat" in route else {"prompt": "x"}
    _error(http.post(route, json={**body, "store": True, **extra}), 400, param)


def test_modalities_text_is_accepted(http):
    r = http.post(
        "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "modalities": ["text"]}
    )
    assert r.status_code == 200 and HEADER not in r.headers


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bodies_that_are_not_json_name_the_problem(http, route):
    as_json = {"content-type": "application/json"}
    message = _error(
        http.post(route, content=b'{"prompt": "x",\n  "max_tokens": 3,}', headers=as_json), 400
    )
    assert "not valid JSON" in message and "line 2 column 19 (char 34)" in message
    message = _error(
        http.post(
            route,
            content=b'{"prompt": "x"}',
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        400,
    )
    assert (
        "'application/x-www-form-urlencoded'" in message
        and "Content-Type: application/json" in message
    )
    assert "Content-Type is missing" in _error(http.post(route, content=b'{"prompt": "x"}'), 400)
    assert "body is empty" in _error(http.post(route, content=b"", headers=as_json), 400)
    assert "not an array" in _error(http.post(route, content=b"[1]", headers=as_json), 400)


def test_chat_template_kwargs_are_validated(http):
    chat = "/v1/chat/completions"
    _error(
        http.post(chat, json={"messages": HI, "chat_template_kwargs": [1]}),
        400,
        "chat_template_kwargs",
    )
    message = _error(
        http.post(chat, json={"messages": HI, "chat_template_kwargs": {"tokenize": True}}),
        400,
        "chat_template_kwargs",
    )
    assert "'tokenize'" in message
    _error(
        http.post(chat, json={"messages": HI, "chat_template_kwargs": {"a-b": 1}}),
        400,
        "chat_template_kwargs",
    )
    # The embedded template reads no extra variable: an unused one changes nothing.
    plain = http.post("/tokenize", json={"messages": HI}).json()
    unused = http.post("/tokenize", json={"messages": HI, "chat_template_kwargs": {"x": 1}}).json()
    assert plain == unused


# Reads `enable_thinking` as Qwen3's template does: false adds an empty think block.
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant:"
    "{%- if enable_thinking is defined and enable_thinking is false %} <think></think>{% endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def template_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(THINKING_TEMPLATE)
    server = launch_server(
        "--max-model-len",
        "256",
        "--chat-template",
        str(path),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    )
    yield server
    server.stop()


def test_chat_template_kwargs_reach_the_template(template_server, tokenizer):
    with httpx.Client(base_url=template_server.url, timeout=60) as http:

        def prompt_of(kwargs):
            body = {
                "messages": HI,
                **({"chat_template_kwargs": kwargs} if kwargs is not None else {}),
            }
            r = http.post("/tokenize", json=body)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        assert tokenizer.decode(prompt_of(None)) == "user: hi\nassistant:"
        assert tokenizer.decode(prompt_of({"enable_thinking": True})) == "user: hi\nassistant:"
        off = prompt_of({"enable_thinking": False})
        assert tokenizer.decode(off) == "user: hi\nassistant: <think></think>"
        r = http.post(
            "/v1/chat/completions",
            json={
                "messages": HI,
                "max_tokens": 1,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(off)
