"""The FastAPI app ``api`` that every route module registers its routes on, its middleware, and the
OpenAPI ``responses`` tables that routes of several modules share.

The routes are methods of ``gateway.Gateway`` and of the mixins it inherits (routes_*.py): Serve's
ingress binds a route to the replica's Gateway when its method's ``__qualname__`` names a class of the
Gateway's MRO (``ray.serve._private.http_util.make_fastapi_class_based_view``). gateway.py completes
the app's OpenAPI document (``openapi_document``).
"""
from fastapi import FastAPI
from ray import serve
from ray.serve.exceptions import RayServeException

from .access_log import AccessLogMiddleware
from .body import BodyMiddleware, HeadMiddleware
from .cors import CorsMiddleware
from .errors import LIBRE_PATHS, add_exception_handlers
from .guard import GuardMiddleware
from .libretranslate import LibreError
from .schemas import ErrorResponse

# The OpenAPI responses of each route: every status it answers, with its body schema.
RETRY_HEADERS = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}


def error_responses(model, statuses: dict[int, str]) -> dict:
    """FastAPI ``responses`` for {status: description}, each with ``model`` as its body (503 with Retry-After)."""
    return {status: {"model": model, "description": description,
                     **({"headers": RETRY_HEADERS} if status == 503 else {})}
            for status, description in statuses.items()}


NATIVE_ERRORS = error_responses(ErrorResponse, {
    404: 'unknown model, or no model for source_lang/target_lang (with source_lang "auto": for a detected language); '
         "glossary_id names no stored glossary",
    409: "glossary_id names a stored glossary of other languages than the model's",
    401: "API keys are on and the request has no valid Authorization: Bearer key",
    413: "a text, list, sentence or body over its limit (the message names it)",
    415: "a Content-Type, charset or Content-Encoding other than the accepted ones (named in the message)",
    422: "invalid fields (wrong types, out of range, unknown), an undecodable body, or a multilingual model's "
         "target_lang missing or unknown (the message names the choices)",
    429: "over the rate limit of this key or client (Retry-After, RateLimit-* headers)",
    503: "overloaded, queue full, or the model is loading",
    504: "timeout_s (or the server's max_timeout_s) passed; the request's sentences were cancelled"})
LIBRE_ERRORS = error_responses(LibreError, {
    400: "invalid request: a field missing or invalid, an unsupported language pair (with source auto: a detected "
         "language no model translates), a text over its limit",
    413: "a body over MAX_BODY_BYTES (service/api/body.py)",
    401: "API keys are on and neither Authorization: Bearer nor api_key holds a valid key",
    415: "a Content-Type, charset or Content-Encoding other than the accepted ones",
    429: "over the rate limit of this key or client",
    503: "overloaded or the model is loading",
    504: "the server's max_timeout_s passed"})

def replica_gateway():
    """This replica's ``gateway.Gateway`` (its API keys, rate limits and CORS origins), None outside a
    Serve replica. Read per request through Serve's replica context, not through this module's ``api``:
    Serve runs a copy of the app, which the Gateway's constructor does not see."""
    try:
        return serve.get_replica_context().servable_object
    except RayServeException:
        return None


api = FastAPI(
    title="Transformer MT service",
    version="0.1.0",
    description="Machine translation with the original Transformer, continuous batching on Ray Serve. "
                "Native API under /v1, LibreTranslate-compatible /translate and /languages, Prometheus /metrics.",
    redirect_slashes=False,   # "/v1/translate/" is a 404 naming the path, not a redirect built from the Host header
)
api.add_middleware(HeadMiddleware)        # innermost: HEAD on every GET route, answered without a body
api.add_middleware(BodyMiddleware)        # decodes bodies before the routes read them
api.add_middleware(GuardMiddleware, get_guard=lambda: getattr(replica_gateway(), "guard", None), libre_paths=LIBRE_PATHS)
api.add_middleware(CorsMiddleware, get_origins=lambda: getattr(replica_gateway(), "cors_origins", None))   # preflights
# answered before the guard (a browser sends them without the key); its headers reach every answer, errors too
api.add_middleware(AccessLogMiddleware)   # outer: logs and counts every answer, the body's 413/415 too
add_exception_handlers(api)
