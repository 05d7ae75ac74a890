"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Owns `APIError` (raised by handlers for any client or server condition), the
mapping of framework errors onto it (pydantic validation -> 400, unknown route ->
404, wrong method -> 405), the messages for a body that is not JSON at all (no
JSON content type, malformed JSON with its line and column, empty, not an object),
and a last-resort handler that turns a bug into a 500
without leaking a traceback. Bad input must never reach that last handler: every
check a client can fail raises APIError with a 4xx first.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# HTTP status -> OpenAI's error "type".
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _TYPES.get(status_code, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return ErrorJSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped JSON: an error may quote client text holding lone surrogates,
    which cannot be encoded as UTF-8."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_bytes(
    status_code: int, message: str, code: str | None = None, param: str | None = None
) -> bytes:
    """The JSON body of an error, for ASGI middlewares that answer without FastAPI."""
    body = error_body(message, _TYPES.get(status_code, "invalid_request_error"), param, code)
    return json.dumps(body, ensure_ascii=True).encode("ascii")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_value_error(exc: Exception) -> APIError:
    """A ValueError/TypeError from SamplingParams or the engine -> 400 naming the field.

    Those messages start with the field name ("top_p must be in (0, 1], got 2.0").
    """
    message = str(exc) or type(exc).__name__
    first_word = message.split(" ", 1)[0]
    param = first_word if first_word.isidentifier() and first_word.islower() else None
    return APIError(400, message, param=param)


_SEND_JSON = "send a JSON object with the header 'Content-Type: application/json'"


def _is_json_content_type(value: str | None) -> bool:
    media_type = (value or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


def _json_syntax_message(doc: Any, pos: int, reason: str) -> str:
    """json's own wording: the reason, then line, column and character offset."""
    text = doc if isinstance(doc, str) else bytes(doc or b"").decode("utf-8", "replace")
    line = text.count("\n", 0, pos) + 1
    column = pos - text.rfind("\n", 0, pos)
    return f"the request body is not valid JSON: {reason}: line {line} column {column} (char {pos})"


def body_problem(exc: RequestValidationError, content_type: str | None) -> str | None:
    """The message when the body as a whole is unusable (not JSON, empty, not an object);
    None when the error is about one field, which the usual message names."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
        reason = (first.get("ctx") or {}).get("error") or first.get("msg")
        return _json_syntax_message(exc.body, pos, reason)
    if loc != ("body",):
        return None
    if first.get("type") == "missing":
        return f"the request body is empty: {_SEND_JSON}"
    if not _is_json_content_type(content_type):
        # FastAPI parses JSON only under a JSON content type (e.g. curl -d sends a form type).
        got = f"is {content_type!r}" if content_type else "is missing"
        return f"the request's Content-Type {got}: {_SEND_JSON}"
    return f"the request body must be a JSON object, not {_json_type(first.get('input'))}"


def _json_type(value: Any) -> str:
    for kind, name in (
        (bool, "a boolean"),
        (str, "a string"),
        ((int, float), "a number"),
        (list, "an array"),
    ):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _validation_message(
    exc: RequestValidationError, content_type: str | None = None
) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    problem = body_problem(exc, content_type)
    if problem is not None:
        return problem, None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        message = (
            f"unsupported parameter: {param!r} is not a parameter Pagoda accepts for this route"
        )
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, request.headers.get("content-type"))
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return APIError(status, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        # json.loads of a body nested thousands of levels deep: bad input, not a server bug.
        return APIError(400, "the request body is nested too deeply").response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return APIError(500, f"internal server error ({type(exc).__name__})").response()
