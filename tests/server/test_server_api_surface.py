"""What a client finds on a default server: the API docs pages off (their scripts come
from a CDN) while /openapi.json is served, a model's card at /v1/models/{id} with an
OpenAI-shaped 404 for an unknown id, and a one-sentence 400 for each content part the
model cannot read (an image, audio, a file) instead of pydantic's dump of the union.
With --enable-api-docs the pages are served, and a served name holding a slash (a
hub id) has its card too. And `from pagoda import StructuredOutputsParams`: the class
the server builds from a request's `structured_outputs`, importable without torch.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from helpers.server_harness import launch_server

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_are_off_by_default_and_say_how_to_turn_them_on(http, path):
    body = _error(http.get(path), 404)
    assert body["code"] == "api_docs_disabled"
    assert "--enable-api-docs" in body["message"] and "/openapi.json" in body["message"]


def test_openapi_schema_is_served_and_lists_the_model_route(http):
    schema = http.get("/openapi.json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert "/v1/models/{model_id}" in paths and "/docs" not in paths


def test_model_card_by_id_matches_the_list(http):
    listed = http.get("/v1/models").json()["data"][0]
    card = http.get(f"/v1/models/{MODEL}")
    assert card.status_code == 200
    card = card.json()
    assert card.pop("created") > 0 and listed.pop("created") > 0
    assert card == listed
    assert card == {
        "id": MODEL,
        "object": "model",
        "owned_by": "pagoda",
        "root": MODEL,
        "max_model_len": 512,
    }


def test_unknown_model_id_is_an_openai_404(http, main_server):
    body = _error(http.get("/v1/models/gpt-4o"), 404)
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert body["type"] == "not_found_error"
    assert "'gpt-4o'" in body["message"] and MODEL in body["message"]
    # The official client reads it as its NotFoundError.
    with openai.OpenAI(
        base_url=f"{main_server.url}/v1", api_key=main_server.api_key, max_retries=0
    ) as client:
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")


UNSUPPORTED_PARTS = {
    "image_url": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    "file": {"type": "file", "file": {"file_id": "file-1"}},
    "refusal": {"type": "refusal", "refusal": "no"},
}


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED_PARTS))
def test_each_unsupported_content_part_is_one_sentence(http, kind):
    content = [{"type": "text", "text": "What is in this?"}, UNSUPPORTED_PARTS[kind]]
    body = _error(http.post(CHAT, json={"messages": [{"role": "user", "content": content}]}), 400)
    assert body["param"] == "messages.0.content"
    assert body["type"] == "invalid_request_error"
    message = body["message"]
    assert message.startswith(
        f"messages.0.content: content part type '{kind}' is not supported by this model: "
        "it reads only 'text' parts (part 1;"
    ), message
    assert "more error" not in message and "Input should be" not in message


@pytest.mark.parametrize(
    "content, expected",
    [
        (5, "content must be a string, a list of content parts or null"),
        (["hi"], "content part 0 must be an object with a 'type'"),
        ([{"type": "text"}], "content part 0 of type 'text' must be exactly"),
        ([{"type": "text", "text": "a", "cache": 1}], "content part 0 of type 'text' must be"),
    ],
)
def test_malformed_content_is_one_sentence(http, content, expected):
    body = _error(http.post(CHAT, json={"messages": [{"role": "user", "content": content}]}), 400)
    assert body["param"] == "messages.0.content"
    assert expected in body["message"] and "more error" not in body["message"]


def test_text_parts_are_served(http):
    content = [{"type": "text", "text": "Say"}, {"type": "text", "text": " hi."}]
    response = http.post(
        CHAT,
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
    )
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def docs_server():
    server = launch_server(
        "--max-model-len",
        "256",
        "--enable-api-docs",
        "--served-model-name",
        "org/tiny-chat",
        "--disable-uvicorn-access-log",
    )
    yield server
    server.stop()


def test_enable_api_docs_serves_the_pages_and_logs_it(docs_server):
    with httpx.Client(base_url=docs_server.url, timeout=30) as client:
        for path in ("/docs", "/redoc"):
            page = client.get(path)
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            assert "/openapi.json" in page.text
        assert client.get("/openapi.json").status_code == 200
    log = docs_server.log_text()
    assert "API docs: on (/docs and /redoc load their scripts from a CDN" in log


def test_a_served_name_with_a_slash_has_its_card(docs_server):
    with httpx.Client(base_url=docs_server.url, timeout=30) as client:
        card = client.get("/v1/models/org/tiny-chat")
        assert card.status_code == 200 and card.json()["id"] == "org/tiny-chat"
        assert client.get("/v1/models/org").status_code == 404
        assert client.get("/v1/models/SmolLM2-135M-Instruct").status_code == 404


def test_structured_outputs_params_is_exported_from_pagoda():
    import pagoda
    from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
    from pagoda.entrypoints.openai.structured_request import structured_outputs_of

    assert "StructuredOutputsParams" in pagoda.__all__
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], structured_outputs={"choice": ["a", "b"]}
    )
    params = structured_outputs_of(request)
    assert isinstance(params, pagoda.StructuredOutputsParams)
    assert params == pagoda.StructuredOutputsParams(choice=["a", "b"])
    # As light as SamplingParams: no torch for a client that only builds requests.
    code = "import sys, pagoda; pagoda.StructuredOutputsParams; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
