"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) served without the internet.

FastAPI's own pages load their scripts and styles from a CDN, so they stay blank on the air-gapped
machines self-hosters often run. Here the same pages (FastAPI's ``get_swagger_ui_html`` /
``get_redoc_html``) read the files the ``fastapi-offline`` package ships (Swagger UI 5, ReDoc), from
``/docs/assets/`` of this app. A reverse proxy's prefix (``root_path``) is kept in every URL.
"""
from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs/assets"      # the bundled files: swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png
ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"
PAGES = frozenset({"/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"})


def is_docs_path(path: str) -> bool:
    """Whether ``path`` (within the app) is a documentation page, the OpenAPI document or a page's file."""
    return path in PAGES or path.startswith(ASSETS + "/")


def add_docs_pages(app: FastAPI) -> None:
    """Serve ``/docs``, ``/docs/oauth2-redirect``, ``/redoc`` and their files on ``app`` (built with
    ``docs_url=None, redoc_url=None``)."""
    app.mount(ASSETS, StaticFiles(directory=ASSETS_DIR), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=root + app.openapi_url, title=app.title + " - Swagger UI",
                                   oauth2_redirect_url=root + "/docs/oauth2-redirect",
                                   swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{ASSETS}/favicon.png")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=root + app.openapi_url, title=app.title + " - ReDoc",
                              redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{ASSETS}/favicon.png", with_google_fonts=False)
