"""The HTTP API: a FastAPI ingress in front of the translators.

    gateway.py         the Gateway ingress: routes, model resolution, limits, SSE
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
