"""The web chat page (/) and the live dashboard (/dashboard) of `pagoda serve`.

Owns serving the static files shipped in the package (`web/` beside this module:
HTML, CSS, JavaScript, no build step, nothing from a CDN) and their security
headers. The files hold no data and no secret, so they are public even with
--api-key (`public_paths()` lists them for the API-key guard); the scripts ask for
the key and send it on every data route. --disable-web-ui registers none of them.

Every file is read once when the app is built and served from memory with a strict
Content-Security-Policy: scripts, styles, images and fetches from this origin only,
no inline script or style (the pages have none: every script and style sheet is a
separate file), no framing, no form posts, no <base>.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import Response

ASSET_PREFIX = "/web/"
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: an upgraded server serves its own scripts
}
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}


@functools.lru_cache(maxsize=1)
def _web_files() -> dict[str, bytes]:
    """Name -> content of every shipped file (package data: see pyproject.toml)."""
    folder = importlib.resources.files("pagoda.entrypoints.openai") / "web"
    files = {
        entry.name: entry.read_bytes()
        for entry in folder.iterdir()
        if entry.is_file() and "." + entry.name.rsplit(".", 1)[-1] in _CONTENT_TYPES
    }
    missing = set(PAGES.values()) - set(files)
    if missing:
        raise RuntimeError(
            f"the web UI files {sorted(missing)} are missing from the package: "
            "reinstall Pagoda, or serve with --disable-web-ui"
        )
    return files


def _routes() -> dict[str, str]:
    """URL path -> file name, for the pages and every other shipped file."""
    routes = dict(PAGES)
    for name in _web_files():
        if name not in PAGES.values():
            routes[ASSET_PREFIX + name] = name
    return routes


def public_paths() -> set[str]:
    """The paths the API-key guard lets through: the pages and their static files."""
    return set(_routes())


def _handler(content: bytes, content_type: str) -> Callable:
    async def serve_file() -> Response:
        return Response(content, media_type=content_type, headers=SECURITY_HEADERS)

    return serve_file


def add_web_ui_routes(app: FastAPI) -> None:
    files = _web_files()
    for path, name in _routes().items():
        content_type = _CONTENT_TYPES["." + name.rsplit(".", 1)[-1]]
        app.add_api_route(
            path,
            _handler(files[name], content_type),
            methods=["GET"],
            include_in_schema=False,
            name=f"web:{name}",
        )
