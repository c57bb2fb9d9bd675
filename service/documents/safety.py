"""Checks on an untrusted archive (docx, pptx and odt are zip files of XML parts) before any library
parses it. Every refusal is a ``DocumentError`` 4xx naming the limit (``common.py``):

    not a zip / unreadable; a member packed other than stored or deflated     422
    more than MAX_ARCHIVE_MEMBERS                                             413
    a member name that leaves the archive (absolute, "..", a drive, a backslash, NUL) or is repeated: 422
    unpacked bytes over MAX_UNCOMPRESSED_BYTES, a member's ratio over MAX_COMPRESSION_RATIO: 413 (zip bomb)
    XML parts' bytes over MAX_XML_BYTES, their elements over MAX_XML_ELEMENTS: 413 (what the parsers build)
    an XML part with a DTD, an entity declaration or external reference (defusedxml): 422
    an XML part nested deeper than MAX_XML_DEPTH: 413; malformed XML: 422

The archive is read from memory (``io.BytesIO``): nothing is written to or read from the file
system, so no member name can reach outside it; the name checks refuse such files outright.

Sizes are counted as the members inflate, not taken from their headers (which an attacker writes):
each member is read in chunks of READ_CHUNK bytes past its declared size, its running count stopping
at the first cap it passes, and each XML part is fed chunk by chunk to an expat parser that builds no
tree (it counts depth and elements). So the check holds at most a chunk of any member, whatever the
archive claims, and a member whose bytes differ from its header is refused: the parsers that follow
(python-docx, python-pptx, odfpy, through ``zipfile``) read exactly the bytes counted here.
"""
from __future__ import annotations

import copy
import io
import posixpath
import zipfile
import zlib
from xml.sax import SAXParseException

import defusedxml.ElementTree as SafeET
from defusedxml import DefusedXmlException

from .common import (
    MAX_ARCHIVE_MEMBERS,
    MAX_COMPRESSION_RATIO,
    MAX_UNCOMPRESSED_BYTES,
    MAX_XML_BYTES,
    MAX_XML_DEPTH,
    MAX_XML_ELEMENTS,
    DocumentError,
)

RATIO_MIN_BYTES = 1024 * 1024   # members smaller than this unpacked are not held to the ratio (tiny XML compresses well)
READ_CHUNK = 64 * 1024          # bytes inflated at a time (deflate's output per call is bounded by the read size)
METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}   # what office files use


def open_archive(data: bytes, what: str, required: str) -> tuple[zipfile.ZipFile, int]:
    """The zip archive of ``data`` and its unpacked bytes, once its member names, count and sizes
    pass; every XML member (``.xml``, ``.rels``) checked as it inflates (``Inflated``, ``XmlCheck``).
    Raises DocumentError:
    415 when ``data`` is not a zip archive or has no member ``required`` (the content is not what the
    extension says)."""
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
    seen, declared = set(), 0
    for info in infos:           # the headers first: a refusal here costs no inflating
        check_member_name(info.filename)
        if info.filename in seen:
            raise DocumentError(422, f"the archive holds {info.filename[:80]!r} twice")
        seen.add(info.filename)
        if info.compress_type not in METHODS:
            raise DocumentError(422, f"archive member {info.filename[:80]!r} is packed with method "
                                     f"{info.compress_type}; office files use stored or deflated only")
        declared += info.file_size
        if declared > MAX_UNCOMPRESSED_BYTES:
            raise unpacked_over(MAX_UNCOMPRESSED_BYTES, "MAX_UNCOMPRESSED_BYTES")
        check_ratio(info, info.file_size)
    inflated = Inflated()
    for info in infos:
        # an empty XML member is no XML and no parser reads it (LibreOffice writes an empty
        # Configurations2/accelerator/current.xml into every file); one holding more than its header
        # says is a 422 once inflated (``Inflated.member``)
        is_xml = info.filename.endswith((".xml", ".rels")) and info.file_size > 0
        xml = XmlCheck(info.filename, inflated) if is_xml else None
        for chunk in inflated.member(zf, info):
            if xml is not None:
                xml.feed(chunk)
        if xml is not None:
            xml.finish()
    return zf, inflated.bytes


def check_member_name(name: str) -> None:
    """Raises DocumentError 422 for a member name that could point outside the archive."""
    parts = name.split("/")
    if (name.startswith("/") or "\\" in name or "\x00" in name or ".." in parts or (len(name) > 1 and name[1] == ":")
            or posixpath.normpath(name).startswith("..")):
        raise DocumentError(422, f"archive member name {name[:80]!r} points outside the archive "
                                 "(absolute, '..', a drive or a backslash)")


def check_ratio(info: zipfile.ZipInfo, unpacked: int) -> None:
    """Raises DocumentError 413 when ``unpacked`` bytes of the member are over MAX_COMPRESSION_RATIO
    times its packed size (from RATIO_MIN_BYTES on)."""
    if unpacked >= RATIO_MIN_BYTES and unpacked > MAX_COMPRESSION_RATIO * max(info.compress_size, 1):
        raise DocumentError(413, f"archive member {info.filename[:80]!r} unpacks {unpacked // max(info.compress_size, 1)} "
                                 f"times its packed size; at most {MAX_COMPRESSION_RATIO} (MAX_COMPRESSION_RATIO)")


def unpacked_over(cap: int, name: str, what: str = "the archive unpacks") -> DocumentError:
    return DocumentError(413, f"{what} to more than {cap} bytes ({name})")


class Inflated:
    """The running counts of one archive's members as they inflate: every member's bytes, the XML
    parts' bytes and elements. Each count stops at its cap (a 413 naming it)."""

    def __init__(self):
        self.bytes = 0          # all members, unpacked
        self.xml_bytes = 0      # the XML parts among them
        self.elements = 0       # the XML parts' elements

    def member(self, zf: zipfile.ZipFile, info: zipfile.ZipInfo):
        """The member's bytes in chunks as they inflate, counted. Raises DocumentError: 413 at a cap,
        422 for a damaged member (bad CRC, bad compressed data, more or fewer bytes than declared)."""
        probe = copy.copy(info)     # zipfile stops at the declared size: let it inflate a chunk past the caps
        probe.file_size = MAX_UNCOMPRESSED_BYTES + READ_CHUNK + 1
        is_xml, n = info.filename.endswith((".xml", ".rels")), 0
        try:
            with zf.open(probe) as f:
                while chunk := f.read(READ_CHUNK):
                    n += len(chunk)
                    self.bytes += len(chunk)
                    if self.bytes > MAX_UNCOMPRESSED_BYTES:
                        raise unpacked_over(MAX_UNCOMPRESSED_BYTES, "MAX_UNCOMPRESSED_BYTES")
                    if is_xml:
                        self.xml_bytes += len(chunk)
                        if self.xml_bytes > MAX_XML_BYTES:
                            raise unpacked_over(MAX_XML_BYTES, "MAX_XML_BYTES", "the archive's XML parts unpack")
                    check_ratio(info, n)
                    yield chunk
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, NotImplementedError, RuntimeError, ValueError) as e:
            raise DocumentError(422, f"archive member {info.filename[:80]!r} cannot be read: {e}") from None
        if n != info.file_size:
            raise DocumentError(422, f"archive member {info.filename[:80]!r} unpacks to {n} bytes; "
                                     f"its header says {info.file_size}")


class XmlCheck:
    """One XML part fed chunk by chunk to defusedxml's expat parser, whose target only counts (no
    tree). Raises DocumentError for a DTD or entities (422), nesting past MAX_XML_DEPTH or elements
    past MAX_XML_ELEMENTS in the archive (413), XML that is not well-formed (422)."""

    def __init__(self, name: str, counts: Inflated):
        self.name, self.counts, self.depth = name, counts, 0
        self.parser = SafeET.XMLParser(target=self, forbid_dtd=True)

    def start(self, tag, attrib) -> None:      # the parser's target (xml.etree.ElementTree.XMLParser)
        self.depth += 1
        self.counts.elements += 1
        if self.depth > MAX_XML_DEPTH:
            raise DocumentError(413, f"XML part {self.name[:80]!r} nests elements more than {MAX_XML_DEPTH} "
                                     f"deep (MAX_XML_DEPTH)")
        if self.counts.elements > MAX_XML_ELEMENTS:
            raise DocumentError(413, f"the archive's XML parts hold more than {MAX_XML_ELEMENTS} elements "
                                     f"(MAX_XML_ELEMENTS)")

    def end(self, tag) -> None:
        self.depth -= 1

    def finish(self) -> None:         # not ``close``: the parser calls its target's close
        self._parse(self.parser.close)

    def feed(self, chunk: bytes) -> None:
        self._parse(self.parser.feed, chunk)

    def _parse(self, step, *args) -> None:
        try:
            step(*args)
        except DefusedXmlException as e:
            raise DocumentError(422, f"XML part {self.name[:80]!r} declares a DTD or entities ({type(e).__name__}); "
                                     "documents may not") from None
        except (SafeET.ParseError, SAXParseException, ValueError) as e:
            raise DocumentError(422, f"XML part {self.name[:80]!r} is not well-formed XML: {e}") from None
