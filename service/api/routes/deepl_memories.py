"""DeepL's translation memory routes (``router``; deepl_memories.py), each key's own:

    GET    /v3/translation_memories?page&page_size     {"translation_memories": [...], "total_count"}
    GET    /v3/translation_memories/{id}                one TranslationMemoryInfo
    DELETE /v3/translation_memories/{id}                204: the memory and its entries
    GET    /v3/translation_memories/{id}/segments       ?page_size (1-100, 50), page_cursor, filter_text,
                                                        filter_case_sensitive: {"segments", "segment_count",
                                                        "next_page_cursor"}
    POST   /v3/translation_memories/import              {"source_file": {file_name, content_length,
                                                        content_type}, "parameters": {display_name}}
                                                        -> {"job_id", "upload_url", "expires_at"}
    POST   /v3/translation_memories/{id}/export         202 {"job_id", "parameters"}
    GET    /v3/translation_memories/jobs/{job_id}       the job: status and result (DeepL's shape)
    PUT    /v3/translation_memories/files/{job_id}      ?token=: the import's file; imported before the answer
    GET    /v3/translation_memories/files/{job_id}      ?token=: the export's TMX file

The two file routes take no key (the client sends none to an upload or download URL): the job's
token in the URL is the key (middleware/guard.py passes them through). Errors are DeepL's
``{"message": ...}``; an unknown memory or job is a 404, another key's too. A memory id is a UUID
(``{tm_id:uuid}``), so that ``import``, ``jobs`` and ``files`` are never one: ``GET .../import`` is a 405
naming POST, as OPTIONS's ``Allow`` is.
"""
import asyncio
import uuid
from typing import Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from service.protocol import ServiceError, TranslationError
from service.replica import mapped_errors

from .. import deepl_memories as tms
from .. import deepl_memory_files as tm_files
from .. import fields as fields_module
from ..middleware.body import parse_content_type
from ..middleware.caller import caller_of
from ..services import Services, services

router = APIRouter()
ERRORS = {400: {"description": 'invalid input: {"message": ...} naming the field'},
          403: {"description": "no or a wrong DeepL-Auth-Key (keys on)"},
          404: {"description": "no translation memory or job of that id for this key"},
          429: {"description": "over the rate limit"},
          503: {"description": "the memory's file cannot be used now"}}
FILE_ERRORS = {**ERRORS, 404: {"description": "no job of that id, or not its token"},
               409: {"description": "PUT: the file was uploaded already"},
               410: {"description": "the URL expired"}, 413: {"description": "PUT: a file over the body cap"}}


def _owner(request: Request) -> str:
    return caller_of(request).scope


@router.get("/v3/translation_memories", responses=ERRORS)
async def list_memories(request: Request, svc: Services = Depends(services)):
    """The key's translation memories, ``page_size`` (1-25, default 10) per ``page`` (from 0)."""
    q = request.query_params
    page = tms.int_param(q.get("page"), "page", 0, 0, 1_000_000)
    size = tms.int_param(q.get("page_size"), "page_size", 10, 1, tms.MAX_LIST_PAGE)
    if svc.memory is None:
        return {"translation_memories": [], "total_count": 0}
    reg = tms.registry(svc.memory)
    with mapped_errors("memory"):
        memories = reg.all(_owner(request), svc.graph)
        shown = [tms.info(m, reg.count(m)) for m in memories[page * size:(page + 1) * size]]
    return {"translation_memories": shown, "total_count": len(memories)}


@router.get("/v3/translation_memories/jobs/{job_id}", responses=ERRORS)
async def get_job(job_id: str, request: Request, svc: Services = Depends(services)):
    """An import or export job of the key: its status and result."""
    with mapped_errors("memory"):
        job = tms.registry(svc.memory).job(job_id)
    if job is None or job["owner"] != _owner(request):
        raise tms.not_found("translation memory job", job_id)
    return tms.job_json(job, str(request.base_url))


@router.get("/v3/translation_memories/{tm_id:uuid}", responses=ERRORS)
async def get_memory(tm_id: uuid.UUID, request: Request, svc: Services = Depends(services)):
    reg = tms.registry(svc.memory)
    with mapped_errors("memory"):
        m = reg.get(_owner(request), str(tm_id), svc.graph)
        return tms.info(m, reg.count(m))


@router.delete("/v3/translation_memories/{tm_id:uuid}", status_code=204, responses=ERRORS)
async def delete_memory(tm_id: uuid.UUID, request: Request, svc: Services = Depends(services)):
    """Delete the memory and its entries (the key's own memory of a model: that model's entries)."""
    reg = tms.registry(svc.memory)
    with mapped_errors("memory"):
        reg.delete(reg.get(_owner(request), str(tm_id), svc.graph))
    return Response(status_code=204)


@router.get("/v3/translation_memories/{tm_id:uuid}/segments", responses=ERRORS)
async def list_segments(tm_id: uuid.UUID, request: Request, svc: Services = Depends(services)):
    """One page of the memory's segments in source order (sources as the memory keys them: normalized)."""
    q = request.query_params
    size = tms.int_param(q.get("page_size"), "page_size", 50, 1, tms.MAX_SEGMENT_PAGE)
    text = q.get("filter_text")
    if text is not None and len(text) < 2:
        raise ServiceError(400, f"Value for 'filter_text' not supported: at least 2 characters, got {len(text)}",
                           "filter_text")
    case = tms.bool_param(q.get("filter_case_sensitive"), "filter_case_sensitive")
    after = tm_files.cursor_in(q.get("page_cursor"), text, case)
    reg = tms.registry(svc.memory)
    with mapped_errors("memory"):
        m = reg.get(_owner(request), str(tm_id), svc.graph)
        segments, last = reg.segments(m, after, size, text, case)
        body = {"segments": [tms.segment(m, s, t) for s, t in segments], "segment_count": reg.count(m)}
    if last is not None:
        body["next_page_cursor"] = tm_files.cursor_out(last, text, case)
    return body


@router.post("/v3/translation_memories/import", responses={**ERRORS, 413: {"description": "MAX_MEMORIES already"}},
             openapi_extra={"requestBody": tm_files.openapi_import_body()})
async def create_import(request: Request, svc: Services = Depends(services)):
    """Declare a file to import as a new memory: answers the job and the URL to PUT the file to."""
    fields = await fields_module.read_fields(request, (), 400)
    reg = tms.registry(svc.memory)
    req = tm_files.import_request(dict(fields), svc.graph)
    f, p = req.source_file, req.parameters
    with mapped_errors("memory"):
        reg.check_room(_owner(request))
        job = reg.new_job(_owner(request), "import", "awaiting_input", display_name=p.display_name or f.file_name,
                          content_type=f.content_type, content_length=f.content_length,
                          source_lang=p.source_lang, target_lang=p.target_lang)
    return {"job_id": job["id"], "upload_url": tms.file_url(str(request.base_url), job),
            "expires_at": tms.timestamp(job["expires"])}


@router.post("/v3/translation_memories/{tm_id:uuid}/export", status_code=202, responses=ERRORS)
async def create_export(tm_id: uuid.UUID, request: Request, svc: Services = Depends(services)):
    """Export the memory as TMX: a job, completed at once; its download_url gives the file."""
    reg = tms.registry(svc.memory)
    with mapped_errors("memory"):
        m = reg.get(_owner(request), str(tm_id), svc.graph)
        job = reg.new_job(_owner(request), "export", "completed", tm_id=m.id)
    return JSONResponse({"job_id": job["id"], "parameters": {"translation_memory_id": m.id}}, status_code=202)


@router.put("/v3/translation_memories/files/{job_id}", responses=FILE_ERRORS, openapi_extra={"requestBody": {
    "required": True, "content": {t: {"schema": {"type": "string"}} for t in tms.UPLOAD_TYPES}}})
async def upload_file(job_id: str, request: Request, token: Optional[str] = None, svc: Services = Depends(services)):
    """The import's file: read, checked and stored as a new memory before the answer; a file that
    cannot be imported fails the job (its error names why) and stores nothing."""
    reg = tms.registry(svc.memory)
    with mapped_errors("memory"):
        job = tms.check_token(reg.job(job_id), token, job_id)
    if job["operation"] != "import":
        raise ServiceError(400, f"job {job_id} is an export: its URL downloads the file")
    body = await request.body()
    media = parse_content_type(request.headers.get("content-type", ""))[0]
    if len(body) != job["content_length"]:
        raise ServiceError(400, f"the file has {len(body)} bytes; the import declared {job['content_length']} "
                                "(source_file.content_length)", "source_file.content_length")
    if media and media != job["content_type"]:
        raise ServiceError(400, f"Content-Type {media} is not the import's ({job['content_type']}, "
                                "source_file.content_type)", "Content-Type")
    with mapped_errors("memory"):
        if not reg.update_job(job_id, when="awaiting_input", status="processing"):
            raise ServiceError(409, f"the file of job {job_id} was uploaded already")
    try:
        source, targets, skipped = await asyncio.to_thread(tm_files.read_file, body, job, svc.graph)
        m = await asyncio.to_thread(reg.create, job["owner"], job["display_name"], source, targets)
    except TranslationError as e:
        reg.update_job(job_id, status="failed", error=e.message)
    except Exception as e:
        reg.update_job(job_id, status="failed", error=f"internal error ({type(e).__name__})")
        raise
    else:
        reg.update_job(job_id, status="completed", tm_id=m.id, skipped=skipped)
    return Response(status_code=200)


@router.get("/v3/translation_memories/files/{job_id}", responses={
    200: {"content": {"application/xml": {}}, "description": "the TMX file"}, **FILE_ERRORS})
async def download_file(job_id: str, request: Request, token: Optional[str] = None, svc: Services = Depends(services)):
    """The export's TMX file, written now from the memory's entries."""
    reg = tms.registry(svc.memory)
    with mapped_errors("memory"):
        job = tms.check_token(reg.job(job_id), token, job_id)
        if job["operation"] != "export":
            raise ServiceError(400, f"job {job_id} is an import: its URL takes the file (PUT)")
        m = reg.get(job["owner"], job["tm_id"], svc.graph)
        data = await asyncio.to_thread(lambda: tm_files.write_tmx(m, reg.segments(m, None, 10 ** 9, None, False)[0]))
    return Response(data, media_type="application/xml",
                    headers={"Content-Disposition": f'attachment; filename="translation_memory_{m.id}.tmx"'})
