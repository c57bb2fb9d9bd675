"""The LibreTranslate-compatible API: ``POST /translate``, ``POST /detect`` and ``GET /languages``.

``q`` (string or list), ``source`` (a code or ``auto``), ``target``, ``format`` (text|html),
``alternatives``, ``api_key`` arrive as JSON, form-urlencoded or multipart form. Answers
``{"translatedText": ...}`` (plus ``alternatives`` when asked; with ``source: auto``, each text's
``detectedLanguage`` ``{"confidence", "language"}`` and, when a text came back unchanged,
``passthrough``); ``/detect`` answers ``[{"confidence", "language"}]``; errors ``{"error": message}``
with LibreTranslate's statuses (``errors.libre_error_response``).
"""
from __future__ import annotations

import json
import math
import urllib.parse
from dataclasses import dataclass
from typing import Annotated, Callable, Iterable, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from service.engine import GenerationOptions
from service.translator import ModelCard
from service.translator.card import match_language
from service.translator.langid import LanguageDetector
from service.protocol import MAX_BEAM_SIZE, TranslateJob, TranslateResponse, Usage
from service.engine.validation import ModelLimits

from . import autodetect
from .autodetect import NAMES as LANGUAGE_NAMES
from .errors import JSON_TOO_DEEP, ServiceError, libre_error_response, mapped_errors, short_name, shown
from .guard import check_body_key
from .html import HtmlText
from .schemas import LibreLanguage, check_keep, check_unicode
LIBRE_FIELDS = ("q", "source", "target", "format", "alternatives", "api_key", "keep")   # the fields this route reads
DETECT_FIELDS = ("q", "api_key")                                                # the fields /detect reads
IGNORED_HEADER = "X-Ignored-Fields"     # the other fields a request sent (LibreTranslate ignores them too)
MAX_IGNORED_NAMES = 20                  # names listed in that header; the rest are counted

FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
Fields = dict[str, object]      # a JSON body's members, or form fields (str, or list[str] for a repeated q)


# ---- the OpenAPI declarations of POST /translate (parse() validates; these only document) -----------
class LibreTranslateBody(BaseModel):
    """POST /translate, as JSON, application/x-www-form-urlencoded or multipart/form-data."""
    q: Union[Annotated[str, Field(min_length=1)], Annotated[list[str], Field(min_length=1)]] = Field(
        ..., description="text, or a list of texts (a repeated form field)")
    source: str = Field(..., min_length=1, description='language code (GET /languages) or "auto"')
    target: str = Field(..., min_length=1, description="language code (GET /languages)")
    format: Literal["text", "html"] = "text"
    alternatives: int = Field(0, ge=0, le=MAX_BEAM_SIZE - 1, description="alternative translations to return")
    api_key: Optional[str] = Field(None, description="checked when API keys are on and no Authorization "
                                                     "header is sent")
    keep: Optional[list[str]] = Field(None, description="do-not-translate terms, as /v1/translate's keep (a JSON "
                                                        "list, or a repeated form field)")


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


class LibreDetectBody(BaseModel):
    """POST /detect, as JSON, application/x-www-form-urlencoded or multipart/form-data."""
    q: Union[Annotated[str, Field(min_length=1)], Annotated[list[str], Field(min_length=1)]] = Field(
        ..., description="text (a list: each language's mean confidence over the texts)")
    api_key: Optional[str] = Field(None, description="checked when API keys are on and no Authorization "
                                                     "header is sent")


class LibreError(BaseModel):
    error: str


def openapi_request_body(model: type[BaseModel] = LibreTranslateBody) -> dict:
    """The requestBody of POST /translate (or /detect) for the OpenAPI document: one schema, three media types."""
    schema = model.model_json_schema()
    return {"required": True, "content": {m: {"schema": schema} for m in
                                          ("application/json", "application/x-www-form-urlencoded",
                                           "multipart/form-data")}}


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

    def job(self, texts: list[str]) -> TranslateJob:
        n_best = self.alternatives + 1
        return TranslateJob(texts, GenerationOptions(beam_size=max(4, n_best), n_best=n_best, length_penalty=1.0),
                            field="q", is_list=self.batch, target_lang=self.target, keep=self.keep)


def languages(cards: Iterable[ModelCard]) -> list[LibreLanguage]:
    """Every language with the codes it translates into (a multilingual model's: every >>xx<< code)."""
    codes: dict[str, set] = {}
    for c in cards:
        codes.setdefault(c.source_lang, set()).update(c.targets)
        for t in c.targets:
            codes.setdefault(t, set())
    return [LibreLanguage(code=code, name=LANGUAGE_NAMES.get(code, code), targets=sorted(t))
            for code, t in codes.items()]


async def translate(request: Request, cards: list[ModelCard], limits: dict[str, ModelLimits],
                    run: Callable, detector: Optional[LanguageDetector] = None) -> JSONResponse:
    """POST /translate. ``run(model, job)`` awaits the model's TranslateResponse (``Backend.translate``);
    ``detector`` finds each text's language with ``source: auto`` (one job per model, run together)."""
    try:
        fields, denied = await read_admitted(request)
        if denied is not None:
            return denied
        req = parse(fields, cards)
    except ServiceError as e:
        return libre_error_response(e)
    try:
        htmls = [HtmlText(t) for t in req.texts] if req.html else []
        if req.auto:
            autodetect.check_sizes(req.texts, "q", req.batch)
            plain = [" ".join(h.segments) for h in htmls] if req.html else req.texts
            detections = await autodetect.detect_texts(detector or LanguageDetector(), plain)
            routed = autodetect.route(req.texts, detections, req.target, lambda lang: pick(cards, lang, req.target).id,
                                      "q", "source", req.batch,
                                      "source languages " + ", ".join(sorted({c.source_lang for c in cards})))
        else:
            routed = [autodetect.Routed(req.card.id, req.card.source_lang, 0.0)] * len(req.texts)
        by_model = autodetect.groups(routed)
        request.state.model = next(iter(by_model)) if len(by_model) == 1 else "auto"
        jobs = {model: checked_job(req, [s for i in idx for s in htmls[i].segments] if req.html else
                                   [req.texts[i] for i in idx], limits[model], n_texts=len(idx))
                for model, idx in by_model.items()}
        results = await autodetect.gather_all([run(model, job) for model, job in jobs.items()])
    except ServiceError as e:
        return libre_error_response(e)
    request.state.usage = Usage(source_tokens=sum(r.usage.source_tokens for r in results),
                                generated_tokens=sum(r.usage.generated_tokens for r in results))
    out: list[str] = list(req.texts)                  # a text passed through comes back as it was sent
    alts: list[list[str]] = [[] for _ in req.texts]
    for idx, result in zip(by_model.values(), results):
        _answers(req, idx, htmls, result, out, alts)
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


def _answers(req: LibreRequest, idx: list[int], htmls: list[HtmlText], result: TranslateResponse,
             out: list[str], alts: list[list[str]]) -> None:
    """Fill ``out[i]`` and ``alts[i]`` for the texts ``idx`` that ``result`` translated (in order; with
    format=html, each text's segments in turn)."""
    k = 0
    for i in idx:
        if req.html:    # alternative j: each segment's hypothesis j + 2 (its best where it has fewer)
            h = htmls[i]
            segs = result.translations[k:k + len(h.segments)]
            k += len(h.segments)
            out[i] = h.rebuild([t.text for t in segs])
            alts[i] = _unique([h.rebuild([(t.alternatives[j] if j < len(t.alternatives) else t).text for t in segs])
                               for j in range(req.alternatives)], out[i])
        else:
            t = result.translations[k]
            k += 1
            out[i] = t.text
            alts[i] = _unique([a.text for a in t.alternatives], t.text)[:req.alternatives]


async def detect(request: Request, detector: LanguageDetector) -> JSONResponse:
    """POST /detect: ``[{"confidence", "language"}]`` best first (``autodetect.detect_answer``)."""
    try:
        fields, denied = await read_admitted(request)
        if denied is not None:
            return denied
        q = fields.get("q")
        if not q:
            raise ServiceError(400, "Invalid request: missing q parameter", "q")
        batch = isinstance(q, list)
        if not (isinstance(q, str) or (batch and all(isinstance(t, str) for t in q))):
            raise ServiceError(400, "Invalid request: q must be a string or a list of strings", "q")
        if fields.get("api_key") is not None and not isinstance(fields["api_key"], str):
            raise ServiceError(400, "Invalid request: api_key must be a string", "api_key")
        texts = list(q) if batch else [q]
        autodetect.check_sizes(texts, "q", batch)
        try:
            check_unicode(texts, "q")
        except ValueError as e:
            raise ServiceError(400, str(e), "q") from None
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
    """(fields, None), or ({}, the 401) when API keys are on, no Authorization header was sent and
    the body holds no valid ``api_key``: a body that cannot be read is that 401 too, before its own
    error. Raises ServiceError (400, 415) for an unreadable body otherwise."""
    try:
        fields, unreadable = await read_fields(request), None
    except ServiceError as e:
        fields, unreadable = {}, e
    denied = check_body_key(request.scope.setdefault("state", {}), fields.get("api_key"))
    if denied is not None:
        return {}, libre_error_response(denied.error, headers=denied.headers)
    if unreadable is not None:
        raise unreadable
    return fields, None


def checked_job(req: LibreRequest, texts: list[str], limits: ModelLimits,
                n_texts: Optional[int] = None) -> TranslateJob:
    """The job for these texts (``q``, or the segments of format=html), checked against the model's
    limits; ``n_texts``: the client's texts (q items) the texts-per-request limit counts (segments
    count as sentences, by the translator). Raises ServiceError 413 or 422 (answered as 400)."""
    job = req.job(texts)
    job.n_texts = n_texts
    try:
        check_unicode(job.texts, job.field)
    except ValueError as e:
        raise ServiceError(422, str(e), job.field) from None
    with mapped_errors(limits.model):
        limits.check(job)
    return job


def parse(f: Fields, cards: list[ModelCard]) -> LibreRequest:
    """Validate the fields and pick the model (with ``source: auto``, only the target: the models are
    picked per text once detected). Raises ServiceError 400 naming the field."""
    q, source, target = f.get("q"), f.get("source"), f.get("target")
    for name, value in (("q", q), ("source", source), ("target", target)):
        if not value:
            raise ServiceError(400, f"Invalid request: missing {name} parameter", name)
    batch = isinstance(q, list)
    if not (isinstance(q, str) or (batch and all(isinstance(t, str) for t in q))):
        raise ServiceError(400, "Invalid request: q must be a string or a list of strings", "q")
    for name, value in (("source", source), ("target", target)):
        if not isinstance(value, str):
            raise ServiceError(400, f"Invalid request: {name} must be a string", name)
    fmt = f.get("format") or "text"
    if fmt not in ("text", "html"):
        raise ServiceError(400, f"{fmt} format is not supported", "format")
    n_alt = _whole_number(f.get("alternatives"))
    try:
        keep = tuple(check_keep(f.get("keep")) or ())
    except ValueError as e:
        raise ServiceError(400, f"Invalid request: keep: {e}" if not str(e).startswith("keep[") else
                           f"Invalid request: {e}", "keep") from None
    sources = {c.source_lang for c in cards}
    targets = {t for c in cards for t in c.targets}
    if autodetect.is_auto(target):
        raise ServiceError(400, "Invalid request: target auto is not supported: auto detects the source language "
                                f"only; give the target language (one of {', '.join(sorted(targets))})", "target")
    texts = list(q) if batch else [q]
    if autodetect.is_auto(source):
        target = match_language(target, targets | sources)
        if target not in targets and target not in sources:
            raise ServiceError(400, f"{target} is not supported (target languages: {', '.join(sorted(targets))})",
                               "target")
        return LibreRequest(texts, batch, None, n_alt, fmt == "html", True, target, keep)
    source, target = match_language(source, sources), match_language(target, targets | sources)
    return LibreRequest(texts, batch, pick(cards, source, target), n_alt, fmt == "html", False, target, keep)


def pick(cards: list[ModelCard], source: str, target: str) -> ModelCard:
    """The model for source -> target: models of one target before multilingual ones (GET /v1/models:
    target_langs). Raises ServiceError 400 naming the field and what is served."""
    sources = {c.source_lang for c in cards}
    targets = {t for c in cards for t in c.targets}
    if source not in sources:
        raise ServiceError(400, f"{source} is not supported (source languages: {', '.join(sorted(sources))})",
                           "source")
    choices = sorted({t for c in cards if c.source_lang == source for t in c.targets})
    if target not in targets and target not in sources:
        raise ServiceError(400, f"{target} is not supported (targets from {source}: {', '.join(choices)})", "target")
    card = min((c for c in cards if c.source_lang == source and target in c.targets),
               key=lambda c: bool(c.target_languages), default=None)
    if card is None:
        raise ServiceError(400, f"{LANGUAGE_NAMES.get(target, target)} ({target}) is not available as a target "
                                f"language from {LANGUAGE_NAMES.get(source, source)} ({source}); choose from "
                                f"{', '.join(choices)}", "target")
    return card


async def read_fields(request: Request) -> Fields:
    """The request fields from a JSON body or a form body (urlencoded or multipart), like LibreTranslate."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json" or ctype.endswith("+json"):
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ServiceError(400, "Invalid JSON format")
        except RecursionError:
            raise ServiceError(400, f"Invalid JSON format: {JSON_TOO_DEEP}", "body")
        if not isinstance(body, dict):
            raise ServiceError(400, "Invalid JSON format")
        return _merged(_grouped(request.query_params.multi_items(), "query parameter"), body)
    fields: Fields = _grouped(request.query_params.multi_items(), "query parameter")
    if ctype not in FORM_TYPES and await request.body():
        raise ServiceError(415, f"Invalid request: the body was not read: its Content-Type is {ctype or 'missing'}; "
                                f"send application/json, {' or '.join(FORM_TYPES)}", "Content-Type")
    if ctype in FORM_TYPES:
        if ctype == "multipart/form-data":
            await _check_multipart(request)
            form = await request.form()
            pairs = form.multi_items()
            for k, v in pairs:
                if not isinstance(v, str):      # an uploaded file: never read as the field's text
                    raise ServiceError(400, f"Invalid request: form field {shown(k)} was sent as a file "
                                            f"({v.filename or 'no name'}); send it as a text field", k)
        else:
            # Decoded as UTF-8 ourselves: clients (curl -d) send raw UTF-8 bytes unescaped, and a
            # Latin-1 reading would garble them.
            try:
                text = (await request.body()).decode("utf-8")
            except UnicodeDecodeError:
                raise ServiceError(400, "Invalid request: the form body is not valid UTF-8")
            try:  # percent-escapes must decode to UTF-8 too
                pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="strict")
            except UnicodeDecodeError:
                raise ServiceError(400, "Invalid request: a form field is not valid UTF-8 once percent-decoded")
        fields = _merged(fields, _grouped(pairs, "form field"))
    return fields


def _merged(query: Fields, body: Fields) -> Fields:
    """The body's fields and the query string's: a field in both is a 400 (one would be dropped)."""
    both = sorted(set(query) & set(body))
    if both:
        raise ServiceError(400, f"Invalid request: {shown(both[0])} given in both the query string and the body; "
                                "send it once", both[0])
    return {**query, **body}


def _grouped(pairs, what: str) -> Fields:
    """Fields from (name, value) pairs: a repeated ``q`` is a batch (LibreTranslate normalises form
    line endings to \\n); ``keep`` is a list, one field per term; any other field given twice is a 400
    (one value would be dropped)."""
    grouped: dict[str, list[str]] = {}
    for k, v in pairs:
        grouped.setdefault(k, []).append(v)
    fields: Fields = {}
    for key, values in grouped.items():
        if key == "q":
            values = ["\n".join(v.splitlines()) for v in values]
            fields[key] = values if len(values) > 1 else values[0]
        elif key == "keep":     # do-not-translate terms: one form field per term
            fields[key] = values
        elif len(values) > 1:
            raise ServiceError(400, f"Invalid request: {what} {shown(key)} given {len(values)} times; send it once", key)
        else:
            fields[key] = values[0]
    return fields


async def _check_multipart(request: Request) -> None:
    """Raises ServiceError 400 for a multipart body without a boundary parameter or its closing
    delimiter (``--boundary--``): a truncated body is not read as an empty form."""
    params = dict(p.strip().partition("=")[::2] for p in request.headers.get("content-type", "").split(";")[1:])
    boundary = params.get("boundary", "").strip('"')
    if not boundary:
        raise ServiceError(400, "Invalid request: the multipart/form-data body is malformed: its Content-Type has "
                                "no boundary parameter", "body")
    if b"--" + boundary.encode("latin-1", "replace") + b"--" not in await request.body():
        raise ServiceError(400, f"Invalid request: the multipart/form-data body is malformed: no closing boundary "
                                f"'--{boundary[:70]}--' (truncated?)", "body")


def _whole_number(value: object) -> int:
    """``alternatives`` as an int: a JSON integer (2 or 2.0), a form's digits, or 0 when absent.
    Raises ServiceError 400 for anything else (1.5, true, "two", inf) and for a whole number beyond
    the field's range, however many digits it has (an integer of thousands of digits is compared,
    never converted to a float or parsed past what the range needs)."""
    if value is None or value == "":
        return 0
    n: Optional[int] = None
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        digits = value.strip().lstrip("+-").lstrip("0") or "0"
        if len(digits) > 6:      # far beyond the range: never parse it (Python refuses > 4,300 digits)
            raise _alternatives_out_of_range(value.strip().startswith("-"))
        n = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        n = int(value)
    if n is None:
        raise ServiceError(400, f"Invalid request: alternatives parameter must be a whole number, got {shown(value)}",
                           "alternatives")
    if n < 0 or n > MAX_BEAM_SIZE - 1:
        raise _alternatives_out_of_range(n < 0)
    return n


def _alternatives_out_of_range(negative: bool) -> ServiceError:
    bound = ">= 0" if negative else f"<= {MAX_BEAM_SIZE - 1}"
    return ServiceError(400, f"Invalid request: alternatives parameter must be {bound}", "alternatives")


def _unique(seq: list[str], exclude: str) -> list[str]:
    seen, out = {exclude, ""}, []
    for s in seq:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out
