"""API-key guard as an ASGI middleware, so every route - present or future - is covered.

The guard sits outside the router: it sees every HTTP request before any route
(including FastAPI's /docs and /openapi.json, unknown paths and wrong methods), so
a new route cannot forget it. Only the paths in `public_paths` pass without the
key (/health always; /metrics when --metrics-public). The key comes as
`Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's)
and is compared with `hmac.compare_digest` (constant time). A missing or wrong key ->
401 with an OpenAI-style body and `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from pagoda.entrypoints.openai.errors import error_bytes

_BEARER = b"bearer "


class APIKeyMiddleware:
    def __init__(
        self, app, api_key: str | None, public_paths: Iterable[str] = ("/health",)
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.public_paths = frozenset(public_paths)

    async def __call__(self, scope, receive, send) -> None:
        if self.api_key is None or scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("path") in self.public_paths:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = error_bytes(
            401,
            "invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="invalid_api_key",
        )
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        bearer = api_key = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and not bearer:
                if value[: len(_BEARER)].lower() == _BEARER:
                    bearer = value[len(_BEARER) :].strip()
            elif name == b"x-api-key" and not api_key:
                api_key = value.strip()
        # Both compared whatever was supplied, so timing does not tell the cases apart.
        by_bearer = hmac.compare_digest(bearer, self.api_key) and bool(bearer)
        by_header = hmac.compare_digest(api_key, self.api_key) and bool(api_key)
        return by_bearer or by_header
