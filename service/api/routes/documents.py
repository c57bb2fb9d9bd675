"""The document routes (``router``):

    POST /v1/documents, POST /translate_file, GET /download_file/{name}   documents.py
    POST /v2/document, /v2/document/{id}, /v2/document/{id}/result        DeepL's (deepl_documents.py)
    DELETE /v2/document/{id}                                              cancel (this service's extension)
"""
from fastapi import APIRouter, Depends, Request

from .. import deepl_documents, documents, libre_schemas
from ..schemas import ErrorResponse
from ..services import Services, services
from .common import LIBRE_ERRORS, NATIVE_ERRORS, error_responses

router = APIRouter()


@router.post("/v1/documents", responses={200: documents.FILE_OR_EVENTS, **NATIVE_ERRORS, **error_responses(
    ErrorResponse, {400: "the multipart form: no file part, a field given twice or unknown, unreadable"})},
          openapi_extra={"requestBody": documents.OPENAPI_NATIVE})
async def translate_document(request: Request, svc: Services = Depends(services)):
    """Translate a document (multipart ``file``; ``source_lang`` (a code, auto or absent),
    ``target_lang``, ``model``, ``stream``): .txt .html .md .srt .vtt .docx .pptx .odt, structure
    and formatting kept (docs/documents.md). Answers the translated file; with ``stream=true``, SSE
    ``progress`` {"done", "total"} then ``document`` {"url", "filename", "bytes"}."""
    return await documents.native(svc, request)


@router.post("/translate_file", response_model=documents.TranslatedFileUrl, responses={
              **LIBRE_ERRORS, **error_responses(libre_schemas.LibreError, {
                  404: "source auto: the document's language cannot be told, or no model translates it"})},
          openapi_extra={"requestBody": documents.OPENAPI_LIBRE})
async def libre_translate_file(request: Request, svc: Services = Depends(services)):
    """LibreTranslate: multipart ``file``, ``source`` (or auto), ``target``, ``api_key``; answers
    ``{"translatedFileUrl": ...}`` (GET it while it is kept, with the same key when keys are on)."""
    return await documents.libre(svc, request)


@router.get("/download_file/{name}", responses={200: documents.FILE, **error_responses(ErrorResponse, {
    401: "API keys are on and the request has no valid key (Bearer or ?api_key=)",
    404: "no such file kept: unknown, expired, evicted, or uploaded with another key",
    429: "over the rate limit of this key or client"})})
async def download_file(name: str, request: Request, svc: Services = Depends(services)):
    """A translated file from /translate_file or a streamed /v1/documents, while it is kept;
    with keys on, only with the key that uploaded it (Bearer or ``?api_key=``)."""
    return await documents.download(svc, request, name)


@router.post("/v2/document", response_model=deepl_documents.DocumentHandle, operation_id="deepl_document_upload",
          responses={200: {"links": deepl_documents.UPLOAD_LINKS}, **deepl_documents.ERRORS},
          openapi_extra={"requestBody": deepl_documents.OPENAPI_UPLOAD})
async def deepl_document(request: Request, svc: Services = Depends(services)):
    """DeepL: upload a document to translate; answers ``{"document_id", "document_key"}``."""
    return await deepl_documents.upload(svc, request)


@router.post("/v2/document/{document_id}", response_model=deepl_documents.DocumentStatus,
          operation_id="deepl_document_status",
          responses={200: {"links": deepl_documents.STATUS_LINKS}, **deepl_documents.ERRORS},
          openapi_extra={"requestBody": deepl_documents.OPENAPI_KEY})
async def deepl_document_status(document_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: the status of a document translation (``document_key`` in the body)."""
    return await deepl_documents.status(svc, request, document_id)


@router.post("/v2/document/{document_id}/result", operation_id="deepl_document_result",
          responses={200: documents.FILE, **deepl_documents.ERRORS},
          openapi_extra={"requestBody": deepl_documents.OPENAPI_KEY})
async def deepl_document_result(document_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: the translated document once its status is done (503 before)."""
    return await deepl_documents.result(svc, request, document_id)


@router.delete("/v2/document/{document_id}", status_code=204, operation_id="deepl_document_cancel",
               responses={204: {"description": "cancelled: the translation stopped, the job and its file removed"},
                          **deepl_documents.ERRORS}, openapi_extra={"requestBody": deepl_documents.OPENAPI_KEY})
async def deepl_document_cancel(document_id: str, request: Request, svc: Services = Depends(services)):
    """This service's extension (DeepL has no cancel): stop a document translation, remove the job and
    its file (``document_key`` in the body, with the API key that uploaded it)."""
    return await deepl_documents.cancel(svc, request, document_id)
