"""LibreTranslate's remaining routes: ``GET /frontend/settings`` and ``POST /suggest``.

    GET  /frontend/settings   {"charLimit", "frontendTimeout", "apiKeys", "keyRequired", "suggestions",
                               "filesTranslation", "supportedFilesFormat", "language": {"source": {"code",
                               "name"}, "target": {"code", "name"}}}, as LibreTranslate's app.py answers it
    POST /suggest             q (the source text), s (its corrected translation), source, target,
                              api_key; JSON or a form. Stores s for q in the translation memory of the
                              model source -> target (and of the caller's key): the next request with q
                              (or a sentence equal to it) gets s on every route. {"success": true};
                              with suggestions off 403 {"error": "Suggestions are disabled on this server."}
"""
from __future__ import annotations

from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from service.documents import EXTENSIONS
from service.pipeline import LanguageGraph
from service.pipeline.autodetect import NAMES
from service.protocol import MAX_TEXT_CHARS, ServiceError
from service.replica import mapped_errors
from service.translator import ModelCard
from service.translator.card import match_language
from service.translator.memory import MemoryStore, memory_model, normalize

from .errors import libre_error_response
from .libretranslate import ignored_fields_header, pick, read_admitted
from .memory import check_entries
from .middleware.caller import caller_of
from .schemas import check_unicode

FRONTEND_TIMEOUT_MS = 500        # LibreTranslate's default: the page waits this long after typing
SUGGEST_FIELDS = ("q", "s", "source", "target", "api_key")
SUPPORTED_FILE_FORMATS: list[str] = list(EXTENSIONS)   # file extensions /translate_file takes (".docx", ...)


class SuggestBody(BaseModel):
    """POST /suggest, as JSON, application/x-www-form-urlencoded or multipart/form-data."""
    q: str = Field(..., min_length=1, max_length=MAX_TEXT_CHARS, description="the original text")
    s: str = Field(..., min_length=1, max_length=MAX_TEXT_CHARS, description="its suggested translation")
    source: str = Field(..., min_length=1, description="language of q (not auto)")
    target: str = Field(..., min_length=1, description="language of s")
    api_key: Optional[str] = None


class SuggestAnswer(BaseModel):
    success: bool


class FrontendLanguage(BaseModel):
    code: str
    name: str


class FrontendLanguages(BaseModel):
    source: FrontendLanguage
    target: FrontendLanguage


class FrontendSettings(BaseModel):
    charLimit: int = Field(..., description="characters per text")
    frontendTimeout: int = Field(..., description="milliseconds")
    apiKeys: bool
    keyRequired: bool
    suggestions: bool
    filesTranslation: bool
    supportedFilesFormat: list[str]
    language: FrontendLanguages


def frontend_settings(cards: list[ModelCard], keys_on: bool, suggestions: bool) -> FrontendSettings:
    """GET /frontend/settings: the limits, whether a key is needed, suggestions and files, and the
    page's default languages (auto -> the default model's target)."""
    target = cards[0].targets[0] if cards[0].targets else cards[0].target_lang
    return FrontendSettings(charLimit=MAX_TEXT_CHARS, frontendTimeout=FRONTEND_TIMEOUT_MS, apiKeys=keys_on,
                            keyRequired=keys_on, suggestions=suggestions,
                            filesTranslation=bool(SUPPORTED_FILE_FORMATS),
                            supportedFilesFormat=list(SUPPORTED_FILE_FORMATS),
                            language=FrontendLanguages(source=FrontendLanguage(code="auto", name="Auto Detect"),
                                                       target=FrontendLanguage(code=target,
                                                                               name=NAMES.get(target, target))))


def _text_field(fields: dict, name: str) -> str:
    value = fields.get(name)
    if value is None:
        raise ServiceError(400, f"Invalid request: missing {name} parameter", name)
    if value == "" or value == []:
        raise ServiceError(400, f"Invalid request: empty {name} parameter", name)
    if not isinstance(value, str):
        raise ServiceError(400, f"Invalid request: {name} must be a string", name)
    if name in ("q", "s") and len(value) > MAX_TEXT_CHARS:
        raise ServiceError(400, f"Invalid request: {name}: at most {MAX_TEXT_CHARS} characters, got {len(value)}", name)
    try:
        check_unicode([value], name)
    except ValueError as e:
        raise ServiceError(400, str(e), name) from None
    return value


async def suggest(request: Request, graph: LanguageGraph, store: Optional[MemoryStore]) -> JSONResponse:
    """POST /suggest (see the module docstring): stored in the memory of the caller, which is known
    once its key is checked (in the body, LibreTranslate's ``api_key``, or a header). Raises nothing:
    errors are LibreTranslate's answers; 413 (as 400) past MAX_MEMORY_ENTRIES for the model and key."""
    try:
        fields, denied = await read_admitted(request)
        if denied is not None:
            return denied
        scope = caller_of(request).scope
        if store is None:
            raise ServiceError(403, "Suggestions are disabled on this server.")
        q, s, source, target = (_text_field(fields, n) for n in ("q", "s", "source", "target"))
        if fields.get("api_key") is not None and not isinstance(fields["api_key"], str):
            raise ServiceError(400, "Invalid request: api_key must be a string", "api_key")
        sources = set(graph.sources)
        targets = {t for c in graph.cards.values() for t in c.targets}
        if source.strip().lower() == "auto":
            raise ServiceError(400, "Invalid request: source auto is not supported here: a suggestion names the "
                                    f"language of q (one of {', '.join(sorted(sources))})", "source")
        source, target = match_language(source, sources), match_language(target, targets | graph.targets)
        route = graph.routes.get((source, target))
        if route is not None:       # no model of its own: its translations come from the legs' memories
            legs = ", ".join(f"{c.card.source_lang}->{c.card.target_lang}" for c in route.legs)
            raise ServiceError(400, f"Invalid request: {route.describe()} has no model of its own, and suggestions "
                                    f"are stored per model: send one for each pair of its legs ({legs})", "target")
        card = pick(graph, source, target, direct=True)
        request.state.model = card.id
        model = memory_model(card.id, match_language(target, targets) if card.target_languages else None)
        with mapped_errors("memory"):     # a file that cannot be written: 503 naming it
            new = [] if store.lookup(model, scope, [normalize(q)]) else [(q, s)]
            check_entries(new, store.count(model, scope))
            store.put(model, scope, [(q, s)])
    except ServiceError as e:
        return libre_error_response(e)
    return JSONResponse({"success": True}, headers=ignored_fields_header(fields, SUGGEST_FIELDS))
