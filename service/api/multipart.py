"""A document upload's multipart form (``read_upload``), and what Starlette's multipart reading
(python-multipart) does not do for it: a part
that names its file only with RFC 5987/2231's ``filename*=`` (``filename*=UTF-8''%C3%A4.docx``, as
some HTTP libraries send non-ASCII names) is read as a text field, and a part whose headers pass
python-multipart's size limit fails as "Invalid multipart data" without saying which part.

``named_files(raw, boundary)`` returns the body with such parts' ``filename`` set from ``filename*``, or
raises ServiceError 400 naming the part whose headers are too long and their length. Only the parts'
header blocks are read; the contents are not copied unless a header is rewritten.
"""
from __future__ import annotations

import dataclasses
import email.utils
import re
import urllib.parse

from fastapi import Request

from service.protocol import MAX_DOCUMENT_BYTES, MAX_FILENAME_CHARS, ServiceError, shown

from .errors import sent_type
from .fields import check_multipart
from .middleware.body import parse_content_type

MAX_PART_HEADER_BYTES = 4096   # python-multipart refuses a part header line over 4,224 bytes (DEFAULT_MAX_HEADER_SIZE)
_DISPOSITION = re.compile(rb"(?im)^content-disposition:([^\r\n]*)")
_PARAM = re.compile(rb'(?i);\s*([a-z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def _params(disposition: bytes) -> dict[str, bytes]:
    return {k.decode("latin-1").lower(): v.strip() for k, v in _PARAM.findall(disposition)}


def _decoded(extended: bytes) -> str:
    """An RFC 5987 value (``charset'language'percent-encoded``) as text; a malformed one as read."""
    value = extended.strip(b'"').decode("latin-1")
    charset, _, text = email.utils.decode_rfc2231(value)
    if charset is None and "'" not in value:
        return urllib.parse.unquote(value, errors="replace")
    return urllib.parse.unquote(text, encoding=charset or "utf-8", errors="replace")


def named_files(raw: bytes, boundary: str) -> bytes:
    """``raw`` with a plain ``filename`` (the decoded ``filename*``) in each part that has ``filename*``.
    Raises ServiceError 400 for a part whose header block is over MAX_PART_HEADER_BYTES."""
    delimiter = b"--" + boundary.encode("latin-1", "replace") + b"\r\n"
    out, last, pos = [], 0, raw.find(delimiter)
    while pos >= 0:
        start = pos + len(delimiter)
        end = raw.find(b"\r\n\r\n", start, start + 8 * MAX_PART_HEADER_BYTES)
        head = raw[start:end if end >= 0 else start + 8 * MAX_PART_HEADER_BYTES]
        m = _DISPOSITION.search(head)
        params = _params(m.group(1)) if m else {}
        longest = max((len(line) for line in head.split(b"\r\n")), default=0)
        if longest > MAX_PART_HEADER_BYTES or end < 0:
            name = params.get("name", b"?").strip(b'"').decode("utf-8", "replace")
            filename = params.get("filename", b"").strip(b'"')
            what = f" (a file name of {len(filename.decode('utf-8', 'replace'))} characters)" if filename else ""
            raise ServiceError(400, f"{shown(name)}: the part's headers are {len(head)} bytes{what}; at most "
                                    f"{MAX_PART_HEADER_BYTES} per header line: shorten the file name", name or "body")
        if m and "filename*" in params:     # RFC 6266: filename* wins over a plain (ASCII fallback) filename
            plain = _decoded(params["filename*"]).replace("\\", "\\\\").replace('"', '\\"')
            kept = _PARAM.sub(lambda p: b"" if p.group(1).lower() == b"filename" else p.group(0), m.group(1))
            out += [raw[last:start + m.start(1)], kept + b'; filename="' + plain.encode("utf-8") + b'"']
            last = start + m.end(1)
        pos = raw.find(delimiter, end if end >= 0 else start)
    return b"".join(out + [raw[last:]]) if out else raw


@dataclasses.dataclass
class Upload:
    data: bytes
    filename: str
    fields: dict[str, str]


def replay(body: bytes):
    """An ASGI ``receive`` that hands over ``body`` once."""
    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}
    return receive


async def read_upload(request: Request, allowed: tuple[str, ...]) -> Upload:
    """The multipart form of a document request: its ``file`` and text fields (each at most once;
    one not in ``allowed`` is a 400 naming it; a body without its boundary or closing ``--boundary--``
    is a 400 naming the malformed body). Raises ServiceError."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "multipart/form-data":
        raise ServiceError(415, f"Content-Type: a document is sent as multipart/form-data with a 'file' field, "
                                f"got {sent_type(request)}", "Content-Type")
    raw = await request.body()
    check_multipart(request.headers.get("content-type", ""), raw, 400)   # truncated: not an empty form
    named = named_files(raw, parse_content_type(request.headers["content-type"])[1]["boundary"])
    if named is not raw:       # a file named by filename*: the form is read from the body that names it plainly
        request = Request(request.scope, replay(named))
    try:
        form = await request.form()
    except Exception as e:  # noqa: BLE001 - the multipart parser's errors are the body's
        raise ServiceError(400, f"body: the multipart/form-data body cannot be read: {e}", "body") from None
    fields: dict[str, str] = {}
    upload = None
    for k, v in form.multi_items():
        if k in fields or (k == "file" and upload is not None):
            raise ServiceError(400, f"{shown(k)}: given twice; send it once", k)
        if k == "file":
            if isinstance(v, str):
                raise ServiceError(400, "file: must be a file part (with a filename), not a text field", "file")
            upload = v
        elif not isinstance(v, str):
            raise ServiceError(400, f"{shown(k)}: a file was sent where a text field is expected", k)
        elif k not in allowed:
            raise ServiceError(400, f"{shown(k)}: unknown field; this route reads file, {', '.join(allowed)}", k)
        else:
            fields[k] = v
    if upload is None:
        raise ServiceError(400, "file: missing; send the document as the multipart field 'file'", "file")
    data = await upload.read(MAX_DOCUMENT_BYTES + 1)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise ServiceError(413, f"file: at most {MAX_DOCUMENT_BYTES} bytes (MAX_DOCUMENT_BYTES)", "file")
    name = fields["filename"] if "filename" in fields else upload.filename or ""    # an empty field: no name
    if len(name) > MAX_FILENAME_CHARS:      # its Content-Disposition must fit a proxy's header buffer
        field = "filename" if "filename" in fields else "file"
        raise ServiceError(400, f"{field}: a file name has at most {MAX_FILENAME_CHARS} characters, got {len(name)}",
                           field)
    return Upload(data, name, fields)
