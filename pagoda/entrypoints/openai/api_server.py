"""The OpenAI-compatible HTTP server: `build_app(engine_client, args)` and `run_server(args)`.

Owns the route table and the process lifecycle; Anthropic's /v1/messages
(entrypoints/anthropic/) is served beside the OpenAI routes. Middlewares, outermost
first: rejection count (4xx and 503 answers to /v1/ requests) -> Anthropic-shaped
errors on /v1/messages -> API key (every route but
/health, the web UI's static pages and files, and /metrics with --metrics-public) ->
server state (503 while draining, in-flight count) ->
request-body size limit -> routes. The web UI (/ and /dashboard, see web_ui.py) and
its statistics stream (stats_stream.py) are registered here too.

Lifecycle: `run_server` binds the port first (a busy port is one `error:` line
naming --port, before any loading; server_startup.py), then loads the engine, so a
model that cannot load fails with one line and a non-zero exit, then logs what is on
(model names, address, API key, web UI, API docs, tool calling) and only then listens on
that socket: a client that connects finds a ready server. Listening, it logs
`ready: URL`. /docs and /redoc (scripts from a CDN) are off unless --enable-api-docs.
(An app built by `build_app` around an engine not yet started loads it at startup
and answers 503 "loading" meanwhile.) SIGTERM/SIGINT start a drain - new requests get 503,
requests in flight finish (up to --shutdown-timeout), then the server stops, the
lifespan's end stops the dashboard sampler and the engine (threads, worker processes,
the disk tier's lock) and the process exits 0. A second signal ends the requests in
flight with an error event (streams) or a 503, then stops; a third stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

import pagoda
from pagoda.engine import trace
from pagoda.engine.async_engine import AsyncEngine
from pagoda.entrypoints.anthropic import protocol as messages_protocol
from pagoda.entrypoints.anthropic.errors import AnthropicErrorMiddleware
from pagoda.entrypoints.anthropic.serving import create_message
from pagoda.entrypoints.openai import protocol
from pagoda.entrypoints.openai.auth import APIKeyMiddleware
from pagoda.entrypoints.openai.errors import APIError, bad_request, install_error_handlers
from pagoda.entrypoints.openai.generation import SSEStream
from pagoda.entrypoints.openai.ignored_fields import note_ignored
from pagoda.entrypoints.openai.middleware import (
    BodySizeLimitMiddleware,
    RejectionMetricsMiddleware,
    ServerState,
    ServerStateMiddleware,
)
from pagoda.entrypoints.openai.server_startup import bind_port, configuration_lines, format_address
from pagoda.entrypoints.openai.serving_chat import create_chat_completion, render_chat
from pagoda.entrypoints.openai.serving_common import ServerSettings, ServingContext, encode_text
from pagoda.entrypoints.openai.serving_completion import create_completion
from pagoda.entrypoints.openai.stats_stream import STREAM_PATH, StatsHub
from pagoda.entrypoints.openai.trace_middleware import TTFTTraceMiddleware
from pagoda.entrypoints.openai.web_ui import add_web_ui_routes, public_paths
from pagoda.metrics.prometheus import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)

_ERROR_RESPONSES = {
    status: {"model": protocol.ErrorResponse} for status in (400, 401, 404, 413, 429, 503)
}


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body and runs `on_close`, even when the
    client went away before the first byte (so aborts and admission releases happen)."""

    def __init__(self, stream: SSEStream, headers: dict[str, str] | None = None) -> None:
        super().__init__(
            stream.body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._on_close = stream.close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._on_close()


def served_model_name(args: Any) -> str:
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    if getattr(args, "model", None):
        return args.model
    return "SmolLM2-135M-Instruct"  # the embedded model


def settings_from_args(args: Any) -> ServerSettings:
    return ServerSettings(
        served_model_names=[served_model_name(args)],
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
        max_num_queued_requests=args.max_num_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        max_request_body_bytes=args.max_request_body_bytes,
        api_key=args.api_key,
        metrics_public=args.metrics_public,
        enable_debug_routes=args.enable_debug_routes,
        log_requests=not args.disable_log_requests,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        strict_tool_template=args.strict_tool_template,
        enable_web_ui=not args.disable_web_ui,
        enable_api_docs=args.enable_api_docs,
    )


def build_app(
    engine_client: AsyncEngine,
    args: argparse.Namespace | ServerSettings,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine_client` (started by the caller, or at app startup)."""
    settings = args if isinstance(args, ServerSettings) else settings_from_args(args)
    metrics = metrics or ServerMetrics(settings.served_model_names[0])
    ctx = ServingContext(engine_client, settings, metrics)
    state = ServerState()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine_client.is_started:
            engine_client.start()
        try:
            yield
        finally:
            # The dashboard's sampler first (it calls into the engine), then the engine:
            # its loop thread joins once the engine released its threads, worker
            # processes, disk lock and memory.
            await app.state.stats_hub.close()
            await engine_client.shutdown(timeout=0.0)

    # /docs and /redoc fetch their scripts from a CDN: blank pages offline, so they
    # are off unless --enable-api-docs; /openapi.json is always served.
    docs = settings.enable_api_docs
    app = FastAPI(
        title="Pagoda OpenAI-compatible API",
        version=pagoda.__version__,
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.ctx = ctx
    app.state.server_state = state
    install_error_handlers(app)
    _add_api_routes(app, ctx)
    _add_ops_routes(app, ctx, state)
    hub = StatsHub(
        engine_client, metrics.recent, ctx.model_name, is_draining=lambda: state.draining
    )
    app.state.stats_hub = hub
    _add_stats_route(app, hub)
    if not docs:
        _add_docs_off_routes(app)
    if settings.enable_web_ui:
        add_web_ui_routes(app)
    # add_middleware puts each new one outermost: this order makes auth the first check.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_request_body_bytes)
    app.add_middleware(ServerStateMiddleware, state=state)
    public = {"/health"} | ({"/metrics"} if settings.metrics_public else set())
    if settings.enable_web_ui:
        public |= public_paths()  # static files only: they hold no data and no secret
    app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, public_paths=public)
    app.add_middleware(AnthropicErrorMiddleware)  # /v1/messages errors, the 401 included
    app.add_middleware(RejectionMetricsMiddleware, observe=metrics.observe_rejection)
    if trace.ENABLED:  # outermost, so the arrival is stamped before any other work
        app.add_middleware(TTFTTraceMiddleware)
    return app


def _respond(result: Any, headers: dict[str, str]) -> Response:
    if isinstance(result, SSEStream):
        return ClosingStreamingResponse(result, headers)
    return JSONResponse(result, headers=headers)


def _add_api_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post(
        "/v1/completions", response_model=protocol.CompletionResponse, responses=_ERROR_RESPONSES
    )
    async def completions(body: protocol.CompletionRequest, request: Request):
        trace.mark("parsed")
        headers = note_ignored(body.ignored_fields())
        return _respond(await create_completion(ctx, body, request.receive), headers)

    @app.post(
        "/v1/chat/completions",
        response_model=protocol.ChatCompletionResponse,
        responses=_ERROR_RESPONSES,
    )
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request):
        trace.mark("parsed")
        headers = note_ignored(body.ignored_fields())
        result, warnings = await create_chat_completion(ctx, body, request.receive)
        return _respond(result, {**headers, **warnings})

    @app.post(
        "/v1/messages",
        response_model=messages_protocol.MessageResponse,
        responses={s: {"model": messages_protocol.ErrorResponse} for s in _ERROR_RESPONSES},
    )
    async def messages(body: messages_protocol.MessagesRequest, request: Request):
        trace.mark("parsed")
        result, headers = await create_message(ctx, body, request.receive)
        return _respond(result, headers)

    @app.get("/v1/models", response_model=protocol.ModelList, responses=_ERROR_RESPONSES)
    async def models():
        # 503 while loading (only an app whose engine loads at startup answers then):
        # a card without the real max_model_len would mislead clients that size by it.
        engine = ctx.require_ready()
        names = ctx.settings.served_model_names
        return {"object": "list", "data": [_model_card(name, engine) for name in names]}

    # `:path`: a served name may hold slashes (a hub id such as Qwen/Qwen3-0.6B).
    @app.get(
        "/v1/models/{model_id:path}", response_model=protocol.ModelCard, responses=_ERROR_RESPONSES
    )
    async def model(model_id: str):
        engine = ctx.require_ready()
        ctx.check_model(model_id)  # 404 for a name this server does not serve
        return _model_card(model_id, engine)

    @app.post("/tokenize", response_model=protocol.TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(body: protocol.TokenizeRequest):
        engine = ctx.require_ready()
        ctx.check_model(body.model)
        if isinstance(body, protocol.TokenizeChatRequest):
            tokens = render_chat(
                ctx, body.messages, body.add_generation_prompt, body.chat_template_kwargs
            )
        else:
            tokens = encode_text(ctx, body.prompt, "prompt", body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", response_model=protocol.DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(body: protocol.DetokenizeRequest):
        engine = ctx.require_ready()
        ctx.check_model(body.model)
        vocab = engine.model_info.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": ctx.tokenizer().decode(body.tokens)}


def _model_card(name: str, engine: Any) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "pagoda",
        "root": name,
        "max_model_len": engine.max_model_len,
    }


def _add_ops_routes(app: FastAPI, ctx: ServingContext, state: ServerState) -> None:
    @app.get("/health", responses={503: {"model": protocol.ErrorResponse}})
    async def health():
        if state.draining:
            raise APIError(503, "the server is shutting down", code="server_draining")
        if ctx.engine.load_error is not None:
            raise APIError(
                503, f"the model failed to load: {ctx.engine.load_error}", code="load_failed"
            )
        if ctx.engine.dead_reason is not None:
            raise APIError(503, f"the engine stopped: {ctx.engine.dead_reason}", code="engine_dead")
        if not ctx.engine.is_ready or not ctx.engine.is_running:
            raise APIError(503, "the model is loading", code="model_loading")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": pagoda.__version__}

    @app.get("/metrics", response_class=Response)
    async def metrics():
        stats = None
        if ctx.engine.is_ready and ctx.engine.is_running:
            stats = await ctx.engine.get_stats()
        return Response(ctx.metrics.render(stats), media_type=CONTENT_TYPE)

    if ctx.settings.enable_debug_routes:

        @app.get("/debug/kv_audit")
        async def kv_audit():
            ctx.require_ready()
            audit = await ctx.engine.audit_kv_cache()
            stats = await ctx.engine.get_stats()
            return {
                "total": audit.total,
                "free": audit.free,
                "cached": audit.cached,
                "in_use": audit.in_use,
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "num_in_flight": ctx.engine.num_in_flight,
            }


def _add_docs_off_routes(app: FastAPI) -> None:
    """/docs and /redoc while they are off: a 404 that says how to turn them on."""

    async def docs_off():
        raise APIError(
            404,
            "the interactive API docs are off: start the server with --enable-api-docs "
            "(their scripts come from a CDN, so the browser needs a network); the schema "
            "is at /openapi.json",
            code="api_docs_disabled",
        )

    for path in ("/docs", "/redoc"):
        app.add_api_route(path, docs_off, methods=["GET"], include_in_schema=False)


def _add_stats_route(app: FastAPI, hub: StatsHub) -> None:
    # Out of the OpenAPI schema: an endless stream is no operation a client generator
    # (or the schema fuzz test) should call.
    @app.get(STREAM_PATH, include_in_schema=False)
    async def engine_stats_stream():
        body, close = await hub.stream()
        return ClosingStreamingResponse(SSEStream(body, close))


# ----------------------------------------------------------------------------- process


class DrainingServer(uvicorn.Server):
    """uvicorn.Server where a signal starts a drain instead of an immediate stop, and a
    drained stop is a clean exit (uvicorn itself re-raises the signal: a non-zero exit)."""

    # After a second signal, how long at most (the drain's deadline comes forward to it)
    # the requests in flight get to write their error (the engine thread delivers it
    # between steps) before uvicorn's own shutdown starts: its graceful window
    # (timeout_graceful_shutdown) would otherwise run concurrently and cut the streams of a
    # slow or loaded machine mid-response.
    STOP_GRACE_S = 15.0

    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        engine: AsyncEngine,
        shutdown_timeout: float,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.engine_client = engine
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: float | None = None
        self.stopping = False  # a second signal came: the requests in flight were failed
        self.exit_code = 0
        self.web_ui = False  # log the pages' URLs once ready

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is None:
            logger.warning(
                "signal %d: draining (%d request(s) in flight, up to %.0fs; "
                "signal again to stop now)",
                sig,
                self.state.num_http_in_flight,
                self.shutdown_timeout,
            )
            self.state.draining = True
            self.drain_deadline = time.monotonic() + self.shutdown_timeout
        elif not self.stopping and not self.should_exit:
            # A second signal: stop now, but cleanly. Requests in flight end with an
            # error (an SSE error event for streams, a 503 otherwise) rather than a cut
            # connection; once they have (the drain's end, on_tick), the ordinary
            # shutdown (lifespan included, which joins the engine thread) runs: no
            # CancelledError tracebacks, no thread killed in C++.
            logger.warning(
                "signal %d again: ending %d request(s) in flight and stopping",
                sig,
                self.state.num_http_in_flight,
            )
            self.engine_client.fail_all_requests(
                "the server was stopped before this request finished"
            )
            self.stopping = True
            self.drain_deadline = min(self.drain_deadline, time.monotonic() + self.STOP_GRACE_S)
        else:  # a third signal: give up on a clean stop
            self.force_exit = True

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets)
        except OSError as exc:
            # listen() on the early-bound socket lost the port to a process that bound
            # it too while the model loaded (both with SO_REUSEADDR): one line, exit 1.
            port = sockets[0].getsockname()[1] if sockets else self.config.port
            logger.error(
                "cannot listen on %s: %s; another process took the port while the model "
                "loaded: choose another port with --port",
                format_address(self.config.host, port),
                exc.strerror,
            )
            self.exit_code = 1
            self.should_exit = True
            return
        if self.started:  # uvicorn exits on a bind failure; this is after a good bind
            url = _listening_url(self)
            logger.info("ready: %s (OpenAI API at /v1)", url)
            if self.web_ui:
                logger.info("web UI: chat at %s/, engine dashboard at %s/dashboard", url, url)

    async def on_tick(self, counter: int) -> bool:
        # uvicorn calls this every 0.1 s; the drain ends when nothing is in flight.
        if self.engine_client.load_error is not None and not self.should_exit:
            logger.error("the engine failed to load; exiting")
            self.exit_code = 1
            self.should_exit = True
        if self.drain_deadline is not None and not self.should_exit:
            if self.state.num_http_in_flight == 0:
                logger.warning("drained: no request in flight; stopping")
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                logger.warning(
                    "shutdown timeout: %d request(s) still in flight; stopping",
                    self.state.num_http_in_flight,
                )
                self.should_exit = True
        return await super().on_tick(counter)


def _listening_url(server: uvicorn.Server) -> str:
    host, port = server.config.host, server.config.port
    for srv in getattr(server, "servers", []):  # the bound port, should --port be 0
        for sock in srv.sockets:
            port = sock.getsockname()[1]
            break
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# How long the process waits at exit for the engine's own shutdown (its worker
# processes get their own bounded wait, then are terminated).
ENGINE_CLOSE_TIMEOUT_S = 60.0


def _load_engine(engine: AsyncEngine) -> None:
    """Starts the engine's thread and waits until the model loaded; re-raises its load
    error (a ValueError such as a bad model path reaches the CLI as one line)."""
    engine.start()
    engine.wait_loaded()
    if engine.load_error is not None:
        raise engine.load_error


def run_server(args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Loads the model, then serves until SIGTERM/SIGINT; returns the process exit code.
    sock: the address already bound (server_startup.bind_port), else bound here."""
    from pagoda.entrypoints.cli_args import engine_args_from_namespace

    # Bound before loading (a busy port is one line within seconds), listening only
    # after it (a client that connects finds a ready server).
    if sock is None:
        sock = bind_port(args.host, args.port)
    with contextlib.closing(sock):
        engine_args = engine_args_from_namespace(args)
        metrics = ServerMetrics(served_model_name(args))
        engine = AsyncEngine.from_engine_args(engine_args, timings_listener=metrics.observe_request)
        app = build_app(engine, args, metrics=metrics)
        _load_engine(engine)  # a failure leaves no half-up server
        address = format_address(args.host, sock.getsockname()[1])
        for line in configuration_lines(app.state.ctx, address):
            logger.info("%s", line)
        return _serve(app, engine, args, sock)


def _serve(app: FastAPI, engine: AsyncEngine, args: argparse.Namespace, sock: socket.socket) -> int:
    """Serves on the bound socket until the drain ends; the process exit code."""
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = DrainingServer(config, app.state.server_state, engine, args.shutdown_timeout)
    server.web_ui = not args.disable_web_ui
    try:
        server.run(sockets=[sock])
    finally:
        # The lifespan's shutdown stopped the engine; a server that failed to start (a
        # port in use) or was forced to exit did not run it: nothing may outlive this.
        engine.close(ENGINE_CLOSE_TIMEOUT_S)
        _report_threads_left()
    return server.exit_code


def _report_threads_left() -> None:
    """Logs the engine's threads still running once it has shut down (a daemon thread
    would otherwise end silently with the process; a test reads the warning)."""
    left = sorted(
        t.name for t in threading.enumerate() if t.name.startswith("pagoda-") and t.is_alive()
    )
    if left:
        logger.warning("threads still running at exit: %s", ", ".join(left))
