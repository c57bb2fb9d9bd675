"""What Starlette's multipart reading (python-multipart) does not do for a document upload: a part
that names its file only with RFC 5987/2231's ``filename*=`` (``filename*=UTF-8''%C3%A4.docx``, as
some HTTP libraries send non-ASCII names) is read as a text field, and a part whose headers pass
python-multipart's size limit fails as "Invalid multipart data" without saying which part.

``named_files(raw, boundary)`` returns the body with such parts' ``filename`` set from ``filename*``, or
raises ServiceError 400 naming the part whose headers are too long and their length. Only the parts'
header blocks are read; the contents are not copied unless a header is rewritten.
"""
from __future__ import annotations

import email.utils
import re
import urllib.parse

from service.protocol import ServiceError, shown

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
