"""ASGI middlewares for server state: request-body size limit, draining, in-flight count,
and the count of refused API requests.

`BodySizeLimitMiddleware` reads the request body up front (bounded by the limit)
and answers 413 when it is too large, whether the client declared the size in
Content-Length or streamed it chunked; the buffered body is then replayed to the
app, and later `receive()` calls reach the server again so disconnects are seen.

`ServerStateMiddleware` counts HTTP requests in flight (the drain on SIGTERM waits
for them) and answers 503 to new requests once draining started. /health and
/metrics stay reachable: /health reports the drain itself.

`RejectionMetricsMiddleware` counts every API request (`/v1/...`) answered with a
4xx status or 503 (`pagoda:http_rejected_requests`, by status): refused by auth,
the size limit, the drain, admission or validation, before the engine ran it.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagoda.engine import trace
from pagoda.entrypoints.openai.errors import error_bytes


async def _send_error(
    send, status: int, message: str, code: str, extra_headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    body = error_bytes(status, message, code=code)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimitMiddleware:
    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(send)
            return
        chunks, size, disconnected = [], 0, False
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        trace.mark("body_read")
        await self.app(scope, _replay(b"".join(chunks), disconnected, receive), send)

    async def _too_large(self, send) -> None:
        await _send_error(
            send,
            413,
            f"the request body is larger than the server's limit of "
            f"{self.max_body_bytes} bytes (--max-request-body-bytes)",
            code="request_too_large",
        )


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, disconnected: bool, receive):
    """A receive() that hands out the buffered body once, then defers to the server."""
    sent = False

    async def replay_receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnected:
            return {"type": "http.disconnect"}
        return await receive()

    return replay_receive


class ServerState:
    """Shared between the middleware, the routes and the shutdown logic."""

    def __init__(self) -> None:
        self.draining = False
        self.num_http_in_flight = 0


class ServerStateMiddleware:
    EXEMPT_PATHS = frozenset({"/health", "/metrics"})

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await _send_error(
                send,
                503,
                "the server is shutting down and accepts no new requests",
                code="server_draining",
                extra_headers=[(b"retry-after", b"5")],
            )
            return
        self.state.num_http_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_http_in_flight -= 1


class RejectionMetricsMiddleware:
    """Counts API requests answered 4xx or 503 (refused before the engine ran them)."""

    def __init__(self, app, observe) -> None:
        self.app = app
        self.observe = observe  # ServerMetrics.observe_rejection

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def observing_send(message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if 400 <= status < 500 or status == 503:
                    self.observe(status)
            await send(message)

        await self.app(scope, receive, observing_send)
