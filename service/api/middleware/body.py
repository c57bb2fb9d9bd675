"""Request bodies before the routes read them: ``Content-Encoding`` decoded, the media type checked,
a ``charset`` honoured; one ASGI middleware for every route (``BodyMiddleware``).

    Content-Encoding  gzip (x-gzip), deflate (zlib, or raw deflate), identity; a list is undone in
                      reverse order. Decoded (and plain) bodies are capped at MAX_BODY_BYTES: 413.
                      Any other coding: 415 naming the accepted ones.
    Content-Type      per route (MEDIA_TYPES): another media type gets 415 naming the accepted ones;
                      no Content-Type is left to the route (FastAPI reads JSON, /translate the query).
    charset           utf-8 passes as it is; another character encoding (CHARSETS: utf-16/32,
                      latin-1, iso-8859-*, cp125x, koi8-*, mac-*, gb*, big5, shift_jis, euc-*,
                      iso-2022-*) is transcoded to UTF-8 (urlencoded forms: their percent-escapes
                      too); any other codec (unicode_escape, idna, undefined, ...), an unknown or a
                      repeated charset, or one other than utf-8 on multipart/form-data, gets 415.
                      Bytes invalid in the declared charset: 422 (400 on LibreTranslate routes); so
                      is an empty body with a Content-Encoding.
    body arrival      the whole body must arrive within BODY_TIMEOUT_S of the request's start: 408
                      (a client that stalls mid-body holds a connection, not the server); a client
                      that disconnects mid-body gets nothing (it is gone; the access log says 499).
    JSON              every JSON body of a route in MEDIA_TYPES is read once, by ``load_json``: a key
                      given twice in one object is a 422 naming it (the parser would keep the last
                      one and drop the first without a word); NaN/Infinity are not JSON; an integer
                      of more than MAX_NUMBER_DIGITS digits is kept as a ``LongInteger`` (never
                      converted: Python refuses > 4,300 digits, and the work grows with the square
                      of the digits) that every field's range refuses, naming the field.
    fields            ``read_fields`` + ``validate`` are the one way a route reads its fields:
                      JSON, application/x-www-form-urlencoded or multipart/form-data, plus the
                      query string, validated by a pydantic model; any wrong type or value out of
                      range is a 4xx naming the field and its limit (``ValidationError``,
                      ``ValueError``, ``OverflowError`` alike).
    HEAD              answered like GET without a body (``HeadMiddleware``).

Errors come in the route's shape: ``{"error": {...}}`` natively, ``{"error": message}`` on
LibreTranslate's routes (``errors.LIBRE_PATHS``).
"""
from __future__ import annotations

import asyncio
import codecs
import json
import re
import sys
import urllib.parse
import zlib
from typing import Iterator, Optional

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from service.protocol import ServiceError, shown

from ..errors import (
    DEEPL_PREFIX,
    JSON_TOO_DEEP,
    LIBRE_PATHS,
    deepl_error_response,
    error_response,
    route_path,
)
from ..schemas import TranslateRequest, validate
from .guard import BODY_KEY_PATHS, check_body_key

MAX_BODY_BYTES = 4 * 1024 * 1024   # bytes of a request body, as sent and once decoded (64 texts of
                                   # 5,000 characters fit with room for JSON escapes)
BODY_TIMEOUT_S = 30                # seconds for a request's whole body to arrive (4 MiB at ~140 kB/s)
ENCODINGS = ("gzip", "deflate", "identity")
JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"
MEDIA_TYPES = {"/v1/translate": (JSON,), "/translate": (JSON, FORM, MULTIPART),   # "+json" types count as JSON
               "/detect": (JSON, FORM, MULTIPART), "/suggest": (JSON, FORM, MULTIPART),
               "/v2/translate": (JSON, FORM, MULTIPART), "/v1/memory": (JSON, "text/tab-separated-values",
                                                                        "application/x-tmx+xml", "application/xml",
                                                                        "text/xml")}
JSON_KEY_PATHS = frozenset(MEDIA_TYPES)     # routes whose JSON bodies are checked for repeated keys
# The methods that take a body on each path of MEDIA_TYPES; another method is left to the router (405).
BODY_ROUTES = {"/v1/translate": {"POST"}, "/translate": {"POST"}, "/detect": {"POST"}, "/suggest": {"POST"},
               "/v2/translate": {"POST"}, "/v1/memory": {"PUT"}}
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# The charsets honoured, as codecs.lookup() names them: character encodings only, never Python's
# transform codecs (unicode_escape, idna, punycode, undefined, utf-7, ...).
CHARSETS = re.compile(r"utf-(8|8-sig|16|32)(-[lb]e)?|ascii|iso8859-\d+|cp125\d|koi8-[a-z]+|mac-[a-z-]+|gb2312|gbk"
                      r"|gb18030|big5(hkscs)?|shift_jis(_2004|x0213)?|cp932|euc_[a-z0-9_]+|iso2022_[a-z0-9_]+")


def parse_content_type(value: str) -> tuple[str, dict[str, str]]:
    """("type/subtype" lower-cased, {param: value}) of a Content-Type header value."""
    media, *params = value.split(";")
    out = {}
    for p in params:
        name, _, v = p.partition("=")
        if name.strip():
            out[name.strip().lower()] = v.strip().strip('"')
    return media.strip().lower(), out


def is_json(media: str) -> bool:
    return media == JSON or (media.startswith("application/") and media.endswith("+json"))


def inflate(data: bytes, coding: str, cap: int = MAX_BODY_BYTES) -> bytes:
    """Undo one content coding. Raises ServiceError 413 once the output passes ``cap`` bytes (without
    inflating further), 422 for data that is not in that coding, 415 for a coding not in ENCODINGS."""
    if coding in ("identity", ""):
        return data
    if not data and coding in ("gzip", "x-gzip", "deflate"):
        raise ServiceError(422, f"body: empty, but Content-Encoding: {coding} needs compressed data", "body")
    if coding in ("gzip", "x-gzip"):
        wbits = 31
    elif coding == "deflate":   # RFC 9110: zlib format; some clients send raw deflate
        wbits = 15 if len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0 else -15
    else:
        raise ServiceError(415, f"Content-Encoding: {shown(coding)} is not supported; accepted: {', '.join(ENCODINGS)}",
                           "Content-Encoding")
    out = bytearray()
    rest = data
    try:
        while rest:     # gzip: one member after another (RFC 1952 allows several)
            d = zlib.decompressobj(wbits)
            out += d.decompress(rest, cap + 1 - len(out))
            if len(out) > cap:
                raise ServiceError(413, f"body: at most {cap} bytes once decoded (Content-Encoding: {coding})",
                                   "body")
            if not d.eof:
                raise zlib.error("truncated data")
            rest = d.unused_data if wbits == 31 else b""
    except zlib.error as e:
        raise ServiceError(422, f"body: not valid {coding} data ({e})", "body") from None
    return bytes(out)


def transcode(body: bytes, media: str, charset: str) -> bytes:
    """The body in UTF-8. Raises ServiceError 415 for a charset that is not a character encoding in
    CHARSETS (or on multipart, whose parts carry their own), 422 for bytes that are invalid in it."""
    try:
        info = codecs.lookup(charset)
    except LookupError:
        info = None
    if info is None or not CHARSETS.fullmatch(info.name):
        raise ServiceError(415, f"Content-Type: charset {shown(charset)} is not supported; send utf-8 (or another "
                                "character encoding such as latin-1, cp1252 or utf-16)", "Content-Type")
    if info.name == "utf-8":
        return body
    if media == MULTIPART:
        raise ServiceError(415, f"Content-Type: a charset ({charset}) on multipart/form-data is not supported; "
                                "send utf-8 parts", "Content-Type")
    try:
        text = body.decode(info.name)
        if media == FORM:   # the percent-escapes are bytes in that charset too
            pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, encoding=info.name, errors="strict")
            text = urllib.parse.urlencode(pairs, encoding="utf-8")
    except UnicodeError as e:
        raise ServiceError(422, f"body: not valid {charset} ({e.__class__.__name__} at byte "
                                f"{getattr(e, 'start', '?')})", "body") from None
    return text.encode("utf-8")


def check_media_type(path: str, media: str) -> None:
    """Raises ServiceError 415 when ``path`` takes only other media types (MEDIA_TYPES)."""
    accepted = MEDIA_TYPES.get(path)
    if accepted is None or not media or media in accepted or (JSON in accepted and is_json(media)):
        return
    raise ServiceError(415, f"Content-Type: {path} takes {' or '.join(accepted)}, got {media}", "Content-Type")


def decode_body(path: str, headers: dict[str, str], body: bytes, cap: int = MAX_BODY_BYTES) -> tuple[bytes, str]:
    """(body as the route reads it, its Content-Type) for a request to ``path`` with these headers
    (lower-case names). Raises ServiceError 413, 415 or 422 (see module docstring)."""
    if len(body) > cap:
        raise ServiceError(413, f"body: at most {cap} bytes, got more", "body")
    ctype = headers.get("content-type", "")
    media, params = parse_content_type(ctype)
    check_media_type(path, media)
    codings = [c.strip().lower() for c in headers.get("content-encoding", "").split(",") if c.strip()]
    for coding in reversed(codings):
        body = inflate(body, coding, cap)
    charset = params.get("charset")
    if charset is not None and not charset.strip():
        raise ServiceError(415, f"Content-Type: an empty charset ({shown(ctype)}); name one (utf-8) or leave it out",
                           "Content-Type")
    if sum(p.split("=")[0].strip().lower() == "charset" for p in ctype.split(";")[1:]) > 1:
        raise ServiceError(415, f"Content-Type: charset given more than once ({shown(ctype)}); send one", "Content-Type")
    if charset:
        transcoded = transcode(body, media, charset)
        if transcoded is not body:
            body, ctype = transcoded, f"{media}; charset=utf-8"
    return body, ctype


MAX_NUMBER_DIGITS = 40      # digits of a JSON integer converted to an int; a longer one is a LongInteger


class LongInteger(int):
    """A JSON integer of more than MAX_NUMBER_DIGITS digits, never converted: its value is
    +-10**MAX_NUMBER_DIGITS (beyond every field's range, so the field's own check refuses it, naming
    the field and its limit) and its repr says how many digits were sent."""
    digits: int

    def __new__(cls, text: str) -> "LongInteger":
        negative = text.startswith("-")
        self = super().__new__(cls, (-1 if negative else 1) * 10 ** MAX_NUMBER_DIGITS)
        self.digits = len(text) - negative
        return self

    def __repr__(self) -> str:
        return f"{'-' if self < 0 else ''}<an integer of {self.digits} digits>"

    __str__ = __repr__


def _json_int(text: str) -> int:
    return int(text) if len(text) <= MAX_NUMBER_DIGITS else LongInteger(text)


def _not_json(name: str) -> None:
    raise ServiceError(422, f"body: {name} is not JSON (RFC 8259 numbers are finite); send a number or null", "body")


def _no_repeated_keys(pairs: list) -> dict:
    """json.loads' object_pairs_hook: the object, or ServiceError 422 naming a key given twice."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ServiceError(422, f"body: the key {shown(key)} is given more than once in one JSON object; send it "
                                f"once (only one of the values would be read)", key)
    return obj


def load_json(body: bytes) -> object:
    """The one JSON reader of every route: the decoded value. Raises ServiceError 422 for invalid
    JSON (naming the character), a key repeated in one object, NaN/Infinity, nesting beyond the
    recursion limit. Integers of more than MAX_NUMBER_DIGITS digits come back as ``LongInteger``."""
    try:
        return json.loads(body, object_pairs_hook=_no_repeated_keys, parse_int=_json_int, parse_constant=_not_json)
    except json.JSONDecodeError as e:
        raise ServiceError(422, f"body: invalid JSON at character {e.pos}: {e.msg}", "body") from None
    except UnicodeDecodeError as e:
        raise ServiceError(422, f"body: not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 JSON",
                           "body") from None
    except RecursionError:
        raise ServiceError(422, f"body: {JSON_TOO_DEEP}", "body") from None


def _long_integers(value: object, path: str = "") -> Iterator[tuple[str, LongInteger]]:
    """(dotted path, value) of each LongInteger in a decoded JSON value."""
    if isinstance(value, LongInteger):
        yield path or "body", value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _long_integers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _long_integers(v, f"{path}[{i}]")


# Routes FastAPI parses itself (from the JSON text) -> their request model: a JSON integer too long for
# Python's int() (sys.get_int_max_str_digits()) would fail FastAPI's parse without naming the field,
# so the middleware validates such a body with the model, whose error names the field and its limit.
ROUTE_MODELS: dict[str, type[BaseModel]] = {"/v1/translate": TranslateRequest}


def check_long_integers(path: str, decoded: object) -> None:
    """For a route FastAPI parses itself (ROUTE_MODELS): raises ServiceError 422 naming the field
    and its limit where the body holds an integer longer than Python's int() takes."""
    model = ROUTE_MODELS.get(path)
    too_long = next((p for p, v in _long_integers(decoded) if v.digits > sys.get_int_max_str_digits()), None)
    if too_long is None or model is None:
        return
    validate(model, decoded, 422)       # the field's own check names it and its range
    raise ServiceError(422, f"{too_long}: an integer of more than {sys.get_int_max_str_digits()} digits; no field "
                            "takes one", too_long)


def render(path: str, err: ServiceError, headers: Optional[dict] = None) -> JSONResponse:
    """The error in the route's shape (LibreTranslate: ``{"error": message}``, invalid bytes as 400)."""
    if path in LIBRE_PATHS:
        return JSONResponse({"error": err.message}, status_code=400 if err.status == 422 else err.status,
                            headers=headers)
    if path.startswith(DEEPL_PREFIX):
        return deepl_error_response(err, headers=headers)
    return error_response(err, headers=headers)


class BodyMiddleware:
    """Reads a request body (up to MAX_BODY_BYTES), decodes it (``decode_body``) and hands the route
    the decoded bytes with matching Content-Encoding, Content-Length and Content-Type headers; answers
    408/413/415/422 itself. Requests without a body method pass through untouched."""

    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.cap, self.timeout_s = app, max_body_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        path = route_path(scope)
        if scope["method"] not in BODY_ROUTES.get(path, _BODY_METHODS):    # a method the route has not: 405
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            length = 0
        try:
            if length > self.cap:
                raise ServiceError(413, f"body: at most {self.cap} bytes, got {length} (Content-Length)", "body")
            body = await self._read(receive, length)
            if body is None:
                return                  # the client disconnected before its body was complete
            body, ctype = decode_body(path, headers, body, self.cap)
            if path in JSON_KEY_PATHS and is_json(parse_content_type(ctype)[0]) and body:
                check_long_integers(path, load_json(body))
        except ServiceError as e:
            # API keys on, no Authorization header, /translate: no readable api_key field -> 401 first
            denied = check_body_key(scope.get("state", {}), None) if path in BODY_KEY_PATHS else None
            resp = render(path, e) if denied is None else render(path, denied.error, denied.headers)
            return await resp(scope, receive, send)
        drop = {b"content-encoding", b"content-length", b"content-type", b"transfer-encoding"}
        new_headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in drop]
        new_headers.append((b"content-length", str(len(body)).encode()))
        if ctype:
            new_headers.append((b"content-type", ctype.encode("latin-1")))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()      # after the body: the client's disconnect
        await self.app({**scope, "headers": new_headers}, replay, send)

    async def _read(self, receive, length: int = 0) -> Optional[bytes]:
        """The body's bytes, or None when the client disconnected first. Raises ServiceError 413
        past the cap and 408 when it has not arrived in full within ``self.timeout_s``."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.cap:
                        raise ServiceError(413, f"body: at most {self.cap} bytes, got more", "body")
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            expected = f" of {length} (Content-Length)" if length else ""
            raise ServiceError(408, f"body: not received in full within {self.timeout_s:g} s "
                                    f"(BODY_TIMEOUT_S): got {size} bytes{expected}", "body") from None
        return b"".join(chunks)



class HeadMiddleware:
    """HEAD answered like GET (status and headers, Content-Length included) without a body, for every
    GET route: load balancers probe with HEAD. The OpenAPI document lists GET only (HEAD is implicit)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            return await self.app(scope, receive, send)

        async def send_head(message):
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)
        await self.app({**scope, "method": "GET"}, receive, send_head)
