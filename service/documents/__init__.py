"""Document translation: a file's text out as segments, the file rebuilt around their translations,
structure and formatting kept (docs/documents.md). No HTTP here (the routes: service/api/documents.py).

    text.py          .txt                    blocks between blank lines
    html_doc.py      .html .htm              the HTML route's HtmlText on the whole page
    markdown_doc.py  .md .markdown           markdown-it-py; code and front matter untouched
    subtitles.py     .srt .vtt               srt / webvtt-py; timings untouched
    docx_doc.py      .docx                   python-docx; runs and hyperlinks carried by RichText
    pptx_doc.py      .pptx                   python-pptx; likewise
    odt_doc.py       .odt                    odfpy; spans and links likewise
    common.py        Document, Segments (paragraphs of runs in, rebuilt runs out), RichText, build,
                     limits, DocumentError
    safety.py        archive and XML checks before any parser runs

``load(data, filename)`` picks the format by the file name's extension and checks that the content
matches it (415 otherwise; a text file's UTF-8 byte-order mark is written back); every refusal is a ``DocumentError`` (a ``ServiceError`` 4xx naming the limit).
``release(doc)`` ends a document once rebuilt or given up: what its file was parsed into takes tens of
times the file's (unpacked) bytes, and glibc keeps freed memory mapped, so after a large one the
memory is collected and handed back to the system (``release_memory``) for the process to return to
its level.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
from dataclasses import dataclass

from .common import MAX_DOCUMENT_BYTES, Document, DocumentError


@dataclass(frozen=True)
class Format:
    name: str           # what the messages call it
    media_type: str     # the Content-Type of the translated file
    loader: str         # "module:function" of this package
    binary: bool        # a zip archive (else UTF-8 text)


FORMATS = {
    "txt": Format("plain text", "text/plain; charset=utf-8", "text:load", False),
    "html": Format("HTML", "text/html; charset=utf-8", "html_doc:load", False),
    "htm": Format("HTML", "text/html; charset=utf-8", "html_doc:load", False),
    "md": Format("Markdown", "text/markdown; charset=utf-8", "markdown_doc:load", False),
    "markdown": Format("Markdown", "text/markdown; charset=utf-8", "markdown_doc:load", False),
    "srt": Format("SubRip subtitles", "application/x-subrip; charset=utf-8", "subtitles:load_srt", False),
    "vtt": Format("WebVTT subtitles", "text/vtt; charset=utf-8", "subtitles:load_vtt", False),
    "docx": Format("Word", "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
                   "docx_doc:load", True),
    "pptx": Format("PowerPoint", "application/vnd.openxmlformats-officedocument.presentationml.presentation",
                   "pptx_doc:load", True),
    "odt": Format("OpenDocument text", "application/vnd.oasis.opendocument.text", "odt_doc:load", True),
}
EXTENSIONS = tuple("." + e for e in FORMATS)
BOM = b"\xef\xbb\xbf"     # UTF-8's byte-order mark: a text file that starts with it is written back with it
_BINARY_MAGIC = (b"PK\x03\x04", b"%PDF", b"\xd0\xcf\x11\xe0", b"\x7fELF", b"\x89PNG", b"\xff\xd8\xff", b"GIF8")


def extension(filename: str) -> str:
    """The lower-case extension of ``filename`` (without the dot). Raises DocumentError 415 for one
    that is not a supported format."""
    name = filename.rsplit("/", 1)[-1].rsplit("\\", 1)[-1]
    ext = name.rsplit(".", 1)[-1] if "." in name else ""
    ext = ext.lower() if ext.isascii() else ext     # ASCII only: "\u212a" (Kelvin sign) lowers to "k"
    if ext not in FORMATS:
        raise DocumentError(415, f"{'.' + ext if ext else 'a file without an extension'} is not a supported "
                                 f"format; supported: {', '.join(EXTENSIONS)}")
    return ext


def load(data: bytes, filename: str) -> Document:
    """The document in ``data``, its format from ``filename``'s extension. Raises DocumentError: 413
    past MAX_DOCUMENT_BYTES (or another limit), 415 for an unsupported extension or content that is
    not that format, 422 for a damaged file."""
    ext = extension(filename)
    fmt = FORMATS[ext]
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentError(413, f"{len(data)} bytes; at most {MAX_DOCUMENT_BYTES} (MAX_DOCUMENT_BYTES)")
    if not data.strip():
        raise DocumentError(422, "the file is empty")
    if not fmt.binary and (data[:2] in (b"\xff\xfe", b"\xfe\xff") or data[:4] == b"\x00\x00\xfe\xff"):
        raise DocumentError(422, f"the text is UTF-{32 if data[:4].count(0) == 2 else 16} (its byte-order mark says "
                                 "so); save it as UTF-8")      # text, not binary: its NULs are half its characters
    if not fmt.binary and (data.startswith(_BINARY_MAGIC) or b"\x00" in data[:8192]):
        raise DocumentError(415, f"the content is binary, not {fmt.name} as the extension .{ext} says")
    module, func = fmt.loader.split(":")
    try:
        doc = getattr(importlib.import_module(f"{__name__}.{module}"), func)(data)
    except DocumentError as e:      # refused after parsing began: free what was parsed, not at the next gc
        e.__traceback__ = None      # its frames hold the partly parsed file
        if len(data) >= RELEASE_MIN_BYTES // 4:
            release_memory()
        raise
    if not fmt.binary and data.startswith(BOM):       # the text formats read past it; the file keeps it
        rebuild = doc.rebuild
        doc.rebuild = lambda translations: BOM + rebuild(translations)
    doc.parsed_bytes = max(getattr(doc, "parsed_bytes", 0), len(data))   # an archive's: its members unpacked
    doc.extension = ext     # its format, as the documents metric names it
    return doc


RELEASE_MIN_BYTES = 1024 * 1024     # a document that parsed this many bytes is collected at once when released
try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim      # glibc's
except (AttributeError, OSError, TypeError):          # another C library, or no dlopen(NULL)
    _malloc_trim = None


def release(doc: Document) -> None:
    """Ends ``doc`` (rebuilt, or given up): drops its attributes, the parsed file among them, and after
    a file of RELEASE_MIN_BYTES or more gives the memory back (``release_memory``)."""
    large = getattr(doc, "parsed_bytes", 0) >= RELEASE_MIN_BYTES
    vars(doc).clear()               # the library's tree, the segments and their callbacks
    if large:
        release_memory()


def release_memory() -> None:
    """Collects garbage now (the libraries' trees hold reference cycles) and, with glibc, hands the
    freed heap back to the system (``malloc_trim``); blocks for a fraction of a second."""
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
