"""The DeepL-compatible routes (``router``; deepl.py):

    POST /v2/translate, GET|POST /v2/languages, GET|POST /v2/usage
    /v2/write/*, /v3/style_rules(/*)   any method: 404 naming the feature as not offered here (not in the
                                       OpenAPI document: nothing is served there)

Errors are DeepL's ``{"message": ...}``; its document routes are in routes_documents.py.
"""
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from service.protocol import ServiceError
from service.replica import mapped_errors

from .. import deepl, libre_schemas
from .. import fields as fields_module
from ..middleware.caller import caller_of
from ..services import Services, services
from .common import RETRY_HEADERS

router = APIRouter()


@router.post("/v2/translate", responses={200: {"description": '{"translations": [{"detected_source_language", '
                                                             '"text", "billed_characters"(, "model_type_used")}]}'},
                                        400: {"description": 'invalid input, or style_id / custom_instructions (not '
                                                             'offered here): {"message": ...} naming the field'},
                                        403: {"description": "no or a wrong DeepL-Auth-Key (keys on)"},
                                        404: {"description": "glossary_id names no stored glossary"},
                                        409: {"description": "glossary_id names a glossary of other languages"},
                                        413: {"description": "a text or the body over its limit"},
                                        429: {"description": "over the rate limit"},
                                        503: {"description": "overloaded or loading", "headers": RETRY_HEADERS}},
             openapi_extra={"requestBody": libre_schemas.openapi_request_body(deepl.DeepLTranslateBody)})
async def deepl_translate(request: Request, svc: Services = Depends(services)):
    """DeepL: translate ``text`` (repeated) into ``target_lang`` (``source_lang`` absent: detected),
    ``tag_handling`` html|xml, ``split_sentences`` 0|1|nonewlines; answers ``{"translations": [...]}``."""
    try:
        fields = await fields_module.read_fields(request, deepl.LIST_FIELDS, 400, single=deepl.SINGLE_FIELDS)
    except ServiceError as e:
        return deepl.error_response(e)
    body = deepl.parse(fields)
    translations, chars = await deepl.translate(body, request, svc)
    svc.add_usage(caller_of(request).scope, chars)
    return JSONResponse({"translations": translations}, headers=deepl.ignored(body, fields))


@router.get("/v2/languages", responses={400: {"description": 'type other than source or target: {"message"}'}})
@router.post("/v2/languages", responses={400: {"description": 'type other than source or target: {"message"}'}})
async def deepl_languages(request: Request, svc: Services = Depends(services)):
    """DeepL: ``[{"language", "name"(, "supports_formality")}]`` for ``type`` source (default) or target."""
    fields = await fields_module.read_fields(request, (), 400)     # the query, or a form body (the client sends
    kind = deepl.source_or_target(fields.get("type"))      # one with GET too)
    return deepl.languages(svc.graph.cards.values(), kind)


@router.get("/v2/usage")
@router.post("/v2/usage")
async def deepl_usage(request: Request, svc: Services = Depends(services)):
    """DeepL: ``{"character_count", "character_limit"}``: characters this key (keys off: everyone) had
    translated by /v2/translate and /v2/document (billed when the document is done); no limit (DeepL
    Pro's figure for none)."""
    with mapped_errors("memory"):
        chars = (svc.memory.usage(svc.memory_scope(request) or "") if svc.memory is not None
                 else svc.usage_chars)
    return deepl.usage(chars)


ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE"]


@router.api_route("/v2/write", methods=ANY_METHOD, include_in_schema=False)
@router.api_route("/v2/write/{rest:path}", methods=ANY_METHOD, include_in_schema=False)
async def deepl_write(request: Request):
    """DeepL Write (rephrase, correct): not offered (deepl.NOT_OFFERED_ROUTES)."""
    return deepl.not_offered("/v2/write", request)


@router.api_route("/v3/style_rules", methods=ANY_METHOD, include_in_schema=False)
@router.api_route("/v3/style_rules/{rest:path}", methods=ANY_METHOD, include_in_schema=False)
async def deepl_style_rules(request: Request):
    """DeepL's style rules: not offered (deepl.NOT_OFFERED_ROUTES)."""
    return deepl.not_offered("/v3/style_rules", request)
