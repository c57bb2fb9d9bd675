"""Cross-origin requests (CORS, https://fetch.spec.whatwg.org/#http-cors-protocol): browser clients on
other origins (LibreTranslate's web page, extensions, web editors) may call every route.

Starlette's ``CORSMiddleware`` does the work; ``CorsMiddleware`` builds it from the origins the
Gateway was configured with (``AppArgs.cors_origins``: default ``["*"]``, any origin, as
LibreTranslate answers; ``[]``: no CORS headers, preflights pass on to the routes). It sits outside
the guard, so a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``, sent
by browsers without the key) is answered 200 without a key, and its headers reach every answer,
the guard's 401/429 and the body's 413/415 included. No credentials (cookies) are allowed across
origins: keys travel in the ``Authorization`` header, which preflights allow. Same-origin requests
(the explorer page) send no preflight and are unaffected.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from starlette.middleware.cors import CORSMiddleware

METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS")
# Answer headers a cross-origin script may read (besides the CORS-safelisted ones)
EXPOSED = ("X-Request-ID", "Retry-After", "RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset",
           "X-Ignored-Fields", "WWW-Authenticate", "Content-Disposition")   # the last: a translated file's name
PREFLIGHT_MAX_AGE_S = 600     # seconds a browser may reuse a preflight's answer


class CorsMiddleware:
    """Starlette's CORSMiddleware with the origins of ``get_origins()`` (None or []: passes through)."""

    def __init__(self, app, get_origins: Callable[[], Optional[Sequence[str]]]):
        self.app, self.get_origins = app, get_origins
        self._built: Optional[tuple[tuple[str, ...], CORSMiddleware]] = None

    async def __call__(self, scope, receive, send):
        origins = tuple(self.get_origins() or ()) if scope["type"] == "http" else ()
        if not origins:
            return await self.app(scope, receive, send)
        if self._built is None or self._built[0] != origins:
            self._built = (origins, CORSMiddleware(self.app, allow_origins=list(origins), allow_methods=list(METHODS),
                                                   allow_headers=["*"], expose_headers=list(EXPOSED),
                                                   max_age=PREFLIGHT_MAX_AGE_S))
        await self._built[1](scope, receive, send)
