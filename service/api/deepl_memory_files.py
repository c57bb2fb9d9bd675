"""The files of DeepL's translation memories (``deepl_memories.py``): an import's request and its
TMX or TSV file read into entries, an export written as TMX, and the cursors of segment pages."""
from __future__ import annotations

import base64
import io
import json
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Annotated, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from service.protocol import MAX_MEMORY_ENTRIES, MAX_TEXT_CHARS, ServiceError

from . import memory as formats
from .errors import format_validation_error
from .middleware.body import MAX_BODY_BYTES

if TYPE_CHECKING:
    from service.pipeline import LanguageGraph

from .deepl_memories import TMX_TYPES, UPLOAD_TYPES, Memory, served_key, short


def _integral(v):
    """333.0 -> 333: JSON Schema's "integer" is any number without a fraction (2020-12, 6.1.1), as the
    OpenAPI 3.1 document says; 333.5, "333" and true stay refused (strict)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


class SourceFile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    file_name: str = Field(..., min_length=1, max_length=255)
    content_length: Annotated[int, BeforeValidator(_integral)] = Field(..., gt=0, le=MAX_BODY_BYTES, description="bytes of the file (the body cap)")
    content_type: Optional[Literal[UPLOAD_TYPES]] = Field(
        None, description=f"{', '.join(TMX_TYPES)} (TMX; absent: application/xml, as DeepL's) or {formats.TSV} "
                          "(source TAB target per line; parameters.source_lang and target_lang say the languages)")


class ImportParameters(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    display_name: Optional[str] = Field(None, min_length=1, max_length=255)
    source_lang: Optional[str] = Field(None, min_length=1, description="TSV only (this service's): its source")
    target_lang: Optional[str] = Field(None, min_length=1, description="TSV only (this service's): its target")


class ImportRequest(BaseModel):
    """POST /v3/translation_memories/import: the file to come, not the file."""
    model_config = ConfigDict(extra="forbid", strict=True)
    source_file: SourceFile
    parameters: ImportParameters = Field(default_factory=ImportParameters)


def openapi_import_body(pairs: Optional[list[tuple[str, list[str]]]] = None) -> dict:
    """The requestBody of POST /v3/translation_memories/import: ImportRequest's schema, its
    references inlined, a TSV's languages required: strings, with ``pairs`` (a served source's DeepL
    code, its targets' codes) one of those pairs."""
    schema = ImportRequest.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node
    schema = inline(schema)
    schema["if"] = {"properties": {"source_file": {"properties": {"content_type": {"const": formats.TSV}},
                                                   "required": ["content_type"]}}}
    langs = {"required": ["source_lang", "target_lang"],
             "properties": {"source_lang": {"type": "string"}, "target_lang": {"type": "string"}}}
    if pairs:
        langs["anyOf"] = [{"properties": {"source_lang": {"const": s}, "target_lang": {"enum": ts}}} for s, ts in pairs]
    schema["then"] = {"properties": {"parameters": langs}, "required": ["parameters"]}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def import_request(fields: dict, graph: "LanguageGraph") -> ImportRequest:
    """The checked request, its content_type set (absent: application/xml). Raises ServiceError 400
    naming the field: a bad value (a file over the body cap, a media type not taken), a TSV without
    source_lang and target_lang, a pair no model here translates."""
    try:
        req = ImportRequest.model_validate(fields)
    except ValidationError as e:
        field, message = format_validation_error(e.errors()[0])
        raise ServiceError(400, f"Value for '{field}' not supported: {message}", field) from None
    req.source_file.content_type = ctype = req.source_file.content_type or TMX_TYPES[0]
    p = req.parameters
    if ctype == formats.TSV:
        for name in ("source_lang", "target_lang"):
            if getattr(p, name) is None:
                raise ServiceError(400, f"Parameter 'parameters.{name}' not specified: a TSV file names no languages",
                                   f"parameters.{name}")
        try:
            served_key(graph, lang_code(p.source_lang), lang_code(p.target_lang))
        except ServiceError as e:
            raise ServiceError(400, f"Value for 'parameters.target_lang' not supported: {e.message}",
                               "parameters.target_lang") from None
    return req


def lang_code(code: str) -> str:
    """The service's code of a DeepL or TMX code: "EN-GB", "en_gb", "en-GB" -> "en"."""
    return code.strip().lower().replace("_", "-").split("-")[0]


def read_file(body: bytes, job: dict, graph: "LanguageGraph"
              ) -> tuple[str, list[tuple[str, str, list[tuple[str, str]]]], int]:
    """(source language, [(target language, model key, pairs)], units skipped) of an uploaded file.
    Raises ServiceError naming the cause (the job's error message): a broken or hostile TMX
    (memory.tmx_root), no unit with a source and a target, a pair no model here translates, a text
    over MAX_TEXT_CHARS, more than MAX_MEMORY_ENTRIES entries."""
    if job["content_type"] == formats.TSV:
        source, target = lang_code(job["source_lang"]), lang_code(job["target_lang"])
        try:
            text = body.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ServiceError(422, f"the TSV file is not UTF-8 (byte {e.start})") from None
        by_target, skipped = {target: formats.parse_tsv(text)}, 0
        if not by_target[target]:
            raise ServiceError(422, "the TSV file has no entries")
    else:
        source, by_target, skipped = tmx_entries(formats.tmx_root(body))
    out = []
    for target, pairs in sorted(by_target.items()):
        if len(pairs) > MAX_MEMORY_ENTRIES:
            raise ServiceError(413, f"{len(pairs)} entries into {short(target)}: at most {MAX_MEMORY_ENTRIES} per "
                                    "translation memory")
        for n, (s, t) in enumerate(pairs, 1):
            if max(len(s), len(t)) > MAX_TEXT_CHARS:
                raise ServiceError(422, f"entry {n} ({short(source)}->{short(target)}): at most {MAX_TEXT_CHARS} "
                                        f"characters per text, got {max(len(s), len(t))}")
        out.append((target, served_key(graph, source, target), pairs))
    return source, out, skipped


def tmx_entries(root: ET.Element) -> tuple[str, dict[str, list[tuple[str, str]]], int]:
    """(source language, {target language: [(source, target)]}, units skipped) of a TMX file: the
    source is the header's srclang (else the first <tuv>'s language), every other language of a
    <tu> holding the source is a target. Raises ServiceError 422 naming why none is usable."""
    units = root.find("body").findall("tu")
    header = root.find("header")
    source = lang_code(header.get("srclang", "")) if header is not None else ""
    if source in ("", "*all*"):
        first = next((tuv for tu in units for tuv in tu.findall("tuv") if formats._lang(tuv)), None)
        source = lang_code(formats._lang(first)) if first is not None else ""
    if not source:
        raise ServiceError(422, "the TMX file names no source language (header srclang) and has no <tuv> with "
                                "xml:lang")
    by_target: dict[str, list[tuple[str, str]]] = {}
    used = 0
    try:
        for tu in units:
            segs: dict[str, str] = {}
            for tuv in tu.findall("tuv"):
                seg, lang = tuv.find("seg"), lang_code(formats._lang(tuv))
                if seg is not None and lang:
                    segs.setdefault(lang, formats._seg_text(seg))
            src = segs.pop(source, "")
            pairs = [(lang, t) for lang, t in segs.items() if t.strip()] if src.strip() else []
            for lang, t in pairs:
                by_target.setdefault(lang, []).append((src, t))
            used += bool(pairs)
    except RecursionError:
        raise ServiceError(422, "TMX <seg> elements nested too deep") from None
    if not by_target:
        raise ServiceError(422, f"none of the {len(units)} <tu> of the TMX file has a <seg> in its source language "
                                f"{short(source)} and one in another language")
    return source, by_target, len(units) - used


def write_tmx(m: Memory, segments: list[tuple[str, dict[str, tuple[str, float]]]]) -> bytes:
    """TMX 1.4 of a memory: one <tu> per source, a <tuv> for it and for each of its targets."""
    root = ET.Element("tmx", version="1.4")
    ET.SubElement(root, "header", {"creationtool": "transformer-mt-service", "creationtoolversion": "0.1.0",
                                   "segtype": "sentence", "o-tmf": "sqlite", "adminlang": "en",
                                   "srclang": m.source_lang, "datatype": "plaintext"})
    body = ET.SubElement(root, "body")
    for source, targets in segments:
        tu = ET.SubElement(body, "tu")
        for lang, text in ((m.source_lang, source), *((lang, t) for lang, (t, _) in sorted(targets.items()))):
            tuv = ET.SubElement(tu, "tuv", {formats.XML_LANG: lang})
            ET.SubElement(tuv, "seg").text = text
    out = io.BytesIO()
    ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)
    return out.getvalue()


# ---- segment pages --------------------------------------------------------------------------------
def cursor_out(after: str, text: Optional[str], case: bool) -> str:
    """An opaque cursor: the last source returned and the filter it was issued under."""
    raw = json.dumps({"after": after, "filter": text, "case": case}, ensure_ascii=False).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def cursor_in(cursor: Optional[str], text: Optional[str], case: bool) -> Optional[str]:
    """The last source a cursor names. Raises ServiceError 400 naming page_cursor for one this service
    did not issue, or one issued under another filter."""
    if cursor is None:
        return None
    try:
        data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        after = data["after"] if isinstance(data, dict) else None
    except (ValueError, KeyError):
        after = None
    if not isinstance(after, str):
        raise ServiceError(400, "Value for 'page_cursor' not supported: not a cursor this service issued",
                           "page_cursor") from None
    if data.get("filter") != text or data.get("case") != case:
        raise ServiceError(400, "Value for 'page_cursor' not supported: it was issued for another filter_text or "
                                "filter_case_sensitive; start again without it", "page_cursor")
    return after
