"""The request bodies of GET /openapi.json as the serving replica accepts them: what FastAPI derives from
the pydantic models, plus every rule that depends on what is served (``complete``):

    /v1/translate       per model (``model``, else its language pair, else the default; anything else:
                        the smallest limits of all): beam_size and n_best <= min(MAX_BEAM_SIZE,
                        max_num_seqs, half the target vocabulary), max_new_tokens <= the model's,
                        attention layer and head indices below its counts; timeout_s <= max_timeout_s
    /translate, /detect, /suggest, /translate_file   the served codes and pairs (libre_schemas.request_schema)
    /v2/translate, /v2/document                       DeepL's codes of the served languages and pairs
    /v1/documents, /translate_file, /v2/document      the file part's name (its extension picks the
                        format: ``encoding``), ``filename`` one of the supported extensions

Rules that depend on stored state are declared as responses instead (an unknown ``glossary_id`` or
``document_key``: 404). Without services (a bare app) the document has no served enums or limits.
"""
from __future__ import annotations

import re
from typing import Optional

from model.inference.search import max_beam_size
from service.documents import EXTENSIONS
from service.protocol import (
    MAX_BEAM_SIZE,
    MAX_MEMORY_IMPORT,
    MAX_TEXT_CHARS,
    MAX_TEXTS,
    ServiceError,
)

from . import deepl, libre_schemas, suggest

UPLOAD_NAME = "document.txt"    # the file part's name the document declares (encoding: Content-Disposition)
# a file name whose extension is a supported format (any case)
FILENAME_PATTERN = r"\.(" + "|".join("".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c)
                                              for c in e[1:]) for e in EXTENSIONS) + r")$"
FILE_ENCODING = {"file": {"headers": {"Content-Disposition": {
    "description": "the file part's name: its extension picks the format (" + ", ".join(EXTENSIONS) + ")",
    "schema": {"type": "string", "example": f'form-data; name="file"; filename="{UPLOAD_NAME}"'}}}}}


def _limits_of(limits) -> dict:
    """{beam, max_new_tokens, layers, heads} of a ModelLimits, or of a pivot route (each the legs' smallest)."""
    legs = getattr(limits, "legs", None) or (limits,)
    return {"beam": min(min(MAX_BEAM_SIZE, l.max_num_seqs, max_beam_size(l.vocab_size)) for l in legs),
            "max_new_tokens": min(l.max_new_tokens for l in legs),
            "layers": min(min(l.n_encoder_layers, l.n_decoder_layers) for l in legs),
            "heads": min(l.n_heads for l in legs)}


def _smallest(all_limits: list[dict]) -> dict:
    return {k: min(lim[k] for lim in all_limits) for k in all_limits[0]}


# a boolean as DeepL's fields take it: JSON true/false, or (forms; JSON too) 0/1 and the words pydantic reads
BOOLEAN = {"anyOf": [{"type": "boolean"}, {"enum": [0, 1]}, {"enum": [w for word in ("0", "1", "true", "false", "yes", "no",
                                                                                  "on", "off", "t", "f", "y", "n")
                                                                     for w in dict.fromkeys((word, word.upper(), word.title()))]}]}


def _model_rules(lim: dict) -> dict:
    # (attention indices: on AttentionOptions, the largest model's: a branch constraining them makes
    # JSON Schema generators give up; complete() says so)
    return {"beam_size": {"maximum": lim["beam"]}, "n_best": {"maximum": lim["beam"]},
            "max_new_tokens": {"maximum": lim["max_new_tokens"]}, "min_new_tokens": {"maximum": lim["max_new_tokens"]}}


def _code(value: Optional[str]) -> dict:
    return {"type": "null"} if value is None else {"const": value}


def native_rules(svc) -> dict:
    """The allOf member of TranslateRequest: an anyOf of one branch per way a model is chosen (its
    id; its languages; the default), each with that model's limits, and a branch for any other
    request with the smallest limits of all (what every model accepts)."""
    limits = {m: _limits_of(l) for m, l in svc.pipeline.limits.items()}
    branches = [{"properties": {"model": {"const": m}, **_model_rules(lim)}} for m, lim in limits.items()]
    sources = sorted({c.source_lang for c in svc.graph.cards.values()})
    targets = sorted({t for c in svc.graph.cards.values() for t in c.targets} | {t for _, t in svc.graph.routes})
    for s in [None, *sources]:
        for t in [None, *targets]:
            try:
                card = svc.graph.resolve(None, s, t)
            except ServiceError:
                continue
            branches.append({"properties": {"model": {"type": "null"}, "source_lang": _code(s), "target_lang": _code(t),
                                            **_model_rules(limits[card.id])}})
    for c in svc.graph.cards.values():      # NLLB-200 / M2M100 / mBART-50: one branch of enums, not a branch per pair
        if c.lang_tokens:
            branches.append({"properties": {"model": {"type": "null"}, "source_lang": {"enum": list(c.sources)},
                                            "target_lang": {"enum": list(c.targets)}, **_model_rules(limits[c.id])}})
    branches.append({"properties": _model_rules(_smallest(list(limits.values())))})
    return {"anyOf": branches}


def glossary_rules(pairs: list[tuple[str, str]], groups: list[tuple] = ()) -> dict:
    """The anyOf of GlossaryCreate's schema that ``glossaries.check_served`` enforces: a branch per
    pair, and one per group (sources, targets) of a model that serves every pair of two different
    languages of them (a language into itself is not one: ``not`` names each)."""
    null = {"type": "null"}
    sources = sorted({s for s, _ in pairs} | {s for a, _ in groups for s in a})
    targets = sorted({t for _, t in pairs} | {t for _, b in groups for t in b})

    def group(a, b) -> dict:
        same = sorted(set(a) & set(b))
        branch = {"properties": {"source_lang": {"enum": list(a)}, "target_lang": {"enum": list(b)}}}
        if same:
            branch["not"] = {"anyOf": [{"required": ["source_lang", "target_lang"], "properties": {
                "source_lang": {"const": x}, "target_lang": {"const": x}}} for x in same]}
        return branch
    return {"anyOf": [{"properties": {"source_lang": null, "target_lang": {"enum": targets}}},
                      {"properties": {"source_lang": {"enum": sources}, "target_lang": null}},
                      *({"properties": {"source_lang": {"const": s}, "target_lang": {"const": t}}} for s, t in pairs),
                      *(group(a, b) for a, b in groups)]}


def _family(svc) -> tuple[list[str], list[str]]:
    """(sources, targets) of the NLLB-200 / M2M100 / mBART-50 models, which serve every pair of them
    (one schema branch of enums, not one per pair)."""
    family = [c for c in svc.graph.cards.values() if c.lang_tokens]
    return sorted({s for c in family for s in c.sources}), sorted({t for c in family for t in c.targets})


def _pairs(svc, deepl_codes: bool) -> list[tuple[str, str]]:
    """(source, target) pairs the service translates (a model or a pivot route)."""
    out = []
    sources = sorted({c.source_lang for c in svc.graph.cards.values() if not c.lang_tokens})
    targets = sorted({t for c in svc.graph.cards.values() for t in c.targets} | {t for _, t in svc.graph.routes})
    for s in sources:
        for t in targets:
            try:
                svc.graph.resolve(None, s, t)
            except ServiceError:
                continue
            out.append((s, t))
    return out


def deepl_translate_schema(svc) -> dict:
    """POST /v2/translate's body: DeepL's codes of the served languages; source_lang -> target_lang a
    served pair (or the same language: the text comes back as it is); source_lang absent or empty:
    detected; glossary_id or glossary_ids, not both."""
    cards = list(svc.graph.cards.values()) if svc else []
    text = {"type": "string", "maxLength": MAX_TEXT_CHARS}
    props = {
        "text": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_TEXTS}],
                 "description": f"a text or a list of up to {MAX_TEXTS} (a repeated form field), each up to "
                                f"{MAX_TEXT_CHARS} characters"},
        "target_lang": {"type": "string", "minLength": 1, "description": 'e.g. "DE", "EN-GB", "EN-US" (GET /v2/languages)'},
        "source_lang": {"type": ["string", "null"], "description": "absent, null or empty: each text's language is detected"},
        "tag_handling": {"enum": ["html", "xml", None], "description": "tags kept, the text between them translated"},
        "split_sentences": {"enum": ["0", "1", "nonewlines", 0, 1, False, True],
                            "description": "1 (default): at punctuation and line breaks; nonewlines: at punctuation "
                                           "only (the default with tag_handling); 0: each text is one sentence"},
        "preserve_formatting": {**BOOLEAN, "description": "accepted; whitespace and case are always kept"},
        "formality": {"type": ["string", "null"], "description": "accepted, not applied (named in X-Ignored-Fields)"},
        "glossary_id": {"type": ["string", "null"], "description": "a DeepL glossary's id or a /v1/glossaries name: "
                                                                   "the dictionary of the pair; unknown: 404"},
        "glossary_ids": {"anyOf": [{"type": "null"}, {"type": "string"}, {"type": "array", "items": {"type": "string"},
                                                        "maxItems": deepl.MAX_GLOSSARY_IDS}],
                         "description": f"up to {deepl.MAX_GLOSSARY_IDS} glossary ids (comma-separated or a list), "
                                        "not with glossary_id; unknown: 404"},
        "show_billed_characters": BOOLEAN}
    some_id = {"type": "string", "pattern": r"[^,\s]"}
    schema = {"type": "object", "required": ["text", "target_lang"], "properties": props,
              "not": {"required": ["glossary_id", "glossary_ids"], "properties": {
                  "glossary_id": {"type": "string", "minLength": 1},
                  "glossary_ids": {"anyOf": [some_id, {"type": "array", "contains": some_id}]}}}}
    if not cards:
        return schema
    pairs = _pairs(svc, True)
    targets = sorted({t for _, t in pairs})
    tcodes = {t: sorted({t.upper(), *deepl.deepl_codes(t, True)}) for t in targets}
    sources = sorted({s for s, _ in pairs})
    fsources, ftargets = _family(svc)
    tcodes.update({t: sorted({t.upper(), *deepl.deepl_codes(t, True)}) for t in ftargets})
    props["target_lang"]["enum"] = sorted({c for t in {*targets, *ftargets} for c in tcodes[t]})
    props["source_lang"]["enum"] = [None, ""] + sorted({s.upper() for s in {*sources, *fsources}})
    branches = [{"properties": {"source_lang": {"const": s.upper()}, "target_lang": {"enum": sorted(
        {c for t in targets if (s, t) in pairs or t == s for c in tcodes[t]})}}} for s in sources]
    if fsources:
        branches.append({"properties": {"source_lang": {"enum": [s.upper() for s in fsources]}, "target_lang": {
            "enum": sorted({c for t in ftargets for c in tcodes[t]})}}})
    branches.append({"properties": {"source_lang": {"enum": ["", None]}}})      # (absent: the same branch)
    schema["anyOf"] = branches
    return schema


def form_of(schema: dict) -> dict:
    """A JSON body's schema as a form's (DeepL's): text fields, so never null."""
    props = {}
    for k, v in schema["properties"].items():
        if isinstance(v.get("type"), list):
            v = {**v, "type": [t for t in v["type"] if t != "null"][0]}
        if any(not isinstance(e, str) for e in v.get("enum", ())):    # a form field carries text: "1", not 1 or true
            v = {**v, "enum": [e for e in v["enum"] if isinstance(e, str)]}
        if {"type": "null"} in v.get("anyOf", ()):
            v = {**{a: b for a, b in v.items() if a != "anyOf"}, **({"anyOf": [o for o in v["anyOf"] if o != {"type": "null"}]}
                                                                   if len(v["anyOf"]) > 2 else
                                                                   next(o for o in v["anyOf"] if o != {"type": "null"}))}
        props[k] = v
    return {**schema, "properties": props}


def _media(schema: dict, form: Optional[dict] = None) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema},
                                          "application/x-www-form-urlencoded": {"schema": form or schema},
                                          "multipart/form-data": {"schema": form or schema}}}


def upload_schema(schema: dict, svc, source: Optional[str], target: Optional[str], deepl_shape: bool = False) -> dict:
    """A document upload's multipart schema: ``filename`` a supported extension, the file part's name
    declared (``encoding``), the languages served (a DeepL upload: DeepL's codes; source empty: detected)."""
    schema = {**schema, "properties": dict(schema["properties"])}
    props = schema["properties"]
    if "filename" in props:
        props["filename"] = {**props["filename"], "pattern": FILENAME_PATTERN,
                             "description": "overrides the file part's name; its extension picks the format ("
                                            + ", ".join(EXTENSIONS) + ")"}
    if svc is not None and source and target:
        pairs = _pairs(svc, deepl_shape)
        fsources, ftargets = _family(svc)
        if deepl_shape:
            targets = sorted({t for _, t in pairs})
            codes = {t: sorted({t.upper(), *deepl.deepl_codes(t, True)}) for t in {*targets, *ftargets}}
            props[target] = {**props[target], "enum": sorted({c for t in {*targets, *ftargets} for c in codes[t]})}
            props[source] = {**props[source], "enum": [""] + sorted({s.upper() for s, _ in pairs} | {s.upper() for s in fsources})}
            languages = [{"properties": {source: {"const": s.upper()}, target: {"enum": sorted(
                {c for t in targets if (s, t) in pairs for c in codes[t]})}}} for s in sorted({s for s, _ in pairs})] + [
                {"properties": {source: {"const": ""}}}]       # (absent: the same branch)
            languages += [{"properties": {source: {"enum": [s.upper() for s in fsources]}, target: {
                "enum": sorted({c for t in ftargets for c in codes[t]})}}}] if fsources else []
            schema["allOf"] = [{"anyOf": languages}, {"anyOf": _output_format_branches()}]
        else:
            props[source] = {**props[source], "enum": sorted({s for s, _ in pairs} | set(fsources)) + ["auto"]}
            props[target] = {**props[target], "enum": sorted({t for _, t in pairs} | set(ftargets))}
            schema["anyOf"] = [{"properties": {source: {"const": s}, target: {"enum": sorted({t for s2, t in pairs if s2 == s})}}}
                               for s in sorted({s for s, _ in pairs})] + [{"properties": {source: {"const": "auto"}}}] + (
                [{"properties": {source: {"enum": fsources}, target: {"enum": ftargets}}}] if fsources else [])
    return schema


def _extension_pattern(ext: str) -> str:
    return r"\." + "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in ext) + "$"


def _output_format_branches() -> list[dict]:
    """DeepL's output_format: empty or the input's own extension (``filename``'s, else the file part's)."""
    upload_ext = UPLOAD_NAME.rsplit(".", 1)[1]
    out = []
    for e in (x[1:] for x in EXTENSIONS):
        branch = {"properties": {"filename": {"pattern": _extension_pattern(e)},
                                 "output_format": {"enum": ["", e, e.upper()]}}}
        if e != upload_ext:         # without filename: the file part's name
            branch["required"] = ["filename"]
        out.append(branch)
    return out


def with_upload_encoding(body: dict) -> dict:
    body = {**body, "content": dict(body["content"])}
    media = body["content"]["multipart/form-data"]
    body["content"]["multipart/form-data"] = {**media, "encoding": FILE_ENCODING}
    return body


def inlined(schema: dict) -> dict:
    """A pydantic JSON Schema with its ``$defs`` put in place of the references (an OpenAPI document
    resolves "#/$defs/..." against its own root, where they are not)."""
    defs = schema.get("$defs", {})

    def walk(v):
        if isinstance(v, dict):
            if set(v) == {"$ref"} and v["$ref"].startswith("#/$defs/"):
                return walk(defs[v["$ref"].rsplit("/", 1)[1]])
            return {k: walk(x) for k, x in v.items() if k != "$defs"}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v
    return walk(schema)


# a TSV line: two tab-separated fields, each with a character other than whitespace (no quote, NUL or line break)
_TSV_FIELD = r'[^\t\r\n"\x00]*[^\s\x1c-\x1f"\x00][^\t\r\n"\x00]*'
TSV_PATTERN = rf"^({_TSV_FIELD}\t{_TSV_FIELD}\n)*({_TSV_FIELD}\t{_TSV_FIELD}\n?)?$"


TMX_SCHEMA = {"type": "string", "format": "binary", "description": (
    'a TMX 1.4 document: <tmx version="1.4"><body>, per unit <tu><tuv xml:lang="SOURCE"><seg>..</seg></tuv>'
    f'<tuv xml:lang="TARGET"><seg>..</seg></tuv></tu>, in the languages of the model the query picks; at most '
    f"{MAX_MEMORY_IMPORT} units (413). An XML format, as a document upload's file: no JSON Schema states it "
    "(an XML writer working from one could not carry what the service checks: no DTD, the xml:lang of units)")}


def memory_bodies(doc: dict, svc=None) -> None:
    """PUT /v1/memory's JSON body and GET's answer with their entries inlined; TSV lines as a pattern;
    TMX a document (``TMX_SCHEMA``)."""
    from . import memory
    put = doc["paths"]["/v1/memory"]["put"]["requestBody"]["content"]
    put["application/json"]["schema"] = inlined(memory.MemoryImport.model_json_schema())
    put[memory.TSV]["schema"] = {**put[memory.TSV]["schema"], "pattern": TSV_PATTERN}
    put[memory.TMX]["schema"] = TMX_SCHEMA
    get = doc["paths"]["/v1/memory"]["get"]["responses"]["200"]["content"]
    get["application/json"]["schema"] = inlined(memory.MemoryAnswer.model_json_schema())


def complete(doc: dict, svc) -> dict:
    """The document with the request bodies of the served replica (``svc``: its ``Services``; None outside one)."""
    from . import deepl_documents, documents
    paths = doc["paths"]
    cards = list(svc.graph.cards.values()) if svc is not None else []
    seqs = {m: l.max_num_seqs for m, l in svc.pipeline.limits.items() if hasattr(l, "max_num_seqs")} if svc else {}
    for path, model in (("/translate", libre_schemas.LibreTranslateBody), ("/detect", libre_schemas.LibreDetectBody)):
        paths[path]["post"]["requestBody"] = libre_schemas.openapi_request_body(model, cards, seqs)
    paths["/suggest"]["post"]["requestBody"] = libre_schemas.openapi_request_body(suggest.SuggestBody, cards, seqs,
                                                                                  auto=False)
    dl = deepl_translate_schema(svc)
    paths["/v2/translate"]["post"]["requestBody"] = _media(dl, form_of(dl))
    for path, body, source, target, deepl_shape in (
            ("/v1/documents", documents.OPENAPI_NATIVE, "source_lang", "target_lang", False),
            ("/translate_file", documents.OPENAPI_LIBRE, "source", "target", False),
            ("/v2/document", deepl_documents.OPENAPI_UPLOAD, "source_lang", "target_lang", True)):
        schema = body["content"]["multipart/form-data"]["schema"]
        # the native route's model field picks the model itself: its languages stay free (404 when unserved)
        langs = (source, target) if path != "/v1/documents" else (None, None)
        body = {**body, "content": {"multipart/form-data": {"schema": upload_schema(schema, svc, *langs,
                                                                                     deepl_shape=deepl_shape)}}}
        paths[path]["post"]["requestBody"] = with_upload_encoding(body)
    memory_bodies(doc, svc)
    if svc is not None and "/v3/translation_memories/import" in paths:    # a TSV import's pair: one served
        from . import deepl_memories, deepl_memory_files
        direct = deepl_memories.served_pairs(svc.graph)
        pairs = [(src.upper(), sorted({c for s, t, _ in direct if s == src for c in (t.upper(), *deepl.deepl_codes(t, True))}))
                 for src in sorted({s for s, _, _ in direct})]
        paths["/v3/translation_memories/import"]["post"]["requestBody"] = deepl_memory_files.openapi_import_body(pairs)
    if svc is not None:
        schemas = doc["components"]["schemas"]
        family = [c for c in svc.graph.cards.values() if c.lang_tokens]     # one branch each, not one per pair
        schemas["GlossaryCreate"].update(glossary_rules(
            [(s, t) for s, t in svc.graph.pairs() if not any(s in c.sources and t in c.targets for c in family)],
            [(c.sources, c.targets) for c in family]))
        request = schemas["TranslateRequest"]
        request["allOf"] = [native_rules(svc)]     # (beside if/then: JSON Schema generators give up on more)
        most = [_limits_of(l) for l in svc.pipeline.limits.values()]
        attention = schemas["AttentionOptions"]["properties"]
        for name, count in (("layers", max(m["layers"] for m in most)), ("heads", max(m["heads"] for m in most))):
            items = attention[name]["anyOf"][0]["items"]
            items["maximum"] = count - 1
            attention[name]["description"] += f" (at most {count - 1} on the largest model; each model's count: GET /v1/models)"
        request["properties"]["timeout_s"] = {**request["properties"]["timeout_s"],
                                              "description": request["properties"]["timeout_s"].get("description", ""),
                                              "anyOf": [{"type": "number", "exclusiveMinimum": 0,
                                                         "maximum": svc.pipeline.max_timeout_s}, {"type": "null"}]}
    return doc
