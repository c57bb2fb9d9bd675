"""DeepL's document API (https://developers.deepl.com/api-reference/document), as the official
clients call it (``deepl.Translator(auth_key, server_url=...).translate_document``):

    POST /v2/document                       multipart ``file``, ``target_lang`` (EN-GB, DE, ...), optional
                                            ``source_lang``, ``filename``, ``formality``, ``output_format``,
                                            ``glossary_id`` or ``glossary_ids`` (stored glossaries' terms:
                                            GlossaryClient.resolve_all), ``translation_memory_id`` and
                                            ``translation_memory_threshold`` (as /v2/translate's)
                                            -> {"document_id", "document_key"}; translation starts in the
                                            background of the replica that took the upload
    POST /v2/document/{document_id}         ``document_key`` (form or JSON) -> {"document_id", "status":
                                            queued|translating|done|error, "seconds_remaining",
                                            "billed_characters", "error_message"}
    POST /v2/document/{document_id}/result  ``document_key`` -> the translated file (503 until done)
    DELETE /v2/document/{document_id}       ``document_key`` -> 204: the job cancelled and forgotten, its
                                            file removed (this service's extension: DeepL has no cancel)

The job's record and file live in the shared ``DocumentStore``, so any ingress replica answers the
status and result. ``document_key`` is the capability (only its SHA-256 is stored); with API keys on,
the same key must also come with every call (``Authorization: DeepL-Auth-Key`` or Bearer). Errors
are DeepL's ``{"message": ...}``. ``formality``, and ``translation_memory_threshold`` without
``translation_memory_id``, are accepted and not applied (the ``X-Unsupported`` header names them);
``output_format`` other than the input's is a 400; ``glossary_id`` and ``translation_memory_id`` are
resolved at the upload for the document's pair (404 unknown; 409, 400 other languages) and applied
to every segment.
One API key (keys off: one client address) has at most ``max_jobs_per_key`` unfinished jobs, counted
in the shared store over every ingress replica (``admit``); one more is a 429 with Retry-After.
Language codes: DeepL's upper-case codes with regions (EN-GB, PT-BR) map to the served ones
(``deepl_language``; the clients helper's service/api/deepl.py is meant to own this at merge).
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import secrets
import time
from typing import TYPE_CHECKING, Callable, Literal, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from service import documents
from service.protocol import ServiceError

from . import deepl, deepl_glossaries, deepl_memories, glossaries, multipart
from . import documents as routes
from .middleware.caller import caller_of
from .schemas import ErrorResponse

if TYPE_CHECKING:
    from .document_store import DocumentStore
    from .services import Services


class DocumentHandle(BaseModel):
    document_id: str
    document_key: str = Field(..., description="send it with the status and result calls")


class DocumentStatus(BaseModel):
    document_id: str
    status: Literal["queued", "translating", "done", "error"]
    seconds_remaining: Optional[int] = None
    billed_characters: Optional[int] = Field(None, description="characters translated, once done")
    error_message: Optional[str] = None


class DeepLError(BaseModel):
    message: str


ERRORS = {status: {"model": DeepLError, "description": what} for status, what in {
    400: "a field missing or invalid (target_lang, output_format, document_key), an unreadable body",
    404: "unknown document_id, wrong document_key or API key, expired; no model for the languages; unknown "
         "glossary_id or translation_memory_id",
    409: "glossary_id names a stored glossary of other languages",
    413: "a file over a limit (docs/documents.md#limits)",
    415: "an unsupported extension, or content that is not that format",
    422: "a damaged file, or its language could not be detected",
    429: "over the rate limit of this key or client; upload: max_jobs_per_key jobs unfinished (Retry-After)",
    503: "result: not done yet (Retry-After)"}.items()}
ERRORS.update({status: {"model": ErrorResponse, "description": what} for status, what in {   # the guard's, native
    401: "API keys are on and no valid key was sent (Authorization: Bearer)"}.items()})
OPENAPI_KEY = {"required": True, "content": {m: {"schema": {"type": "object", "required": ["document_key"], "properties": {
    "document_key": {"type": "string", "minLength": 1, "description": "POST /v2/document's answer (unknown: 404)"}}}}
    for m in ("application/json", "application/x-www-form-urlencoded")}}
# OpenAPI links: a handle's document_id and document_key are what the status and result calls take
# (a stateful client, such as schemathesis' stateful phase, follows them)
_HANDLE = {"parameters": {"document_id": "$response.body#/document_id"},
           "requestBody": {"document_key": "$response.body#/document_key"}}
UPLOAD_LINKS = {"status": {"operationId": "deepl_document_status", **_HANDLE,
                           "description": "the status of the uploaded document"},
                "result": {"operationId": "deepl_document_result", **_HANDLE,
                           "description": "the translated document, once its status is done"}}
MAX_IDS = deepl.MAX_GLOSSARY_IDS
STATUS_LINKS = {"result": {"operationId": "deepl_document_result",
                           "parameters": {"document_id": "$request.path.document_id"},
                           "requestBody": {"document_key": "$request.body#/document_key"},
                           "description": "the translated document, with the same key"}}
OPENAPI_UPLOAD = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "target_lang"], "properties": {
        "file": {"type": "string", "format": "binary"}, "target_lang": {"type": "string"},
        "source_lang": {"type": "string"}, "filename": {"type": "string"}, "formality": {"type": "string"},
        "output_format": {"type": "string", "description": "empty, or the file's own extension (no conversion)"},
        "glossary_id": {"type": "string", "description": "a DeepL glossary's id or a /v1/glossaries name; unknown: "
                                                        "404; without a dictionary of the document's pair: 409"},
        "glossary_ids": {"type": "string", "pattern": rf"^[^,]*(,[^,]*){{0,{MAX_IDS - 1}}}$",
                         "description": f"up to {MAX_IDS} glossary ids, comma-separated, not with glossary_id"},
        "translation_memory_id": {"type": "string", "format": "uuid", "description": "GET /v3/translation_memories' "
                                  "id, of the document's pair (else 400); unknown: 404"},
        "translation_memory_threshold": {"type": "integer", "minimum": 0, "maximum": 100, "description":
                                         "with translation_memory_id (absent: 75); without it not applied "
                                         "(named in X-Unsupported)"},
        "auth_key": {"type": "string", "description": "DeepL's legacy key field"}},
    "additionalProperties": False,
    "anyOf": [{"properties": {"glossary_id": {"maxLength": 0}}},         # both named: 400
              {"properties": {"glossary_ids": {"pattern": r"^[,\s]*$"}}}]}}}}

JOB_STALE_S = 600        # a job not updated for this long lost its replica: reported as an error
JOBS_RETRY_AFTER_S = 5   # Retry-After of the 429 for too many unfinished jobs
MAX_CANCEL_BODY_BYTES = 16 * 1024   # a DELETE's body (its document_key): the body middleware reads POST, PUT, PATCH only
FIELDS = ("target_lang", "source_lang", "filename", "formality", "output_format", "glossary_id", "glossary_ids",
          "translation_memory_id", "translation_memory_threshold", "auth_key")


class Cancelled(routes.JobCancelled):
    """The job's record is gone from the store: its owner cancelled it (on any replica)."""


class Jobs:
    """This replica's running jobs (a reference keeps each task alive) by document_id; the places of
    each holder's unfinished jobs are counted in the shared store (``admit``)."""

    def __init__(self):
        self.running: dict[str, asyncio.Future] = {}


_jobs = Jobs()


async def admit(store: "DocumentStore", who: str, job_id: str, record: dict, limit: int) -> None:
    """Keep ``record`` (a job's first) as job ``job_id``'s in ``store``, a place among the unfinished
    jobs of ``who`` (``Caller.who``: "k:<key label>", keys off "c:<client address>"; the record keeps its
    hash), counted in the store over every ingress replica that shares it: the place is given back when
    the job's record turns done or error, is removed (cancelled, a failed upload) or goes stale
    (JOB_STALE_S). Raises ServiceError 429 when ``who`` has ``limit`` unfinished jobs."""
    record["holder"] = _hash(who)
    held = await asyncio.to_thread(store.admit_job, job_id, record, limit, JOB_STALE_S)
    if held >= limit:
        what = "API key" if who.startswith("k:") else "client"
        raise ServiceError(429, f"Too many documents: at most {limit} unfinished document translations per "
                                f"{what} (documents.max_jobs_per_key); {held} are queued or translating: "
                                "retry when one is done, or cancel one (DELETE /v2/document/{id})",
                           "file", retry_after=JOBS_RETRY_AFTER_S, type="too_many_documents")


def deepl_language(code: Optional[str]) -> Optional[str]:
    """A DeepL language code as the service's (case-insensitive; EN-GB -> en-gb, matched to en by
    the gateway's ``match_language``); None stays None."""
    return code.strip().lower() if code and code.strip() else None


def message(e: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after else None
    return JSONResponse({"message": e.message}, status_code=e.status, headers=headers)


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


async def upload(svc: "Services", request: Request) -> Response:
    doc, admitted = None, False
    job_id, key = secrets.token_hex(16).upper(), secrets.token_hex(32).upper()
    try:
        up = await multipart.read_upload(request, FIELDS)
        caller = caller_of(request)
        record = {"status": "queued", "key": _hash(key), "owner": caller.owner, "filename": up.filename, "total": 0,
                  "done": 0, "started": time.time(), "billed_characters": None, "error_message": None, "result": None}
        await admit(svc.doc_store, caller.who, job_id, record, svc.doc_settings.max_jobs_per_key)
        admitted = True
        target = deepl_language(up.fields.get("target_lang"))
        if not target:
            raise ServiceError(400, "Value for 'target_lang' not supported. target_lang is required", "target_lang")
        ext = documents.extension(up.filename)
        out_fmt = (up.fields.get("output_format") or ext).lower()
        if out_fmt != ext:
            raise ServiceError(400, f"output_format: converting .{ext} to .{out_fmt} is not supported; "
                                    "the translated file has the input's format", "output_format")
        doc = await routes.parsed(up, svc)
        source = deepl_language(up.fields.get("source_lang")) or "auto"
        ids, field = deepl_glossaries.ids_of(up.fields)
        model, target, source = await routes.plan(svc, doc, None, source, target, "source_lang")
        glossary: tuple = ()
        card = svc.graph.cards.get(model) or svc.graph.pivots[model].card    # the pair the document goes to
        pair = (source, target) if card.lang_tokens else (card.source_lang, card.target_lang)
        if ids:     # 404 for an unknown glossary, 409 for one without that pair (GlossaryClient.resolve_all)
            glossary = await svc.glossaries.resolve_all(glossaries.scope_of(request), ids, *pair, field=field)
        tm_id = up.fields.get("translation_memory_id")
        threshold = deepl_memories.int_param(up.fields.get("translation_memory_threshold"),
                                             "translation_memory_threshold", None, 0, 100)
        memory = deepl_memories.job_fields(     # as /v2/translate's: 404 unknown, 400 another pair
            svc.memory, svc.memory_scope(request), svc.graph, tm_id, threshold if tm_id else None,
            *pair)
        record.update(total=len(doc.segments), started=time.time())
        await asyncio.to_thread(svc.doc_store.put_job, job_id, record)
    except BaseException as e:          # the place goes back: the job's record is removed
        if admitted:
            svc.doc_store.remove_job(job_id)
        if doc is not None and vars(doc):   # refused after plan (which counts and releases what it refuses)
            routes.count(svc, getattr(doc, "extension", "other"), "refused")
            documents.release(doc)
        if isinstance(e, ServiceError):
            return message(e)
        raise
    task = asyncio.ensure_future(_run(svc, job_id, record, doc, model, target, up.filename, glossary,
                                      functools.partial(svc.add_usage, caller_of(request).scope), memory, source))
    _jobs.running[job_id] = task
    task.add_done_callback(lambda _: _jobs.running.pop(job_id, None))
    task.add_done_callback(functools.partial(_never_ran, svc, record, doc))
    unsupported = [name for name, unused in (("formality", up.fields.get("formality") not in (None, "", "default")),
                   ("translation_memory_threshold", threshold is not None and not tm_id)) if unused]
    headers = {"X-Unsupported": ", ".join(unsupported)} if unsupported else None
    return JSONResponse({"document_id": job_id, "document_key": key}, headers=headers)


def _never_ran(svc: "Services", record: dict, doc, task: asyncio.Task) -> None:
    """A job cancelled before ``_run`` began (its record still queued): its document counted and released."""
    if task.cancelled() and record.get("status") == "queued":
        routes.count(svc, getattr(doc, "extension", "other"), "cancelled")
        documents.release(doc)


async def _run(svc: "Services", job_id: str, record: dict, doc, model: str, target: Optional[str], filename: str,
               glossary: tuple = (), bill: Callable[[int], None] = lambda chars: None,
               memory: Optional[dict] = None, source: Optional[str] = None) -> None:
    store = svc.doc_store
    last = [0.0]

    def progress(done: int, total: int) -> None:
        if time.time() - last[0] >= 0.5 or done == total:     # at most two record writes a second
            last[0] = time.time()
            if store.get_job(job_id) is None:       # cancelled on another replica
                raise Cancelled(job_id)
            record.update(status="translating", done=done)
            store.put_job(job_id, record)
    try:
        record["status"] = "translating"
        await asyncio.to_thread(store.put_job, job_id, record)
        data, chars = await routes.translated(svc, doc, model, target, progress, glossary, memory, source)
        if await asyncio.to_thread(store.get_job, job_id) is None:
            raise Cancelled(job_id)
        media = documents.FORMATS[documents.extension(filename)].media_type
        rec = await asyncio.to_thread(store.put, data, filename, media, record["owner"])
        record.update(status="done", result=rec.name, billed_characters=chars, done=record["total"])
        await asyncio.to_thread(bill, chars)
    except Cancelled:
        return          # its record and file are gone: nothing to write
    except ServiceError as e:
        record.update(status="error", error_message=e.message)
    except Exception as e:  # noqa: BLE001 - a background job: its error goes to its status, not the log only
        record.update(status="error", error_message=f"internal error: {type(e).__name__}")
    await asyncio.to_thread(store.put_job, job_id, record)


async def _job(svc: "Services", request: Request, job_id: str) -> dict:
    """The job record once ``document_key`` (and, with keys on, the API key) match. Raises ServiceError 404/400."""
    try:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "application/json":
            body = json.loads(await request.body() or b"{}")
            key = body.get("document_key") if isinstance(body, dict) else None
        else:
            key = (await request.form()).get("document_key")
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ServiceError(400, "body: cannot be read; send document_key as JSON or a form field", "document_key") from None
    if not isinstance(key, str) or not key:
        raise ServiceError(400, "Parameter 'document_key' not specified", "document_key")
    job = await asyncio.to_thread(svc.doc_store.get_job, job_id)
    if (job is None or not hmac.compare_digest(job["key"], _hash(key))
            or (svc.guard.keys_on and job["owner"] != caller_of(request).owner)):
        raise ServiceError(404, "Document not found: unknown document_id, wrong document_key, another API key, "
                                f"already downloaded, or expired (kept {svc.doc_settings.ttl_s:g} s)", "document_id")
    if job["status"] in ("queued", "translating") and time.time() - job["updated"] > JOB_STALE_S:
        job.update(status="error", error_message=f"the replica translating it stopped (no progress for "
                                                 f"{JOB_STALE_S} s); upload the document again")
    return job


async def status(svc: "Services", request: Request, job_id: str) -> Response:
    try:
        job = await _job(svc, request, job_id)
    except ServiceError as e:
        return message(e)
    body = {"document_id": job_id, "status": job["status"]}
    if job["status"] == "translating" and job["done"]:
        spent = time.time() - job["started"]
        body["seconds_remaining"] = max(1, round(spent * (job["total"] - job["done"]) / job["done"]))
    if job["billed_characters"] is not None:
        body["billed_characters"] = job["billed_characters"]
    if job["error_message"]:
        body["error_message"] = job["error_message"]
    return JSONResponse(body)


async def result(svc: "Services", request: Request, job_id: str) -> Response:
    """POST /v2/document/{id}/result: the translated file, once (as DeepL's API: the job and its file
    are removed when they are handed over; a second download is the 404 of an unknown job); 503 with
    Retry-After until the job is done."""
    try:
        job = await _job(svc, request, job_id)
        if job["status"] != "done":
            raise ServiceError(503, f"Document not ready: its status is {job['status']}"
                                    f"{': ' + job['error_message'] if job['error_message'] else ''}",
                               "document_id", retry_after=1)
        rec, data = await asyncio.to_thread(svc.doc_store.get, job["result"], job["owner"], False)
    except ServiceError as e:
        return message(e)
    await asyncio.to_thread(svc.doc_store.remove_job, job_id)     # as DeepL: downloaded once, then gone
    return routes.file_response(data, rec.filename, rec.media_type)


async def cancel(svc: "Services", request: Request, job_id: str) -> Response:
    """DELETE /v2/document/{id} (this service's extension): the job's translation stopped, its record
    and file removed; 204. The same 404 as ``status`` for another key or a wrong document_key."""
    try:
        await _job(svc, await capped(request, MAX_CANCEL_BODY_BYTES), job_id)
    except ServiceError as e:
        return message(e)
    running = _jobs.running.pop(job_id, None)
    if running is not None:     # on this replica; on another, it stops at its next progress (Cancelled)
        running.cancel()
    await asyncio.to_thread(svc.doc_store.remove_job, job_id)      # its place is free
    return Response(status_code=204)


async def capped(request: Request, cap: int) -> Request:
    """The request with its body read, at most ``cap`` bytes (more: ServiceError 413)."""
    data = b""
    async for chunk in request.stream():
        data += chunk
        if len(data) > cap:
            raise ServiceError(413, f"body: at most {cap} bytes (a document_key)", "body")
    return Request(request.scope, multipart.replay(data))
