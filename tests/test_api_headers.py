"""HeaderCheck (service/api/middleware/headers.py): header values that Ray Serve's ingress decodes as UTF-8 get the
API's 400 naming the header; everything else reaches the app unchanged. Here as a plain ASGI app in
front of a recording app; through Serve (HAProxy and the Python proxy) in test_ingress_mode."""
from __future__ import annotations

import asyncio
import json

import pytest

from service.api.middleware.headers import (MAX_REQUEST_ID_CHARS, HeaderCheck, bad_header, ingress_middlewares,
                                 repeated_request_id, serve_read_headers, too_long_request_id)


class Recorder:
    """The app behind the middleware: records the scopes it got and answers 204."""

    def __init__(self):
        self.scopes = []

    async def __call__(self, scope, receive, send):
        self.scopes.append(scope)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def call(app, headers, path="/v1/translate", kind="http", response_headers=None):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": kind, "path": path, "method": "POST", "headers": headers}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    status = start["status"]
    if response_headers is not None:
        response_headers.extend(start.get("headers", []))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, (json.loads(body) if body else None)


def test_serve_read_headers_cover_what_serve_decodes():
    names = serve_read_headers()
    for n in (b"x_request_id", b"serve_multiplexed_model_id", b"x_session_id", b"x_request_disconnect_disabled",
              b"x_request_timeout_seconds", b"traceparent", b"tracestate"):
        assert n in names
    assert b"user_agent" not in names and b"content_type" not in names


@pytest.mark.parametrize("headers, bad", [
    ([(b"x-request-id", b"abc-123")], None),
    ([(b"x-request-id", "caf\u00e9-\u4e2d".encode())], None),        # UTF-8 beyond ASCII is readable
    ([(b"x-request-id", b"caf\xe9")], "x-request-id"),               # Latin-1
    ([(b"x-request-id", b"\xff\xfe")], "x-request-id"),
    ([(b"serve_multiplexed_model_id", b"\xc3")], "serve_multiplexed_model_id"),   # a cut UTF-8 sequence
    ([(b"serve-multiplexed-model-id", b"\xe9")], "serve-multiplexed-model-id"),   # Serve treats - as _
    ([(b"X-Session-ID", b"\x80")], "X-Session-ID"),
    ([(b"user-agent", b"caf\xe9")], None),                           # not read by Serve: obs-text is HTTP
    ([(b"accept", b"*/*"), (b"x-request-d\xe9", b"1")], "x-request-d\xe9"),   # a header name beyond ASCII
])
def test_bad_header(headers, bad):
    assert bad_header(headers, serve_read_headers()) == bad


def test_bad_request_id_is_a_400_naming_the_header_and_never_reaches_the_app():
    inner = Recorder()
    app = HeaderCheck(inner)
    status, body = call(app, [(b"content-type", b"application/json"), (b"x-request-id", b"id-\xe9")])
    assert status == 400 and inner.scopes == []
    assert body["error"]["type"] == "invalid_request" and body["error"]["field"] == "header.x-request-id"
    assert "x-request-id" in body["error"]["message"] and "UTF-8" in body["error"]["message"]
    # LibreTranslate's routes answer in its shape
    status, body = call(app, [(b"x-request-id", b"\xe9")], path="/translate")
    assert status == 400 and set(body) == {"error"} and "x-request-id" in body["error"]
    # a bad header name
    status, body = call(app, [(b"x-\xe9", b"1")])
    assert status == 400 and "header names must be ASCII" in body["error"]["message"]


def test_a_request_id_over_the_limit_is_a_400_with_a_fresh_id():
    """X-Request-ID is counted in characters (UTF-8): exactly MAX_REQUEST_ID_CHARS passes, one more is a
    400 naming the header and the limit; a refused id (too long or not UTF-8) is not echoed, the 400
    carries a fresh one."""
    inner = Recorder()
    app = HeaderCheck(inner)
    at_limit = ("\u00e9" * MAX_REQUEST_ID_CHARS).encode()               # twice as many bytes: still fits
    assert too_long_request_id([(b"x-request-id", at_limit)]) is None
    assert call(app, [(b"x-request-id", at_limit)]) == (204, None) and len(inner.scopes) == 1
    for value, path in ((b"r" * (MAX_REQUEST_ID_CHARS + 1), "/v1/translate"), (b"r" * 10_000, "/translate"),
                        (b"id-\xe9", "/v1/translate")):
        got_headers = []
        status, body = call(app, [(b"X-Request-ID", value)], path=path, response_headers=got_headers)
        assert status == 400 and len(inner.scopes) == 1
        message = body["error"] if path == "/translate" else body["error"]["message"]
        assert "x-request-id" in message.lower()
        if len(value) > MAX_REQUEST_ID_CHARS:
            assert f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(value)}" in message
        ids = [v for k, v in got_headers if k.lower() == b"x-request-id"]
        assert len(ids) == 1 and ids[0] != value and len(ids[0]) == 32
    assert too_long_request_id([(b"user-agent", b"u" * 10_000)]) is None   # other headers: no cap here


def test_two_different_request_ids_are_a_400_and_one_repeated_passes():
    """A request has one id, echoed and logged: two different X-Request-ID values (either spelling,
    either route) are refused naming the header, not one of them dropped; the same value twice passes."""
    inner = Recorder()
    app = HeaderCheck(inner)
    same = [(b"x-request-id", b"abc"), (b"X-Request-Id", b"abc")]
    assert repeated_request_id(same) is None and call(app, same) == (204, None) and len(inner.scopes) == 1
    for path in ("/v1/translate", "/translate"):
        two = [(b"x-request-id", b"abc"), (b"user-agent", b"t"), (b"X-Request-ID", b"xyz"), (b"x-request-id", b"abc")]
        assert repeated_request_id(two) == 2
        got_headers = []
        status, body = call(app, two, path=path, response_headers=got_headers)
        message = body["error"] if path == "/translate" else body["error"]["message"]
        assert status == 400 and "x-request-id: one value per request, got 2 different ones" in message
        ids = [v for k, v in got_headers if k.lower() == b"x-request-id"]
        assert len(ids) == 1 and ids[0] not in (b"abc", b"xyz")
    assert len(inner.scopes) == 1


def test_good_requests_pass_unchanged():
    inner = Recorder()
    app = HeaderCheck(inner)
    headers = [(b"x-request-id", "r\u00e9-1".encode()), (b"user-agent", b"caf\xe9")]
    assert call(app, headers) == (204, None)
    assert call(app, [(b"x-request-id", b"\xe9")], kind="websocket") == (204, None)   # not an HTTP request
    assert [s["headers"] for s in inner.scopes] == [headers, [(b"x-request-id", b"\xe9")]]


def test_ingress_middlewares_is_a_serve_proxy_callback():
    import importlib

    from ray.serve._private.http_util import validate_http_proxy_callback_return

    from service.ray_env import HEADER_CHECK
    module, name = HEADER_CHECK.split(":")
    assert getattr(importlib.import_module(module), name) is ingress_middlewares   # what Serve imports
    [mw] = validate_http_proxy_callback_return(ingress_middlewares())
    assert mw.cls is HeaderCheck
