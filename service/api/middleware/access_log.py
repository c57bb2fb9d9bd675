"""The access-log and HTTP-metrics middleware of the ingress."""
from __future__ import annotations

import asyncio
import json
import logging
import logging.handlers
import re
import time
from typing import Optional

from ray import serve
from starlette.requests import ClientDisconnect

from service.metrics import HttpMetrics

from ..errors import route_path

logger = logging.getLogger("ray.serve")

# Paths recorded under their own name in the metrics' endpoint label; any other is "other".
ENDPOINTS = frozenset({"/v1/translate", "/v1/models", "/healthz", "/readyz", "/metrics", "/translate",
                       "/languages", "/detect", "/docs", "/openapi.json", "/"})


# Serve's throughput mode buffers a replica's log records (RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE, 1,000)
# and writes them only when the buffer fills or an ERROR comes: a quiet replica's access lines waited
# indefinitely and were lost when it stopped. The middleware writes them every FLUSH_S seconds instead.
FLUSH_S = 1.0


def flush_serve_log() -> None:
    """Write what Serve's log handlers of this process hold (its ``MemoryHandler`` buffers)."""
    for handler in logger.handlers:
        if isinstance(handler, logging.handlers.MemoryHandler):
            handler.flush()


_PLAIN = re.compile(r'[^\s"=\\]+')


def log_value(value: str) -> str:
    """``value`` as one field of a key=value line: as it is when it has no whitespace, quote, ``=`` or
    backslash (request ids are usually UUIDs), else JSON-quoted, so that a client's X-Request-ID
    cannot add fields to its access line."""
    return value if _PLAIN.fullmatch(value) else json.dumps(value, ensure_ascii=False)


# The status recorded (log and metrics) for a request whose client disconnected before its response
# started (nginx's "client closed request"): none was sent, and it is not a server error.
CLIENT_CLOSED = 499


class AccessLogMiddleware:
    """Per request: one access-log line (request id, status, latency, token counts) and the HTTP metrics.

    Pure ASGI so the latency of a streamed response is measured to its last byte. A request whose
    client went away before its response started is recorded as 499 (``CLIENT_CLOSED``), one that
    failed with no response as 500. Handlers put
    ``model`` (its id), ``usage`` (a ``schemas.Usage``) and ``stream`` into ``request.state``.
    """

    def __init__(self, app, flush_s: float = FLUSH_S):
        self.app = app
        self.metrics: Optional[HttpMetrics] = None
        self.flush_s = flush_s
        self._flusher: Optional[asyncio.Task] = None

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            try:
                flush_serve_log()
            except Exception:  # noqa: BLE001 - a full disk must not stop the flushing of later lines
                pass

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.metrics is None:
            self.metrics = HttpMetrics()   # created in the replica process, on its first request
        if self._flusher is None:          # in the replica's event loop
            self._flusher = asyncio.get_running_loop().create_task(self._flush_every())
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        status = {"code": 500}
        # ASGI servers send header names lower-cased; only this one is needed
        rid = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), None) \
            or serve.context._get_serve_request_context().request_id

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["sent"] = True
            await send(message)

        async def receive_wrapper():
            message = await receive()
            if message["type"] == "http.disconnect" and not status.get("sent"):
                status["code"] = CLIENT_CLOSED     # gone before its answer: not a server error
            return message

        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except (asyncio.CancelledError, ClientDisconnect):
            if not status.get("sent"):
                status["code"] = CLIENT_CLOSED     # Serve cancels a request whose client went away
            raise
        finally:
            seconds = time.perf_counter() - t0
            path, route = scope.get("path", ""), route_path(scope)
            endpoint = route if route in ENDPOINTS else "other"
            model = state.get("model") or "none"
            usage = state.get("usage")
            self.metrics.record(model, endpoint, status["code"], seconds)
            logger.info("access request_id=%s method=%s path=%s status=%d latency_ms=%.1f model=%s "
                        "source_tokens=%s generated_tokens=%s stream=%s", log_value(rid), scope.get("method"), path,
                        status["code"], seconds * 1000, model, usage.source_tokens if usage else 0,
                        usage.generated_tokens if usage else 0, bool(state.get("stream")))
