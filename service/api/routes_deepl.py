"""The DeepL-compatible routes (``DeepLRoutes``, a mixin of ``gateway.Gateway``; deepl.py):

    POST /v2/translate, GET|POST /v2/languages, GET|POST /v2/usage

Errors are DeepL's ``{"message": ...}``; its document routes are in routes_documents.py.
"""
# No `from __future__ import annotations` here: Serve's ingress rebinds the route methods, and FastAPI
# must see the request model classes themselves, not their names.
from fastapi import Request
from fastapi.responses import JSONResponse

from service.protocol import ServiceError
from service.replica import mapped_errors

from . import body as body_module
from . import deepl, glossaries, libretranslate
from .routes_common import RETRY_HEADERS, api


class DeepLRoutes:
    """DeepL's routes, methods of ``gateway.Gateway``: they read its ``cards``, ``limits``,
    ``detector``, ``glossaries`` and ``memory`` (the usage count's store; None: counted in this
    replica), and pick a model with its ``resolve``."""

    @api.post("/v2/translate", responses={200: {"description": '{"translations": [{"detected_source_language", '
                                                               '"text", "billed_characters"}]}'},
                                          400: {"description": 'invalid input: {"message": ...} naming the field'},
                                          403: {"description": "no or a wrong DeepL-Auth-Key (keys on)"},
                                          404: {"description": "glossary_id names no stored glossary"},
                                          409: {"description": "glossary_id names a glossary of other languages"},
                                          413: {"description": "a text or the body over its limit"},
                                          429: {"description": "over the rate limit"},
                                          503: {"description": "overloaded or loading", "headers": RETRY_HEADERS}},
              openapi_extra={"requestBody": libretranslate.openapi_request_body(deepl.DeepLTranslateBody)})
    async def deepl_translate(self, request: Request):
        """DeepL: translate ``text`` (repeated) into ``target_lang`` (``source_lang`` absent: detected),
        ``tag_handling`` html|xml, ``split_sentences`` 0|1|nonewlines; answers ``{"translations": [...]}``."""
        try:
            fields = await body_module.read_fields(request, deepl.LIST_FIELDS, 400, single=deepl.SINGLE_FIELDS)
        except ServiceError as e:
            return deepl.error_response(e)
        body = deepl.parse(fields)
        scope = glossaries.scope_of(request)
        ctx = deepl.Context(list(self.cards.values()), self.limits, lambda s, t: self.resolve(None, s, t),
                            self._scoped(request), self.detector,
                            glossary=lambda name, s, t: self.glossaries.resolve(scope, name, s, t))
        translations, chars = await deepl.translate(body, ctx)
        self._count_usage(request, chars)
        return JSONResponse({"translations": translations}, headers=deepl.ignored(body, fields))

    def _count_usage(self, request: Request, chars: int) -> None:
        """Add ``chars`` to the caller's /v2/usage count: in the memory's store, else in this replica."""
        if self.memory is not None:
            with mapped_errors("memory"):
                self.memory.add_usage(self._scope(request) or "", chars)
        else:
            self._usage = getattr(self, "_usage", 0) + chars

    @api.get("/v2/languages", responses={400: {"description": 'type other than source or target: {"message"}'}})
    @api.post("/v2/languages", responses={400: {"description": 'type other than source or target: {"message"}'}})
    async def deepl_languages(self, request: Request):
        """DeepL: ``[{"language", "name"(, "supports_formality")}]`` for ``type`` source (default) or target."""
        fields = await body_module.read_fields(request, (), 400)     # the query, or a form body (the client sends
        kind = deepl.source_or_target(fields.get("type"))      # one with GET too)
        return deepl.languages(self.cards.values(), kind)

    @api.get("/v2/usage")
    @api.post("/v2/usage")
    async def deepl_usage(self, request: Request):
        """DeepL: ``{"character_count", "character_limit"}``: characters this key (keys off: everyone) sent to
        /v2/translate; no limit (DeepL Pro's figure for none)."""
        with mapped_errors("memory"):
            chars = (self.memory.usage(self._scope(request) or "") if self.memory is not None
                     else getattr(self, "_usage", 0))
        return deepl.usage(chars)
