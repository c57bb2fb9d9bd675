"""Document translation over HTTP (formats: ``service/documents``; docs/documents.md).

    POST /v1/documents            multipart ``file``, ``source_lang``, ``target_lang``, ``model``,
                                  ``stream``: the translated file itself (same name and type), or with
                                  stream=true Server-Sent Events ``progress`` {"done", "total"} then
                                  ``document`` {"url", "filename", "bytes"} (download as below)
    POST /translate_file          LibreTranslate: multipart ``file``, ``source``, ``target``, ``api_key``;
                                  answers {"translatedFileUrl": ".../download_file/NAME"}
    GET  /download_file/{name}    a translated file, while it is kept (DocumentStore), same key only;
                                  errors in the native shape (the guard's 401 on this path is too)
    (DeepL's /v2/document routes: deepl_documents.py)

A document's segments go to the engine in jobs of ``chunk_segments`` (``translate_segments``), at
most ``parallel_chunks`` in flight: each job is one group of the scheduler's fair queueing
(``service/engine/scheduler.py``), so another client's request waits for at most those few jobs'
sentences, not for the whole document. A job refused as too large (413: a segment over the
per-text limit, or over the sentence limit) is split in halves until it fits; an overloaded engine
(503) is retried after its Retry-After, a few times.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import urllib.parse
from typing import TYPE_CHECKING, Awaitable, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from service import documents
from service.documents import Document
from service.pipeline import autodetect
from service.protocol import (
    MAX_FILENAME_CHARS,
    GenerationOptions,
    JobOrigin,
    ServiceError,
    TranslateJob,
    TranslateResponse,
    shown,
)
from service.translator.card import match_language

from . import sse
from .document_store import DocumentSettings
from .errors import error_response, libre_error_response
from .middleware.caller import caller_of
from .middleware.guard import check_body_key
from .multipart import Upload, read_upload

if TYPE_CHECKING:
    from .services import Services

RETRIES_503 = 5                 # attempts of one job while the engine answers 503 (overloaded, loading)
DETECT_SAMPLE_CHARS = 2_000     # characters of a document read to detect its language (source auto)
Run = Callable[[str, TranslateJob], Awaitable[TranslateResponse]]
FILE_SEGMENTS = JobOrigin("file", True)     # a job's texts: segments of the uploaded file, file[i] in messages


_FILE = {"type": "string", "format": "binary", "description": "the document: " + ", ".join(documents.EXTENSIONS)}
OPENAPI_NATIVE = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"], "properties": {
        "file": _FILE, "source_lang": {"type": "string", "description": 'a code, "auto" or absent'},
        "target_lang": {"type": "string"}, "model": {"type": "string"},
        "stream": {"type": "boolean", "description": "SSE progress, then a download URL"},
        "filename": {"type": "string", "description": "overrides the file part's name (its extension picks the format)"}},
    "additionalProperties": False}}}}
OPENAPI_LIBRE = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "source", "target"], "properties": {
        "file": _FILE, "source": {"type": "string", "description": 'a code or "auto"'},
        "target": {"type": "string"}, "api_key": {"type": "string"}}, "additionalProperties": False}}}}


_BINARY = {"schema": {"type": "string", "format": "binary"}}
FILE = {"description": "the translated file: same format, its name in Content-Disposition",
        "content": {m: _BINARY for m in dict.fromkeys(f.media_type.split(";")[0] for f in documents.FORMATS.values())}}
FILE_OR_EVENTS = {"description": FILE["description"] + '; with stream=true, text/event-stream: "progress" '
                                 '{"done", "total"} events, then "document" {"url", "filename", "bytes"} or "error"',
                  "content": {**FILE["content"], "text/event-stream": {"schema": {   # one event (OpenAPI < 3.2)
                      "type": "object", "required": ["event", "data"],
                      "properties": {"event": {"type": "string", "enum": ["progress", "document", "error"]},
                                     "data": {"type": "string", "contentMediaType": "application/json",
                                              "description": 'progress: {"done", "total"}; document: {"url", '
                                                             '"filename", "bytes"}; error: an ErrorResponse'}}}}}}


class TranslatedFileUrl(BaseModel):
    translatedFileUrl: str = Field(..., description="GET it (GET /download_file/{name}) while it is kept")


# ---- the engine side ----------------------------------------------------------------------------------
def chunks(segments: list[str], size: int, max_chars: int = 4_000) -> list[tuple[int, int]]:
    """(start, end) index ranges of ``segments`` with at most ``size`` segments and, past the first,
    ``max_chars`` characters each."""
    out, start, chars = [], 0, 0
    for i, s in enumerate(segments):
        if i > start and (i - start >= size or chars + len(s) > max_chars):
            out.append((start, i))
            start, chars = i, 0
        chars += len(s)
    if start < len(segments):
        out.append((start, len(segments)))
    return out


async def translate_segments(segments: list[str], model: str, target_lang: Optional[str], run: Run,
                             settings: DocumentSettings,
                             progress: Optional[Callable[[int, int], None]] = None) -> tuple[list[str], int]:
    """The translations of ``segments`` (in order) and the source characters translated; jobs as in
    the module docstring. ``progress(done, total)`` after each job. Raises ServiceError."""
    out: list[Optional[str]] = [None] * len(segments)
    todo = [i for i, s in enumerate(segments) if s.strip()]
    for i, s in enumerate(segments):
        if not s.strip():
            out[i] = s
    texts = [segments[i] for i in todo]
    gate = asyncio.Semaphore(settings.parallel_chunks)
    done = 0

    async def one(a: int, b: int) -> None:
        nonlocal done
        async with gate:
            for k, t in zip(todo[a:b], await _translate(texts[a:b], model, target_lang, run)):
                out[k] = t
        done += b - a
        if progress is not None:
            progress(done, len(texts))
    tasks = [asyncio.ensure_future(one(a, b)) for a, b in chunks(texts, settings.chunk_segments)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    return [o if o is not None else "" for o in out], sum(len(t) for t in texts)


async def _translate(texts: list[str], model: str, target_lang: Optional[str], run: Run) -> list[str]:
    """One job's translations; a 413 splits the job (a single text: at the space nearest its middle)."""
    job = TranslateJob(list(texts), GenerationOptions(), target_lang=target_lang)
    for attempt in range(RETRIES_503):
        try:
            result = await run(model, dataclasses.replace(job))
            return [t.text for t in result.translations]
        except ServiceError as e:
            if e.status == 413:
                return await _split(texts, model, target_lang, run, e)
            if e.status != 503 or attempt == RETRIES_503 - 1:
                raise
            await asyncio.sleep(e.retry_after or 1)
    raise AssertionError("unreachable")


async def _split(texts: list[str], model: str, target_lang: Optional[str], run: Run, e: ServiceError) -> list[str]:
    if len(texts) > 1:
        h = len(texts) // 2
        return (await _translate(texts[:h], model, target_lang, run)
                + await _translate(texts[h:], model, target_lang, run))
    text = texts[0]
    if len(text) < 2:
        raise e
    mid = len(text) // 2
    cut = text.rfind(" ", 0, mid + 1)
    cut = cut if cut > 0 else text.find(" ", mid)
    cut = cut if cut > 0 else mid
    a = await _translate([text[:cut]], model, target_lang, run)      # in turn: the gate's slot is this job's
    b = await _translate([text[cut:]], model, target_lang, run)
    return [a[0] + b[0]]          # the second half starts with the space (translations keep edge whitespace)


# ---- the request side ----------------------------------------------------------------------------------
def parse_document(upload: Upload) -> Document:
    """The document, off the event loop (parsing a large file takes a while). Raises DocumentError."""
    return documents.load(upload.data, upload.filename)


async def parsed(upload: Upload, svc: Optional["Services"] = None) -> Document:
    """``parse_document``; a refused file counted in ``svc``'s documents metric (outcome refused)."""
    try:
        return await asyncio.to_thread(parse_document, upload)
    except ServiceError:
        count(svc, format_of(upload.filename), "refused")
        raise


def format_of(filename: str) -> str:
    """The metric's format label: the supported extension of ``filename``, else ``other``."""
    try:
        return documents.extension(filename)
    except ServiceError:
        return "other"


class JobCancelled(Exception):
    """A document's translation stopped because its job was cancelled (raised by ``progress``)."""


def ended(e: BaseException) -> str:
    """The documents metric's outcome of a translation that raised ``e``: cancelled or failed."""
    return "cancelled" if isinstance(e, (asyncio.CancelledError, JobCancelled)) else "failed"


def count(svc: Optional["Services"], fmt: str, outcome: str) -> None:
    """One document ended with ``outcome`` (ok, refused, failed, cancelled) in ``svc``'s metrics, if any."""
    if svc is not None and svc.doc_metrics is not None:
        svc.doc_metrics.record(fmt, outcome)


async def detected_source(detector, doc: Document, field: str) -> str:
    """The language of the document's text (a sample of its first segments). Raises ServiceError 422."""
    sample, n = [], 0
    for s in doc.segments:
        sample.append(s)
        n += len(s)
        if n >= DETECT_SAMPLE_CHARS:
            break
    (cands,) = await autodetect.detect_texts(detector, [" ".join(sample)[:DETECT_SAMPLE_CHARS]])
    if not cands or cands[0][0] == autodetect.NO_LANGUAGE:
        raise ServiceError(404, f"{field}: auto cannot tell the document's language; send {field}", field,
                           type=autodetect.NOT_SERVED)
    return cands[0][0]


def file_response(data: bytes, filename: str, media_type: str, headers: Optional[dict] = None) -> Response:
    """The file as an attachment (RFC 6266 / 5987 file name): the upload's base name only (RFC 6266
    section 4.3: no directories, "../../etc/passwd.txt" -> "passwd.txt"), without control characters."""
    filename = re.split(r"[/\\]", filename)[-1]
    filename = "".join(c for c in filename if c.isprintable()).strip(". ")[-MAX_FILENAME_CHARS:] or "document"
    ascii_name = filename.encode("ascii", "replace").decode().replace('"', "'").replace("\\", "_")
    disposition = f'attachment; filename="{ascii_name}"; filename*=UTF-8\'\'{urllib.parse.quote(filename)}'
    return Response(data, media_type=media_type, headers={"Content-Disposition": disposition, **(headers or {})})


def progress_events(work: Callable[[Callable[[int, int], None]], Awaitable[dict]]):
    """SSE text: ``progress`` {"done", "total"} as jobs finish, then ``document`` (work's result) or
    ``error``; ``work(progress)`` runs as a task that the stream's end cancels."""
    async def gen():
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(work(lambda d, t: queue.put_nowait(("progress", {"done": d, "total": t}))))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                yield sse.format_event(*item)
            try:
                yield sse.format_event("document", task.result())
            except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
                err = e if isinstance(e, ServiceError) else ServiceError(500, f"internal error: {type(e).__name__}")
                yield sse.format_event("error", {"error": {"type": err.type, "message": err.message,
                                                           "field": err.field}})
        finally:
            task.cancel()
    return gen()


def stored_url(request: Request, name: str, settings: DocumentSettings) -> str:
    """The download URL of a kept file: under ``settings.public_url`` when configured (never from
    what the request's headers say), else under the request's own base URL."""
    base = settings.public_url or str(request.base_url)
    return base.rstrip("/") + "/download_file/" + name


def truthy(value: Optional[str], field: str) -> bool:
    if value is None or value.strip().lower() in ("", "0", "false", "no"):
        return False
    if value.strip().lower() in ("1", "true", "yes"):
        return True
    raise ServiceError(400, f"{field}: must be true or false, got {shown(value)}", field)


# ---- the routes' bodies (the Gateway's methods call these with itself) --------------------------------
async def plan(svc: "Services", doc: Document, model: Optional[str], source: Optional[str], target: Optional[str],
               source_field: str) -> tuple[str, Optional[str], Optional[str]]:
    """(model id, target language, source language) for a document, ``source`` "auto" detected from
    its text (None: the model's); the source is the served code an NLLB-200 / M2M100 / mBART-50 / T5
    model reads (None for other models). Raises ServiceError 404/422 (the gateway's ``resolve``), the
    document released."""
    try:
        return await _plan(svc, doc, model, source, target, source_field)
    except BaseException:
        count(svc, getattr(doc, "extension", "other"), "refused")
        documents.release(doc)
        raise


async def _plan(svc: "Services", doc: Document, model: Optional[str], source: Optional[str], target: Optional[str],
                source_field: str) -> tuple[str, Optional[str], Optional[str]]:
    if autodetect.is_auto(source):
        source = await detected_source(svc.detector, doc, source_field)
        try:
            card = svc.graph.resolve(model, source, target)
        except ServiceError as e:      # the detected language: the 404 of autodetect.route
            raise ServiceError(e.status, f"{source_field}: auto detected {source} in the document: {e.message}",
                               source_field, type=autodetect.NOT_SERVED if e.status == 404 else None) from None
    else:
        card = svc.graph.resolve(model, source, target)
    source = svc.graph.code(source, svc.graph.sources) if card.lang_tokens else None
    return card.id, match_language(target, set(card.targets)) if target else None, source


async def translated(svc: "Services", doc: Document, model: str, target: Optional[str],
                     progress: Optional[Callable[[int, int], None]] = None,
                     glossary: tuple = (), memory: Optional[dict] = None,
                     source: Optional[str] = None) -> tuple[bytes, int]:
    """The translated file's bytes and the characters translated; ``glossary``: (source, target) terms
    every segment's translation keeps (a stored glossary's entries, DeepL's ``glossary_id``); ``memory``:
    the jobs' ``memory_scope`` and ``memory_threshold`` (DeepL's ``translation_memory_id``); ``source``:
    the source language of a model that reads one (``plan``). The document is released at the end
    (``documents.release``), translated or not."""
    async def run(m: str, job: TranslateJob) -> TranslateResponse:
        job = svc.graph.bind(svc.graph.cards.get(m), job, source)
        if glossary:
            job = dataclasses.replace(job, glossary=tuple(glossary), stored_glossary=True)
        if memory:
            job = dataclasses.replace(job, **memory)
        svc.pipeline.check(m, job, FILE_SEGMENTS)
        return await svc.pipeline.run(m, svc.pipeline.deadline(job, job.timeout_s), FILE_SEGMENTS)
    fmt = getattr(doc, "extension", "other")
    try:
        out, chars = await translate_segments(doc.segments, model, target, run, svc.doc_settings, progress)
    except BaseException as e:
        count(svc, fmt, ended(e))
        documents.release(doc)
        raise
    try:
        data = await asyncio.to_thread(rebuilt, doc, out)      # rebuilt releases the document
    except BaseException as e:
        count(svc, fmt, ended(e))
        raise
    count(svc, fmt, "ok")
    return data, chars


def rebuilt(doc: Document, translations: list[str]) -> bytes:
    """The document's file with ``translations``; the document released (even when the await that
    asked for it was cancelled: this runs to its end in its thread)."""
    try:
        return doc.rebuild(translations)
    finally:
        documents.release(doc)


async def native(svc: "Services", request: Request) -> Response:
    """POST /v1/documents (module docstring). Errors: ServiceError (the native error shape)."""
    up = await read_upload(request, ("source_lang", "target_lang", "model", "stream", "filename"))
    stream = truthy(up.fields.get("stream"), "stream")
    doc = await parsed(up, svc)
    model, target, source = await plan(svc, doc, up.fields.get("model"), up.fields.get("source_lang"),
                                       up.fields.get("target_lang"), "source_lang")
    request.state.model = model
    media = documents.FORMATS[documents.extension(up.filename)].media_type
    if not stream:
        data, _ = await translated(svc, doc, model, target, source=source)
        return file_response(data, up.filename, media)
    owner = caller_of(request).owner

    async def work(progress) -> dict:
        data, _ = await translated(svc, doc, model, target, progress, source=source)
        rec = await asyncio.to_thread(svc.doc_store.put, data, up.filename, media, owner)
        return {"url": stored_url(request, rec.name, svc.doc_settings), "filename": up.filename, "bytes": rec.size}
    decision = request.scope.get("state", {}).get("guard_decision")      # counted like any stream (or 429)
    release = svc.guard.open_stream(decision.who, decision.key) if decision else (lambda: None)
    request.state.stream = True
    return sse.ClosingStreamingResponse(progress_events(work), release, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def libre(svc: "Services", request: Request) -> Response:
    """POST /translate_file: LibreTranslate's shape ({"translatedFileUrl"}; errors {"error"}, 4xx as 400)."""
    try:
        try:
            up, unreadable = await read_upload(request, ("source", "target", "api_key")), None
        except ServiceError as e:
            up, unreadable = None, e
        denied = check_body_key(request.scope.setdefault("state", {}), up.fields.get("api_key") if up else None)
        if denied is not None:
            return libre_error_response(denied.error, headers=denied.headers)
        if unreadable is not None:
            raise unreadable
        for name in ("source", "target"):
            if not up.fields.get(name):
                raise ServiceError(400, f"Invalid request: {'empty' if name in up.fields else 'missing'} {name} "
                                        "parameter", name)
        doc = await parsed(up, svc)
        model, target, source = await plan(svc, doc, None, up.fields["source"], up.fields["target"], "source")
        request.state.model = model
        data, _ = await translated(svc, doc, model, target, source=source)
        owner = caller_of(request).owner
        media = documents.FORMATS[documents.extension(up.filename)].media_type
        rec = await asyncio.to_thread(svc.doc_store.put, data, up.filename, media, owner)
    except ServiceError as e:
        return libre_error_response(e)
    return JSONResponse({"translatedFileUrl": stored_url(request, rec.name, svc.doc_settings)})


async def download(svc: "Services", request: Request, name: str) -> Response:
    """GET /download_file/{name}: the kept file (404 once expired or for another key)."""
    state = request.scope.setdefault("state", {})
    denied = check_body_key(state, request.query_params.get("api_key"))
    if denied is not None:
        return error_response(denied.error, headers=denied.headers)
    owner = caller_of(request).owner
    try:
        rec, data = await asyncio.to_thread(svc.doc_store.get, name, owner, svc.guard.keys_on)
    except ServiceError as e:
        return error_response(e)
    return file_response(data, rec.filename, rec.media_type)
