"""The DeepL-compatible API (DeepL API v2, https://developers.deepl.com/docs): ``POST /v2/translate``,
``GET|POST /v2/languages``, ``GET|POST /v2/usage``, and the pieces other DeepL routes reuse.

    Authorization: DeepL-Auth-Key KEY    the service's API keys (guard.py; Bearer works too)
    POST /v2/translate                   JSON or form: text (repeated / list), target_lang, source_lang
                                         (absent: detected), tag_handling (html|xml) with ignore_tags,
                                         splitting_tags, non_splitting_tags, outline_detection,
                                         split_sentences (0|1|nonewlines), preserve_formatting,
                                         formality, glossary_id, translation_memory_id and
                                         translation_memory_threshold (deepl_memories.py)
        -> {"translations": [{"detected_source_language": "DE", "text": "...", "billed_characters": n}]}
    errors                               {"message": "..."}: 400 invalid input (the field named), 403 no
                                         or a wrong key, 404 unknown glossary, 413 too large, 429 rate
                                         limit, 503 overloaded (Retry-After); 456 (quota) never occurs

Reusable by the document routes (``/v2/document``): ``service_language`` / ``deepl_codes`` (language
codes both ways), ``error_response`` (DeepL's error shape and statuses). The key of a
``DeepL-Auth-Key`` header is read by the guard (``middleware/guard.deepl_auth_key``).
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Iterable, Literal, Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from service.engine import GenerationOptions
from service.pipeline import autodetect
from service.pipeline.autodetect import NAMES
from service.pipeline.markup import TagOptions, tags
from service.pipeline.texts import Texts
from service.protocol import (
    JobOrigin,
    ServiceError,
    TranslateJob,
    short_name,
    shown,
)
from service.translator import ModelCard

from . import deepl_memories, glossaries
from .errors import deepl_error_response, format_validation_error

if TYPE_CHECKING:
    from .services import Services

IGNORED_HEADER = "X-Ignored-Fields"   # fields accepted but not applied (formality, context, ...), as on /translate
# DeepL's target codes with a region: the language's variants, all served by the language's model
REGIONAL_TARGETS = {"en": ("EN-GB", "EN-US"), "pt": ("PT-PT", "PT-BR"), "zh": ("ZH-HANS", "ZH-HANT")}
REGION_NAMES = {"EN-GB": "English (British)", "EN-US": "English (American)", "PT-PT": "Portuguese (European)",
                "PT-BR": "Portuguese (Brazilian)", "ZH-HANS": "Chinese (simplified)", "ZH-HANT": "Chinese (traditional)"}
# DeepL Pro without a cost limit reports this character_limit (GET /v2/usage); the service has no quota
NO_CHARACTER_LIMIT = 1_000_000_000_000
# Fields DeepL defines that change nothing here: reported in IGNORED_HEADER when sent with a value that
# asks for something (formality other than default, a context, ...)
LIST_FIELDS = ("text", "non_splitting_tags", "splitting_tags", "ignore_tags", "glossary_ids", "custom_instructions")
# the fields read once (given twice: 400); others, unknown ones included, may repeat (named in IGNORED_HEADER)
SINGLE_FIELDS = ("target_lang", "source_lang", "tag_handling", "split_sentences", "preserve_formatting", "formality",
                 "glossary_id", "show_billed_characters", "context", "model_type", "outline_detection",
                 "translation_memory_id", "translation_memory_threshold")
NOT_APPLIED = ("formality", "context", "model_type", "tag_handling_version", "custom_instructions", "style_id",
               "glossary_ids")
TAG_LISTS = ("ignore_tags", "splitting_tags", "non_splitting_tags")     # DeepL's lists of element names
_TAG_NAME = re.compile(r"(?:[^\W\d]|:)[\w.:-]*")      # an XML name (letters, digits, _ . : -)


# ---- language codes ------------------------------------------------------------------------------
def service_language(code: str) -> str:
    """The service's code for a DeepL code: "EN-GB" -> "en", "PT-BR" -> "pt", "DE" -> "de" (lower
    case, region or script dropped; ``card.match_language`` does the same against served codes)."""
    return code.strip().lower().replace("_", "-").split("-")[0]


def deepl_codes(lang: str, target: bool) -> list[str]:
    """DeepL's codes for a service language: a source is its upper-case code ("DE"); a target with
    regional variants in DeepL is each variant ("en" -> ["EN-GB", "EN-US"]), else the upper-case code."""
    if target and lang in REGIONAL_TARGETS:
        return list(REGIONAL_TARGETS[lang])
    return [lang.upper()]


def language_name(code: str) -> str:
    """DeepL's English name of a code of either kind ("EN-GB" -> "English (British)", "DE" -> "German")."""
    return REGION_NAMES.get(code) or NAMES.get(service_language(code), code)


def languages(cards: Iterable[ModelCard], kind: str) -> list[dict]:
    """``GET /v2/languages`` for ``kind`` "source" or "target": ``[{"language", "name"}]`` (targets
    with ``supports_formality``: false: no model here has a formality control)."""
    cards = list(cards)
    langs = sorted({c.source_lang for c in cards} if kind == "source" else {t for c in cards for t in c.targets})
    out = []
    for lang in langs:
        for code in deepl_codes(lang, kind == "target"):
            item = {"language": code, "name": language_name(code)}
            if kind == "target":
                item["supports_formality"] = False
            out.append(item)
    return out


# ---- keys and errors -----------------------------------------------------------------------------
error_response = deepl_error_response     # DeepL's error shape and statuses (errors.deepl_error_response)


# ---- POST /v2/translate --------------------------------------------------------------------------
class DeepLTranslateBody(BaseModel):
    """POST /v2/translate, as JSON, application/x-www-form-urlencoded or multipart/form-data (form
    values are strings: "1"/"0" for booleans; ``text`` repeated for several texts)."""
    model_config = ConfigDict(extra="allow")
    text: list[str] = Field(..., min_length=1, description="the texts (a string counts as one)")
    target_lang: str = Field(..., min_length=1, description='e.g. "DE", "EN-GB", "EN-US" (GET /v2/languages)')
    source_lang: Optional[str] = Field(None, description="absent: each text's language is detected")
    tag_handling: Optional[Literal["html", "xml"]] = Field(
        None, description="html or xml: tags kept, text between them translated (the HTML route's handling)")
    split_sentences: Literal["0", "1", "nonewlines"] = Field(
        "1", description="1: at punctuation and line breaks; nonewlines: at punctuation only; 0: each text "
                         "is one sentence (default nonewlines with tag_handling)")
    preserve_formatting: bool = Field(False, description="accepted; whitespace and case are always kept")
    formality: Optional[str] = Field(None, description="accepted; no model here has a formality control "
                                                       f"(named in {IGNORED_HEADER})")
    glossary_id: Optional[str] = Field(None, description="a stored glossary's id")
    show_billed_characters: bool = True
    ignore_tags: list[str] = Field([], description="with tag_handling: elements whose content is kept as it is")
    splitting_tags: list[str] = Field([], description="with tag_handling: elements that always end a sentence")
    non_splitting_tags: list[str] = Field([], description="with tag_handling: elements inside a sentence (their "
                                                          "text joins the sentence around them)")
    outline_detection: bool = Field(True, description="with tag_handling: false: only splitting_tags end a sentence")
    translation_memory_id: Optional[str] = Field(
        None, min_length=1, description="a translation memory's id (GET /v3/translation_memories): a sentence whose "
                                        "best match in it scores at least translation_memory_threshold takes its "
                                        "translation (deepl_memories.py)")
    translation_memory_threshold: Optional[int] = Field(
        None, ge=0, le=100, description="0-100, with translation_memory_id (absent: 75, DeepL's default): the lowest "
                                        "match score (rapidfuzz fuzz.ratio) that takes the memory's translation")

    def tag_options(self) -> TagOptions:
        """How the segmenter reads this request's markup (``markup.TagOptions``)."""
        return tags(self.ignore_tags, self.splitting_tags, self.non_splitting_tags, self.outline_detection,
                    xml=self.tag_handling == "xml")

    @field_validator("text", mode="before")
    @classmethod
    def _texts(cls, v):
        if isinstance(v, str):
            return [v]
        if isinstance(v, list):
            bad = next((i for i, t in enumerate(v) if not isinstance(t, str)), None)
            if bad is not None:
                raise ValueError(f"text[{bad}] must be a string, got {type(v[bad]).__name__}")
        return v

    @field_validator(*TAG_LISTS, mode="before")
    @classmethod
    def _tag_names(cls, v):
        """DeepL's lists of element names: a comma-separated string, or a list of them (a repeated form
        field); spaces around a name and empty names are dropped."""
        if v is None:
            return []
        if not isinstance(v, (str, list)):
            raise ValueError("send tag names, comma-separated, or a list of them")
        names = []
        for item in [v] if isinstance(v, str) else v:
            if not isinstance(item, str):
                raise ValueError(f"a tag name must be a string, got {type(item).__name__}")
            for name in filter(None, (n.strip() for n in item.split(","))):
                if not _TAG_NAME.fullmatch(name):
                    raise ValueError(f"a tag name has letters, digits, _ . : - only: got {shown(name)}")
                names.append(name)
        return names

    @field_validator("split_sentences", mode="before")
    @classmethod
    def _split(cls, v):
        return str(int(v)) if isinstance(v, (bool, int)) else v


def parse(fields: dict) -> DeepLTranslateBody:
    """The validated body. Raises ServiceError 400 naming the first invalid field."""
    try:
        body = DeepLTranslateBody.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        field, message = format_validation_error(err)
        if err.get("type") == "missing":      # DeepL's words for it
            raise ServiceError(400, f"Parameter '{field}' not specified.", field) from None
        raise ServiceError(400, f"Value for '{field}' not supported: {message}", field) from None
    if body.tag_handling is not None and "split_sentences" not in fields:
        body.split_sentences = "nonewlines"      # DeepL's default with tag handling
    asked = [f for f in (*TAG_LISTS, "outline_detection") if getattr(body, f) not in ([], True)]
    if asked and body.tag_handling is None:      # the tags are text then: nothing they could apply to
        raise ServiceError(400, f"Value for '{asked[0]}' not supported: it applies with tag_handling html or xml "
                                "only (without it, tags are text)", asked[0])
    options = body.tag_options()
    if options.splitting & options.non_splitting:
        raise ServiceError(400, f"Value for 'non_splitting_tags' not supported: "
                                f"{shown(min(options.splitting & options.non_splitting))} is in splitting_tags "
                                "too", "non_splitting_tags")
    return body


def ignored(body: DeepLTranslateBody, fields: dict) -> Optional[dict[str, str]]:
    """``{X-Ignored-Fields: ...}`` naming what was sent but changes nothing here (formality other than
    "default", context, unknown fields), or None."""
    names = [k for k in fields if k not in DeepLTranslateBody.model_fields and fields[k] not in (None, "", [])]
    if body.formality not in (None, "", "default"):
        names.insert(0, "formality")
    names = [json.dumps(short_name(n))[1:-1] for n in dict.fromkeys(names)]    # ASCII, as on /translate
    return {IGNORED_HEADER: ", ".join(names[:20]) + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")
            } if names else None


def _job(texts: list[str], target: str, body: DeepLTranslateBody, extra: dict) -> TranslateJob:
    return TranslateJob(list(texts), GenerationOptions(), target_lang=target, split_sentences=body.split_sentences,
                        **extra)


async def translate(body: DeepLTranslateBody, request: Request, svc: "Services") -> tuple[list[dict], int]:
    """The ``translations`` of the answer and the characters billed. Raises ServiceError."""
    from .schemas import check_unicode
    texts = body.text
    try:
        check_unicode(texts, "text")
    except ValueError as e:
        raise ServiceError(400, str(e), "text") from None
    try:
        autodetect.check_sizes(texts, "text", True)
    except ServiceError as e:       # a stated limit of the field (maxLength, maxItems): DeepL's 400
        raise ServiceError(400, f"Value for 'text' not supported: {e.message}", "text") from None
    if body.glossary_id and not (body.source_lang or "").strip():
        raise ServiceError(400, "source_lang: required with glossary_id (a glossary is for one language pair)",
                           "source_lang")
    targets = {t for c in svc.graph.cards.values() for t in c.targets}
    sources = set(svc.graph.sources)
    target = service_language(body.target_lang)
    if target not in targets:
        raise ServiceError(400, f"Value for 'target_lang' not supported: {shown(body.target_lang)}; target languages "
                                f"here: {', '.join(c for t in sorted(targets) for c in deepl_codes(t, True))}",
                           "target_lang")
    # parsed (and rebuilt below) in a worker thread: a large fragment must not hold up the event loop
    units = await Texts.read(texts, bool(body.tag_handling), "text", True, body.tag_options())
    if body.source_lang is None or not body.source_lang.strip():
        detections = await autodetect.detect_texts(svc.detector, units.plain(), top=0)
        routed = autodetect.route(texts, detections, target, lambda lang: svc.graph.resolve(None, lang, target).id,
                                  "text", "source_lang", True, ", ".join(sorted(s.upper() for s in sources)))
    else:
        source = service_language(body.source_lang)
        if source not in sources and source != target:
            raise ServiceError(400, f"Value for 'source_lang' not supported: {shown(body.source_lang)}; source "
                                    f"languages here: {', '.join(sorted(s.upper() for s in sources))}", "source_lang")
        if source == target:
            routed = [autodetect.Routed(None, source, 100.0, True)] * len(texts)
        else:
            card = svc.graph.resolve(None, source, target)
            routed = [autodetect.Routed(card.id, source, 100.0)] * len(texts)
    extra = {"memory_scope": svc.memory_scope(request)}
    extra.update(deepl_memories.job_fields(svc.memory, extra["memory_scope"], svc.graph, body.translation_memory_id,
                                           body.translation_memory_threshold,
                                           service_language(body.source_lang) if (body.source_lang or "").strip()
                                           else None, target))
    if body.glossary_id:            # stored glossaries (glossaries.py): enforced in decoding by every job
        try:
            extra.update(glossary=await svc.glossaries.resolve(glossaries.scope_of(request), body.glossary_id,
                                                               service_language(body.source_lang), target),
                         stored_glossary=True)
        except ServiceError as e:     # unknown: DeepL's 404 (glossary_not_found); another pair: 400
            raise ServiceError(e.status, e.message, e.field,
                               type="glossary_not_found" if e.status == 404 else None) from None
    by_model = autodetect.groups(routed)
    jobs = svc.pipeline.jobs(by_model, lambda model, idx: (
        svc.pipeline.deadline(_job(units.units(idx), target, body, extra)), JobOrigin("text", True, len(idx))))
    results = (await svc.pipeline.run_all(jobs)).values()
    out = list(texts)
    for idx, result in zip(by_model.values(), results):
        for i, text in zip(idx, await units.rebuilt(idx, result.translations)):
            out[i] = text
    answer = []
    for text, translated, r in zip(texts, out, routed):
        item = {"detected_source_language": r.language.upper() if r.language != "und" else "", "text": translated}
        if body.show_billed_characters:
            item["billed_characters"] = len(text)
        answer.append(item)
    return answer, sum(len(t) for t in texts)


def usage(characters: int) -> dict:
    """``GET /v2/usage``: the characters this key (or, with keys off, everyone) sent to /v2/translate."""
    return {"character_count": characters, "character_limit": NO_CHARACTER_LIMIT}


def source_or_target(value: object) -> str:
    """The ``type`` of ``GET /v2/languages``: source (default) or target. Raises ServiceError 400."""
    kind = (value or "source").strip().lower() if isinstance(value, (str, type(None))) else repr(value)
    if kind not in ("source", "target"):
        raise ServiceError(400, f"Value for 'type' not supported: {shown(value)}; send source or target", "type")
    return kind
