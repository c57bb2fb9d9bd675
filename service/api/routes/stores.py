"""The routes of what the service stores for its callers (``router``):

    GET|POST /v1/glossaries, GET|DELETE /v1/glossaries/{name}   stored glossaries (glossaries.py)
    PUT|GET|DELETE /v1/memory                                   the translation memory (memory.py)

Both are kept per API key (with keys off, one for every caller).
"""
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from service.protocol import ServiceError, shown
from service.replica import mapped_errors
from service.translator import ModelCard
from service.translator.memory import memory_model

from .. import glossaries, memory
from ..schemas import ErrorResponse
from ..services import Services, services
from .common import NATIVE_ERRORS, error_responses

GLOSSARY_ERRORS = error_responses(ErrorResponse, {
    401: "API keys are on and the request has no valid Authorization: Bearer key",
    403: "DELETE of a shared glossary (loaded from the server's glossary directory)",
    404: "no glossary of that name for this key (nor a shared one)",
    409: "POST: a glossary of that name exists, or two of its entries give one source term different targets",
    413: "POST: the key has MAX_GLOSSARIES glossaries already",
    415: "a Content-Type, charset or Content-Encoding other than the accepted ones",
    422: "invalid fields: a bad name, blank or over-long terms, conflicting entries, languages not served (the "
         "message names them)",
    429: "over the rate limit of this key or client (Retry-After, RateLimit-* headers)"})


router = APIRouter()


# ---- stored glossaries (glossaries.py) ----
@router.get("/v1/glossaries", response_model=glossaries.GlossaryList, responses=GLOSSARY_ERRORS)
async def list_glossaries(request: Request, svc: Services = Depends(services)):
    """The caller's stored glossaries (those of its API key) and the shared ones, without entries."""
    return glossaries.GlossaryList(data=[g.info() for g in await svc.glossaries.list(glossaries.scope_of(request))])


@router.post("/v1/glossaries", status_code=201, response_model=glossaries.GlossaryInfo, responses=GLOSSARY_ERRORS)
async def create_glossary(body: glossaries.GlossaryCreate, request: Request, svc: Services = Depends(services)):
    """Store a glossary under a name for the caller's API key; 409 when the name is taken; 422 for
    languages no served model translates."""
    glossaries.check_served(body, svc.graph.pairs())
    return (await svc.glossaries.create(glossaries.scope_of(request), body)).info()


@router.get("/v1/glossaries/{name}", response_model=glossaries.GlossaryInfo, responses=GLOSSARY_ERRORS)
async def get_glossary(name: str, request: Request, svc: Services = Depends(services)):
    """One stored glossary with its entries."""
    return (await svc.glossaries.get(glossaries.scope_of(request), name, "name")).info(with_entries=True)


@router.delete("/v1/glossaries/{name}", status_code=204, responses=GLOSSARY_ERRORS)
async def delete_glossary(name: str, request: Request, svc: Services = Depends(services)):
    """Delete a glossary the caller created (204); 403 for a shared one from the directory."""
    await svc.glossaries.delete(glossaries.scope_of(request), name)
    return Response(status_code=204)

# ---- translation memory (memory.py) ----
def _memory_target(request: Request, svc: Services) -> tuple[ModelCard, str, str, str, str]:
    """(card, the store's model key, the memory scope, source and target language) of a /v1/memory
    request (query: model, or source_lang and target_lang, as /v1/translate picks it; none: the
    default model; an NLLB-200 / M2M100 / mBART-50 / T5 model: the pair named, its memory keyed by
    the target). Raises ServiceError 403 (memory off), 404, 422."""
    if svc.memory is None:
        raise ServiceError(403, "memory: the translation memory is off on this server (suggestions: false)")
    q = request.query_params
    known = {"model", "source_lang", "target_lang", "format", "source"}
    unknown = [k for k in q.keys() if k not in known]
    if unknown:
        raise ServiceError(422, f"query parameter {shown(unknown[0])}: /v1/memory takes model, source_lang, "
                                "target_lang (and format on GET, source on DELETE)", unknown[0])
    card = svc.graph.resolve(q.get("model"), q.get("source_lang"), q.get("target_lang"))
    target = svc.graph.code(q.get("target_lang"), svc.graph.targets) if card.target_languages else None
    source = svc.graph.code(q.get("source_lang"), svc.graph.sources) if card.lang_tokens else card.source_lang
    return card, memory_model(card.id, target), svc.memory_scope(request) or "", source, target or card.target_lang


@router.put("/v1/memory", response_model=memory.MemoryAnswer, response_model_exclude_none=True, responses=NATIVE_ERRORS, openapi_extra={
    "requestBody": {"required": True, "content": {
        "application/json": {"schema": memory.MemoryImport.model_json_schema()},
        memory.TSV: {"schema": {"type": "string", "description": "source TAB target per line"}},
        memory.TMX: {"schema": {"type": "string", "description": "TMX 1.4"}}}}})
async def memory_put(request: Request, svc: Services = Depends(services)):
    """Import entries (TSV, TMX or JSON) into the memory of a model (and the caller's key): each
    source's stored translation is used for it on every route from the next request on."""
    card, key, scope, source, target = _memory_target(request, svc)
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    pairs = memory.read_import(await request.body(), media, source, target)
    with mapped_errors("memory"):     # a file that cannot be written: 503 naming it
        memory.check_entries(pairs, svc.memory.count(key, scope))
        return memory.MemoryAnswer(model=card.id, stored=svc.memory.put(key, scope, pairs, origin="import"))


@router.get("/v1/memory", responses={200: {"content": {"application/json": {"schema": memory.MemoryAnswer.model_json_schema()},
                                                    memory.TSV: {}, memory.TMX: {}}}, **NATIVE_ERRORS})
async def memory_get(request: Request, svc: Services = Depends(services)):
    """Export the memory of a model (and the caller's key): ``format`` json (default), tsv or tmx."""
    card, key, scope, source, target = _memory_target(request, svc)
    with mapped_errors("memory"):
        body, media = memory.export(svc.memory, key, scope, request.query_params.get("format", "json"),
                                    source, target)
    return Response(body, media_type=media)


@router.delete("/v1/memory", response_model=memory.MemoryAnswer, response_model_exclude_none=True, responses=NATIVE_ERRORS)
async def memory_delete(request: Request, svc: Services = Depends(services)):
    """Delete the memory of a model (and the caller's key), or with ``source`` that one entry."""
    card, key, scope, _, _ = _memory_target(request, svc)
    source = request.query_params.get("source")
    with mapped_errors("memory"):
        return memory.MemoryAnswer(model=card.id, deleted=svc.memory.delete(key, scope, None if source is None
                                                                           else [source]))
