"""ASGI middleware that opens a TTFT trace per generation request (see pagoda/engine/trace.py).

Installed outermost, and only when `PAGODA_TTFT_TRACE` is set: it stamps the arrival
before any other middleware runs, watches `send` for the response headers and the
first body bytes, and writes the trace when the response is over.

`first_text` is the first body chunk whose text (completions) or delta content (chat)
is not empty: what a client's TTFT waits for. Tokens that decode to nothing yet (a
partial UTF-8 sequence, or ids a smaller tokenizer does not know, as with dummy
weights of a larger vocabulary) come in chunks with empty text before it.
"""

from __future__ import annotations

import time

from pagoda.engine import trace

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class TTFTTraceMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        request_trace = trace.open_trace(scope["path"])
        if request_trace is None:
            await self.app(scope, receive, send)
            return

        async def traced_send(message) -> None:
            if message["type"] == "http.response.start":
                request_trace.mark("headers_sent")
            elif message["type"] == "http.response.body" and message.get("body"):
                await send(message)
                written = time.monotonic()
                request_trace.mark("first_body", written)
                if "first_text" not in request_trace.times and _has_text(message["body"]):
                    request_trace.mark("first_text", written)
                return
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        finally:
            trace.finish(request_trace)


def _has_text(body: bytes) -> bool:
    for key in (b'"text":"', b'"content":"'):
        at = body.find(key)
        if at >= 0 and body[at + len(key) : at + len(key) + 1] != b'"':
            return True
    return False
