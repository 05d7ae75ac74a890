"""`pagoda serve`: the subcommand and its flags (vLLM's names), registered by
`add_serve_parser(subparsers)` from the main CLI.

Engine flags come from the shared `add_engine_args` (so `serve`, `generate` and
`chat` agree); the server's own flags are grouped under "server".
"""

from __future__ import annotations

import argparse
import os

from pagoda.entrypoints.cli_args import add_engine_args
from pagoda.entrypoints.openai.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "PAGODA_API_KEY"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for all)",
    )
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer <key>' on every route but /health "
        f"(default: ${API_KEY_ENV}; unset means no key)",
    )
    g.add_argument(
        "--metrics-public", action="store_true", help="serve /metrics without the API key"
    )
    g.add_argument(
        "--max-num-queued-requests",
        type=_positive_int,
        default=1024,
        help="requests waiting for their first token beyond which new ones get 429 "
        "with Retry-After (default 1024)",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=_positive_int,
        default=None,
        help="prompt tokens waiting for their first token beyond which new requests "
        "get 429 (default: no limit)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=4 << 20,
        help="larger request bodies get 413 (default 4 MiB)",
    )
    g.add_argument(
        "--max-n",
        type=_positive_int,
        default=16,
        help="largest n (choices per prompt) a request may ask for (default 16)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        choices=range(0, 21),
        metavar="[0-20]",
        help="largest logprobs / top_logprobs a request may ask for (default 20)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish (default 30)",
    )
    g.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="do not serve the chat page (/) and the engine dashboard (/dashboard)",
    )
    g.add_argument(
        "--enable-debug-routes",
        action="store_true",
        help="add GET /debug/kv_audit (KV block audit; guarded by the API key)",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log each request's id, prompt length and sampling parameters",
    )
    g.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="do not log one line per HTTP request",
    )
    add_tool_args(parser)
    g.add_argument(
        "--enable-api-docs",
        action="store_true",
        help="serve the interactive API docs at /docs and /redoc (their scripts come "
        "from a CDN: they need a network); /openapi.json is always served",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default info)",
    )


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """The tool-calling flags: which parser reads calls, and what a template that drops
    tools gets (docs/structured-outputs.md)."""
    g = parser.add_argument_group("tool calling")
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how to find tool calls in free text for tool_choice 'auto': hermes "
        "(<tool_call>{json}</tool_call>: Hermes, Qwen) or llama3_json (Llama 3.1+); "
        "default: the format the chat template writes calls in, when it renders tools",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="parse tool calls for tool_choice 'auto' (the default with tools) even when "
        "the chat template does not render tools; needs --tool-call-parser. Without it, "
        "'auto' parses calls when the template renders tools and answers in plain text "
        "when it does not",
    )
    g.add_argument(
        "--strict-tool-template",
        action="store_true",
        help="answer 400 to a chat request with tools when the model's chat template "
        "does not render them (default: serve it with an x-pagoda-warning header)",
    )


def cmd_serve(ns: argparse.Namespace) -> int:
    from pagoda.entrypoints.openai.server_startup import bind_port

    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError(
            "--enable-auto-tool-choice needs --tool-call-parser hermes (Hermes and Qwen "
            "templates) or --tool-call-parser llama3_json (Llama 3.1+ templates)"
        )
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    # The port first, before the server stack (torch) is imported: a busy port is one
    # line within a few seconds.
    sock = bind_port(ns.host, ns.port)
    from pagoda.entrypoints.openai.api_server import run_server

    return run_server(ns, sock)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /v1/models/{id}, /tokenize, /detokenize, /health, "
        "/metrics, /version), with a chat page at / and a live engine dashboard "
        "at /dashboard.",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="the model to serve (same as --model; default: the embedded SmolLM2)",
    )
    add_engine_args(parser)
    add_server_args(parser)
    parser.set_defaults(func=cmd_serve)
    return parser
