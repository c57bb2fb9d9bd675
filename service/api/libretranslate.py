"""The LibreTranslate-compatible API: ``POST /translate``, ``POST /detect`` and ``GET /languages``.

``q`` (string or list), ``source`` (a code or ``auto``), ``target``, ``format`` (text|html),
``alternatives``, ``api_key`` arrive as JSON, form-urlencoded or multipart form. Answers
``{"translatedText": ...}`` (plus ``alternatives`` when asked; with ``source: auto``, each text's
``detectedLanguage`` ``{"confidence", "language"}`` and, when a text came back unchanged,
``passthrough``); ``/detect`` answers ``[{"confidence", "language"}]``; errors ``{"error": message}``
with LibreTranslate's statuses (``errors.libre_error_response``).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse

from service.engine import GenerationOptions
from service.pipeline import LanguageGraph, autodetect
from service.pipeline.autodetect import NAMES as LANGUAGE_NAMES
from service.pipeline.texts import Texts
from service.protocol import (
    JobOrigin,
    ServiceError,
    TranslateJob,
    TranslateResponse,
    Usage,
    short_name,
)
from service.translator import ModelCard
from service.translator.card import match_language
from service.translator.langid import LanguageDetector

from . import fields as fields_module
from . import glossaries
from .errors import format_validation_error, libre_error_response
from .fields import Fields
from .libre_schemas import LibreDetectBody, LibreTranslateBody
from .middleware import body as body_module
from .middleware.guard import check_body_key
from .schemas import (
    FormFields,
    LibreLanguage,
    TranslateRequest,
    check_unicode,
    validate,
)

if TYPE_CHECKING:
    from .services import Services

LIBRE_FIELDS = ("q", "source", "target", "format", "alternatives", "api_key", "keep",
                "glossary", "glossary_id")     # the fields this route reads (the last three: this service's own)
DETECT_FIELDS = ("q", "api_key")                                                # the fields /detect reads
IGNORED_HEADER = "X-Ignored-Fields"     # the other fields a request sent (LibreTranslate ignores them too)
MAX_IGNORED_NAMES = 20                  # names listed in that header; the rest are counted



@dataclass
class LibreRequest:
    """A validated POST /translate."""
    texts: list[str]            # q as a list
    batch: bool                 # q was a list: answer with lists
    card: Optional[ModelCard]   # the model for source -> target (None with source=auto: chosen per text)
    alternatives: int           # alternatives asked for, 0..MAX_BEAM_SIZE - 1
    html: bool                  # format=html
    auto: bool                  # source=auto: each text's language detected
    target: Optional[str] = None    # the target language (a multilingual model's >>target<< token)
    keep: tuple[str, ...] = ()      # do-not-translate terms (as /v1/translate's keep)
    glossary: tuple = ()            # (source term, target term) entries (``glossary`` or ``glossary_id``)
    stored_glossary: bool = False   # the entries are ``glossary_id``'s alone (TranslateJob.stored_glossary)
    source: Optional[str] = None    # the source language as served (an NLLB-200 / M2M100 / mBART-50 model's token)

    def job(self, texts: list[str], memory_scope: Optional[str] = None) -> TranslateJob:
        n_best = self.alternatives + 1
        return TranslateJob(texts, GenerationOptions(beam_size=max(4, n_best), n_best=n_best, length_penalty=1.0),
                            target_lang=self.target, keep=self.keep, glossary=self.glossary,
                            stored_glossary=self.stored_glossary, memory_scope=memory_scope)

    def origin(self, n_texts: Optional[int] = None) -> JobOrigin:
        """Where a job's texts came from: ``q`` (``n_texts``: the q items of a job of HTML segments)."""
        return JobOrigin("q", self.batch, n_texts)


def languages(cards: Iterable[ModelCard], pivots: Iterable = ()) -> list[LibreLanguage]:
    """Every language with the codes it translates into (a multilingual model's: every >>xx<< code),
    the targets reached through a pivot language (``pivot.PivotRoute``) too, named in ``via``."""
    codes: dict[str, set] = {}
    via: dict[str, dict[str, str]] = {}
    for c in cards:
        for s in c.sources:     # an NLLB-200 / M2M100 / mBART-50 model: each of its languages into every other
            codes.setdefault(s, set()).update(t for t in c.targets if t != s or not c.lang_tokens)
        for t in c.targets:
            codes.setdefault(t, set())
    for r in pivots:
        codes.setdefault(r.source_lang, set()).add(r.target_lang)
        via.setdefault(r.source_lang, {})[r.target_lang] = r.via
    return [LibreLanguage(code=code, name=LANGUAGE_NAMES.get(code, code), targets=sorted(t),
                          via=dict(sorted(via[code].items())) if code in via else None)
            for code, t in codes.items()]


async def translate(request: Request, svc: "Services") -> JSONResponse:
    """POST /translate: ``source: auto`` finds each text's language (one job per model, run together);
    ``glossary_id`` is looked up in the caller's stored glossaries."""
    cards = svc.graph.all_cards()
    try:
        fields, denied = await read_admitted(request)
        if denied is not None:
            return denied
        req = parse(fields, svc.graph)
        await read_glossary(req, fields, request, svc.glossaries)
    except ServiceError as e:
        return libre_error_response(e)
    try:
        if req.html:    # an HTML text's characters count its tags, as LibreTranslate's char_limit does
            autodetect.check_sizes(req.texts, req.origin())
        # parsed in a worker thread: a large fragment must not hold up the replica's event loop
        units = await Texts.read(req.texts, req.html, req.origin())
        if req.auto:
            autodetect.check_sizes(req.texts, req.origin())
            detections = await autodetect.detect_texts(svc.detector, units.plain(), top=0)
            routed = autodetect.route(req.texts, detections, req.target, lambda lang: pick(svc.graph, lang, req.target).id,
                                      req.origin(), "source",
                                      "source languages " + ", ".join(sorted({s for c in cards for s in c.sources})))
        else:
            lang = req.source if req.card.lang_tokens else req.card.source_lang
            routed = [autodetect.Routed(req.card.id, lang, 0.0)] * len(req.texts)
        by_model = autodetect.groups(routed)
        request.state.model = next(iter(by_model)) if len(by_model) == 1 else "auto"
        scope = svc.memory_scope(request)
        jobs = svc.pipeline.jobs(by_model, lambda model, idx: bound(svc.graph, model, [routed[i].language for i in idx],
                                                                    *checked_job(req, units.units(idx), len(idx), scope)))
        results = list((await svc.pipeline.run_all({m: (svc.pipeline.deadline(j), o)
                                                    for m, (j, o) in jobs.items()})).values())
    except ServiceError as e:
        return libre_error_response(e)
    request.state.usage = Usage(source_tokens=sum(r.usage.source_tokens for r in results),
                                generated_tokens=sum(r.usage.generated_tokens for r in results))
    out: list[str] = list(req.texts)                  # a text passed through comes back as it was sent
    alts: list[list[str]] = [[] for _ in req.texts]
    for idx, result in zip(by_model.values(), results):
        if req.html:    # rebuilding a large fragment, like parsing it, in a worker thread
            await asyncio.to_thread(_answers, req, idx, units, result, out, alts)
        else:
            _answers(req, idx, units, result, out, alts)
    body: dict[str, object] = {"translatedText": out if req.batch else out[0]}
    if req.auto:
        detected = [{"confidence": r.confidence, "language": r.language} for r in routed]
        body["detectedLanguage"] = detected if req.batch else detected[0]
        if any(r.passthrough for r in routed):
            flags = [r.passthrough for r in routed]
            body["passthrough"] = flags if req.batch else flags[0]
    if req.alternatives > 0:
        body["alternatives"] = alts if req.batch else alts[0]
    return JSONResponse(body, headers=ignored_fields_header(fields))


def _answers(req: LibreRequest, idx: list[int], units: Texts, result: TranslateResponse,
             out: list[str], alts: list[list[str]]) -> None:
    """Fill ``out[i]`` and ``alts[i]`` for the texts ``idx`` that ``result`` translated (in order; with
    format=html, each text's segments in turn)."""
    for i, segs in zip(idx, units.split(idx, result.translations)):
        if req.html:    # alternative j: each segment's hypothesis j + 2 (its best where it has fewer)
            h = units.markup[i]
            out[i] = h.rebuild([t.text for t in segs])
            alts[i] = _unique([h.rebuild([(t.alternatives[j] if j < len(t.alternatives) else t).text for t in segs])
                               for j in range(req.alternatives)], out[i])
        else:
            out[i] = segs[0].text
            alts[i] = _unique([a.text for a in segs[0].alternatives], segs[0].text)[:req.alternatives]


async def detect(request: Request, detector: LanguageDetector) -> JSONResponse:
    """POST /detect: ``[{"confidence", "language"}]`` best first (``autodetect.detect_answer``)."""
    try:
        fields, denied = await read_admitted(request)
        if denied is not None:
            return denied
        texts = validate(LibreDetectBody, fields, 400).texts
        autodetect.check_sizes(texts, JobOrigin("q", isinstance(fields.get("q"), list)))
        detections = await autodetect.detect_texts(detector, texts)
    except ServiceError as e:
        return libre_error_response(e)
    return JSONResponse(autodetect.detect_answer(detections), headers=ignored_fields_header(fields, DETECT_FIELDS))


def ignored_fields_header(fields: Fields, read: tuple[str, ...] = LIBRE_FIELDS) -> Optional[dict[str, str]]:
    """``{X-Ignored-Fields: "a, b"}`` naming the fields sent that the route does not read (as
    LibreTranslate, it answers without them, but says so; names shortened as ``errors.short_name``,
    non-ASCII characters as \\uXXXX, at most MAX_IGNORED_NAMES, then "... (N more)"), or None."""
    ignored = [k for k in fields if k not in read]
    if not ignored:
        return None
    names = [json.dumps(short_name(k))[1:-1] for k in ignored[:MAX_IGNORED_NAMES]]
    if len(ignored) > MAX_IGNORED_NAMES:
        names.append(f"... ({len(ignored) - MAX_IGNORED_NAMES} more)")
    return {IGNORED_HEADER: ", ".join(names)}


async def read_admitted(request: Request) -> tuple[Fields, Optional[JSONResponse]]:
    """(fields, None): the fields of a JSON body or a form body (urlencoded or multipart) and the query
    string, like LibreTranslate's (``fields.read_fields``: a repeated ``q`` is a batch); or ({}, the
    401) when API keys are on, no Authorization header was sent and the body holds no valid
    ``api_key``: a body that cannot be read is that 401 too, before its own error. Raises
    ServiceError (400, 415) for an unreadable body otherwise."""
    try:
        fields, unreadable = await fields_module.read_fields(request, ("q", "keep"), 400, single=LIBRE_FIELDS), None
    except ServiceError as e:
        fields, unreadable = {}, e
    denied = check_body_key(request.scope.setdefault("state", {}), fields.get("api_key"))
    if denied is not None:
        return {}, libre_error_response(denied.error, headers=denied.headers)
    if unreadable is not None:
        raise unreadable
    return fields, None


def bound(graph: LanguageGraph, model: str, langs: list[str], job: TranslateJob, origin: JobOrigin
          ) -> tuple[TranslateJob, JobOrigin]:
    """The job with an NLLB-200 / M2M100 / mBART-50 model's languages (``LanguageGraph.bind``): each
    text's source (``langs``) and the target."""
    return graph.bind(graph.cards.get(model), job, None, langs), origin


def checked_job(req: LibreRequest, texts: list[str], n_texts: Optional[int] = None,
                memory_scope: Optional[str] = None) -> tuple[TranslateJob, JobOrigin]:
    """The job for these texts (``q``, or the segments of format=html) and its origin; ``n_texts``:
    the client's texts (q items) the texts-per-request limit counts (segments count as sentences, by
    the translator). Raises ServiceError 422 (answered as 400) for text that is not Unicode."""
    job, origin = req.job(texts, memory_scope), req.origin(n_texts)
    try:
        check_unicode(job.texts, origin.field)
    except ValueError as e:
        raise ServiceError(422, str(e), origin.field) from None
    return job, origin


async def read_glossary(req: LibreRequest, f: Fields, request: Request,
                        store: Optional[glossaries.GlossaryClient]) -> None:
    """Set ``req.glossary`` from the ``glossary`` field (a list of {"source", "target"} objects, or
    that list as a JSON string) or the stored glossary ``glossary_id``. Raises ServiceError 400
    naming the field (the entries themselves are checked as /v1/translate's, by the translator)."""
    entries, name = f.get("glossary"), f.get("glossary_id")
    if isinstance(f, FormFields):       # an empty form field: none (as the model reads it)
        entries, name = (None if v == "" else v for v in (entries, name))
    stored: tuple = ()
    if name is not None:        # its entries first, then the request's own (both apply, as on /v1/translate)
        if not isinstance(name, str) or not name or store is None:
            raise ServiceError(400, "Invalid request: glossary_id must be a stored glossary's name", "glossary_id")
        card = req.card     # an NLLB-200 / M2M100 / mBART-50 / T5 model: the request's pair, not its "mul"
        source = (req.source if card.lang_tokens else card.source_lang) if card else None
        stored = tuple(await store.resolve(glossaries.scope_of(request), name, source, req.target))
        req.glossary, req.stored_glossary = stored, True
    if entries is None:
        return
    if isinstance(entries, str):
        try:
            entries = body_module.load_json(entries.encode("utf-8"))     # the one JSON reader
        except ServiceError:
            raise ServiceError(400, "Invalid request: glossary must be a JSON list of {\"source\", \"target\"} "
                                    "objects", "glossary") from None
    try:
        parsed = TranslateRequest.model_validate({"text": "", "glossary": entries}).glossary or []
    except pydantic.ValidationError as e:
        field, message = format_validation_error(e.errors()[0])
        raise ServiceError(400, "Invalid request: " + message, field) from None
    req.glossary, req.stored_glossary = stored + tuple((g.source, g.target) for g in parsed), False


def parse(f: Fields, graph: LanguageGraph) -> LibreRequest:
    """Validate the fields and pick the model (with ``source: auto``, only the target: the models are
    picked per text once detected). Raises ServiceError 400 naming the field."""
    body = validate(LibreTranslateBody, f, 400)
    source, target, batch = body.source, body.target, isinstance(body.q, list)
    n_alt, fmt = body.alternatives or 0, body.format or "text"
    keep = tuple(body.keep or ())
    sources, targets = graph.sources, graph.targets
    if autodetect.is_auto(target):
        raise ServiceError(400, "Invalid request: target auto is not supported: auto detects the source language "
                                f"only; give the target language (one of {', '.join(sorted(targets))})", "target")
    texts = body.texts
    if autodetect.is_auto(source):
        target = match_language(target, targets | sources)
        if target not in targets and target not in sources:
            raise ServiceError(400, f"{short_name(target)} is not supported (target languages: {', '.join(sorted(targets))})",
                               "target")
        return LibreRequest(texts, batch, None, n_alt, fmt == "html", True, target, keep)
    source, target = match_language(source, sources), match_language(target, targets | sources)
    source, target = graph.code(source, sources), graph.code(target, targets | sources)
    return LibreRequest(texts, batch, pick(graph, source, target), n_alt, fmt == "html", False, target, keep, source=source)


def pick(graph: LanguageGraph, source: str, target: str, direct: bool = False) -> ModelCard:
    """The model for source -> target (``LanguageGraph.resolve``; ``direct``: a model, never a pivot
    route), with LibreTranslate's messages for a language or pair not served. Raises ServiceError 400
    naming the field and what is served."""
    cards = list(graph.cards.values()) if direct else graph.all_cards()
    targets = {t for c in cards for t in c.targets}
    choices = sorted({t for c in cards if source in c.sources for t in c.targets if t != source or not c.lang_tokens})
    if source not in graph.sources:
        raise ServiceError(400, f"{short_name(source)} is not supported (source languages: "
                                f"{', '.join(sorted(graph.sources))})", "source")
    if target not in targets and target not in graph.sources:
        raise ServiceError(400, f"{short_name(target)} is not supported (targets from {source}: {', '.join(choices)})",
                           "target")
    try:
        card = graph.resolve(None, source, target)
    except ServiceError:
        card = None
    if card is None or (direct and card.id in graph.pivots):
        raise ServiceError(400, f"{LANGUAGE_NAMES.get(target, target)} ({target}) is not available as a target "
                                f"language from {LANGUAGE_NAMES.get(source, source)} ({source}); choose from "
                                f"{', '.join(choices)}", "target")
    return card


def _unique(seq: list[str], exclude: str) -> list[str]:
    seen, out = {exclude, ""}, []
    for s in seq:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out
