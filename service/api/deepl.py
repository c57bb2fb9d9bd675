"""The DeepL-compatible API (DeepL API v2, https://developers.deepl.com/docs): ``POST /v2/translate``,
``GET|POST /v2/languages``, ``GET|POST /v2/usage``, and the pieces other DeepL routes reuse.

    Authorization: DeepL-Auth-Key KEY    the service's API keys (guard.py; Bearer works too)
    POST /v2/translate                   JSON or form: text (repeated / list), target_lang, source_lang
                                         (absent: detected), tag_handling (html|xml) with ignore_tags,
                                         splitting_tags, non_splitting_tags, outline_detection,
                                         split_sentences (0|1|nonewlines), preserve_formatting,
                                         formality, glossary_id or glossary_ids (deepl_glossaries.py),
                                         translation_memory_id and translation_memory_threshold
                                         (deepl_memories.py),
                                         model_type (``decoding``), context (read by detection only:
                                         ``autodetect.detect_in_context``)
        -> {"translations": [{"detected_source_language": "DE", "text": "...", "billed_characters": n
                              (, "model_type_used": "quality_optimized")}]}
    errors                               {"message": "..."}: 400 invalid input (the field named; style_id
                                         and custom_instructions: not offered), 403 no or a wrong key, 404
                                         unknown glossary, 413 too large, 429 rate limit, 503 overloaded
                                         (Retry-After); 456 (quota) never occurs

Reusable by the document routes (``/v2/document``): ``service_language`` / ``deepl_codes`` (language
codes both ways), ``error_response`` (DeepL's error shape and statuses). The key of a
``DeepL-Auth-Key`` header is read by the guard (``middleware/guard.deepl_auth_key``).
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Iterable, Literal, Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)

from service.engine import GenerationOptions
from service.pipeline import autodetect
from service.pipeline.autodetect import NAMES
from service.pipeline.markup_parse import TagOptions, tags
from service.pipeline.texts import Texts
from service import protocol
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
    from service.pipeline import LanguageGraph

    from .services import Services

IGNORED_HEADER = "X-Ignored-Fields"   # fields accepted but not applied (formality, ...), as on /translate
# DeepL's target codes with a region: the language's variants, all served by the language's model
REGIONAL_TARGETS = {"en": ("EN-GB", "EN-US"), "pt": ("PT-PT", "PT-BR"), "zh": ("ZH-HANS", "ZH-HANT")}
REGION_NAMES = {"EN-GB": "English (British)", "EN-US": "English (American)", "PT-PT": "Portuguese (European)",
                "PT-BR": "Portuguese (Brazilian)", "ZH-HANS": "Chinese (simplified)", "ZH-HANT": "Chinese (traditional)"}
# DeepL Pro without a cost limit reports this character_limit (GET /v2/usage); the service has no quota
NO_CHARACTER_LIMIT = 1_000_000_000_000
# model_type (DeepL: latency_optimized when absent there; prefer_quality_optimized a legacy name of
# quality_optimized) -> the model_type_used answered; what each decodes with: ``decoding``
MODEL_TYPES = {"latency_optimized": "latency_optimized", "quality_optimized": "quality_optimized",
               "prefer_quality_optimized": "quality_optimized"}
QUALITY_BEAM = 4        # quality_optimized's beam width (the service's default one); latency_optimized: 1 (greedy)
# DeepL features no model here has: a request field sent with a value is a 400 naming it (``parse``)
NOT_OFFERED = {"style_id": "style rules (style_id)", "custom_instructions": "custom instructions (custom_instructions)"}
# Fields DeepL defines that change nothing here: reported in IGNORED_HEADER when sent with a value that
# asks for something (formality other than default, a context nothing read, ...)
LIST_FIELDS = ("text", "non_splitting_tags", "splitting_tags", "ignore_tags", "glossary_ids", "custom_instructions")
# the fields read once (given twice: 400); others, unknown ones included, may repeat (named in IGNORED_HEADER)
SINGLE_FIELDS = ("target_lang", "source_lang", "tag_handling", "split_sentences", "preserve_formatting", "formality",
                 "glossary_id", "show_billed_characters", "context", "model_type", "outline_detection",
                 "translation_memory_id", "translation_memory_threshold")
NOT_APPLIED = ("formality", "tag_handling_version")
TAG_LISTS = ("ignore_tags", "splitting_tags", "non_splitting_tags")     # DeepL's lists of element names
MAX_GLOSSARY_IDS = protocol.MAX_GLOSSARY_IDS      # glossary_ids in one request, as DeepL
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
    langs = sorted({s for c in cards for s in c.sources} if kind == "source" else {t for c in cards for t in c.targets})
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


# ---- DeepL's features not offered here ----------------------------------------------------------
# DeepL routes no model here can answer: any method is DeepL's 404 naming the feature (``not_offered``;
# 404, not 501: DeepL's clients retry every 5xx, a 404 they raise at once as "Not found, message: ...")
NOT_OFFERED_ROUTES = {"/v2/write": "DeepL Write (/v2/write/rephrase, /v2/write/correct: rephrasing and correcting "
                                   "text) is not offered by this server: its models translate, they do not rewrite",
                      "/v3/style_rules": "style rules (/v3/style_rules) are not offered by this server: its models "
                                         "translate sentence by sentence and follow no style rules"}


def not_offered(prefix: str, request: Request) -> JSONResponse:
    """DeepL's 404 for a route under ``prefix`` (a key of NOT_OFFERED_ROUTES), naming the feature."""
    return error_response(ServiceError(404, f"{request.method} {request.url.path}: {NOT_OFFERED_ROUTES[prefix]}",
                                       type="path_not_found"))


# ---- POST /v2/translate --------------------------------------------------------------------------
class DeepLTranslateBody(BaseModel):
    """POST /v2/translate, as JSON, application/x-www-form-urlencoded or multipart/form-data (form
    values are strings: "1"/"0" for booleans; ``text`` repeated for several texts)."""
    model_config = ConfigDict(extra="allow")
    _context_read: bool = PrivateAttr(False)     # set by ``translate``: detection read ``context``
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
    glossary_id: Optional[str] = Field(None, description="a DeepL glossary's id (/v2 or /v3/glossaries) or a /v1 "
                                                          "glossary's name; without source_lang, the dictionary of "
                                                          "each text's detected language")
    glossary_ids: list[str] = Field([], max_length=MAX_GLOSSARY_IDS, description=(
        f"up to {MAX_GLOSSARY_IDS} glossary ids (a list, or comma-separated), not with glossary_id: each one's "
        "dictionary of the pair; a source term an earlier one has keeps that one's target"))
    show_billed_characters: bool = True
    ignore_tags: list[str] = Field([], description="with tag_handling: elements whose content is kept as it is")
    splitting_tags: list[str] = Field([], description="with tag_handling: elements that always end a sentence")
    non_splitting_tags: list[str] = Field([], description="with tag_handling: elements inside a sentence (their "
                                                          "text joins the sentence around them)")
    outline_detection: bool = Field(True, description="with tag_handling: false: only splitting_tags end a sentence")
    model_type: Optional[Literal[tuple(MODEL_TYPES)]] = Field(
        None, description="latency_optimized: greedy search; quality_optimized, prefer_quality_optimized: beam "
                          f"search of {QUALITY_BEAM}, with the model's length penalty; answered as model_type_used. "
                          "Absent: the service's default decoding (beam 4), no model_type_used")
    context: Optional[str] = Field(
        None, description="text around the texts, never translated nor billed: when source_lang is absent, a text "
                          f"of at most {autodetect.SHORT_TEXT_WORDS} words whose language is unsure alone is "
                          "detected with it; changes nothing else")
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

    @field_validator("glossary_ids", mode="before")
    @classmethod
    def _ids(cls, v):
        """A list of ids, or DeepL's comma-separated string (a repeated form field: a list of them)."""
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError("send glossary ids as a list of strings or comma-separated")
        if len(items) > MAX_GLOSSARY_IDS:       # blank ones count too: the schema's maxItems
            raise ValueError(f"at most {MAX_GLOSSARY_IDS} glossary ids, got {len(items)}")
        return [i.strip() for item in items for i in item.split(",") if i.strip()]

    @field_validator("split_sentences", mode="before")
    @classmethod
    def _split(cls, v):
        return str(int(v)) if isinstance(v, (bool, int)) else v


def parse(fields: dict) -> DeepLTranslateBody:
    """The validated body. Raises ServiceError 400 naming the first invalid field, or a field of a
    feature not offered here (NOT_OFFERED) sent with a value."""
    for name, feature in NOT_OFFERED.items():
        if fields.get(name) not in (None, "", []):
            raise ServiceError(400, f"Value for '{name}' not supported: {feature} are not offered by this server (its "
                                    f"models translate sentence by sentence and take no style or instructions); "
                                    f"leave {name} out", name)
    try:
        body = DeepLTranslateBody.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        field, message = format_validation_error(err)
        if err.get("type") == "missing":      # DeepL's words for it
            raise ServiceError(400, f"Parameter '{field}' not specified.", field) from None
        message = message[len(field) + 2:] if message.startswith(f"{field}: ") else message     # named once
        raise ServiceError(400, f"Value for '{field}' not supported: {message}", field) from None
    if body.glossary_id and body.glossary_ids:
        raise ServiceError(400, "Value for 'glossary_ids' not supported: it cannot be used together with glossary_id",
                           "glossary_ids")
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
    "default", a context that detection did not read, unknown fields), or None. Called after ``translate``."""
    names = [k for k in fields if k not in DeepLTranslateBody.model_fields and fields[k] not in (None, "", [])]
    if body.context and not body._context_read:
        names.insert(0, "context")
    if body.formality not in (None, "", "default"):
        names.insert(0, "formality")
    names = [json.dumps(short_name(n))[1:-1] for n in dict.fromkeys(names)]    # ASCII, as on /translate
    return {IGNORED_HEADER: ", ".join(names[:20]) + (f", ... ({len(names) - 20} more)" if len(names) > 20 else "")
            } if names else None


def decoding(model_type: Optional[str], card: ModelCard) -> GenerationOptions:
    """How ``card``'s model decodes for ``model_type``: latency_optimized greedy search (beam 1),
    quality_optimized and prefer_quality_optimized beam search of QUALITY_BEAM, each with the model's
    length penalty (an imported model's generation config, metadata ``generation``; else 1.0); None:
    the service's default options (beam 4, length penalty 1), as before model_type was read."""
    if model_type is None:
        return GenerationOptions()
    length_penalty = float(card.metadata.get("generation", {}).get("length_penalty", 1.0))
    beam = 1 if MODEL_TYPES[model_type] == "latency_optimized" else QUALITY_BEAM
    return GenerationOptions(beam_size=beam, length_penalty=length_penalty)


def _card(graph: "LanguageGraph", model: str) -> ModelCard:
    """The card whose generation settings ``model`` decodes with: a pivot route's last leg's."""
    return graph.cards[model] if model in graph.cards else graph.pivots[model].legs[-1].card


def _job(texts: list[str], target: str, body: DeepLTranslateBody, extra: dict,
         options: GenerationOptions) -> TranslateJob:
    return TranslateJob(list(texts), options, target_lang=target, split_sentences=body.split_sentences, **extra)


async def _glossaries(body: DeepLTranslateBody, request: Request, svc: "Services", routed: list, target: str
                      ) -> dict[str, dict]:
    """Source language -> the job fields of the entries ``glossary_id`` (or ``glossary_ids``) give it
    -> ``target`` (glossaries.GlossaryClient.resolve_all: of a DeepL glossary, the pair's dictionary),
    enforced in decoding by every job. Without source_lang a detected language a glossary has no
    dictionary for gets none from it. Raises ServiceError 404 (unknown: DeepL's glossary_not_found),
    409 (no dictionary for source_lang)."""
    field = "glossary_id" if body.glossary_id else "glossary_ids"
    ids = [body.glossary_id] if body.glossary_id else body.glossary_ids
    if not ids:
        return {}
    scope, out = glossaries.scope_of(request), {}
    detected = body.source_lang is None or not body.source_lang.strip()
    langs = list(dict.fromkeys(r.language for r in routed if r.card_id is not None))
    for lang in langs or [None]:
        try:
            entries = await svc.glossaries.resolve_all(scope, ids, lang, target if lang else None, detected, field)
        except ServiceError as e:
            raise ServiceError(e.status, e.message, e.field,
                               type="glossary_not_found" if e.status == 404 else None) from None
        if entries is not None:
            out[lang] = {"glossary": entries, "stored_glossary": True}
    return out


async def translate(body: DeepLTranslateBody, request: Request, svc: "Services") -> tuple[list[dict], int]:
    """The ``translations`` of the answer and the characters billed. Raises ServiceError."""
    from .schemas import check_unicode
    texts = body.text
    try:
        check_unicode(texts, "text")
        check_unicode([body.context or ""], "context")
    except ValueError as e:
        field = "context" if str(e).startswith("context") else "text"
        raise ServiceError(400, str(e), field) from None
    try:
        autodetect.check_sizes(texts, JobOrigin("text", True))
    except ServiceError as e:       # too many texts or a text too long: 413, as every route here and DeepL's size limit
        raise ServiceError(413, f"Request too large: {e.message}", "text") from None
    targets = {t for c in svc.graph.cards.values() for t in c.targets}
    sources = set(svc.graph.sources)
    target = service_language(body.target_lang)
    if target not in targets:
        raise ServiceError(400, f"Value for 'target_lang' not supported: {shown(body.target_lang)}; target languages "
                                f"here: {', '.join(c for t in sorted(targets) for c in deepl_codes(t, True))}",
                           "target_lang")
    # parsed (and rebuilt below) in a worker thread: a large fragment must not hold up the event loop
    units = await Texts.read(texts, bool(body.tag_handling), JobOrigin("text", True), body.tag_options())
    if body.source_lang is None or not body.source_lang.strip():
        detections, read = await autodetect.detect_in_context(svc.detector, units.plain(), body.context, top=0)
        body._context_read = any(read)      # a short text's language was detected with the context
        routed = autodetect.route(texts, detections, target, lambda lang: svc.graph.resolve(None, lang, target).id,
                                  JobOrigin("text", True), "source_lang", ", ".join(sorted(s.upper() for s in sources)))
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
    glossary_of = await _glossaries(body, request, svc, routed, target)
    by_model = autodetect.groups(routed)
    jobs = svc.pipeline.jobs(by_model, lambda model, idx: (
        svc.pipeline.deadline(svc.graph.bind(svc.graph.cards.get(model), _job(
            units.units(idx), target, body, {**extra, **glossary_of.get(routed[idx[0]].language, {})},
            decoding(body.model_type, _card(svc.graph, model))), None, [routed[i].language for i in idx])),
        JobOrigin("text", True, len(idx))))
    results = (await svc.pipeline.run_all(jobs)).values()
    out = list(texts)
    for idx, result in zip(by_model.values(), results):
        for i, text in zip(idx, await units.rebuilt(idx, result.translations)):
            out[i] = text
    answer = []
    for text, translated, r in zip(texts, out, routed):
        item = {"detected_source_language": r.language.upper() if r.language != "und" else "", "text": translated}
        if body.show_billed_characters:
            item["billed_characters"] = len(text)        # the text's alone: context is never billed
        if body.model_type is not None:
            item["model_type_used"] = MODEL_TYPES[body.model_type]
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
