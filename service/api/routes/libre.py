"""The LibreTranslate-compatible routes (``router``):

    GET  /languages, POST /translate, POST /detect   libretranslate.py
    GET  /frontend/settings, POST /suggest           suggest.py

Errors are LibreTranslate's ``{"error": message}`` (``LIBRE_ERRORS``); /translate_file is with the
other document routes (routes_documents.py).
"""
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from service.protocol import ServiceError

from .. import fields as fields_module
from .. import libre_schemas, libretranslate, suggest
from ..errors import libre_error_response
from ..schemas import LibreLanguage
from ..services import Services, services
from .common import LIBRE_ERRORS, error_responses

router = APIRouter()


@router.get("/languages", response_model=list[LibreLanguage], response_model_exclude_none=True,
         responses=LIBRE_ERRORS)
async def languages(request: Request, svc: Services = Depends(services)):
    """LibreTranslate: every language with the codes it translates into (those reached through
    a pivot language too, named in ``via``). It reads no parameter: any sent is named in the
    X-Ignored-Fields header."""
    try:
        fields = await fields_module.read_fields(request, (), 400, single=())
    except ServiceError as e:
        return libre_error_response(e)
    langs = libretranslate.languages(svc.graph.cards.values(), svc.graph.pivots.values())
    return JSONResponse([lang.model_dump(exclude_none=True) for lang in langs],
                        headers=libretranslate.ignored_fields_header(fields, ()))

@router.post("/translate", response_model=libre_schemas.LibreTranslateAnswer, responses={
              **LIBRE_ERRORS, **error_responses(libre_schemas.LibreError, {
                  404: "glossary_id names no stored glossary, or source auto finds no model for the text's "
                       "language",
                  409: "glossary_id names a glossary of other languages than the model's"})},
          openapi_extra={"requestBody": libre_schemas.openapi_request_body()})   # languages: openapi_document
async def libre_translate(request: Request, svc: Services = Depends(services)):
    """LibreTranslate: ``q`` (string or list), ``source`` (a code, or ``auto``: each text's language
    detected), ``target``, ``format`` (text|html), ``alternatives``, ``api_key`` as JSON,
    form-urlencoded or multipart form. Answers ``{"translatedText": ...}`` (plus ``alternatives``
    when asked, ``detectedLanguage`` with auto); errors ``{"error": message}``.
    """
    return await libretranslate.translate(request, svc)

@router.post("/detect", response_model=list[libre_schemas.LibreDetection], responses=LIBRE_ERRORS,
          openapi_extra={"requestBody": libre_schemas.openapi_request_body(libre_schemas.LibreDetectBody)})
async def libre_detect(request: Request, svc: Services = Depends(services)):
    """LibreTranslate: the language of ``q`` (a string; a list: each language's mean over the
    texts) as ``[{"confidence": 0-100, "language": code}]``, best first; ``[{"confidence": 0.0,
    "language": "und"}]`` for text without letters. ``q`` and ``api_key`` as JSON or a form."""
    return await libretranslate.detect(request, svc.detector)

@router.get("/frontend/settings", response_model=suggest.FrontendSettings)
async def frontend_settings(svc: Services = Depends(services)):
    """LibreTranslate: the settings its web page reads (limits, keys, suggestions, files, default languages)."""
    return suggest.frontend_settings(list(svc.graph.cards.values()), svc.guard.keys_on, svc.memory is not None)

@router.post("/suggest", response_model=suggest.SuggestAnswer, responses={**LIBRE_ERRORS, **error_responses(
              libre_schemas.LibreError, {403: "suggestions are off on this server (suggestions: false)"})},
          openapi_extra={"requestBody": libre_schemas.openapi_request_body(suggest.SuggestBody)})
async def libre_suggest(request: Request, svc: Services = Depends(services)):
    """LibreTranslate: store ``s`` as the translation of ``q`` (``source`` -> ``target``) in the
    translation memory of that model (and of the caller's key): the next request holding ``q`` as
    a text or a sentence gets ``s`` on every route. ``{"success": true}``."""
    return await suggest.suggest(request, svc.graph, svc.memory)
