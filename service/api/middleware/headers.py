"""Request headers that Ray Serve's own ingress code reads, checked before it reads them.

Serve's HTTP entry (the direct-ingress replica behind HAProxy, and its Python proxy) decodes a few
header values as UTF-8 before any application code runs: ``X-Request-ID``, the multiplexed-model and
session-id headers, ``X-Request-Disconnect-Disabled``, the request-timeout header and the tracing
headers. HTTP allows any byte from 0x80 up in a header value (RFC 9110 section 5.5, ``obs-text``), so a
client sending e.g. a Latin-1 request id got a plain-text 500 from Serve. ``HeaderCheck`` answers such
a request with the API's 400 naming the header instead, and likewise an ``X-Request-ID`` over
``MAX_REQUEST_ID_CHARS`` characters or two different ``X-Request-ID`` values in one request.

Serve runs it through its proxy-callback hook: ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` =
``service.api.middleware.headers:ingress_middlewares`` (set by ``service.ray_env.serve_env``, the Dockerfile and
``deploy/rayservice.yaml``); Serve applies the middlewares it returns inside its request-id middleware
and ahead of its own request handling, in the proxy and in every ingress replica.
"""
from __future__ import annotations

from typing import Any

# Header names as Serve compares them: lower case, "-" and "_" alike. Serve's own constants are used
# where this Ray version has them, so that a renamed header is still covered.
_FALLBACK = ("x-request-id", "serve_multiplexed_model_id", "x-session-id", "x-request-disconnect-disabled",
             "x-request-timeout-seconds", "traceparent", "tracestate")
_SERVE_CONSTANTS = ("SERVE_HTTP_REQUEST_ID_HEADER", "SERVE_MULTIPLEXED_MODEL_ID", "SERVE_SESSION_ID",
                    "SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER", "SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER")


def _key(name: bytes) -> bytes:
    return name.lower().replace(b"-", b"_")


def serve_read_headers() -> frozenset[bytes]:
    """The header names (as ``_key`` gives them) whose values Serve decodes as UTF-8."""
    names = set(_FALLBACK)
    try:
        from ray.serve._private import constants
        names.update(v for v in (getattr(constants, c, None) for c in _SERVE_CONSTANTS) if isinstance(v, str))
    except ImportError:    # pragma: no cover - Serve moved its constants: the fallback names remain
        pass
    return frozenset(_key(n.encode("ascii")) for n in names)


# X-Request-ID is echoed in every response and written into every access-log line: longer ones are
# refused (400 naming the header and the limit) rather than copied whole.
MAX_REQUEST_ID_CHARS = 200
_REQUEST_ID = b"x_request_id"


def too_long_request_id(headers) -> int | None:
    """The length in characters of an X-Request-ID over ``MAX_REQUEST_ID_CHARS``, else None (also for
    one that is not UTF-8: ``bad_header`` names that)."""
    for name, value in headers:
        if len(value) > MAX_REQUEST_ID_CHARS and _key(name) == _REQUEST_ID:
            try:
                n = len(value.decode("utf-8"))
            except UnicodeDecodeError:
                return None
            return n if n > MAX_REQUEST_ID_CHARS else None
    return None


def repeated_request_id(headers) -> int | None:
    """How many different X-Request-ID values ``headers`` carry when more than one, else None: a
    request has one id (it is echoed and logged), so two different ones are refused, not one dropped."""
    values = {value for name, value in headers if _key(name) == _REQUEST_ID}
    return len(values) if len(values) > 1 else None


def bad_header(headers, checked: frozenset[bytes]) -> str | None:
    """The first header of ``headers`` (ASGI [(name, value)] byte pairs) that Serve could not read: a
    name that is not ASCII, or a value of a ``checked`` header that is not UTF-8; None when all are fine."""
    for name, value in headers:
        if not name.isascii():
            return name.decode("latin-1")
        if _key(name) in checked and not value.isascii():
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return name.decode("ascii")
    return None


class HeaderCheck:
    """Pure ASGI middleware: 400 with the API's error body for a header ``bad_header`` finds, an
    X-Request-ID over ``MAX_REQUEST_ID_CHARS`` or two different X-Request-IDs; every other request
    (and every non-HTTP scope) passes through untouched. Per request it only scans the header list (bytes comparisons). A refused request
    id is not echoed: the 400 carries a fresh one."""

    def __init__(self, app: Any):
        self.app = app
        self.checked = serve_read_headers()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers", ())
            name = bad_header(headers, self.checked)
            if name is not None:
                printable = name.encode("latin-1").decode("ascii", "backslashreplace")
                await self._reject(printable, f"header {printable}: its value must be UTF-8 text (ASCII is safest)"
                                   if name.isascii() else f"header name {printable!r}: header names must be ASCII",
                                   scope, receive, send)
                return
            n = too_long_request_id(headers)
            if n is not None:
                await self._reject("x-request-id", f"header x-request-id: at most {MAX_REQUEST_ID_CHARS} "
                                   f"characters, got {n}", scope, receive, send)
                return
            n = repeated_request_id(headers)
            if n is not None:
                await self._reject("x-request-id", f"header x-request-id: one value per request, got {n} "
                                   "different ones", scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _reject(printable: str, message: str, scope, receive, send) -> None:
        import uuid

        from service.protocol import ServiceError

        from ..errors import LIBRE_PATHS, error_response, libre_error_response
        err = ServiceError(400, message, field=f"header.{printable.lower()}")
        headers = {"x-request-id": uuid.uuid4().hex} if _key(printable.encode("latin-1")) == _REQUEST_ID else None
        response = (libre_error_response(err, headers) if scope.get("path") in LIBRE_PATHS
                    else error_response(err, headers=headers))
        await response(scope, receive, send)


def ingress_middlewares() -> list:
    """Serve's HTTP proxy callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): [HeaderCheck]."""
    from starlette.middleware import Middleware
    return [Middleware(HeaderCheck)]
