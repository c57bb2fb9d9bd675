"""``build_app(services)``: the FastAPI app of one ingress replica, its middleware and routers in
the order they apply, and its OpenAPI document.

Middleware, outermost first (each answers what is its own, in the route's error shape):
    AccessLogMiddleware   logs and counts every answer (access_log.py), the body's 413/415 too
    CorsMiddleware        preflights answered before the guard (a browser sends them without the key);
                          Access-Control-* headers on every answer, errors too (cors.py)
    GuardMiddleware       API keys, rate limits (guard.py)
    BodyMiddleware        reads and decodes bodies before the routes do (body.py)
    HeadMiddleware        HEAD on every GET route, answered without a body (body.py)

Routers (routes/), in the OpenAPI document's order: native.py, stores.py, libre.py (LibreTranslate),
deepl.py, deepl_glossaries.py (DeepL's /v2 and /v3 glossaries), deepl_memories.py (DeepL's
/v3/translation_memories), documents.py.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI

from . import openapi
from .docs_pages import add_docs_pages
from .errors import LIBRE_PATHS, add_exception_handlers
from .middleware.access_log import AccessLogMiddleware
from .middleware.body import BodyMiddleware, HeadMiddleware
from .middleware.cors import CorsMiddleware
from .middleware.guard import GuardMiddleware
from .routes import deepl as routes_deepl
from .routes import deepl_glossaries as routes_deepl_glossaries
from .routes import deepl_memories as routes_deepl_memories
from .routes import documents as routes_documents
from .routes import libre as routes_libre
from .routes import native as routes_native
from .routes import stores as routes_stores
from .services import Services

ROUTERS = (routes_native.router, routes_stores.router, routes_libre.router, routes_deepl.router,
           routes_deepl_glossaries.router, routes_deepl_memories.router, routes_documents.router)


def build_app(svc: Optional[Services]) -> FastAPI:
    """The app serving ``svc`` (``services.services`` hands it to every route). ``svc`` None: the
    bare app, for its OpenAPI document without served models (a route that needs them fails)."""
    app = FastAPI(
        title="Transformer MT service",
        version="0.1.0",
        description="Machine translation with the original Transformer, continuous batching on Ray Serve. "
                    "Native API under /v1, LibreTranslate-compatible /translate and /languages, Prometheus /metrics.",
        redirect_slashes=False,   # "/v1/translate/" is a 404 naming the path, not a redirect built from the Host header
        docs_url=None, redoc_url=None,    # served from the package's files instead of a CDN (docs_pages.py)
    )
    add_docs_pages(app)
    app.state.services = svc
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(HeadMiddleware)
    app.add_middleware(BodyMiddleware)
    app.add_middleware(GuardMiddleware, get_guard=lambda: svc.guard if svc else None, libre_paths=LIBRE_PATHS)
    app.add_middleware(CorsMiddleware, get_origins=lambda: svc.cors_origins if svc else None)
    app.add_middleware(AccessLogMiddleware)
    add_exception_handlers(app)

    def document() -> dict:
        """GET /openapi.json: FastAPI's document, with the request bodies as these services accept
        them (``openapi.complete``); built once."""
        if app.openapi_schema is None:
            app.openapi_schema = openapi.complete(FastAPI.openapi(app), svc)
        return app.openapi_schema
    app.openapi = document
    return app
