"""The routes of what the service stores for its callers (``StoreRoutes``, a mixin of ``gateway.Gateway``):

    GET|POST /v1/glossaries, GET|DELETE /v1/glossaries/{name}   stored glossaries (glossaries.py)
    PUT|GET|DELETE /v1/memory                                   the translation memory (memory.py)

Both are kept per API key (with keys off, one for every caller).
"""
# No `from __future__ import annotations` here: Serve's ingress rebinds the route methods, and FastAPI
# must see the request model classes themselves, not their names.
from fastapi import Request
from fastapi.responses import Response

from service.protocol import ServiceError
from service.replica import mapped_errors
from service.translator import ModelCard
from service.translator.card import match_language
from service.translator.memory import memory_model

from . import glossaries, memory
from .errors import shown
from .routes_common import NATIVE_ERRORS, api, error_responses
from .schemas import ErrorResponse

GLOSSARY_ERRORS = error_responses(ErrorResponse, {
    401: "API keys are on and the request has no valid Authorization: Bearer key",
    403: "DELETE of a shared glossary (loaded from the server's glossary directory)",
    404: "no glossary of that name for this key (nor a shared one)",
    409: "POST: a glossary of that name exists, or two of its entries give one source term different targets",
    413: "POST: the key has MAX_GLOSSARIES glossaries already",
    415: "a Content-Type, charset or Content-Encoding other than the accepted ones",
    422: "invalid fields: a bad name, blank or over-long terms, conflicting entries (the message names them)",
    429: "over the rate limit of this key or client (Retry-After, RateLimit-* headers)"})


class StoreRoutes:
    """The glossary and memory routes, methods of ``gateway.Gateway``: they read its ``glossaries``
    (the cluster's store), ``memory`` (None: off) and ``_scope``, and pick a model with its
    ``resolve`` (``_targets``: the target codes it matches)."""

    # ---- stored glossaries (glossaries.py) ----
    @api.get("/v1/glossaries", response_model=glossaries.GlossaryList, responses=GLOSSARY_ERRORS)
    async def list_glossaries(self, request: Request):
        """The caller's stored glossaries (those of its API key) and the shared ones, without entries."""
        return glossaries.GlossaryList(data=[g.info() for g in await self.glossaries.list(glossaries.scope_of(request))])

    @api.post("/v1/glossaries", status_code=201, response_model=glossaries.GlossaryInfo, responses=GLOSSARY_ERRORS)
    async def create_glossary(self, body: glossaries.GlossaryCreate, request: Request):
        """Store a glossary under a name for the caller's API key; 409 when the name is taken."""
        return (await self.glossaries.create(glossaries.scope_of(request), body)).info()

    @api.get("/v1/glossaries/{name}", response_model=glossaries.GlossaryInfo, responses=GLOSSARY_ERRORS)
    async def get_glossary(self, name: str, request: Request):
        """One stored glossary with its entries."""
        return (await self.glossaries.get(glossaries.scope_of(request), name, "name")).info(with_entries=True)

    @api.delete("/v1/glossaries/{name}", status_code=204, responses=GLOSSARY_ERRORS)
    async def delete_glossary(self, name: str, request: Request):
        """Delete a glossary the caller created (204); 403 for a shared one from the directory."""
        await self.glossaries.delete(glossaries.scope_of(request), name)
        return Response(status_code=204)

    # ---- translation memory (memory.py) ----
    def _memory_target(self, request: Request) -> tuple[ModelCard, str, str]:
        """(card, the store's model key, the memory scope) of a /v1/memory request (query: model, or
        source_lang and target_lang, as /v1/translate picks it; none: the default model). Raises
        ServiceError 403 (memory off), 404, 422."""
        if self.memory is None:
            raise ServiceError(403, "memory: the translation memory is off on this server (suggestions: false)")
        q = request.query_params
        known = {"model", "source_lang", "target_lang", "format", "source"}
        unknown = [k for k in q.keys() if k not in known]
        if unknown:
            raise ServiceError(422, f"query parameter {shown(unknown[0])}: /v1/memory takes model, source_lang, "
                                    "target_lang (and format on GET, source on DELETE)", unknown[0])
        card = self.resolve(q.get("model"), q.get("source_lang"), q.get("target_lang"))
        target = match_language(q.get("target_lang"), self._targets) if card.target_languages else None
        return card, memory_model(card.id, target), self._scope(request) or ""

    @api.put("/v1/memory", response_model=memory.MemoryAnswer, response_model_exclude_none=True, responses=NATIVE_ERRORS, openapi_extra={
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": memory.MemoryImport.model_json_schema()},
            memory.TSV: {"schema": {"type": "string", "description": "source TAB target per line"}},
            memory.TMX: {"schema": {"type": "string", "description": "TMX 1.4"}}}}})
    async def memory_put(self, request: Request):
        """Import entries (TSV, TMX or JSON) into the memory of a model (and the caller's key): each
        source's stored translation is used for it on every route from the next request on."""
        card, key, scope = self._memory_target(request)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        target = key.split(">>")[1] if ">>" in key else card.target_lang
        pairs = memory.read_import(await request.body(), media, card.source_lang, target)
        with mapped_errors("memory"):     # a file that cannot be written: 503 naming it
            memory.check_entries(pairs, self.memory.count(key, scope))
            return memory.MemoryAnswer(model=card.id, stored=self.memory.put(key, scope, pairs, origin="import"))

    @api.get("/v1/memory", responses={200: {"content": {"application/json": {"schema": memory.MemoryAnswer.model_json_schema()},
                                                        memory.TSV: {}, memory.TMX: {}}}, **NATIVE_ERRORS})
    async def memory_get(self, request: Request):
        """Export the memory of a model (and the caller's key): ``format`` json (default), tsv or tmx."""
        card, key, scope = self._memory_target(request)
        target = key.split(">>")[1] if ">>" in key else card.target_lang
        with mapped_errors("memory"):
            body, media = memory.export(self.memory, key, scope, request.query_params.get("format", "json"),
                                        card.source_lang, target)
        return Response(body, media_type=media)

    @api.delete("/v1/memory", response_model=memory.MemoryAnswer, response_model_exclude_none=True, responses=NATIVE_ERRORS)
    async def memory_delete(self, request: Request):
        """Delete the memory of a model (and the caller's key), or with ``source`` that one entry."""
        card, key, scope = self._memory_target(request)
        source = request.query_params.get("source")
        with mapped_errors("memory"):
            return memory.MemoryAnswer(model=card.id, deleted=self.memory.delete(key, scope, None if source is None
                                                                               else [source]))
