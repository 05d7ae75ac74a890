"""Errors on /v1/messages in Anthropic's shape: `{"type": "error", "error": {"type",
"message"}}`, with the same status codes as the OpenAI routes.

Owns `AnthropicErrorMiddleware`, which rewrites the JSON error bodies of requests to
/v1/messages into that shape whoever made them (a handler's APIError, a validation
error, the API-key guard, the draining or body-size middlewares), and `error_event`,
the SSE `event: error` a stream ends with when it fails after its headers went out.
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.entrypoints.openai.errors import APIError

PATH = "/v1/messages"

# HTTP status -> Anthropic's error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Anthropic's body. The error also carries the OpenAI routes' `param` (the field at
    fault) and `code` (null when none): Anthropic's clients read type and message, and
    a client of both APIs finds the same fields on every route."""
    error = {"type": error_type(status), "message": message, "param": param, "code": code}
    return {"type": "error", "error": error}


def error_event(exc: BaseException) -> str:
    error = (
        exc if isinstance(exc, APIError) else APIError(500, f"internal error: {type(exc).__name__}")
    )
    body = anthropic_error(error.status_code, error.message, error.param, error.code)
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class AnthropicErrorMiddleware:
    """Rewrites JSON error responses of /v1/messages (status >= 400) into Anthropic's shape."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") != PATH:
            await self.app(scope, receive, send)
            return
        start: dict | None = None  # a held error response's start
        body = bytearray()

        async def rewriting_send(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and _is_json_error(message):
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            new_body = _rewritten(start["status"], bytes(body))
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new_body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new_body})

        await self.app(scope, receive, rewriting_send)


def _is_json_error(start: dict) -> bool:
    if int(start["status"]) < 400:
        return False
    for name, value in start.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";")[0].strip().lower() == b"application/json"
    return False


def _rewritten(status: int, body: bytes) -> bytes:
    try:
        error = json.loads(body)["error"]
        message, param, code = str(error["message"]), error.get("param"), error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param, code = body.decode("utf-8", "replace") or f"HTTP {status}", None, None
    rewritten = anthropic_error(status, message, param, code)
    return json.dumps(rewritten, ensure_ascii=True).encode("ascii")
