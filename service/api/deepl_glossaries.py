"""DeepL's glossary API (https://developers.deepl.com/api-reference/multilingual-glossaries and
/glossaries), as the official clients call it, over the service's one glossary store (glossaries.py):

    v2 (one language pair)                          v3 (dictionaries: several pairs under one id)
    POST   /v2/glossaries         -> 201 glossary   POST   /v3/glossaries                   -> 201
    GET    /v2/glossaries         {"glossaries"}    GET    /v3/glossaries                   {"glossaries"}
    GET    /v2/glossaries/{id}                      GET    /v3/glossaries/{id}
    GET    /v2/glossaries/{id}/entries  TSV text    GET    /v3/glossaries/{id}/entries?source_lang&target_lang
    DELETE /v2/glossaries/{id}    -> 204            PATCH  /v3/glossaries/{id}  name, dictionaries merged
    GET    /v2/glossary-language-pairs              PUT    /v3/glossaries/{id}/dictionaries  one replaced
                                                    DELETE /v3/glossaries/{id}/dictionaries?source_lang&target_lang
                                                    DELETE /v3/glossaries/{id}       -> 204

A DeepL glossary is a group in the store (``GlossaryStore.edit_group``): its glossary_id (a UUID)
keys one stored glossary per dictionary, named ``<glossary_id>.<source>-<target>`` in /v1/glossaries;
the DeepL name is a label. A glossary stored with /v1/glossaries with both languages is a one-pair
DeepL glossary whose glossary_id is its name. Shared (file) glossaries are not listed here. Every
``glossary_id`` (/v2/translate, /v2/document, /v1/translate, /translate) names either.

Entries (``entries_format`` tsv, the default, or csv) are checked whole before anything is stored:
a line without exactly one tab (TSV), a CSV row of other than 2 or 4 columns (4: source_lang and
target_lang of the dictionary), an empty side, a tab or another control character inside a term,
a term over MAX_GLOSSARY_TERM_CHARS characters or DeepL's 1024 UTF-8 bytes, a source given twice,
more than MAX_STORED_GLOSSARY_ENTRIES entries, two sources of one stem with different targets
(translator/glossary.py), or a pair no served model (nor pivot route) translates: a 400 whose
message names the line and the field. Errors are DeepL's ``{"message"}``.
"""
from __future__ import annotations

import csv
import io
import re
import time
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from service.protocol import (
    MAX_GLOSSARY_TERM_CHARS,
    MAX_STORED_GLOSSARY_ENTRIES,
    InvalidRequest,
    ServiceError,
    shown,
)
from service.translator.glossary import Glossary

from . import deepl, glossaries
from .fields import read_fields
from .glossaries import StoredGlossary

if TYPE_CHECKING:
    from .services import Services

FORMATS = ("tsv", "csv")
TSV = "text/tab-separated-values"
MAX_TERM_BYTES = 1024      # DeepL's limit of a term and of a glossary's name, in UTF-8 bytes
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")    # what DeepL refuses inside a term
_ENTRY_AT = re.compile(r"entries\[(\d+)\](?:\.(source|target))?")


# ---- reading ---------------------------------------------------------------------------------------
def bad(field: str, message: str) -> ServiceError:
    return ServiceError(400, f"{field}: {message}", field)


def not_found(glossary_id: str) -> ServiceError:
    return ServiceError(404, f"glossary_id: no glossary {shown(glossary_id)} for this key", "glossary_id",
                        type="glossary_not_found")


def text_field(fields: dict, name: str, where: str = "", required: bool = True) -> Optional[str]:
    """A string field (``where``: the prefix naming it). Raises ServiceError 400."""
    value = fields.get(name)
    if value is None or (isinstance(value, str) and not value.strip() and required):
        if required:
            raise ServiceError(400, f"Parameter '{where}{name}' not specified.", where + name)
        return None
    if not isinstance(value, str):
        raise bad(where + name, f"must be a string, got {type(value).__name__}")
    return value


def glossary_name(fields: dict) -> str:
    name = text_field(fields, "name").strip()
    if len(name.encode("utf-8", "surrogatepass")) > MAX_TERM_BYTES or _CONTROL.search(name):
        raise bad("name", f"at most {MAX_TERM_BYTES} UTF-8 bytes, no control characters")
    return name


def served_pairs(svc: "Services") -> list[tuple[str, str]]:
    """The glossary language pairs: those a served model or pivot route translates."""
    return svc.graph.pairs()


def pair(svc: "Services", fields: dict, where: str = "") -> tuple[str, str]:
    """The dictionary's (source, target) in the service's codes ("EN-GB" -> "en"). Raises
    ServiceError 400 for a missing code or a pair no model serves."""
    src, tgt = (deepl.service_language(text_field(fields, f, where)) for f in ("source_lang", "target_lang"))
    if (src, tgt) not in served_pairs(svc):
        raise bad(where + "target_lang", f"no model here translates {src.upper()}->{tgt.upper()}; glossary language "
                                         f"pairs: {', '.join(f'{s}->{t}' for s, t in served_pairs(svc)).upper()}")
    return src, tgt


def _rows(text: str, fmt: str, field: str) -> list[tuple[int, list[str]]]:
    """(line number, cells) of each non-blank line of an entries text."""
    if fmt == "tsv":
        return [(n, line.split("\t")) for n, line in enumerate(re.split(r"\r\n|\r|\n", text), 1) if line.strip()]
    reader = csv.reader(io.StringIO(text, newline=""))
    rows = []
    try:
        for row in reader:
            if any(c.strip() for c in row):
                rows.append((reader.line_num, row))
    except csv.Error as e:
        raise bad(field, f"line {reader.line_num}: not CSV ({e})") from None
    return rows


def parse_entries(text: object, fmt: object, langs: tuple[str, str], field: str = "entries"
                  ) -> tuple[tuple[str, str], ...]:
    """The entries of a TSV or CSV text for the dictionary ``langs`` (module docstring). Raises
    ServiceError 400 naming ``field``, the line and the side (source or target)."""
    fmt_field = field.rsplit("entries", 1)[0] + "entries_format"
    fmt = "tsv" if fmt is None else fmt
    if fmt not in FORMATS:
        raise bad(fmt_field, f"tsv or csv, got {shown(fmt)}")
    if not isinstance(text, str) or not text.strip():
        raise ServiceError(400, f"Parameter '{field}' not specified.", field)
    entries, lines, seen = [], [], {}
    for n, cells in _rows(text, fmt, field):
        if fmt == "csv" and len(cells) == 4:
            if tuple(deepl.service_language(c) for c in cells[2:]) != langs:
                raise bad(field, f"line {n}: languages {cells[2]}->{cells[3]}, the dictionary's are "
                                 f"{langs[0]}->{langs[1]}")
            cells = cells[:2]
        if len(cells) != 2:
            what = ("no tab between source and target" if len(cells) < 2 else
                    f"a tab inside a term ({len(cells) - 1} tabs; one separates source and target)")
            raise bad(field, f"line {n}: {what}" if fmt == "tsv" else
                      f"line {n}: {len(cells)} columns; send source,target (or source,target,source_lang,target_lang)")
        for side, term in zip(("source", "target"), cells):
            term = term.strip()
            control = _CONTROL.search(term)
            if not term:
                raise bad(field, f"line {n}, {side}: an empty term")
            if control:
                what = "a tab" if control.group() == "\t" else f"a control character (U+{ord(control.group()):04X})"
                raise bad(field, f"line {n}, {side}: {what} inside the term")
            if len(term) > MAX_GLOSSARY_TERM_CHARS or len(term.encode("utf-8", "surrogatepass")) > MAX_TERM_BYTES:
                raise bad(field, f"line {n}, {side}: at most {MAX_GLOSSARY_TERM_CHARS} characters and "
                                 f"{MAX_TERM_BYTES} UTF-8 bytes, got {len(term)} characters")
        src, tgt = Glossary.normalized([(cells[0], cells[1])])[0]
        if src in seen:
            raise bad(field, f"line {n}, source: {shown(src)} duplicates line {seen[src]}")
        seen[src] = n
        entries.append((src, tgt))
        lines.append(n)
        if len(entries) > MAX_STORED_GLOSSARY_ENTRIES:
            raise bad(field, f"at most {MAX_STORED_GLOSSARY_ENTRIES} entries (line {n} is one more)")
    try:
        Glossary(entries, langs[0], None, 0, "entries", MAX_STORED_GLOSSARY_ENTRIES)
    except InvalidRequest as e:     # a source without a letter or digit, two of one stem: the lines named
        raise bad(field, _ENTRY_AT.sub(lambda m: f"line {lines[int(m.group(1))]}" + (f", {m.group(2)}" if m.group(2)
                                                                                     else ""), e.message)) from None
    return tuple(entries)


def tsv(entries) -> str:
    """Entries as DeepL answers them: source TAB target, one a line."""
    return "\n".join(f"{s}\t{t}" for s, t in entries)


def dictionary(svc: "Services", fields: object, where: str, label: Optional[str] = None) -> StoredGlossary:
    """A dictionary's fields (source_lang, target_lang, entries, entries_format) read into a
    StoredGlossary of the store (its name and group are the store's to set)."""
    if not isinstance(fields, dict):
        raise bad(where.rstrip("."), "must be an object: {source_lang, target_lang, entries, entries_format}")
    langs = pair(svc, fields, where)
    entries = parse_entries(fields.get("entries"), fields.get("entries_format"), langs, where + "entries")
    return StoredGlossary("", entries, *langs, label=label, created=time.time())


def dictionaries(svc: "Services", fields: dict, required: bool) -> list[StoredGlossary]:
    value = fields.get("dictionaries")
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise bad("dictionaries", "a JSON list of {source_lang, target_lang, entries, entries_format} objects, "
                                  "at least one")
    out = [dictionary(svc, d, f"dictionaries[{i}].") for i, d in enumerate(value)]
    pairs = [(g.source_lang, g.target_lang) for g in out]
    twice = next((i for i, p in enumerate(pairs) if p in pairs[:i]), None)
    if twice is not None:
        raise bad(f"dictionaries[{twice}].source_lang", f"a second dictionary for {'->'.join(pairs[twice])}")
    return out


# ---- answers ---------------------------------------------------------------------------------------
def creation_time(t: float) -> str:
    """ISO 8601 with milliseconds, as DeepL writes it: 2021-08-03T14:16:18.329Z."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def label(gs: list[StoredGlossary]) -> str:
    return next((g.label for g in gs if g.label), gs[0].key)


def langs_of(g: StoredGlossary) -> tuple[str, str]:
    return glossaries.base(g.source_lang), glossaries.base(g.target_lang)


def v2_info(g: StoredGlossary) -> dict:
    src, tgt = langs_of(g)
    return {"glossary_id": g.key, "name": label([g]), "ready": True, "source_lang": src, "target_lang": tgt,
            "creation_time": creation_time(g.created), "entry_count": len(g.entries)}


def counts(g: StoredGlossary) -> dict:
    src, tgt = langs_of(g)
    return {"source_lang": src, "target_lang": tgt, "entry_count": len(g.entries)}


def v3_info(gs: list[StoredGlossary]) -> dict:
    return {"glossary_id": gs[0].key, "name": label(gs), "dictionaries": [counts(g) for g in gs],
            "creation_time": creation_time(min(g.created for g in gs))}


# ---- the store, as DeepL sees it -------------------------------------------------------------------
def _deepl(gs: list[StoredGlossary]) -> list[StoredGlossary]:
    """The dictionaries DeepL can show: both languages known."""
    return [g for g in gs if g.source_lang and g.target_lang]


async def groups(svc: "Services", request: Request) -> list[list[StoredGlossary]]:
    """The caller's DeepL glossaries, each its dictionaries, oldest first."""
    out: dict[str, list[StoredGlossary]] = {}
    for g in _deepl(await svc.glossaries.members(glossaries.scope_of(request))):
        out.setdefault(g.key, []).append(g)
    return sorted(out.values(), key=lambda gs: min(g.created for g in gs))


async def group(svc: "Services", request: Request, glossary_id: str) -> list[StoredGlossary]:
    """Glossary ``glossary_id``'s dictionaries. Raises ServiceError 404."""
    gs = _deepl(await svc.glossaries.members(glossaries.scope_of(request), glossary_id))
    if not gs:
        raise not_found(glossary_id)
    return gs


async def fields_of(request: Request) -> dict:
    """The request's fields (JSON, a form, or the query string). Raises ServiceError 400, 415."""
    return await read_fields(request, (), 400)


def pair_of_query(request: Request) -> tuple[str, str]:
    q = request.query_params
    src, tgt = (q.get(f) for f in ("source_lang", "target_lang"))
    for name, value in (("source_lang", src), ("target_lang", tgt)):
        if not value or not value.strip():
            raise ServiceError(400, f"Parameter '{name}' not specified.", name)
    return deepl.service_language(src), deepl.service_language(tgt)


def the_dictionary(gs: list[StoredGlossary], langs: tuple[str, str]) -> StoredGlossary:
    for g in gs:
        if langs_of(g) == langs:
            return g
    raise ServiceError(404, f"glossary {shown(gs[0].key)} has no dictionary {langs[0]}->{langs[1]}",
                       "source_lang", type="glossary_not_found")


# ---- v2 --------------------------------------------------------------------------------------------
async def create_v2(svc: "Services", request: Request) -> JSONResponse:
    fields = await fields_of(request)
    name = glossary_name(fields)
    g = dictionary(svc, fields, "", label=name)
    made = await svc.glossaries.edit_group(glossaries.scope_of(request), str(uuid.uuid4()), [g], label=name,
                                           create=True)
    return JSONResponse(v2_info(made[0]), status_code=201)


async def list_v2(svc: "Services", request: Request) -> dict:
    return {"glossaries": [v2_info(gs[0]) for gs in await groups(svc, request) if len(gs) == 1]}


async def get_v2(svc: "Services", request: Request, glossary_id: str) -> StoredGlossary:
    gs = await group(svc, request, glossary_id)
    if len(gs) > 1:
        raise bad("glossary_id", f"glossary {shown(glossary_id)} has {len(gs)} dictionaries; the v2 routes show a "
                                 "glossary of one: GET /v3/glossaries/{glossary_id}")
    return gs[0]


async def entries_v2(svc: "Services", request: Request, glossary_id: str) -> Response:
    accept = [a.split(";")[0].strip().lower() for a in request.headers.get("accept", TSV).split(",")]
    if not {TSV, "*/*", "text/*", ""} & set(accept):
        return JSONResponse({"message": f"Accept: only {TSV} is offered, got {shown(request.headers['accept'])}"},
                            status_code=415)
    g = await get_v2(svc, request, glossary_id)
    return Response(tsv(g.entries), media_type=f"{TSV}; charset=utf-8")


# ---- v3 --------------------------------------------------------------------------------------------
async def create_v3(svc: "Services", request: Request) -> JSONResponse:
    fields = await fields_of(request)
    name = glossary_name(fields)
    gs = [d for d in dictionaries(svc, fields, required=True)]
    made = await svc.glossaries.edit_group(glossaries.scope_of(request), str(uuid.uuid4()), gs, label=name,
                                           create=True)
    return JSONResponse(v3_info(made), status_code=201)


async def patch_v3(svc: "Services", request: Request, glossary_id: str) -> dict:
    """PATCH: a new ``name`` and/or ``dictionaries`` merged into those of their pairs (a source term
    already there takes the new target; a new pair is added)."""
    fields = await fields_of(request)
    name = glossary_name(fields) if fields.get("name") is not None else None
    put = dictionaries(svc, fields, required=False)
    if name is None and not put:
        raise ServiceError(400, "Parameter 'name' not specified: send name, dictionaries or both.", "name")
    await group(svc, request, glossary_id)
    made = await svc.glossaries.edit_group(glossaries.scope_of(request), glossary_id, put, merge=True, label=name)
    return v3_info(_deepl(made))


async def replace_dictionary(svc: "Services", request: Request, glossary_id: str) -> dict:
    """PUT .../dictionaries: the dictionary of the body's pair replaced (or added)."""
    g = dictionary(svc, await fields_of(request), "")
    await group(svc, request, glossary_id)
    made = await svc.glossaries.edit_group(glossaries.scope_of(request), glossary_id, [g])
    return counts(the_dictionary(made, (g.source_lang, g.target_lang)))


async def entries_v3(svc: "Services", request: Request, glossary_id: str) -> dict:
    langs = pair_of_query(request)
    g = the_dictionary(await group(svc, request, glossary_id), langs)
    return {"dictionaries": [{**counts(g), "entries": tsv(g.entries), "entries_format": "tsv"}]}


async def delete_dictionary(svc: "Services", request: Request, glossary_id: str) -> Response:
    langs = pair_of_query(request)
    await group(svc, request, glossary_id)
    await svc.glossaries.edit_group(glossaries.scope_of(request), glossary_id, [], drop=(langs,))
    return Response(status_code=204)


async def delete(svc: "Services", request: Request, glossary_id: str) -> Response:
    """DELETE /v2 or /v3/glossaries/{id}: every dictionary of it (a /v1 glossary: that one)."""
    await group(svc, request, glossary_id)
    await svc.glossaries.delete_group(glossaries.scope_of(request), glossary_id)
    return Response(status_code=204)


# ---- translating with them -------------------------------------------------------------------------
def ids_of(fields: dict) -> tuple[list[str], str]:
    """(the glossary ids, the field naming them) of a request's ``glossary_id`` or ``glossary_ids``
    (up to deepl.MAX_GLOSSARY_IDS, a list or comma-separated). Raises ServiceError 400."""
    one, many = fields.get("glossary_id") or None, fields.get("glossary_ids") or []
    items = [many] if isinstance(many, str) else many
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise bad("glossary_ids", "send glossary ids as a list of strings or comma-separated")
    ids = [i.strip() for item in items for i in item.split(",") if i.strip()]
    if one is not None and ids:
        raise bad("glossary_ids", "cannot be used together with glossary_id")
    if len(ids) > deepl.MAX_GLOSSARY_IDS:
        raise bad("glossary_ids", f"at most {deepl.MAX_GLOSSARY_IDS} glossary ids, got {len(ids)}")
    return ([one], "glossary_id") if one is not None else (ids, "glossary_ids")
