"""The one reading of a route's fields, after ``middleware/body.py`` has decoded its body: a JSON
object's members or a form's fields (and the query string's), validated by the route's pydantic
model with errors naming the field and its limit."""
from __future__ import annotations

import urllib.parse
from typing import Optional

from fastapi import Request

from service.protocol import ServiceError, shown

from .errors import sent_type
from .middleware.body import (
    FORM,
    JSON,
    MULTIPART,
    is_json,
    load_json,
    parse_content_type,
)
from .schemas import FormFields

Fields = dict[str, object]      # a JSON body's members, or form fields (str, or list[str] when repeated)

FORM_TYPES = (FORM, MULTIPART)


async def read_fields(request: Request, repeatable: tuple[str, ...] = ("q",), status: int = 400,
                      single: Optional[tuple[str, ...]] = None) -> Fields:
    """A request's fields: the members of a JSON object body, or the fields of a form body
    (application/x-www-form-urlencoded or multipart/form-data, read as UTF-8; a field in
    ``repeatable`` given several times is a list, its line endings CR LF and CR made LF), plus the
    query string's parameters (a FormFields unless the body is JSON). Raises ServiceError (``status``
    for what the client sent wrong; 415 for a body of another media type): a JSON body that is not an
    object, a field of ``single`` (None: every field but ``repeatable``) given twice (one value would
    be dropped; other fields, which the route does not read, are kept as lists), a field in both the
    query string and the body, an uploaded file, a multipart body without its closing boundary, a
    JSON error of ``load_json``."""
    media = parse_content_type(request.headers.get("content-type", ""))[0]
    query = _grouped(request.query_params.multi_items(), "query parameter", repeatable, status, single)
    raw = await request.body()
    if is_json(media):
        try:
            body = load_json(raw or b"null")
        except ServiceError as e:
            raise ServiceError(status, e.message, e.field) from None
        if not isinstance(body, dict):
            raise ServiceError(status, "Invalid JSON format: the body must be a JSON object of fields", "body")
        return _merged(query, body, status)
    if media not in FORM_TYPES:
        if raw:
            raise ServiceError(415, f"Invalid request: the body was not read: its Content-Type is "
                                    f"{sent_type(request, 'missing')}; send application/json, "
                                    f"{' or '.join(FORM_TYPES)}", "Content-Type")
        return FormFields(query)
    if media == MULTIPART:
        check_multipart(request.headers.get("content-type", ""), raw, status)
        form = await request.form()
        pairs = form.multi_items()
        for k, v in pairs:
            if not isinstance(v, str):      # an uploaded file: never read as the field's text
                raise ServiceError(status, f"Invalid request: form field {shown(k)} was sent as a file "
                                           f"({v.filename or 'no name'}); send it as a text field", k)
    else:
        # Decoded as UTF-8 ourselves: clients (curl -d) send raw UTF-8 bytes unescaped, and a Latin-1
        # reading would garble them.
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ServiceError(status, "Invalid request: the form body is not valid UTF-8", "body") from None
        try:  # percent-escapes must decode to UTF-8 too
            pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="strict")
        except UnicodeDecodeError:
            raise ServiceError(status, "Invalid request: a form field is not valid UTF-8 once percent-decoded",
                               "body") from None
    return FormFields(_merged(query, _grouped(pairs, "form field", repeatable, status, single), status))


def _merged(query: Fields, body: Fields, status: int) -> Fields:
    """The body's fields and the query string's: a field in both is refused (one would be dropped)."""
    both = sorted(set(query) & set(body))
    if both:
        raise ServiceError(status, f"Invalid request: {shown(both[0])} given in both the query string and the body; "
                                   "send it once", both[0])
    return {**query, **body}


def _grouped(pairs, what: str, repeatable: tuple[str, ...], status: int,
             single: Optional[tuple[str, ...]] = None) -> Fields:
    """Fields from (name, value) pairs (see ``read_fields``)."""
    grouped: dict[str, list[str]] = {}
    for k, v in pairs:
        grouped.setdefault(k, []).append(v)
    fields: Fields = {}
    for key, values in grouped.items():
        if key in repeatable:
            values = [v.replace("\r\n", "\n").replace("\r", "\n") for v in values]
            fields[key] = values if len(values) > 1 else values[0]
        elif len(values) > 1 and (single is None or key in single):
            raise ServiceError(status, f"Invalid request: {what} {shown(key)} given {len(values)} times; send it once",
                               key)
        elif len(values) > 1:
            fields[key] = values
        else:
            fields[key] = values[0]
    return fields


def check_multipart(content_type: str, raw: bytes, status: int) -> None:
    """Raises ServiceError for a multipart body without a boundary parameter or its closing delimiter
    (``--boundary--``): a truncated body is not read as an empty form."""
    boundary = parse_content_type(content_type)[1].get("boundary", "")
    if not boundary:
        raise ServiceError(status, "Invalid request: the multipart/form-data body is malformed: its Content-Type has "
                                   "no boundary parameter", "body")
    if b"--" + boundary.encode("latin-1", "replace") + b"--" not in raw:
        raise ServiceError(status, f"Invalid request: the multipart/form-data body is malformed: no closing boundary "
                                   f"'--{boundary[:70]}--' (truncated?)", "body")


def openapi_request_body(schema: dict, media_types: tuple[str, ...] = (JSON, FORM, MULTIPART)) -> dict:
    """An OpenAPI requestBody: ``schema`` (a JSON Schema without $defs) under each media type."""
    return {"required": True, "content": {m: {"schema": schema} for m in media_types}}


