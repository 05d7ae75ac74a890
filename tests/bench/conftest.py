"""A tiny OpenAI-style aiohttp server on 127.0.0.1 (port 0) for the bench tool's own tests.

It runs in a background thread with its own event loop, so both the synchronous
tokenizer client and the asyncio load generator can talk to it. The `model` field of
each request picks a behaviour: a recorded SSE stream, or one way of failing.
"""

import asyncio
import json
import threading

import pytest
from aiohttp import web

BOS = 1
WORDS = ["Once", " upon", " a", " time", " there", " was", " a", " river", ".", " It", " ran"]


class ToyTokenizer:
    """Characters plus a few merges; the server adds a BOS in front, like many models."""

    MERGES = ["the", " the", "th", "he", "an", "in", "er", " a", "on"]

    def __init__(self):
        self.vocab = {s: 10 + i for i, s in enumerate(self.MERGES)}

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            merge = max((m for m in self.MERGES if text.startswith(m, i)), key=len, default=None)
            if merge is not None:
                ids.append(self.vocab[merge])
                i += len(merge)
            else:
                ids.append(1000 + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids):
        inverse = {v: k for k, v in self.vocab.items()}
        return "".join(inverse[i] if i in inverse else chr(i - 1000) for i in ids if i != BOS)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class FakeOpenAIServer:
    def __init__(self, with_tokenizer=True, with_metrics=True, chunk_delay=0.0):
        self.tokenizer = ToyTokenizer()
        self.chunk_delay = chunk_delay
        self.requests_by_model = {}
        self.bodies = []
        self.scrapes = 0
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        if with_tokenizer:
            app.router.add_post("/tokenize", self.tokenize)
            app.router.add_post("/detokenize", self.detokenize)
        if with_metrics:
            app.router.add_get("/metrics", self.metrics)
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    # ---- lifecycle ------------------------------------------------------------------
    def _serve(self):
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(
            self.app,
            handle_signals=False,
            shutdown_timeout=0.2,
            handler_cancellation=True,
            access_log=None,
        )
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self.loop.run_forever()

    def start(self):
        self._thread.start()
        assert self._started.wait(10), "fake server did not start"
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def stop(self):
        async def shutdown():
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    # ---- routes ---------------------------------------------------------------------
    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "ok", "object": "model"}]})

    async def tokenize(self, request):
        body = await request.json()
        tokens = [BOS] + self.tokenizer.encode(body["prompt"])
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 2048})

    async def detokenize(self, request):
        body = await request.json()
        return web.json_response({"prompt": self.tokenizer.decode(body["tokens"])})

    async def metrics(self, request):
        self.scrapes += 1
        n = self.scrapes
        text = (
            "# HELP pagoda:num_preemptions_total preemptions\n"
            "# TYPE pagoda:num_preemptions_total counter\n"
            f'pagoda:num_preemptions_total{{model_name="ok"}} {2 * n}\n'
            f'pagoda:prefix_cache_queries_total{{model_name="ok"}} {100 * n}\n'
            f'pagoda:prefix_cache_hits_total{{model_name="ok"}} {25 * n}\n'
            f"pagoda:spec_decode_num_draft_tokens_total {40 * n}\n"
            f"pagoda:spec_decode_num_accepted_tokens_total {30 * n}\n"
            f"pagoda:spec_decode_num_drafts_total {20 * n}\n"
            f"pagoda:kv_cache_usage_perc {0.5 if n == 2 else 0.1}\n"
            f"process_resident_memory_bytes {1000 + (500 if n == 2 else 0)}\n"
            f'pagoda:ttft_seconds_bucket{{le="0.1"}} {n}\n'
        )
        return web.Response(text=text)

    async def completions(self, request):
        body = await request.json()
        model = body.get("model")
        count = self.requests_by_model.get(model, 0) + 1
        self.requests_by_model[model] = count
        self.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        if model == "429" or (model == "flaky" and count % 3 == 0):
            return web.json_response(
                {"error": {"message": "queue full", "type": "rate_limit"}},
                status=429,
                headers={"Retry-After": "1"},
            )
        if model == "bad":
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        if model == "oom":
            return web.json_response(
                {"error": {"message": "CUDA out of memory. Tried to allocate"}}, status=500
            )
        if model == "hang":
            await asyncio.Event().wait()
        return await self._stream(request, body, model, chat)

    async def _stream(self, request, body, model, chat):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 4
        per_chunk = 2 if model == "multi" else 1
        if chat:
            await response.write(
                _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            )
        await response.write(b": keep-alive\n\n")
        sent = 0
        while sent < n:
            k = min(per_chunk, n - sent)
            text = "".join(WORDS[(sent + j) % len(WORDS)] for j in range(k))
            if model == "heldback" and sent == 0:
                text = ""  # a token whose text the server holds back
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            await response.write(_sse({"choices": [choice]}))
            sent += k
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            if model == "close" and sent == 2:
                request.transport.close()  # the server dies mid-stream
                return response
            if model == "streamerr" and sent == 1:
                await response.write(_sse({"error": {"message": "engine failed this request"}}))
                return response
            if model == "badjson" and sent == 1:
                await response.write(b"data: {not json\n\n")
                return response
        if model != "nousage":
            prompt = body.get("prompt") or body["messages"][0]["content"]
            usage = {
                "prompt_tokens": len(self.tokenizer.encode(prompt)) + 1,
                "completion_tokens": n,
                "total_tokens": 0,
            }
            await response.write(_sse({"choices": [], "usage": usage}))
        if model != "nodone":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
def fake_server():
    server = FakeOpenAIServer().start()
    yield server
    server.stop()


@pytest.fixture
def bare_server():
    """No /tokenize, /detokenize or /metrics routes."""
    server = FakeOpenAIServer(with_tokenizer=False, with_metrics=False).start()
    yield server
    server.stop()


@pytest.fixture
def slow_server():
    server = FakeOpenAIServer(chunk_delay=0.01).start()
    yield server
    server.stop()
