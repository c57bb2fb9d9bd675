"""The HTTP API: a FastAPI ingress in front of the translators.

    gateway.py         the Gateway ingress: the native API and health routes, model resolution, limits, SSE
    routes_*.py        the Gateway's other route groups, a mixin each: LibreTranslate (routes_libre),
                       DeepL (routes_deepl), documents (routes_documents), glossaries and memory (routes_stores)
    routes_common.py   the FastAPI app they all register on, its middleware, shared OpenAPI responses
    backends.py        how the gateway reaches translators: Ray handles, or in-process
    schemas.py         request/response models, service-wide limits, ModelLimits, TranslateJob
    errors.py          ServiceError, the one mapping of engine/Ray errors, error responses
    libretranslate.py  the LibreTranslate-compatible /translate and /languages
    html.py            format=html: translating an HTML fragment's text, keeping its markup
    sse.py             Server-Sent Events formatting
    access_log.py      the access-log and HTTP-metrics middleware

Nothing is imported here: ``service.translator`` imports ``schemas`` and ``errors`` while
``gateway`` imports ``service.translator``.
"""
