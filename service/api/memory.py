"""The translation memory over HTTP: ``/v1/memory`` (bulk import and export) and the formats it reads
and writes; LibreTranslate's ``POST /suggest`` stores into the same memory (suggest.py).

    PUT    /v1/memory?model=M    body TSV (text/tab-separated-values: source TAB target per line, the
                                 csv module's excel-tab quoting), TMX 1.4 (application/x-tmx+xml) or
                                 JSON {"entries": [{"source", "target"}]}: adds or replaces entries
    GET    /v1/memory?model=M&format=json|tsv|tmx    every entry of the model (and the caller's key)
    DELETE /v1/memory?model=M[&source=TEXT]          all entries, or the one of that source
    (``source_lang`` + ``target_lang`` may name the model instead of ``model``)

TMX is parsed with defusedxml (no DTDs, entities or external references: a billion-laughs or XXE
document is a 400). Entries are keyed by the normalized source (``service.translator.memory``); the
store (one SQLite file per node) is what every translator reads, so an import applies to the next
request on any replica.
"""
from __future__ import annotations

import csv
import io
import xml.etree.ElementTree as ET
from typing import Optional

import defusedxml.ElementTree as DET
from defusedxml import DefusedXmlException
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.protocol import (
    MAX_MEMORY_ENTRIES,
    MAX_MEMORY_IMPORT,
    MAX_TEXT_CHARS,
    ServiceError,
    shown,
)
from service.translator.memory import MemoryStore

from .errors import format_validation_error
from .middleware.body import load_json

TSV = "text/tab-separated-values"
TMX = "application/x-tmx+xml"
XML_TYPES = (TMX, "application/xml", "text/xml")
XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"
_CODE_TAGS = frozenset({"bpt", "ept", "ph", "it", "ut"})    # TMX inline elements holding native code, not text


class MemoryEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    source: str = Field(..., min_length=1, max_length=MAX_TEXT_CHARS)
    target: str = Field(..., min_length=1, max_length=MAX_TEXT_CHARS)


class MemoryImport(BaseModel):
    """PUT /v1/memory as JSON."""
    model_config = ConfigDict(extra="forbid", strict=True)
    entries: list[MemoryEntry] = Field(..., max_length=MAX_MEMORY_IMPORT)


class StoredEntry(BaseModel):
    """An entry as the memory keeps it: the source is its key, normalized (NFKC, whitespace runs as one
    space, trimmed): NFKC can lengthen a text, and one of whitespace, control and format characters
    only is empty (such a text is passed through untranslated, never looked up)."""
    source: str
    target: str


class MemoryAnswer(BaseModel):
    model: str
    stored: Optional[int] = Field(None, description="PUT: entries added or replaced")
    deleted: Optional[int] = Field(None, description="DELETE: entries removed")
    entries: Optional[list[StoredEntry]] = Field(None, description="GET: every entry, sources in order")


def parse_json(body: bytes) -> list[tuple[str, str]]:
    """(source, target) of each entry of ``{"entries": [...]}``. Raises ServiceError 422 naming the
    field: JSON that ``load_json`` (every route's reader) refuses, a wrong type (an integer longer
    than int() takes included), text with a lone surrogate (``\\ud800``)."""
    try:
        parsed = MemoryImport.model_validate(load_json(body or b"{}"))
    except ValidationError as e:
        field, message = format_validation_error(e.errors()[0])
        raise ServiceError(422, message, field) from None
    return [(e.source, e.target) for e in parsed.entries]


def parse_tsv(text: str) -> list[tuple[str, str]]:
    """(source, target) per line of TSV (blank lines skipped). Raises ServiceError 422 naming the line."""
    out = []
    rows = csv.reader(io.StringIO(text), dialect="excel-tab")
    try:
        for n, row in enumerate(rows, 1):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 2 or not row[0].strip() or not row[1].strip():
                raise ServiceError(422, f"body: line {n}: expected 'source<TAB>target' (2 non-empty fields), got "
                                        f"{len(row)} field{'s' if len(row) != 1 else ''}", "body")
            out.append((row[0], row[1]))
    except csv.Error as e:      # a NUL character, an unclosed quote at the end
        raise ServiceError(422, f"body: TSV line {rows.line_num}: {e}", "body") from None
    return out


def _seg_text(seg: ET.Element) -> str:
    """A TMX <seg>'s text: its text and its inline elements' text, native code (bpt, ept, ph, it, ut) left out."""
    parts = [seg.text or ""]
    for child in seg:
        if child.tag not in _CODE_TAGS:
            parts.append(_seg_text(child))
        parts.append(child.tail or "")
    return "".join(parts)


def _lang(tuv: ET.Element) -> str:
    return (tuv.get(XML_LANG) or tuv.get("lang") or "").strip().lower().replace("_", "-")


def parse_tmx(body: bytes, source_lang: str, target_lang: str) -> list[tuple[str, str]]:
    """(source, target) of each <tu> holding a <tuv> in ``source_lang`` and one in ``target_lang``
    (matched ignoring case and region: "de-DE" is "de"). Raises ServiceError 422 for XML that is not
    well-formed, has a DTD or entities (defusedxml), is not TMX, or has no unit in those languages."""
    root = tmx_root(body)
    try:
        return _units(root, source_lang, target_lang)
    except RecursionError:
        raise ServiceError(422, "body: TMX <seg> elements nested too deep", "body") from None


def tmx_root(body: bytes) -> ET.Element:
    """The <tmx> element of a TMX file. Raises ServiceError 422 for XML that is not well-formed, has
    a DTD or entities (defusedxml), or is not TMX."""
    try:
        root = DET.fromstring(body, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except DefusedXmlException as e:
        raise ServiceError(422, f"body: TMX with a DTD, entities or external references is refused ({type(e).__name__})",
                           "body") from None
    except ET.ParseError as e:
        raise ServiceError(422, f"body: not well-formed XML: {e}", "body") from None
    if root.tag != "tmx" or root.find("body") is None:
        raise ServiceError(422, f"body: not TMX (root element <{str(root.tag)[:40]}>, expected <tmx> with a <body>)",
                           "body")
    return root


def _units(root: ET.Element, source_lang: str, target_lang: str) -> list[tuple[str, str]]:
    out = []
    units = root.find("body").findall("tu")
    for tu in units:
        segs: dict[str, str] = {}
        for tuv in tu.findall("tuv"):
            seg = tuv.find("seg")
            lang = _lang(tuv)
            if seg is not None and lang:
                segs.setdefault(lang, _seg_text(seg))
                segs.setdefault(lang.split("-")[0], _seg_text(seg))
        src, tgt = segs.get(source_lang), segs.get(target_lang)
        if src and tgt and src.strip() and tgt.strip():
            out.append((src, tgt))
    if units and not out:
        raise ServiceError(422, f"body: none of the {len(units)} <tu> has a <tuv> in both {source_lang} and "
                                f"{target_lang} (xml:lang)", "body")
    return out


def check_entries(pairs: list[tuple[str, str]], stored: int) -> None:
    """Raises ServiceError 413 past MAX_MEMORY_IMPORT entries per request or MAX_MEMORY_ENTRIES stored,
    422 for a source or target over MAX_TEXT_CHARS characters (as the JSON body's own check)."""
    if len(pairs) > MAX_MEMORY_IMPORT:
        raise ServiceError(413, f"body: at most {MAX_MEMORY_IMPORT} entries per request, got {len(pairs)}", "body")
    if stored + len(pairs) > MAX_MEMORY_ENTRIES:
        raise ServiceError(413, f"body: at most {MAX_MEMORY_ENTRIES} entries per model and key; {stored} are stored "
                                f"and {len(pairs)} were sent", "body")
    for i, (s, t) in enumerate(pairs):
        for name, v in (("source", s), ("target", t)):
            if len(v) > MAX_TEXT_CHARS:
                raise ServiceError(422, f"entries[{i}].{name}: at most {MAX_TEXT_CHARS} characters, got {len(v)}",
                                   f"entries.{name}")


def read_import(body: bytes, media: str, source_lang: str, target_lang: str) -> list[tuple[str, str]]:
    """The entries of a PUT body of media type ``media``. Raises ServiceError 415 or 422."""
    if media in XML_TYPES:
        return parse_tmx(body, source_lang, target_lang)
    if media == TSV:
        try:
            return parse_tsv(body.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ServiceError(422, f"body: TSV not valid UTF-8 at byte {e.start}", "body") from None
    if media in ("application/json", "") or media.endswith("+json"):
        return parse_json(body)
    raise ServiceError(415, f"Content-Type: PUT /v1/memory takes {TSV}, {TMX} or application/json, got {shown(media)}",
                       "Content-Type")


def write_tsv(pairs: list[tuple[str, str]]) -> str:
    out = io.StringIO()
    csv.writer(out, dialect="excel-tab", lineterminator="\n").writerows(pairs)
    return out.getvalue()


def write_tmx(pairs: list[tuple[str, str]], source_lang: str, target_lang: str) -> bytes:
    """TMX 1.4 of the entries (one <tu> each, <seg> as plain text)."""
    root = ET.Element("tmx", version="1.4")
    ET.SubElement(root, "header", {"creationtool": "transformer-mt-service", "creationtoolversion": "0.1.0",
                                   "segtype": "sentence", "o-tmf": "sqlite", "adminlang": "en",
                                   "srclang": source_lang, "datatype": "plaintext"})
    body = ET.SubElement(root, "body")
    for s, t in pairs:
        tu = ET.SubElement(body, "tu")
        for lang, text in ((source_lang, s), (target_lang, t)):
            tuv = ET.SubElement(tu, "tuv", {XML_LANG: lang})
            ET.SubElement(tuv, "seg").text = text
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def export(store: MemoryStore, model: str, scope: str, fmt: str, source_lang: str, target_lang: str):
    """(body, media type) of GET /v1/memory in ``fmt`` (json, tsv, tmx). Raises ServiceError 422."""
    pairs = store.export(model, scope)
    if fmt == "tsv":
        return write_tsv(pairs).encode("utf-8"), f"{TSV}; charset=utf-8"
    if fmt == "tmx":
        return write_tmx(pairs, source_lang, target_lang), TMX
    if fmt == "json":
        return (MemoryAnswer(model=model, entries=[StoredEntry(source=s, target=t) for s, t in pairs])
                .model_dump_json(exclude_none=True).encode("utf-8"), "application/json")
    raise ServiceError(422, f"format: one of json, tsv, tmx, got {shown(fmt)}", "format")
