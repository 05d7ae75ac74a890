"""The soak's client: the workload's requests (short prompts, several max_tokens,
streaming and not, completions and chat, some disconnected mid-stream or aborted
before the first token) and one request run to its single outcome: completed,
rejected (429 with Retry-After), aborted by its client, or one of FAILURES."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import aiohttp

PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Count from one to five.",
    "Why is the sky blue?",
    "Describe a cat in one sentence.",
    "What is 7 times 8?",
    "Say hello in Spanish.",
    "Tell me a fun fact.",
    "Name a planet.",
)
MAX_TOKENS = (8, 16, 32, 64)
FAILURES = ("http_error", "bad_429", "malformed", "stream_error", "connection_error", "hung")


@dataclasses.dataclass
class Spec:
    behaviour: str  # normal | disconnect (mid-stream) | abort (before the first token)
    chat: bool
    stream: bool
    max_tokens: int
    ignore_eos: bool
    temperature: float
    prompt: str
    disconnect_after: int = 0  # content chunks read before closing the connection
    abort_after_s: float = 0.0


@dataclasses.dataclass
class Result:
    spec: Spec
    start: float
    outcome: str = ""  # completed | rejected | aborted | one of FAILURES
    detail: str = ""
    end: float = 0.0
    ttft: float | None = None
    tokens: int | None = None


def make_spec(
    rng: random.Random, disconnect_share: float, abort_share: float, normal_only: bool = False
) -> Spec:
    draw = 1.0 if normal_only else rng.random()
    behaviour = (
        "disconnect"
        if draw < disconnect_share
        else "abort"
        if draw < disconnect_share + abort_share
        else "normal"
    )
    spec = Spec(
        behaviour,
        chat=rng.random() < 0.5,
        stream=rng.random() < 0.5,
        max_tokens=rng.choice(MAX_TOKENS),
        ignore_eos=rng.random() < 0.5,
        temperature=rng.choice((0.0, 0.8)),
        prompt=rng.choice(PROMPTS),
    )
    if behaviour == "disconnect":  # long enough that it is cut mid-stream
        spec.stream, spec.max_tokens, spec.ignore_eos = True, 64, True
        spec.disconnect_after = rng.randint(1, 4)
    elif behaviour == "abort":
        spec.abort_after_s = rng.uniform(0.0, 0.5)
    return spec


def _body(spec: Spec) -> tuple[str, dict]:
    body = {
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "ignore_eos": spec.ignore_eos,
        "stream": spec.stream,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.chat:
        return "/v1/chat/completions", {
            **body,
            "messages": [{"role": "user", "content": spec.prompt}],
        }
    return "/v1/completions", {**body, "prompt": spec.prompt}


def _check_answer(spec: Spec, finish_reason, tokens) -> str:
    """'' for a full answer, else what is wrong with it."""
    if finish_reason not in ("stop", "length"):
        return f"finish_reason {finish_reason!r}"
    if not isinstance(tokens, int) or not 0 <= tokens <= spec.max_tokens:
        return f"completion_tokens {tokens!r} outside [0, {spec.max_tokens}]"
    if (spec.ignore_eos or finish_reason == "length") and tokens != spec.max_tokens:
        return f"{tokens} completion tokens, expected {spec.max_tokens} ({finish_reason})"
    return ""


async def _read_stream(resp: aiohttp.ClientResponse, res: Result) -> None:
    spec, chunks, finish, tokens, done = res.spec, 0, None, None, False
    async for raw in resp.content:
        line = raw.strip()
        if not line:
            continue
        if done or not line.startswith(b"data: "):
            res.outcome, res.detail = "malformed", f"unexpected line {line[:80]!r}"
            return
        if line == b"data: [DONE]":
            done = True
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            res.outcome, res.detail = "malformed", f"not JSON: {line[:80]!r}"
            return
        if "error" in event:
            res.outcome, res.detail = "stream_error", json.dumps(event["error"])[:200]
            return
        for choice in event.get("choices") or []:
            if (choice.get("delta") or {}).get("content") if spec.chat else choice.get("text"):
                chunks += 1
                if res.ttft is None:
                    res.ttft = time.monotonic() - res.start
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            tokens = event["usage"].get("completion_tokens")
        if spec.behaviour == "disconnect" and chunks >= spec.disconnect_after:
            resp.close()  # the client goes away mid-stream
            res.outcome, res.detail = "aborted", "disconnected mid-stream"
            return
    problem = "no [DONE]" if not done else _check_answer(spec, finish, tokens)
    res.tokens = tokens
    res.outcome, res.detail = ("malformed", problem) if problem else ("completed", "")


async def _exchange(session: aiohttp.ClientSession, url: str, res: Result) -> None:
    path, body = _body(res.spec)
    async with session.post(url + path, json=body) as resp:
        if resp.status == 429:
            ok = resp.headers.get("Retry-After", "").isdigit()
            res.outcome, res.detail = ("rejected", "") if ok else ("bad_429", "no Retry-After")
        elif resp.status != 200:
            res.outcome, res.detail = (
                "http_error",
                f"HTTP {resp.status}: {(await resp.text())[:200]}",
            )
        elif res.spec.stream:
            await _read_stream(resp, res)
        else:
            try:
                data = await resp.json()
                choice = data["choices"][0]
                text = choice["message"]["content"] if res.spec.chat else choice["text"]
                res.tokens, finish = data["usage"]["completion_tokens"], choice["finish_reason"]
                problem = "" if isinstance(text, str) else "no text"
                problem = problem or _check_answer(res.spec, finish, res.tokens)
            except (ValueError, KeyError, IndexError, TypeError, aiohttp.ContentTypeError) as exc:
                problem = f"bad JSON answer: {type(exc).__name__}: {exc}"
            res.outcome, res.detail = ("malformed", problem) if problem else ("completed", "")


async def run_request(
    session: aiohttp.ClientSession, url: str, spec: Spec, timeout_s: float
) -> Result:
    """One request to its single outcome (never raises but on cancellation of the caller)."""
    res = Result(spec, start=time.monotonic())
    task = asyncio.create_task(_exchange(session, url, res))
    try:
        if spec.behaviour == "abort":
            await asyncio.wait({task}, timeout=spec.abort_after_s)
            if not task.done():  # the client gives up: cancelling closes the connection
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                res.outcome = "aborted"
                res.detail = (
                    "before the first token" if res.ttft is None else "after the first token"
                )
        if not res.outcome:
            await asyncio.wait_for(task, max(0.0, timeout_s - (time.monotonic() - res.start)))
    except TimeoutError:
        res.outcome, res.detail = "hung", f"no end within {timeout_s:.0f} s"
    except (aiohttp.ClientError, OSError) as exc:
        res.outcome, res.detail = "connection_error", f"{type(exc).__name__}: {exc}"[:200]
    except asyncio.CancelledError:
        task.cancel()
        raise
    res.end = time.monotonic()
    return res


def describe(r: Result) -> dict:
    """The request's outcome and what it was, for the JSON report."""
    s = r.spec
    return {
        "outcome": r.outcome,
        "detail": r.detail,
        "behaviour": s.behaviour,
        "endpoint": "chat" if s.chat else "completions",
        "stream": s.stream,
        "max_tokens": s.max_tokens,
        "latency_s": round(r.end - r.start, 3),
    }
