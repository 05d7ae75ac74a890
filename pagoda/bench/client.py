"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Owns the wire side of `pagoda bench serve`: the JSON payload for `/v1/completions`
(backend `openai`) or `/v1/chat/completions` (backend `openai-chat`), always with
`stream: true` and `stream_options.include_usage`, the Server-Sent-Events parser,
and the classification of every way a request can fail:

    http_<status>       the server answered with a non-200 status (429, 400, 500, ...)
    server_oom          an error status or stream error whose message says out-of-memory
    timeout             no complete response within --request-timeout
    connection_error    refused, reset, or closed mid-response
    stream_error        an `{"error": ...}` event inside the stream
    incomplete_stream   the stream ended without `data: [DONE]`
    protocol_error      a chunk that is not JSON
    client_error        anything else raised while sending (named in the message)

The caller owns the `RequestResult`: it is filled in place, so a request cancelled
by the run's time limit still leaves its timestamps behind.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from pagoda.bench import metrics as m
from pagoda.bench.backends import BACKENDS
from pagoda.bench.datasets import SampleRequest

_OOM = re.compile(r"out of memory|outofmemory|\boom\b", re.IGNORECASE)
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Target:
    """Where and how requests are sent; `url` is always base URL + endpoint."""

    url: str
    backend: str
    model: str
    api_key: str | None = None
    request_timeout: float | None = None
    ignore_eos: bool = False
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k, extra body

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(target: Target, sample: SampleRequest) -> dict:
    if target.backend == "openai":
        body = {
            "model": target.model,
            "prompt": sample.prompt,
            "max_tokens": sample.expected_output_len,
        }
    elif target.backend == "openai-chat":
        body = {
            "model": target.model,
            "messages": [{"role": "user", "content": sample.prompt}],
            "max_completion_tokens": sample.expected_output_len,
        }
    else:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {target.backend!r}")
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        body["ignore_eos"] = True
    body.update(target.sampling)
    return body


def classify_http_error(status: int, body: str) -> str:
    if status >= 500 and _OOM.search(body):
        return m.SERVER_OOM
    return f"http_{status}"


def _fail(result: m.RequestResult, kind: str, message: str, now: float) -> None:
    result.success = False
    result.error_kind = kind
    result.error = message[:MAX_ERROR_CHARS]
    if result.end is None:
        result.end = now


def _chunk_text(event: dict, backend: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if backend == "openai":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def _read_stream(
    response: aiohttp.ClientResponse,
    backend: str,
    result: m.RequestResult,
    clock: Callable[[], float],
) -> None:
    pieces: list[str] = []
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, ": keep-alive" comments, event:/id: fields
        now = clock()
        data = line[5:].strip()
        if data == b"[DONE]":
            result.end = now
            result.generated_text = "".join(pieces)
            result.success = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            _fail(result, m.PROTOCOL_ERROR, f"chunk is not JSON: {data[:200]!r}", now)
            return
        if event.get("error"):
            message = json.dumps(event["error"])
            _fail(result, m.SERVER_OOM if _OOM.search(message) else m.STREAM_ERROR, message, now)
            return
        usage = event.get("usage")
        if usage:
            result.output_tokens = usage.get("completion_tokens", result.output_tokens)
            result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        text = _chunk_text(event, backend)
        if text or (backend == "openai" and event.get("choices")):
            # A completion chunk carries generated tokens even when their text is empty
            # (held back mid-character, or a token the tokenizer prints as nothing): it
            # counts, as vLLM's benchmark counts it. A chat chunk counts by its content,
            # so the opening role-only chunk does not.
            result.chunk_times.append(now)
            pieces.append(text)
    result.generated_text = "".join(pieces)
    _fail(result, m.INCOMPLETE_STREAM, "the stream ended without data: [DONE]", clock())


async def stream_request(
    session: aiohttp.ClientSession,
    target: Target,
    sample: SampleRequest,
    result: m.RequestResult,
    clock: Callable[[], float],
) -> None:
    """Send one request and fill `result`; never raises except on cancellation."""
    payload = build_payload(target, sample)
    timeout = aiohttp.ClientTimeout(total=target.request_timeout)
    result.start = clock()
    try:
        async with session.post(
            target.url, json=payload, headers=target.headers(), timeout=timeout
        ) as response:
            result.status = response.status
            if response.status != 200:
                body = await response.text(errors="replace")
                _fail(result, classify_http_error(response.status, body), body, clock())
                return
            await _read_stream(response, target.backend, result, clock)
    except TimeoutError:  # also aiohttp's ServerTimeoutError
        _fail(result, m.TIMEOUT, f"no complete response within {target.request_timeout} s", clock())
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
        _fail(result, m.CONNECTION_ERROR, f"{type(err).__name__}: {err}", clock())
    except (aiohttp.ClientError, ValueError, OSError) as err:
        _fail(result, m.CLIENT_ERROR, f"{type(err).__name__}: {err}", clock())
