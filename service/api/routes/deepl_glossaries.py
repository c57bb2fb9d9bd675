"""DeepL's glossary routes (``router``; deepl_glossaries.py): v2 (one language pair) and v3
(multilingual: dictionaries), over the service's one glossary store, per API key.

    POST|GET /v2/glossaries, GET|DELETE /v2/glossaries/{id}, GET /v2/glossaries/{id}/entries,
    GET /v2/glossary-language-pairs
    POST|GET /v3/glossaries, GET|PATCH|DELETE /v3/glossaries/{id}, GET /v3/glossaries/{id}/entries,
    PUT|DELETE /v3/glossaries/{id}/dictionaries

Errors are DeepL's ``{"message": ...}`` (errors.deepl_error_response).
"""
from fastapi import APIRouter, Depends, Request

from .. import deepl_glossaries as dg
from ..deepl_documents import DeepLError
from ..fields import openapi_request_body
from ..services import Services, services

router = APIRouter()

ERRORS = {status: {"model": DeepLError, "description": what} for status, what in {
    400: "invalid input, the message naming the field (and the entries' line): a missing name or language, a pair "
         "no model serves, entries with a duplicate source, an empty side, a tab in a term, over the limits",
    403: "API keys are on and no valid key was sent (Authorization: DeepL-Auth-Key)",
    404: "no glossary (or dictionary) of that id for this key",
    409: "the stored name of a new dictionary is taken by another glossary",
    413: "a body over its limit, or the key has MAX_GLOSSARIES glossaries (dictionaries) already",
    415: "a Content-Type the route does not read; entries: an Accept other than text/tab-separated-values",
    429: "over the rate limit of this key or client"}.items()}
NOT_FOUND = {k: v for k, v in ERRORS.items() if k in (403, 404, 429)}
_LANG = {"type": "string", "minLength": 1, "pattern": r"[^\s\x1c-\x1f\x85]",    # blank (str.strip): not specified
         "description": "DeepL's code (EN, DE, ...): GET /v2/glossary-language-pairs"}
_DICTIONARY = {"type": "object", "required": ["source_lang", "target_lang", "entries"], "properties": {
    "source_lang": _LANG, "target_lang": _LANG,
    "entries": {"type": "string", "minLength": 1, "description": "TSV (source TAB target a line) or CSV "
                                                                  "(source,target[,source_lang,target_lang])"},
    "entries_format": {"type": "string", "enum": list(dg.FORMATS), "default": "tsv"}}}
_NAME = {"type": "string", "minLength": 1, "description": f"at most {dg.MAX_TERM_BYTES} UTF-8 bytes"}
V2_BODY = openapi_request_body({**_DICTIONARY, "required": ["name", *_DICTIONARY["required"]],
                                "properties": {"name": _NAME, **_DICTIONARY["properties"]}},
                               ("application/json", "application/x-www-form-urlencoded"))
V3_BODY = openapi_request_body({"type": "object", "required": ["name", "dictionaries"], "properties": {
    "name": _NAME, "dictionaries": {"type": "array", "minItems": 1, "items": _DICTIONARY}}}, ("application/json",))
PATCH_BODY = openapi_request_body({"type": "object", "properties": {
    "name": _NAME, "dictionaries": {"type": "array", "items": _DICTIONARY,
                                    "description": "merged into the dictionaries of their pairs"}}},
                                  ("application/json",))
PUT_BODY = openapi_request_body(_DICTIONARY, ("application/json", "application/x-www-form-urlencoded"))
PAIR_QUERY = [{"name": n, "in": "query", "required": True, "schema": _LANG} for n in ("source_lang", "target_lang")]


# ---- v2 --------------------------------------------------------------------------------------------
@router.post("/v2/glossaries", status_code=201, responses={201: {"description": "the glossary"}, **ERRORS},
             openapi_extra={"requestBody": V2_BODY})
async def create_glossary_v2(request: Request, svc: Services = Depends(services)):
    """DeepL: create a glossary of one pair (``name``, ``source_lang``, ``target_lang``, ``entries``,
    ``entries_format`` tsv|csv)."""
    return await dg.create_v2(svc, request)


@router.get("/v2/glossaries", responses=NOT_FOUND)
async def list_glossaries_v2(request: Request, svc: Services = Depends(services)):
    """DeepL: the key's glossaries of one pair (``{"glossaries": [...]}``, without entries)."""
    return await dg.list_v2(svc, request)


@router.get("/v2/glossaries/{glossary_id}", responses={**NOT_FOUND, 400: ERRORS[400]})
async def get_glossary_v2(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: one glossary of one pair, without entries."""
    return dg.v2_info(await dg.get_v2(svc, request, glossary_id))


@router.get("/v2/glossaries/{glossary_id}/entries", responses={
    200: {"content": {dg.TSV: {"schema": {"type": "string"}}}}, **NOT_FOUND, 400: ERRORS[400], 415: ERRORS[415]})
async def glossary_entries_v2(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: a glossary's entries, source TAB target a line."""
    return await dg.entries_v2(svc, request, glossary_id)


@router.delete("/v2/glossaries/{glossary_id}", status_code=204, responses={204: {"description": "deleted"},
                                                                           **NOT_FOUND})
async def delete_glossary_v2(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: delete a glossary."""
    return await dg.delete(svc, request, glossary_id)


@router.get("/v2/glossary-language-pairs", responses=NOT_FOUND)
async def glossary_language_pairs(svc: Services = Depends(services)):
    """DeepL: the pairs a glossary may have: those the served models (and pivot routes) translate."""
    return {"supported_languages": [{"source_lang": s, "target_lang": t} for s, t in dg.served_pairs(svc)]}


# ---- v3 --------------------------------------------------------------------------------------------
@router.post("/v3/glossaries", status_code=201, responses={201: {"description": "the glossary"}, **ERRORS},
             openapi_extra={"requestBody": V3_BODY})
async def create_glossary_v3(request: Request, svc: Services = Depends(services)):
    """DeepL: create a glossary of one or more dictionaries (``name``, ``dictionaries``)."""
    return await dg.create_v3(svc, request)


@router.get("/v3/glossaries", responses=NOT_FOUND)
async def list_glossaries_v3(request: Request, svc: Services = Depends(services)):
    """DeepL: the key's glossaries with their dictionaries' pairs and sizes."""
    return {"glossaries": [dg.v3_info(gs) for gs in await dg.groups(svc, request)]}


@router.get("/v3/glossaries/{glossary_id}", responses=NOT_FOUND)
async def get_glossary_v3(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: one glossary with its dictionaries' pairs and sizes."""
    return dg.v3_info(await dg.group(svc, request, glossary_id))


@router.get("/v3/glossaries/{glossary_id}/entries", responses={**NOT_FOUND, 400: ERRORS[400]},
            openapi_extra={"parameters": PAIR_QUERY})
async def glossary_entries_v3(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: the entries of the dictionary ``source_lang`` -> ``target_lang``, as TSV in JSON."""
    return await dg.entries_v3(svc, request, glossary_id)


@router.patch("/v3/glossaries/{glossary_id}", responses=ERRORS, openapi_extra={"requestBody": PATCH_BODY})
async def patch_glossary_v3(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: rename a glossary (``name``) and/or merge entries into its dictionaries (``dictionaries``)."""
    return await dg.patch_v3(svc, request, glossary_id)


@router.put("/v3/glossaries/{glossary_id}/dictionaries", responses=ERRORS, openapi_extra={"requestBody": PUT_BODY})
async def replace_dictionary_v3(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: replace (or add) the dictionary of the body's pair."""
    return await dg.replace_dictionary(svc, request, glossary_id)


@router.delete("/v3/glossaries/{glossary_id}/dictionaries", status_code=204,
               responses={204: {"description": "deleted"}, **NOT_FOUND, 400: ERRORS[400]},
               openapi_extra={"parameters": PAIR_QUERY})
async def delete_dictionary_v3(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: delete the dictionary ``source_lang`` -> ``target_lang`` (not a glossary's last one)."""
    return await dg.delete_dictionary(svc, request, glossary_id)


@router.delete("/v3/glossaries/{glossary_id}", status_code=204, responses={204: {"description": "deleted"},
                                                                           **NOT_FOUND})
async def delete_glossary_v3(glossary_id: str, request: Request, svc: Services = Depends(services)):
    """DeepL: delete a glossary and its dictionaries."""
    return await dg.delete(svc, request, glossary_id)
