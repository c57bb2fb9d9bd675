"""LibreTranslate's request and answer models: they validate (``schemas.validate``) and document
(``request_schema``, ``openapi_request_body``) ``POST /translate``, ``/detect`` and ``/suggest``."""
from __future__ import annotations

import json
from typing import Annotated, Any, Iterable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.pipeline import autodetect
from service.protocol import (
    MAX_BEAM_SIZE,
    MAX_GLOSSARY_ENTRIES,
    MAX_KEEP_TERMS,
    MAX_TEXT_CHARS,
    MAX_TEXTS,
    short_name,
)
from service.translator import ModelCard

from . import glossaries
from .middleware import body as body_module
from .schemas import KeepTerm, check_keep, check_unicode


def _json_type(v: Any) -> str:
    return ("boolean" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else "object"
            if isinstance(v, dict) else "null" if v is None else type(v).__name__)


def _texts(v: Any) -> Any:
    """q: a string or a non-empty list of strings; an empty one is missing (as LibreTranslate says)."""
    if v is None:
        raise ValueError("Invalid request: missing q parameter")
    if v == "" or v == []:
        raise ValueError("Invalid request: empty q parameter; send the text to translate")
    if isinstance(v, list):
        bad = next((i for i, t in enumerate(v) if not isinstance(t, str)), None)
        if bad is not None:
            raise ValueError(f"q[{bad}]: must be a string (q: a string or a list of strings), got {_json_type(v[bad])}")
        empty = next((i for i, t in enumerate(v) if not t), None)
        if empty is not None:       # as a form field, one empty q is indistinguishable from a missing one
            raise ValueError(f"q[{empty}]: empty; each text needs at least one character")
    elif not isinstance(v, str):
        raise ValueError(f"must be a string or a list of strings, got {_json_type(v)}")
    check_unicode(v if isinstance(v, list) else [v], "q")
    return v


# a text: the document states the limits that autodetect.check_sizes / ModelLimits.check answer (with their messages)
TextField = Annotated[str, Field(min_length=1, json_schema_extra={"maxLength": MAX_TEXT_CHARS})]


class LibreDetectBody(BaseModel):
    """POST /detect, as JSON, application/x-www-form-urlencoded or multipart/form-data."""
    model_config = ConfigDict(extra="allow")     # LibreTranslate answers without the fields it does not read
    q: Union[TextField, Annotated[list[TextField], Field(min_length=1, json_schema_extra={"maxItems": MAX_TEXTS})]] = Field(
        ..., description="text (a list: each language's mean confidence over the texts)")
    api_key: Optional[str] = Field(None, description="checked when API keys are on and no Authorization "
                                                     "header is sent")

    _q = field_validator("q", mode="before")(classmethod(lambda cls, v: _texts(v)))

    @property
    def texts(self) -> list[str]:
        return list(self.q) if isinstance(self.q, list) else [self.q]


class LibreTranslateBody(LibreDetectBody):
    """POST /translate, as JSON, application/x-www-form-urlencoded or multipart/form-data."""
    q: Union[TextField, Annotated[list[TextField], Field(min_length=1, json_schema_extra={"maxItems": MAX_TEXTS})]] = Field(
        ..., description="text, or a list of texts (a repeated form field)")
    source: str = Field(..., min_length=1, description='language code (GET /languages) or "auto"')
    target: str = Field(..., min_length=1, description="language code (GET /languages)")
    format: Optional[Literal["text", "html"]] = Field("text", description="null: text")
    alternatives: Optional[int] = Field(0, ge=0, le=MAX_BEAM_SIZE - 1,
                                        description="alternative translations to return; null: 0")
    glossary: Optional[Union[list[dict[str, str]], str]] = Field(
        None, description='this service\'s own: [{"source", "target"}] entries as on /v1/translate (in a form: '
                          "that list as a JSON string)")
    glossary_id: Optional[str] = Field(None, min_length=1, description="this service's own: a stored glossary's name "
                                                                      "(GET /v1/glossaries; unknown: 404); with "
                                                                      "glossary: both apply")
    keep: Optional[list[KeepTerm]] = Field(None, max_length=MAX_KEEP_TERMS,
                                           description="this service's own: do-not-translate terms, as "
                                                        "/v1/translate's keep (a JSON list, or one form field per term)")

    @field_validator("glossary", "glossary_id", mode="before")
    @classmethod
    def _empty_form_field(cls, v: Any, info) -> Any:
        return None if v == "" and (info.context or {}).get("form") else v     # an empty form field: none

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, v: Any, info) -> Any:
        if v == "" and (info.context or {}).get("form"):      # an empty form field: the default
            return "text"
        if v is not None and v not in ("text", "html"):
            raise ValueError(f"{short_name(str(v))} format is not supported (text or html)")
        return v

    @field_validator("alternatives", mode="before")
    @classmethod
    def _whole_number(cls, v: Any, info) -> Any:
        """JSON: an integer (2 or 2.0) or null; a form: its digits, empty for 0. Never a boolean."""
        if (info.context or {}).get("form") and isinstance(v, str):
            return v.strip() or 0
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"must be a whole number or null, got {json.dumps(v) if isinstance(v, (bool, str)) else _json_type(v)}")
        return v

    @field_validator("source", "target")
    @classmethod
    def _unicode(cls, v: str, info) -> str:
        check_unicode([v], info.field_name)
        return v

    @field_validator("keep", mode="before")
    @classmethod
    def _keep(cls, v: Any, info) -> Any:
        """A list of terms (the rules of /v1/translate's keep); in a form, one field per term."""
        if isinstance(v, str) and (info.context or {}).get("form"):
            v = [v] if v else None           # an empty form field: none
        return check_keep(v)


def request_schema(model: type[BaseModel], cards: Iterable[ModelCard] = (),
                   max_num_seqs: Optional[dict[str, int]] = None, auto: bool = True) -> dict:
    """The JSON Schema of a LibreTranslate request body. With the served models: ``source`` and
    ``target`` take the served codes only (``source`` also "auto"), and each source only the targets
    its models translate into (an ``anyOf`` of source/target pairs), with ``alternatives`` below the
    beam its model's engine runs (``max_num_seqs``: model id -> its engine's) -- what the service
    accepts, so that a request valid by the document is not refused for its languages."""
    schema = model.model_json_schema()
    cards = list(cards)
    if not cards or "source" not in schema["properties"]:
        return schema
    seqs = max_num_seqs or {}

    def most(chosen: list[ModelCard]) -> dict:
        n = min([MAX_BEAM_SIZE] + [seqs[c.id] for c in chosen if c.id in seqs]) - 1
        return {"alternatives": {"maximum": n}} if n < MAX_BEAM_SIZE - 1 and "alternatives" in props else {}
    family = [c for c in cards if c.lang_tokens]     # NLLB-200 / M2M100 / mBART-50: one branch each, of enums
    cards = [c for c in cards if not c.lang_tokens]
    sources = sorted({c.source_lang for c in cards} | {s for c in family for s in c.sources})
    targets = sorted({t for c in cards for t in c.targets} | {t for c in family for t in c.targets})
    props = schema["properties"]
    props["source"] = {**props["source"], "enum": sources + ([autodetect.AUTO] if auto else [])}
    props["target"] = {**props["target"], "enum": targets}
    pairs = []
    for s in sorted({c.source_lang for c in cards}):
        for t in sorted({t for c in cards if c.source_lang == s for t in c.targets}):
            chosen = min((c for c in cards if c.source_lang == s and t in c.targets), key=lambda c: bool(c.target_languages))
            pairs.append({"properties": {"source": {"const": s}, "target": {"const": t}, **most([chosen])}})
    pairs += [{"properties": {"source": {"enum": list(c.sources)}, "target": {"enum": list(c.targets)}, **most([c])}}
              for c in family]
    cards += family
    schema["anyOf"] = pairs + ([{"properties": {"source": {"const": autodetect.AUTO}, **most(cards)}}] if auto else [])
    return schema


def openapi_request_body(model: type[BaseModel] = LibreTranslateBody, cards: Iterable[ModelCard] = (),
                         max_num_seqs: Optional[dict[str, int]] = None, auto: bool = True) -> dict:
    """The requestBody of POST /translate (or /detect, /suggest) for the OpenAPI document: JSON and
    the two form types, whose fields are text: never null, but empty for the default. ``glossary``
    is a JSON list in a JSON body; in a form it is that list as JSON text, which JSON Schema cannot
    state: the forms' schema leaves it out (the description says it)."""
    schema = request_schema(model, cards, max_num_seqs, auto)
    if "glossary" in schema["properties"]:      # a JSON body's: entries as on /v1/translate
        glossary, entry = schema["properties"]["glossary"], glossaries.GlossaryEntry.model_json_schema()
        schema["properties"]["glossary"] = {**glossary, "anyOf": [
            {**o, "items": entry, "maxItems": MAX_GLOSSARY_ENTRIES} if o.get("type") == "array" else o
            for o in glossary["anyOf"] if o.get("type") != "string"]}
    form = {**schema, "properties": {k: _form_field(v) for k, v in schema["properties"].items() if k != "glossary"}}
    keep = form["properties"].get("keep")
    if keep is not None:        # one form field per term: a single one is a string
        term = next(o["items"] for o in keep["anyOf"] if o.get("type") == "array")
        form["properties"]["keep"] = {**keep, "anyOf": keep["anyOf"] + [term]}
    if "glossary" in schema["properties"]:
        form["description"] = ("Form fields. glossary: the JSON list of entries as one field's text (not stated "
                               "here: JSON Schema cannot describe a JSON text inside a string)")
    return {"required": True, "content": {body_module.JSON: {"schema": schema},
                                          **{m: {"schema": form} for m in (body_module.FORM, body_module.MULTIPART)}}}


def _form_field(prop: dict) -> dict:
    """A property as a form field: text, so its null option (``anyOf: [X, {"type": "null"}]``) is the
    empty field instead (which means the default), or nothing for a string."""
    if {"type": "null"} not in prop.get("anyOf", ()):
        return prop
    options = [o for o in prop["anyOf"] if o != {"type": "null"}]
    if options == [{"type": "string"}]:       # any string, the empty one too
        return {**{k: v for k, v in prop.items() if k not in ("anyOf", "default")}, **options[0]}
    return {**prop, "anyOf": options + [{"const": ""}]}


class LibreDetection(BaseModel):
    confidence: float = Field(..., ge=0, lt=100, description="0-100, never 100")
    language: str = Field(..., description='language code; "und" for text without letters')


class LibreTranslateAnswer(BaseModel):
    translatedText: Union[str, list[str]]
    alternatives: Optional[Union[list[str], list[list[str]]]] = None
    detectedLanguage: Optional[Union[LibreDetection, list[LibreDetection]]] = Field(
        None, description='with source "auto": the language detected in each text')
    passthrough: Optional[Union[bool, list[bool]]] = Field(
        None, description='with source "auto", when a text came back unchanged (detected as the target '
                          'language, or without letters): true for it')


class LibreError(BaseModel):
    error: str


