"""The OpenAPI ``responses`` tables that the routers of several modules share."""
from ..libre_schemas import LibreError
from ..schemas import ErrorResponse

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
    413: "a body over MAX_BODY_BYTES (service/api/middleware/body.py)",
    401: "API keys are on and neither Authorization: Bearer nor api_key holds a valid key",
    415: "a Content-Type, charset or Content-Encoding other than the accepted ones",
    429: "over the rate limit of this key or client",
    503: "overloaded or the model is loading",
    504: "the server's max_timeout_s passed"})
