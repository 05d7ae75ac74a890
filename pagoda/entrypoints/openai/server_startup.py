"""What `pagoda serve` does around loading the model: take the port first, say what is
on once loaded.

Owns `bind_port(host, port)`: binds the listening address before the model loads, so
a busy port, a privileged port or an address this machine lacks is one `error:` line
(exit 2, no traceback) naming the flag to change, seconds after start rather than
after the load. The socket is bound, not listening: a client that connects while
the model loads is refused, never left waiting; uvicorn starts listening on this
very socket once the engine is ready. (Only a process that binds the port with
SO_REUSEADDR while this one loads can still take it; listening then fails with one
line, api_server.DrainingServer.)

And `configuration_lines(ctx, address)`: the start-up log's one line per setting a
user asks "is it on?" about (served model names, address, API key, web UI, API
docs, tool calling), logged at INFO before `ready:`. The API key itself is never
logged.
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

from pagoda.entrypoints.openai.tool_template import WARNING_HEADER

if TYPE_CHECKING:  # the serving stack imports torch: bind_port runs before it loads
    from pagoda.entrypoints.openai.serving_common import ServingContext

_HINTS = {
    errno.EADDRINUSE: "another process holds it: stop that process or choose another port "
    "with --port",
    errno.EACCES: "ports below 1024 need privileges: choose another port with --port",
    errno.EADDRNOTAVAIL: "this machine has no such address: check --host",
}


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; ValueError (one line for
    the CLI) naming --port or --host when the address cannot be taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn and asyncio do: a restart may rebind while the last run's
    # connections sit in TIME_WAIT; a port another process listens on still fails.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host!r}: {exc.strerror}: check --host") from None
    except OSError as exc:
        sock.close()
        hint = _HINTS.get(exc.errno, "choose another address with --host or --port")
        address = format_address(host, port)
        raise ValueError(f"cannot listen on {address}: {exc.strerror}; {hint}") from None
    return sock


def _tools_line(ctx: ServingContext) -> str:
    auto = ctx.auto_tool_choice()
    if auto.parser is not None:
        chosen = auto.source == "chat template"
        origin = "chosen from the chat template" if chosen else "--tool-call-parser"
        auto_state = f"tool_choice 'auto' on, parser {auto.parser} ({origin})"
    elif auto.answers_as_text:
        auto_state = "tool_choice 'auto' answers in plain text"
    else:
        auto_state = f"tool_choice 'auto' off ({auto.source}; --tool-call-parser NAME turns it on)"
    if ctx.tool_support().renders_tools:
        template = "the chat template renders tools"
    elif ctx.settings.strict_tool_template:
        template = (
            "the chat template drops tools: requests with tools get a 400 (--strict-tool-template)"
        )
    else:
        template = (
            f"the chat template drops tools: responses to requests with tools carry "
            f"{WARNING_HEADER} (--strict-tool-template refuses them)"
        )
    return f"tool calling: {template}; {auto_state}"


def configuration_lines(ctx: ServingContext, address: str) -> list[str]:
    """One line per setting, in the order a user checks them (the engine logs its
    own: model, KV cache, structured output and the reasoning parser)."""
    settings = ctx.settings
    key = (
        "on (every route but /health and the web UI's static files needs "
        "'Authorization: Bearer <key>')"
        if settings.api_key
        else "off (every route is open; --api-key or $PAGODA_API_KEY sets one)"
    )
    if settings.metrics_public and settings.api_key:
        key += "; /metrics is public"
    web_ui = "on (/ and /dashboard)" if settings.enable_web_ui else "off (--disable-web-ui)"
    docs = (
        "on (/docs and /redoc load their scripts from a CDN: they need a network)"
        if settings.enable_api_docs
        else "off (--enable-api-docs; /openapi.json is served)"
    )
    return [
        f"served model names: {', '.join(settings.served_model_names)}",
        f"address: {address}",
        f"API key: {key}",
        f"web UI: {web_ui}",
        f"API docs: {docs}",
        _tools_line(ctx),
    ]
