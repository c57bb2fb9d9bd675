"""Errors of the HTTP API: a ``ServiceError`` (``service/protocol.py``; every other error is mapped to
one by ``service/replica.to_service_error``) rendered in the error shape of the route's API.

    raised on the request path     -> ServiceError(status, message, field, retry_after)
    domain / Ray handle exception  -> replica.to_service_error() -> ServiceError   (the one mapping)
    translator replica             -> returns ErrorRecord (a value: no replica failure in Ray's logs)
    FastAPI handlers               -> {"error": {"type", "message", "field"}}   (native API)
                                      {"error": message}, 4xx as 400          (LibreTranslate routes)
"""
from __future__ import annotations

import math
import re
import sys
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.protocol import ServiceError, short_name, shown

LIBRE_PATHS = ("/translate", "/languages", "/detect", "/translate_file", "/suggest",
               "/frontend/settings")    # routes that answer in LibreTranslate's error shape
DEEPL_PREFIX = ("/v2/", "/v3/")     # DeepL-compatible routes (str.startswith): DeepL's error shape
MAX_DETAILS = 20      # errors listed in one 422 body; the rest are counted, not listed
# Python's JSON parser recurses once per nested array or object and stops at the recursion limit.
JSON_TOO_DEEP = (f"JSON nested too deep (arrays and objects inside each other beyond about "
                 f"{sys.getrecursionlimit()} levels; a request needs at most 3)")


# ---- rendering ---------------------------------------------------------------------------------------
def _retry_header(retry_after: Optional[float]) -> Optional[dict[str, str]]:
    return {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None


def error_response(err: ServiceError, details: Optional[list] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """The native API's error body: {"error": {"type", "message", "field"[, "details"]}}."""
    body = {"error": {"type": err.type, "message": err.message, "field": err.field}}
    if details:
        body["error"]["details"] = details
    return JSONResponse(body, status_code=err.status, headers={**(_retry_header(err.retry_after) or {}),
                                                                **(headers or {})} or None)


def libre_error_response(err: ServiceError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """LibreTranslate's error format: {"error": message}; invalid input is a 400 there. An unknown
    stored glossary (``glossary_id``, this service's own field) and a text whose language ``source:
    auto`` finds no model for (autodetect.NOT_SERVED) stay 404, as on every route."""
    kept = err.status == 404 and (err.field == "glossary_id" or err.type == "language_not_served")
    status = 400 if err.status in (404, 413, 422) and not kept else err.status
    return JSONResponse({"error": err.message}, status_code=status,
                        headers={**(_retry_header(err.retry_after) or {}), **(headers or {})} or None)


def deepl_error_response(err: ServiceError, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """DeepL's error shape ``{"message": ...}`` with its statuses (deepl.py): a missing or wrong key
    (401 here) is 403; invalid input (404 unknown language pair, 415, 422) is 400; an unknown
    glossary, memory or path, and a text whose language detection cannot tell or no model reads
    (autodetect.NOT_SERVED: 404 on every route; the text is valid, this server lacks its model), 404;
    413, 429, 503, 504 stay (Retry-After kept)."""
    status = {401: 403, 404: 400, 415: 400, 422: 400}.get(err.status, err.status)
    if err.type in ("glossary_not_found", "path_not_found", "translation_memory_not_found", "language_not_served"):
        status = 404
    hdrs = {**(_retry_header(err.retry_after) or {}), **(headers or {})}
    hdrs.pop("WWW-Authenticate", None)
    return JSONResponse({"message": err.message}, status_code=status, headers=hdrs or None)


def format_validation_error(err: dict) -> tuple[str, str]:
    """(field, message) for one pydantic error dict: the dotted field path and a message naming it."""
    if err.get("type") == "json_invalid":  # loc is ("body", character offset)
        offset = err.get("loc", (None, None))[-1]
        return "body", f"body: invalid JSON at character {offset}: {err.get('msg', 'JSON decode error')}"
    loc = [short_name(str(p)) for p in err.get("loc", ()) if p not in ("body", "query")]
    # Union members and the model-level validator add noise to the path.
    loc = [p for p in loc if p not in ("str", "list[str]", "function-after[_n_best_within_beam(), TranslateRequest]")]
    field = ".".join(loc)
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if not field:   # a model-level check names its field first ("n_best: ..."); else the body itself
        named = re.match(r"([a-z_]+(?:\.[a-z_]+)*): ", msg)
        field = named.group(1) if named else "body"
    value = err.get("input")
    if err.get("type") == "string_too_long" and isinstance(value, str):
        msg += f" (got {len(value)})"       # the length received beside the limit, not the whole value
    elif "input" in err and err.get("type") not in ("missing", "extra_forbidden") and not isinstance(value, (dict, list)):
        got = repr(value)
        if len(got) <= 40 and f"got {got}" not in msg:     # a message that names the value already: once
            msg += f" (got {got})"
    named = msg.startswith(field) or f" {field} parameter" in msg or f"'{field}'" in msg    # named already: once
    return field, f"{field}: {msg}" if field and not named else msg


def route_path(scope) -> str:
    """The request's path within the app: Ray Serve keeps the route prefix in ``path`` and names it
    in ``root_path`` (an app served under ``/embedded`` sees ``/embedded/translate``)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


def _is_libre(request: Request) -> bool:
    return route_path(request.scope) in LIBRE_PATHS


def sent_type(request: Request, absent: str = "none") -> str:
    """The Content-Type a request sent, for messages: its media type, else the header as sent
    (``;;;===`` has none), else ``absent``."""
    raw = request.headers.get("content-type", "")
    return raw.split(";")[0].strip().lower() or (shown(raw) if raw.strip() else absent)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method == "POST" and ctype != "application/json" and not ctype.endswith("+json"):
        # FastAPI did not parse the body at all: say so instead of "body: must be an object"
        return error_response(ServiceError(415, f"Content-Type: {request.url.path} takes a JSON body "
                                                f"(application/json), got {sent_type(request)}", "Content-Type"))
    details = []
    errors = exc.errors()
    for err in errors[:MAX_DETAILS]:
        field, msg = format_validation_error(err)
        details.append({"field": field, "message": msg})
    if len(errors) > MAX_DETAILS:   # e.g. thousands of unknown fields: the body stays small
        details.append({"field": "body", "message": f"body: {len(errors) - MAX_DETAILS} more errors not listed "
                                                    f"(the first {MAX_DETAILS} are)"})
    first = details[0] if details else {"field": None, "message": "invalid request"}
    return error_response(ServiceError(422, first["message"], first["field"]),
                          details=details if len(details) > 1 else None)


def _path_methods(request: Request, first: str) -> str:
    """The methods of every route of the request's path ("GET, PUT, DELETE"; included and mounted
    routers too: Serve's ingress includes the class's routes), ``first`` (Starlette's Allow) when none
    are found."""
    from starlette.routing import Match
    methods: list[str] = []

    def collect(routes, scope) -> None:
        for route in routes:
            included = getattr(route, "original_router", None)    # FastAPI's include_router (Serve's ingress)
            if included is not None:
                collect(included.routes, scope)
            elif getattr(route, "routes", None) is not None and not getattr(route, "methods", None):
                match, child = route.matches(scope)          # a Mount: its routes, below its path
                if match != Match.NONE:
                    collect(route.routes, {**scope, **child})
            elif getattr(route, "methods", None) and route.matches(scope)[0] == Match.PARTIAL:
                methods.extend(m for m in sorted(route.methods) if m not in methods and m != "HEAD")
    collect(getattr(getattr(request, "app", None), "routes", ()), request.scope)
    return ", ".join(methods) or first


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Framework errors (unknown path, wrong method, unparsable body) in the service's error shape."""
    message = exc.detail if isinstance(exc.detail, str) else "invalid request"
    # A 405 names the methods the path takes (Allow, RFC 9110 15.5.6); nothing else is passed on.
    allow = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"} or None
    if allow:   # Starlette names the first route of the path only: every route of it counts
        allow = {k: _path_methods(request, v) for k, v in allow.items()}
    if allow:   # GET routes answer HEAD too (body.HeadMiddleware)
        allow = {k: v + ", HEAD" if "GET" in v.split(", ") and "HEAD" not in v else v for k, v in allow.items()}
    if allow:
        message = f"{message}; allowed: {next(iter(allow.values()))}"
    if _is_libre(request):
        return libre_error_response(ServiceError(exc.status_code, message), headers=allow)
    if _is_deepl(request):
        return deepl_error_response(ServiceError(exc.status_code, f"{request.method} {request.url.path}: {message}",
                                                 type="path_not_found" if exc.status_code == 404 else None),
                                    headers=allow)
    if exc.status_code == 400:  # FastAPI could not parse the body: say why where we know it
        cause = exc.__cause__
        if isinstance(cause, RecursionError):
            return error_response(ServiceError(422, f"body: {JSON_TOO_DEEP}", "body"))
        if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
            return error_response(ServiceError(
                422, f"body: a number with more than {sys.get_int_max_str_digits()} digits; no field takes one", "body"))
        if isinstance(cause, UnicodeDecodeError):
            return error_response(ServiceError(
                422, f"body: not valid UTF-8 ({cause.reason} at byte {cause.start}); send UTF-8 JSON", "body"))
        return error_response(ServiceError(422, f"body: {message} (send UTF-8 JSON)", "body"))
    return error_response(ServiceError(exc.status_code, f"{request.method} {request.url.path}: {message}"),
                          headers=allow)


def _is_deepl(request: Request) -> bool:
    return route_path(request.scope).startswith(DEEPL_PREFIX)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    if _is_deepl(request):
        return deepl_error_response(exc)
    return libre_error_response(exc) if _is_libre(request) else error_response(exc)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: a 500 in the route's error shape (Starlette logs the traceback after it is sent)."""
    return await _service_error(request, ServiceError(500, f"internal error ({type(exc).__name__}); please "
                                                           "report it with the request's X-Request-ID"))


def add_exception_handlers(api: FastAPI) -> None:
    """Render validation, framework and service errors in the service's error shapes, and anything
    else as a 500 in the same shapes (never Starlette's plain-text page)."""
    api.add_exception_handler(RequestValidationError, _validation_error)
    api.add_exception_handler(StarletteHTTPException, _http_error)
    api.add_exception_handler(ServiceError, _service_error)
    api.add_exception_handler(Exception, _unexpected_error)
