"""Checks on an untrusted archive (docx, pptx and odt are zip files of XML parts) before any library
parses it. Every refusal is a ``DocumentError`` 4xx naming the limit (``common.py``):

    not a zip / unreadable           422
    more than MAX_ARCHIVE_MEMBERS    413
    a member name that leaves the archive (absolute, "..", a drive, a backslash, NUL) or is repeated: 422
    unpacked size over MAX_UNCOMPRESSED_BYTES, a member's ratio over MAX_COMPRESSION_RATIO: 413 (zip bomb)
    an XML part with a DTD, an entity declaration or external reference (defusedxml): 422
    an XML part nested deeper than MAX_XML_DEPTH: 413; malformed XML: 422

The archive is read from memory (``io.BytesIO``): nothing is written to or read from the file
system, so no member name can reach outside it; the name checks refuse such files outright. Sizes
are the members' declared ones, which ``zipfile`` enforces while it inflates (a member that inflates
to more than it declares fails its read), and each XML part is read with its declared size as a cap.
"""
from __future__ import annotations

import io
import posixpath
import zipfile
from xml.sax import SAXParseException

import defusedxml.ElementTree as SafeET
from defusedxml import DefusedXmlException

from .common import (MAX_ARCHIVE_MEMBERS, MAX_COMPRESSION_RATIO, MAX_UNCOMPRESSED_BYTES, MAX_XML_DEPTH,
                     DocumentError)

RATIO_MIN_BYTES = 1024 * 1024   # members smaller than this unpacked are not held to the ratio (tiny XML compresses well)


def open_archive(data: bytes, what: str, required: str) -> zipfile.ZipFile:
    """The zip archive of ``data`` once its member names, count and sizes pass; every XML member
    (``.xml``, ``.rels``) checked with ``check_xml``. Raises DocumentError: 415 when ``data`` is not a
    zip archive or has no member ``required`` (the content is not what the extension says)."""
    if not data.startswith(b"PK\x03\x04"):
        raise DocumentError(415, f"the content is not a {what} file (not a zip archive), whatever its name says")
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as e:
        raise DocumentError(422, f"not a {what} file (a zip archive was expected: {e})") from None
    if len(infos) > MAX_ARCHIVE_MEMBERS:
        raise DocumentError(413, f"the archive has {len(infos)} members; at most {MAX_ARCHIVE_MEMBERS} "
                                 f"(MAX_ARCHIVE_MEMBERS)")
    if required not in {i.filename for i in infos}:
        raise DocumentError(415, f"the content is a zip archive but not a {what} file (no {required}), "
                                 "whatever its name says")
    seen, total = set(), 0
    for info in infos:
        check_member_name(info.filename)
        if info.filename in seen:
            raise DocumentError(422, f"the archive holds {info.filename[:80]!r} twice")
        seen.add(info.filename)
        total += info.file_size
        if total > MAX_UNCOMPRESSED_BYTES:
            raise DocumentError(413, f"the archive unpacks to more than {MAX_UNCOMPRESSED_BYTES} bytes "
                                     f"(MAX_UNCOMPRESSED_BYTES)")
        if info.file_size >= RATIO_MIN_BYTES and info.file_size > MAX_COMPRESSION_RATIO * max(info.compress_size, 1):
            raise DocumentError(413, f"archive member {info.filename[:80]!r} unpacks {info.file_size // max(info.compress_size, 1)} "
                                     f"times its packed size; at most {MAX_COMPRESSION_RATIO} (MAX_COMPRESSION_RATIO)")
    for info in infos:
        if info.filename.endswith((".xml", ".rels")):
            check_xml(read_member(zf, info), info.filename)
    return zf


def check_member_name(name: str) -> None:
    """Raises DocumentError 422 for a member name that could point outside the archive."""
    parts = name.split("/")
    if (name.startswith("/") or "\\" in name or "\x00" in name or ".." in parts or (len(name) > 1 and name[1] == ":")
            or posixpath.normpath(name).startswith("..")):
        raise DocumentError(422, f"archive member name {name[:80]!r} points outside the archive "
                                 "(absolute, '..', a drive or a backslash)")


def read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A member's bytes, at most its declared size (more: DocumentError 413). Raises DocumentError 422
    for a damaged member (bad CRC, bad compressed data)."""
    try:
        with zf.open(info) as f:
            data = f.read(info.file_size + 1)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, RuntimeError) as e:
        raise DocumentError(422, f"archive member {info.filename[:80]!r} cannot be read: {e}") from None
    if len(data) > info.file_size:
        raise DocumentError(413, f"archive member {info.filename[:80]!r} unpacks to more than it declares")
    return data


def check_xml(data: bytes, name: str) -> None:
    """Raises DocumentError for XML with a DTD or entities (422), nested past MAX_XML_DEPTH (413),
    or not well-formed (422). Reads it once, as events, with defusedxml (expat, no network)."""
    depth = 0
    try:
        for event, _ in SafeET.iterparse(io.BytesIO(data), events=("start", "end"), forbid_dtd=True):
            depth += 1 if event == "start" else -1
            if depth > MAX_XML_DEPTH:
                raise DocumentError(413, f"XML part {name[:80]!r} nests elements more than {MAX_XML_DEPTH} "
                                         f"deep (MAX_XML_DEPTH)")
    except DefusedXmlException as e:
        raise DocumentError(422, f"XML part {name[:80]!r} declares a DTD or entities ({type(e).__name__}); "
                                 "documents may not") from None
    except (SafeET.ParseError, SAXParseException, ValueError) as e:
        raise DocumentError(422, f"XML part {name[:80]!r} is not well-formed XML: {e}") from None
