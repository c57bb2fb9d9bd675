"""The attention explorer: a static web page at ``/`` that calls ``POST /v1/translate`` with
``return_attention`` and draws every layer's and head's weights (docs/explorer.md).

    GET /                      explorer.html, with <base href> set to the app's route prefix
    GET /explorer/{name}       its script and style sheet (STATIC_FILES); 404 for any other name

The files live in ``service/api/static/`` (package data): no CDN, no build step. With API keys on and
``protect_explorer`` set, these paths need a key too (guard.py): an ``Authorization: Bearer`` header
or the ``KEY_COOKIE`` cookie the page sets from its key field; a browser without one gets
``key.html`` (status 401), a form that stores the key and reloads.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Optional
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from service.protocol import ServiceError

STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"explorer.js": "text/javascript; charset=utf-8", "explorer.css": "text/css; charset=utf-8"}
PREFIX = "/explorer/"
KEY_COOKIE = "mt_api_key"        # set by the page (key field) for its own files under protect_explorer
BASE_MARK = '<base href="./">'   # explorer.html's placeholder, replaced by the app's root path
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def is_explorer_path(path: str) -> bool:
    """Whether ``path`` (within the app) is the page or one of its files."""
    return path == "/" or path.startswith(PREFIX)


def _read(name: str) -> str:
    """A file of STATIC (read on each request: a few KB, and edits show without a restart)."""
    return (STATIC / name).read_text(encoding="utf-8")


def page(request: Request) -> HTMLResponse:
    """explorer.html; relative URLs (its files, the API) resolve under the app's route prefix."""
    root = request.scope.get("root_path", "").rstrip("/")
    text = _read("explorer.html").replace(BASE_MARK, f'<base href="{html.escape(root, quote=True)}/">', 1)
    return HTMLResponse(text, headers=HEADERS)


def static_file(name: str) -> Response:
    """One of STATIC_FILES. Raises ServiceError 404 for any other name."""
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise ServiceError(404, f"path: no explorer file {name!r}; files: {sorted(STATIC_FILES)}", "path")
    return Response(_read(name), media_type=media_type, headers=HEADERS)


def cookie_key(headers: dict[str, str]) -> Optional[str]:
    """The API key of the ``KEY_COOKIE`` cookie (lower-cased header names), else None."""
    for part in headers.get("cookie", "").split(";"):
        name, sep, value = part.strip().partition("=")
        if sep and name == KEY_COOKIE and value:
            return unquote(value)
    return None


def key_page(err: ServiceError, headers: Optional[dict[str, str]] = None) -> HTMLResponse:
    """The 401 answer on explorer paths: a form that asks for the key (the error's message included)."""
    text = _read("key.html").replace("{message}", html.escape(err.message))
    return HTMLResponse(text, status_code=err.status, headers={**HEADERS, **(headers or {})})
