"""Fuzz the real server from its own OpenAPI schema (schemathesis): no 5xx, no crash.

Cases come from schemathesis' strategies for every operation, valid and invalid
bodies alike, drawn by hypothesis with a fixed seed and a bounded number of
examples. Work a valid case asks of the model is clamped (1 generated token, at
most 2 samples, at most 2 prompts) so the fuzz measures the API's input handling,
not the model's speed; values the server must refuse are left as generated.
"""

from __future__ import annotations

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_EXAMPLES = 200
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")
MAX_N = 16  # the server's --max-n: larger values must still reach it (and get a 400)


@pytest.fixture(scope="module")
def schema(main_server):
    return schemathesis.openapi.from_url(
        f"{main_server.url}/openapi.json", headers=main_server.headers
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _clamp_work(case) -> None:
    """Bounds the model work of a case (a chat request without a limit gets one)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for field in _LENGTH_FIELDS:
        if _is_int(body.get(field)) and body[field] > 1:
            body[field] = 1
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 1
    for field in ("n", "best_of"):
        if _is_int(body.get(field)) and 2 < body[field] <= MAX_N:
            body[field] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:2]


def test_fuzz_openapi_no_server_errors(main_server, schema):
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= paths
    cases = st.one_of(
        [
            op.as_strategy(generation_mode=mode)
            for op in operations
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
        ]
    )
    seen_statuses: set[int] = set()

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @given(case=cases)
    def check(case):
        _clamp_work(case)
        response = case.call(base_url=main_server.url, headers=main_server.headers, timeout=120)
        seen_statuses.add(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

    check()
    assert seen_statuses & {200} and seen_statuses & {400, 404, 405, 422}
    # The server is still healthy and every KV block came back.
    audit = httpx.get(
        f"{main_server.url}/debug/kv_audit", headers=main_server.headers, timeout=60
    ).json()
    assert audit["in_use"] == 0 and audit["num_in_flight"] == 0
