"""Request bodies (service/api/middleware/body.py): Content-Encoding gzip/deflate with a cap on the inflated
size, 415 for other codings and media types, charset honoured or refused; and a 405's Allow header.
Through BodyMiddleware on a small FastAPI app with the service's error handlers and LibreTranslate
body parsing; no Ray."""
from __future__ import annotations

import gzip
import json
import urllib.parse
import zlib

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel

from service.api import libretranslate
from service.api.errors import add_exception_handlers
from service.api.fields import read_fields
from service.api.middleware.body import (
    MAX_BODY_BYTES,
    BodyMiddleware,
    HeadMiddleware,
    decode_body,
    inflate,
    load_json,
)
from service.protocol import ServiceError

TEXT = "Ein Mann fährt Fahrrad. Zwei Hunde spielen im Schnee – „schön“ 🐶"
CAP = 64 * 1024


class Body(BaseModel):
    text: str


def make_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(BodyMiddleware, max_body_bytes=CAP)
    add_exception_handlers(app)

    @app.post("/v1/translate")
    async def native(body: Body):
        return {"text": body.text}

    @app.post("/translate")
    async def libre(request: Request):
        try:
            return await read_fields(request, ("q", "keep"), 400, single=libretranslate.LIBRE_FIELDS)
        except ServiceError as e:
            return libretranslate.libre_error_response(e)
    return app


@pytest.fixture(scope="module")
def client():
    return TestClient(make_app())


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


JSON_BODY = json.dumps({"text": TEXT}).encode()
FORM_BODY = urllib.parse.urlencode({"q": TEXT, "source": "de", "target": "en"}).encode()


@pytest.mark.parametrize("coding, encode", [
    ("gzip", gzip.compress), ("x-gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", raw_deflate),
    ("GZIP", gzip.compress), ("identity", lambda b: b),
    ("gzip, deflate", lambda b: zlib.compress(gzip.compress(b))),     # applied in order, undone in reverse
    ("gzip", lambda b: gzip.compress(b[:10]) + gzip.compress(b[10:])),   # two gzip members
])
def test_encoded_bodies_are_decoded_on_both_routes(client, coding, encode):
    r = client.post("/v1/translate", content=encode(JSON_BODY),
                    headers={"Content-Type": "application/json", "Content-Encoding": coding})
    assert r.status_code == 200 and r.json() == {"text": TEXT}, r.text
    r = client.post("/translate", content=encode(FORM_BODY),
                    headers={"Content-Type": "application/x-www-form-urlencoded", "Content-Encoding": coding})
    assert r.status_code == 200 and r.json() == {"q": TEXT, "source": "de", "target": "en"}, r.text


def test_inflated_size_is_capped_without_inflating_all_of_it(client):
    bomb = gzip.compress(b"{" + b" " * (CAP * 100) + b"}")       # ~6 MB of JSON whitespace in ~6 KB
    assert len(bomb) < CAP
    for path, shape in (("/v1/translate", lambda j: j["error"]["message"]), ("/translate", lambda j: j["error"])):
        r = client.post(path, content=bomb, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert r.status_code == 413, r.text
        assert f"at most {CAP} bytes once decoded" in shape(r.json())
    with pytest.raises(ServiceError) as e:
        inflate(zlib.compress(b"x" * 1001), "deflate", cap=1000)
    assert e.value.status == 413 and "1000" in e.value.message
    assert inflate(zlib.compress(b"x" * 1000), "deflate", cap=1000) == b"x" * 1000     # exactly the cap fits


def test_plain_bodies_are_capped_too(client):
    r = client.post("/v1/translate", content=b'{"text": "' + b"a" * CAP + b'"}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and str(CAP) in r.json()["error"]["message"]
    assert MAX_BODY_BYTES >= 64 * 5000 * 12     # the service's cap fits its largest request, escaped


@pytest.mark.parametrize("coding", ["br", "zstd", "compress", "gzip, br"])
def test_other_encodings_are_415_naming_the_accepted_ones(client, coding):
    r = client.post("/v1/translate", content=JSON_BODY,
                    headers={"Content-Type": "application/json", "Content-Encoding": coding})
    assert r.status_code == 415
    err = r.json()["error"]
    assert err["field"] == "Content-Encoding" and "gzip, deflate, identity" in err["message"]
    r = client.post("/translate", content=FORM_BODY,
                    headers={"Content-Type": "application/x-www-form-urlencoded", "Content-Encoding": coding})
    assert r.status_code == 415 and "gzip, deflate, identity" in r.json()["error"]


def test_corrupt_encoded_body_is_a_client_error(client):
    bad = gzip.compress(JSON_BODY)[:-12]      # truncated
    r = client.post("/v1/translate", content=bad, headers={"Content-Type": "application/json",
                                                           "Content-Encoding": "gzip"})
    assert r.status_code == 422 and "not valid gzip data" in r.json()["error"]["message"]
    r = client.post("/translate", content=b"not deflate", headers={"Content-Type": "application/json",
                                                                   "Content-Encoding": "deflate"})
    assert r.status_code == 400 and "not valid deflate data" in r.json()["error"]


@pytest.mark.parametrize("ctype", ["text/plain", "application/xml", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_other_media_types_on_the_native_route_are_415(client, ctype):
    r = client.post("/v1/translate", content=JSON_BODY, headers={"Content-Type": ctype})
    assert r.status_code == 415
    err = r.json()["error"]
    assert err["field"] == "Content-Type"
    assert "application/json" in err["message"] and ctype.split(";")[0] in err["message"]


def test_media_types_of_the_libretranslate_route(client):
    r = client.post("/translate", content=FORM_BODY, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    assert all(m in r.json()["error"] for m in ("application/json", "application/x-www-form-urlencoded",
                                                 "multipart/form-data"))
    r = client.post("/translate", content=json.dumps({"q": "x"}), headers={"Content-Type": "application/vnd.api+json"})
    assert r.status_code == 200 and r.json() == {"q": "x"}


@pytest.mark.parametrize("charset", ["latin-1", "ISO-8859-1", "cp1252", "utf-16", "utf-16-le", "UTF-8", "utf8",
                                     '"utf-8"', "utf-32"])
def test_charsets_are_honoured(client, charset):
    text = "Ein Mann fährt – „schön“ Straße" if "8859" not in charset and "latin" not in charset \
        else "Ein Mann fährt über die Straße"      # latin-1 has no dashes or German quotes
    codec = charset.strip('"')
    r = client.post("/v1/translate", content=json.dumps({"text": text}, ensure_ascii=False).encode(codec),
                    headers={"Content-Type": f"application/json; charset={charset}"})
    assert r.status_code == 200 and r.json() == {"text": text}, r.text
    # a form: raw characters and percent-escapes (in ASCII-compatible charsets) are both in the declared charset
    escaped = urllib.parse.quote(text[:16], encoding=codec) if "16" not in codec and "32" not in codec else text[:16]
    form = ("q=" + escaped + text[16:] + "&source=de").encode(codec)
    r = client.post("/translate", content=form,
                    headers={"Content-Type": f"application/x-www-form-urlencoded; charset={charset}"})
    assert r.status_code == 200 and r.json() == {"q": text, "source": "de"}, r.text


def test_charset_and_encoding_together(client):
    body = gzip.compress(json.dumps({"text": "Grüße"}, ensure_ascii=False).encode("utf-16"))
    r = client.post("/v1/translate", content=body,
                    headers={"Content-Type": "application/json; charset=utf-16", "Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.json() == {"text": "Grüße"}


@pytest.mark.parametrize("charset", ["klingon-8", "rot13", "base64", "unicode_escape", "raw_unicode_escape", "idna",
                                     "punycode", "undefined", "utf-7"])
def test_unknown_or_non_text_charsets_are_415(client, charset):
    r = client.post("/v1/translate", content=JSON_BODY,
                    headers={"Content-Type": f"application/json; charset={charset}"})
    assert r.status_code == 415
    err = r.json()["error"]
    assert err["field"] == "Content-Type" and charset in err["message"] and "utf-8" in err["message"]
    r = client.post("/translate", content=FORM_BODY,
                    headers={"Content-Type": f"application/x-www-form-urlencoded; charset={charset}"})
    assert r.status_code == 415 and charset in r.json()["error"]


@pytest.mark.parametrize("charset", ["KOI8-R", "windows-1251", "iso-8859-5", "mac-cyrillic", "gb18030", "big5",
                                     "shift_jis", "euc-kr", "iso-2022-jp", "utf-32-be", "ascii"])
def test_character_encodings_of_the_positive_list_are_honoured(client, charset):
    text = {"ascii": "Ein Hund", "gb18030": "一只狗", "big5": "一隻狗", "shift_jis": "犬が走る",
            "euc-kr": "개가 달린다", "iso-2022-jp": "犬が走る"}.get(charset, "Собака бежит")
    r = client.post("/v1/translate", content=json.dumps({"text": text}, ensure_ascii=False).encode(charset),
                    headers={"Content-Type": f"application/json; charset={charset}"})
    assert r.status_code == 200 and r.json() == {"text": text}, r.text


def test_a_repeated_charset_is_415(client):
    for ctype in ("application/json; charset=utf-8; charset=latin-1",
                  "application/json; Charset=latin-1;charset=utf-8"):
        r = client.post("/v1/translate", content=JSON_BODY, headers={"Content-Type": ctype})
        assert r.status_code == 415 and "more than once" in r.json()["error"]["message"], r.text
        r = client.post("/translate", content=FORM_BODY, headers={"Content-Type": ctype.replace(
            "application/json", "application/x-www-form-urlencoded")})
        assert r.status_code == 415 and "more than once" in r.json()["error"]


def test_an_empty_compressed_body_is_named(client):
    for coding in ("gzip", "deflate"):
        r = client.post("/v1/translate", content=b"", headers={"Content-Type": "application/json",
                                                               "Content-Encoding": coding})
        assert r.status_code == 422 and f"Content-Encoding: {coding}" in r.json()["error"]["message"]
        assert r.json()["error"]["field"] == "body"
        r = client.post("/translate", content=b"", headers={"Content-Type": "application/json",
                                                            "Content-Encoding": coding})
        assert r.status_code == 400 and "empty" in r.json()["error"]


def test_a_multipart_body_without_its_closing_boundary_is_400(client):
    whole = (b'--xyz\r\nContent-Disposition: form-data; name="q"\r\n\r\nHallo\r\n'
             b'--xyz\r\nContent-Disposition: form-data; name="source"\r\n\r\nde\r\n--xyz--\r\n')
    ok = client.post("/translate", content=whole, headers={"Content-Type": "multipart/form-data; boundary=xyz"})
    assert ok.status_code == 200 and ok.json() == {"q": "Hallo", "source": "de"}
    for body in (whole[:-len(b"--xyz--\r\n")], whole[:40]):
        r = client.post("/translate", content=body, headers={"Content-Type": "multipart/form-data; boundary=xyz"})
        assert r.status_code == 400 and "malformed" in r.json()["error"] and "--xyz--" in r.json()["error"], r.text
    r = client.post("/translate", content=whole, headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 400 and "no boundary" in r.json()["error"]


def test_head_answers_like_get_without_a_body():
    app = FastAPI()
    app.add_middleware(HeadMiddleware)
    add_exception_handlers(app)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "padding": "x" * 100}

    @app.post("/v1/translate")
    async def native():
        return {}
    c = TestClient(app)
    get, head = c.get("/healthz"), c.head("/healthz")
    assert head.status_code == get.status_code == 200 and head.content == b"" and len(get.content) > 100
    assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))
    assert head.headers["content-type"] == get.headers["content-type"]
    r = c.head("/v1/translate")          # a POST route: 405, still without a body
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b""
    assert c.post("/healthz").headers["allow"] == "GET, HEAD"
    assert c.head("/nowhere").status_code == 404


def test_bytes_invalid_in_the_declared_charset_are_refused_not_misread(client):
    r = client.post("/v1/translate", content=b'{"text": "\xff\xfe\xfd"}',
                    headers={"Content-Type": "application/json; charset=utf-16"})   # odd length
    assert r.status_code == 422 and "utf-16" in r.json()["error"]["message"]
    r = client.post("/v1/translate", content='{"text": "fährt"}'.encode("latin-1"),
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 422    # declared utf-8: never silently read as latin-1
    r = client.post("/translate", content=b"q=a", headers={"Content-Type": "multipart/form-data; boundary=x; "
                                                                            "charset=latin-1"})
    assert r.status_code == 415 and "multipart" in r.json()["error"]


def test_decode_body_leaves_plain_utf8_alone():
    body, ctype = decode_body("/v1/translate", {"content-type": "application/json"}, JSON_BODY)
    assert body is JSON_BODY and ctype == "application/json"
    body, ctype = decode_body("/v1/translate", {"content-type": "application/json; charset=latin-1"},
                              '{"text": "ä"}'.encode("latin-1"))
    assert body == '{"text": "ä"}'.encode() and ctype == "application/json; charset=utf-8"


def test_405_names_the_allowed_methods(client):
    for path, methods in (("/v1/translate", "POST"), ("/translate", "POST")):
        r = client.get(path)
        assert r.status_code == 405
        assert r.headers["allow"] == methods
        msg = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"]
        assert "POST" in msg


def test_an_app_under_a_route_prefix_checks_its_own_paths():
    """Ray Serve keeps a route prefix in ``path`` (``root_path`` names it): the checks of each route
    and LibreTranslate's error shape still apply to the route within the app."""
    prefixed = TestClient(make_app(), root_path="/embedded")
    r = prefixed.post("/embedded/v1/translate", content=JSON_BODY, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["field"] == "Content-Type"
    assert "application/json" in r.json()["error"]["message"]
    r = prefixed.get("/embedded/translate")
    assert r.status_code == 405 and isinstance(r.json()["error"], str)      # LibreTranslate's shape


def test_a_bug_is_a_json_500_and_a_huge_number_names_its_digits():
    app = make_app()

    @app.post("/v1/bug")
    async def bug():
        raise RuntimeError("boom")

    @app.get("/languages")
    async def libre_bug():
        raise KeyError("x")
    client = TestClient(app, raise_server_exceptions=False)
    r = client.post("/v1/bug", json={})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "internal_error" and "RuntimeError" in err["message"] and "boom" not in err["message"]
    r = client.get("/languages")        # a LibreTranslate route: its shape, {"error": message}
    assert r.status_code == 500 and "KeyError" in r.json()["error"]
    digits = "9" * 5000     # more than Python's int parser takes (4300): not "error parsing the body"
    import service.api.gateway  # noqa: F401 - registers /v1/translate's request model (body.ROUTE_MODELS)
    r = client.post("/v1/translate", content=f'{{"text": "x", "beam_size": {digits}}}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "beam_size", r.text
    assert "1 <= beam_size <= 16" in r.json()["error"]["message"] and "<an integer of 5000 digits>" in r.text


def test_libre_form_fields_are_never_dropped(client):
    """A repeated field other than q (a batch), or a field sent as a file upload, is a 400 naming it."""
    r = client.post("/translate", content="q=Hallo&source=de&source=en",
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "'source' given 2 times" in r.json()["error"]
    r = client.post("/translate?target=en&target=fr", data={"q": "Hallo"})
    assert r.status_code == 400 and "query parameter 'target' given 2 times" in r.json()["error"]
    r = client.post("/translate?q=x", data={"q": "Ein Hund."})
    assert r.status_code == 400 and "'q' given in both the query string and the body" in r.json()["error"]
    r = client.post("/translate?format=html", json={"q": "<b>Hund</b>", "format": "text"})
    assert r.status_code == 400 and "'format' given in both" in r.json()["error"]
    r = client.post("/translate?format=html", json={"q": "<b>Hund</b>"})        # a JSON body takes the query's too
    assert r.status_code == 200 and r.json() == {"q": "<b>Hund</b>", "format": "html"}
    r = client.post("/translate", data={"source": "de"}, files={"q": ("q.txt", b"Hallo Welt", "text/plain")})
    assert r.status_code == 400 and "'q' was sent as a file (q.txt)" in r.json()["error"]
    r = client.post("/translate", content="q=Ein%20Hund&q=Zwei\r\nKatzen&source=de",
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json() == {"q": ["Ein Hund", "Zwei\nKatzen"], "source": "de"}


def test_a_key_repeated_in_a_json_object_is_refused_naming_it(client):
    """The parser would keep the last value and drop the first: 422 on /v1 (400 on LibreTranslate's
    route) naming the key, in the top object or a nested one; distinct keys pass."""
    r = client.post("/v1/translate", content=b'{"text": "Ein Hund.", "text": "Zwei Katzen."}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "text" and "more than once" in r.json()["error"]["message"]
    r = client.post("/translate", content=b'{"q": "Ein Hund.", "q": "Zwei Katzen.", "source": "de", "target": "en"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "'q'" in r.json()["error"]
    r = client.post("/v1/translate", content=b'{"text": "Ein Hund.", "x": {"a": 1, "a": 2}}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "a"
    assert client.post("/v1/translate", json={"text": TEXT}).json() == {"text": TEXT}
    load_json(b'[{"a": 1}, {"a": 2}]')      # the same key in two objects is no repeat
    with pytest.raises(ServiceError, match="invalid JSON at character 6") as e:
        load_json(b'{"a": ')                # invalid JSON: the one reader says where
    assert (e.value.status, e.value.field) == (422, "body")


def test_an_empty_charset_is_415(client):
    r = client.post("/v1/translate", content=JSON_BODY, headers={"content-type": "application/json; charset="})
    assert r.status_code == 415 and "empty charset" in r.json()["error"]["message"]


def _run_asgi(app, messages: list, hang: bool = False, path: str = "/v1/translate") -> list:
    """Call an ASGI app with the request messages given (then a hang or a disconnect); what it sent."""
    import asyncio
    sent, queue = [], list(messages)

    async def receive():
        if queue:
            return queue.pop(0)
        if hang:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent


def test_a_body_that_stalls_is_408_and_one_abandoned_mid_way_gets_nothing():
    """Content-Length 100, 12 bytes sent, then nothing: 408 naming the timeout and the bytes (not a
    connection held forever); a client that disconnects mid-body: the route is never called."""
    called = []

    async def route(scope, receive, send):
        called.append(scope["path"])
    partial = {"type": "http.request", "body": b'{"text": "Ei', "more_body": True}
    sent = _run_asgi(BodyMiddleware(route, timeout_s=0.2), [partial], hang=True)
    assert sent[0]["status"] == 408 and not called
    body = json.loads(sent[1]["body"])
    assert body["error"]["field"] == "body" and "0.2 s" in body["error"]["message"] and "12 bytes of 100" in body["error"]["message"]
    assert _run_asgi(BodyMiddleware(route, timeout_s=5), [partial]) == [] and not called
    whole = {"type": "http.request", "body": JSON_BODY, "more_body": False}
    assert _run_asgi(BodyMiddleware(route, timeout_s=5), [whole]) == [] and called == ["/v1/translate"]


def test_the_access_log_records_a_client_that_left_as_499_not_500(caplog):
    """No response started and the client went away (Serve cancels the request, or the body read
    saw the disconnect): 499 in the metrics and the log; an app that fails with no response: 500."""
    import asyncio

    from service.api.middleware.access_log import AccessLogMiddleware

    class Metrics:
        def __init__(self):
            self.codes = []

        def record(self, model, endpoint, code, seconds):
            self.codes.append(code)

    async def cancelled(scope, receive, send):
        raise asyncio.CancelledError

    async def reads_until_gone(scope, receive, send):
        await receive()

    async def fails(scope, receive, send):
        raise RuntimeError("a bug")

    async def answers(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        await receive()                  # the client leaves after its answer: still a 200
    codes = []
    for app, raises in ((cancelled, asyncio.CancelledError), (reads_until_gone, None), (fails, RuntimeError),
                        (answers, None)):
        mw = AccessLogMiddleware(app)
        mw.metrics = Metrics()
        scope = {"type": "http", "method": "POST", "path": "/v1/translate", "headers": [(b"x-request-id", b"r1")]}

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            pass
        try:
            asyncio.run(mw(scope, receive, send))
        except BaseException as e:  # noqa: BLE001
            assert raises is not None and isinstance(e, raises)
        codes += mw.metrics.codes
    assert codes == [499, 499, 500, 200]


def test_the_access_log_reaches_a_buffered_handler_s_file_within_a_second_or_so():
    """Serve's throughput mode buffers log records until 1,000 are held: the middleware writes them
    every flush_s seconds, so a quiet replica's access lines are not held back (or lost when it stops).
    A request id with spaces is quoted: it cannot add fields to its line."""
    import asyncio
    import logging
    import logging.handlers

    from service.api.middleware.access_log import AccessLogMiddleware, logger

    class Metrics:
        def record(self, model, endpoint, code, seconds):
            pass

    written: list[str] = []

    class Target(logging.Handler):
        def emit(self, record):
            written.append(record.getMessage())

    buffered = logging.handlers.MemoryHandler(capacity=1000, target=Target(), flushLevel=logging.ERROR)
    logger.addHandler(buffered)
    level = logger.level
    logger.setLevel(logging.INFO)

    async def answers(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main():
        mw = AccessLogMiddleware(answers, flush_s=0.2)
        mw.metrics = Metrics()

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            pass
        for rid in (b"quiet-1", b"x status=500 path=/evil"):     # the second tries to add fields to its line
            scope = {"type": "http", "method": "POST", "path": "/v1/translate", "headers": [(b"x-request-id", rid)]}
            await mw(scope, receive, send)
        held = list(written)                # still in the buffer right after the requests
        await asyncio.sleep(0.6)
        return held
    try:
        held = asyncio.run(main())
    finally:
        logger.removeHandler(buffered)
        logger.setLevel(level)
    assert not any("quiet-1" in line for line in held)
    assert [line for line in written if "request_id=quiet-1" in line and "status=200" in line], written
    [evil] = [line for line in written if "evil" in line]
    assert 'request_id="x status=500 path=/evil" method=POST path=/v1/translate status=200' in evil, evil
