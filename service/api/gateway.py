"""The HTTP ingress (FastAPI on Ray Serve): validates, resolves the model, checks its limits, sends
a ``TranslateJob`` to that model's translator and answers JSON or Server-Sent Events.

``Gateway`` (here) holds the native API and the service's own routes; it inherits each other route
group from a mixin in its own module. All register on the one app, ``routes_common.api``.

    gateway.py (Gateway)
    POST /v1/translate        native API (TranslateRequest -> TranslateResponse, or SSE)
    GET  /v1/models           served models, their languages, config, engine settings, test BLEU
    GET  /healthz, /readyz    liveness; readiness of every model
    GET  /metrics             Prometheus text of the whole cluster (service/metrics.py)
    GET  /, /explorer/{name}  the attention explorer page and its files (explorer.py)
    routes_libre.py (LibreRoutes)
    POST /translate, GET /languages, POST /detect   LibreTranslate-compatible (libretranslate.py)
    GET  /frontend/settings, POST /suggest          LibreTranslate's other routes (suggest.py)
    routes_stores.py (StoreRoutes)
    GET|POST /v1/glossaries, GET|DELETE /v1/glossaries/{name}   stored glossaries (glossaries.py)
    PUT|GET|DELETE /v1/memory  the translation memory: import, export, delete (memory.py)
    routes_deepl.py (DeepLRoutes)
    POST /v2/translate, GET|POST /v2/languages, /v2/usage  DeepL-compatible (deepl.py)
    routes_documents.py (DocumentRoutes)
    POST /v1/documents, POST /translate_file, GET /download_file/{name}   documents (documents.py)
    POST /v2/document, /v2/document/{id}, /v2/document/{id}/result        DeepL's (deepl_documents.py)
    across the groups
    source_lang / source "auto": each text's language detected, the text sent to its model (autodetect.py)
    a pair no model serves, but X -> target and source -> X do: two legs through X (pivot.py)
    (HEAD on every GET route: the same status and headers, no body; body.HeadMiddleware)
    CORS: preflights answered and Access-Control-* headers on every route (cors.py)
"""
# No `from __future__ import annotations` here: Serve's ingress rebinds the route methods, and FastAPI
# must see the request model classes themselves, not their names.
import asyncio
import dataclasses
import threading
import time
import types
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from service.engine import EngineConfig
from service.engine.validation import ModelLimits
from service.metrics import GuardMetrics, RetryMetrics, scrape_metrics
from service.pipeline import autodetect, pivot
from service.protocol import RETRY_AFTER_S, ServiceError, TranslateResponse
from service.replica import mapped_errors
from service.translator import ModelCard
from service.translator.card import match_language
from service.translator.langid import LanguageDetector
from service.translator.memory import MemoryStore

from . import body as body_module
from . import explorer, glossaries, libretranslate, openapi, sse
from .access_log import flush_serve_log
from .backends import Backend, LocalBackend, PoolBackend, RemoteBackend
from .document_store import DocumentSettings, DocumentStore
from .errors import short_name, shown
from .guard import Guard, GuardSettings
from .routes_common import NATIVE_ERRORS, RETRY_HEADERS, api
from .routes_deepl import DeepLRoutes
from .routes_documents import DocumentRoutes
from .routes_libre import LibreRoutes

# The route groups register on ``api`` as these modules are imported, in this order (the OpenAPI
# document lists them so), and before Gateway's own routes.
from .routes_stores import StoreRoutes
from .schemas import ModelInfo, ModelsResponse, PivotInfo, TranslateRequest

READY_PROBE_S = 1.0     # /readyz: how long a model may take to say it is ready before it counts as loading

READY_SCHEMA = {"type": "object", "required": ["status", "models"], "properties": {
    "status": {"type": "string", "enum": ["ready", "loading"]},
    "models": {"type": "object", "additionalProperties": {"type": "string", "enum": ["ready", "loading"]}}}}
SSE_CONTENT = {"text/event-stream": {"schema": {   # one event (OpenAPI < 3.2: `schema` describes each event)
    "type": "object", "required": ["event", "data"], "description": (
        'with "stream": true: `token` per text delta, then `response` with the TranslateResponse; '
        '`error` (an ErrorResponse) if it fails midway'),
    "properties": {"event": {"type": "string", "enum": ["token", "response", "error"]},
                   "data": {"type": "string", "contentMediaType": "application/json",
                            "description": 'token: {"index", "text", "token"}; response: TranslateResponse; '
                                           "error: ErrorResponse"}}}}}

body_module.ROUTE_MODELS["/v1/translate"] = TranslateRequest     # FastAPI parses it; the middleware names long integers


def openapi_document(app: FastAPI) -> dict:
    """GET /openapi.json: FastAPI's document, with the request bodies as this replica's models and
    settings accept them (``openapi.complete``); built once per replica. (A method of the app, not a
    function of the module's ``api``: Serve serves a copy of it.)"""
    if app.openapi_schema is None:
        try:
            gateway = serve.get_replica_context().servable_object
        except Exception:  # noqa: BLE001 - not in a Serve replica: no served models
            gateway = None
        app.openapi_schema = openapi.complete(FastAPI.openapi(app), gateway)
    return app.openapi_schema


api.openapi = types.MethodType(openapi_document, api)


def _checked_target(card: ModelCard, target_lang: Optional[str]) -> ModelCard:
    """The card, once a multilingual model's target_lang is one it knows. Raises ServiceError 422."""
    try:
        card.check_target(target_lang)
    except ValueError as e:
        raise ServiceError(422, f"target_lang: model {card.id!r}: {e}", "target_lang") from None
    return card


async def _rewrite_final(items, final):
    """The stream's items with its closing TranslateResponse replaced by ``final(response)``. (Defined
    before the class: Serve's ingress copies the class's methods with the globals of that moment.)"""
    try:
        async for item in items:
            yield final(item) if isinstance(item, TranslateResponse) else item
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


class Gateway(StoreRoutes, LibreRoutes, DeepLRoutes, DocumentRoutes):
    """The HTTP ingress in front of one translator per model; the route groups of its bases are
    routes_stores.py, routes_libre.py, routes_deepl.py and routes_documents.py.

    Args:
        cards: the served models; the first is the default.
        handles: model id -> its translator deployment; None: run the translators in this process.
        engine: EngineConfig fields for every model (a card's ``engine`` overrides them).
        num_threads: torch threads of the in-process translators.
        guard: ``GuardSettings`` fields (API keys, rate limits; service/api/guard.py).
        max_timeout_s: the longest ``timeout_s`` a request may ask for, and every request's deadline.
        pivot_lang: the language a pair no model serves is translated through (pivot.py); None: off.
        documents: ``DocumentSettings`` fields (where translated files are kept; document_store.py).
        clients: ``app.client_settings``: cors_origins, memory_file (None: suggestions and the memory
            off), cache_entries (the in-process translators' result cache).
        pool: the model pool's {"handle", "directory", "models"} (``service/pool.py``); None: no pool.
    """

    def __init__(self, cards: list[ModelCard], handles: Optional[dict[str, DeploymentHandle]] = None,
                 engine: Optional[dict] = None, num_threads: int = 1, guard: Optional[dict] = None,
                 max_timeout_s: float = 60.0, clients: Optional[dict] = None,
                 pivot_lang: Optional[str] = pivot.DEFAULT_PIVOT_LANG, documents: Optional[dict] = None,
                 pool: Optional[dict] = None):
        self.cards = {c.id: c for c in cards}
        self.default = cards[0].id
        self.routes = pivot.routes(cards, pivot_lang)                       # (source, target) -> PivotRoute
        self.pivots = {r.id: r for r in self.routes.values()}               # route id -> PivotRoute
        self._sources = frozenset(c.source_lang for c in cards)             # the codes match_language maps to
        self._targets = frozenset(t for c in cards for t in c.targets) | {t for _, t in self.routes}
        # source "auto": detects among common languages and the served ones; loads in the background (~2 s)
        self.detector = LanguageDetector(sorted(self._sources | self._targets))
        threading.Thread(target=self.detector.load, name="langid-load", daemon=True).start()
        clients = clients or {}
        self.memory = MemoryStore(clients["memory_file"]) if clients.get("memory_file") else None
        self.cors_origins = clients.get("cors_origins", ["*"])     # read by CorsMiddleware (routes_common)
        self.backend: Backend = (RemoteBackend(handles, RetryMetrics(list(self.cards)).record) if handles is not None
                                 else LocalBackend(cards, num_threads, memory_file=clients.get("memory_file"),
                                                   cache_entries=clients.get("cache_entries", 0)))
        if pool is not None:    # pinned models through their deployments, the pool's through Serve's multiplexing
            self.backend = PoolBackend(handles or {}, pool, RetryMetrics(list(self.cards)).record)
        self._ready_seen: set[str] = set()   # models that have answered /readyz's probe once
        self.max_timeout_s = max_timeout_s
        self.guard = Guard(GuardSettings.model_validate(guard or {}))
        self.guard.metrics = GuardMetrics()
        self.doc_settings = DocumentSettings.model_validate(documents or {})
        self.doc_store = DocumentStore(self.doc_settings)
        self._configure(engine or {})
        self.glossaries = glossaries.GlossaryClient.cluster()   # stored glossaries, shared by the replicas

    def _configure(self, engine: dict) -> None:
        self.engine = engine
        self.limits = {c.id: ModelLimits.of(c.id, c.config, EngineConfig.from_dict({**engine, **c.engine}))
                       for c in self.cards.values()}
        self.limits.update({r.id: pivot.RouteLimits(r, tuple(self.limits[leg.card.id] for leg in r.legs))
                            for r in self.pivots.values()})

    async def reconfigure(self, user_config: dict) -> None:
        """Only used with ``ingress: translator``: the engine settings of the in-process translators
        ({"engine": fields for every model, "per_model": {model: overrides}})."""
        await self.backend.reconfigure(user_config)
        self._configure(user_config.get("engine", {}))
        self.guard.reload()

    def __del__(self):
        """Serve's shutdown hook, after its drain of ongoing requests: the last access lines reach the
        log file before the process is killed (``access_log.flush_serve_log``)."""
        flush_serve_log()

    # ---- routing ----
    def resolve(self, model: Optional[str], source_lang: Optional[str], target_lang: Optional[str]) -> ModelCard:
        """The card of the model that serves this request: the named model, else the first that
        translates source_lang -> target_lang (models of one target before multilingual ones, which
        match every target their vocabulary knows), else the pivot route's card (``pivot.PivotRoute.card``:
        its id is the route's, e.g. "de-en+en-fr", which ``model`` may name too), else the default.
        Raises ServiceError: 404 for an
        unknown model or pair, 422 when a multilingual model's target_lang is missing or unknown (the
        message names its choices). Language codes match ignoring case, and a code with a region
        falls back to its language ("de-DE" -> "de"; ``card.match_language``)."""
        source_lang = match_language(source_lang, self._sources)
        target_lang = match_language(target_lang, self._targets)
        if model is not None:
            card = self.cards.get(model) or (self.pivots[model].card if model in self.pivots else None)
            if card is None:
                raise ServiceError(404, f"model: unknown model {shown(model)}; available: "
                                        f"{sorted(self.cards) + sorted(self.pivots)}", "model")
            for field, want, have in (("source_lang", source_lang, (card.source_lang,)),
                                      ("target_lang", target_lang, () if card.target_languages else card.targets)):
                if want is not None and have and want not in have:
                    raise ServiceError(404, f"{field}: model {shown(model)} translates {card.pair}, not {shown(want)}", field)
            return _checked_target(card, target_lang)
        if source_lang is None and target_lang is None:
            return _checked_target(self.cards[self.default], None)
        matches = [c for c in self.cards.values()
                   if source_lang in (None, c.source_lang) and (target_lang is None or target_lang in c.targets)]
        if matches:
            return _checked_target(min(matches, key=lambda c: bool(c.target_languages)), target_lang)
        if (source_lang, target_lang) in self.routes:
            return self.routes[source_lang, target_lang].card
        field = "source_lang" if source_lang is not None and not any(
            c.source_lang == source_lang for c in self.cards.values()) else "target_lang"
        pair = f"{short_name(source_lang or '*')}->{short_name(target_lang or '*')}"
        raise ServiceError(404, f"{field}: no model for {pair}; available pairs: {self._pairs()}", field)

    def _pairs(self) -> str:
        return ", ".join([f"{c.pair} ({c.id})" for c in self.cards.values()] +
                         [r.describe() for r in self.pivots.values()])

    async def _run(self, model: str, job) -> TranslateResponse:
        """``job`` on ``model``: a model's translator, or both legs of a pivot route (pivot.py)."""
        if model in self.pivots:
            return await pivot.run(self.backend.translate, self.pivots[model], job)
        return await self.backend.translate(model, job)

    def _deadline(self, job, timeout_s: Optional[float] = None):
        """Set the job's deadline: ``timeout_s`` (<= max_timeout_s, else 422) or max_timeout_s."""
        if timeout_s is not None and timeout_s > self.max_timeout_s:
            raise ServiceError(422, f"timeout_s: must be <= {self.max_timeout_s:g} (the server's max_timeout_s), "
                                    f"got {timeout_s:g}", "timeout_s")
        job.timeout_s = timeout_s or self.max_timeout_s
        job.deadline = time.time() + job.timeout_s
        return job

    async def _translate(self, model: str, job):
        return await self._run(model, self._deadline(job, job.timeout_s))

    def _scope(self, request: Request) -> Optional[str]:
        """The request's translation memory (``TranslateJob.memory_scope``): its key's, "" with keys
        off; None when the memory is off."""
        return request.scope.get("state", {}).get("memory_scope", "") if self.memory is not None else None

    def _scoped(self, request: Request):
        """``_translate`` with the request's memory scope on every job."""
        scope = self._scope(request)

        async def run(model: str, job):
            job.memory_scope = scope
            return await self._translate(model, job)
        return run

    # ---- native API ----
    @api.post("/v1/translate", response_model=TranslateResponse,
              responses={200: {"content": SSE_CONTENT}, **NATIVE_ERRORS})
    async def translate(self, body: TranslateRequest, request: Request):
        """Translate one text or a list of texts (paragraphs are split into sentences and rejoined).

        With ``"stream": true`` the answer is Server-Sent Events: ``event: token`` per new target token
        (``{"index", "text", "token"}``; the concatenated ``text`` of an index is its translation), then
        ``event: response`` with the whole response; ``event: error`` if it fails midway.
        """
        if request.scope.get("query_string"):   # nothing sent is dropped: the fields are the body's
            name = next(iter(request.query_params.keys()), "")
            raise ServiceError(422, f"query parameter {shown(name)}: /v1/translate reads its fields from the JSON body "
                                    f"only; send it there", name or "query")
        if autodetect.is_auto(body.target_lang):
            raise ServiceError(422, "target_lang: auto detects the source language only; target_lang must be a "
                                    f"language code (one of {', '.join(sorted(self._targets))}) or null", "target_lang")
        headers = {libretranslate.IGNORED_HEADER: ", ".join(body.ignored)} if body.ignored else None
        if autodetect.is_auto(body.source_lang):
            response = await self._translate_auto(body, request)
            if headers and isinstance(response, TranslateResponse):
                response = Response(response.model_dump_json(), media_type="application/json")
            if headers:
                response.headers.update(headers)
            return response
        card = self.resolve(body.model, body.source_lang, body.target_lang)
        request.state.model = card.id
        job = await self._with_glossary(self._deadline(body.job(), body.timeout_s), body.glossary_id, request, card)
        job.memory_scope = self._scope(request)
        with mapped_errors(card.id):
            self.limits[card.id].check(job)
        if not body.stream:
            result = await self._run(card.id, job)
            request.state.usage = result.usage
            return Response(result.body_bytes(), media_type="application/json", headers=headers)
        response = await self._stream(card.id, job, request)
        response.headers.update(headers or {})
        return response

    async def _translate_auto(self, body: TranslateRequest, request: Request):
        """source_lang "auto": each text's language detected, each text translated by the model that
        reads it (one job per model, run together), passed through when it has no letters or is in
        target_lang already (autodetect.py)."""
        texts, is_list = body.texts, isinstance(body.text, list)
        autodetect.check_sizes(texts, "text", is_list)
        known = self._targets | self._sources
        target = match_language(body.target_lang, known)
        if target is not None and target not in known:
            raise ServiceError(404, f"target_lang: no model translates into {shown(body.target_lang)}; target "
                                    f"languages: {', '.join(sorted(self._targets))}", "target_lang")
        named = self.cards.get(body.model) if body.model is not None else None
        if target is None and named is not None and not named.target_languages:
            target = named.target_lang      # the named model's one target: text already in it passes through
        detections = await autodetect.detect_texts(self.detector, texts)
        routed = autodetect.route(texts, detections, target,
                                  lambda lang: self.resolve(body.model, lang, body.target_lang).id,
                                  "text", "source_lang", is_list, self._pairs())
        by_model = autodetect.groups(routed)
        request.state.model = next(iter(by_model)) if len(by_model) == 1 else "auto"
        base = await self._with_glossary(self._deadline(body.job(), body.timeout_s), body.glossary_id, request)
        base.memory_scope = self._scope(request)
        jobs = {}
        for model, idx in by_model.items():    # errors name the text: text[i] when alone in its job
            one = is_list and len(idx) == 1
            jobs[model] = dataclasses.replace(base, texts=[texts[i] for i in idx], is_list=is_list and not one,
                                              field=f"text[{idx[0]}]" if one else "text")
            with mapped_errors(model):
                self.limits[model].check(jobs[model])

        def merged(results: dict) -> TranslateResponse:
            return autodetect.merged(texts, routed, results, by_model)
        if not body.stream:
            answers = await autodetect.gather_all([self._run(m, j) for m, j in jobs.items()])
            result = merged(dict(zip(jobs, answers)))
            request.state.usage = result.usage
            return Response(result.body_bytes(), media_type="application/json")
        if len(jobs) != 1 or any(r.passthrough for r in routed):
            found = ", ".join(f"{r.language}{' (unchanged)' if r.passthrough else ''}" for r in routed)
            raise ServiceError(422, "stream: with source_lang auto, a stream takes texts that one model translates "
                                    f"(detected: {found}); send them without stream, or one language per request",
                                    "stream")
        (model, job), = jobs.items()
        return await self._stream(model, job, request, lambda r: merged({model: r}))

    async def _with_glossary(self, job, glossary_id: Optional[str], request: Request, card: Optional[ModelCard] = None):
        """The job with stored glossary ``glossary_id``'s entries (none: as it is), and the request's own
        ``glossary`` entries after them when both are sent. Raises ServiceError 404 for an unknown
        name, 409 for a glossary of other languages than the card's."""
        if glossary_id is None:
            return job
        stored = await self.glossaries.resolve(glossaries.scope_of(request), glossary_id,
                                               card.source_lang if card else None,
                                               card.target_lang if card else None)
        job.glossary, job.glossary_field = tuple(stored) + tuple(job.glossary), "glossary" if job.glossary else "glossary_id"
        return job

    async def _stream(self, model: str, job, request: Request, final=None):
        """The SSE answer of ``job`` on ``model``; ``final`` rewrites the closing TranslateResponse.
        A pivot route streams its last leg: the first runs whole before the stream starts (its errors
        are HTTP errors), and the closing response is the combined one (``pivot.combined``)."""
        request.state.stream = True
        decision = request.scope.get("state", {}).get("guard_decision")
        release = self.guard.open_stream(decision.who, decision.key) if decision else (lambda: None)   # or 429
        route, second_leg = self.pivots.get(model), False
        try:
            if route is not None:
                first, job = await pivot.first_leg(self.backend.translate, route, job)
                model, outer, second_leg = route.legs[1].card.id, final or (lambda r: r), True

                def final(r, first=first, route=route, outer=outer):
                    return outer(pivot.combined(route, first, r))
            items = self.backend.stream(model, job)
            if final is not None:
                items = _rewrite_final(items, final)
            await anext(items)     # StreamStart: validation and admission errors become HTTP errors
        except StopAsyncIteration:
            release()
            raise ServiceError(500, "stream ended before it started") from None
        except ServiceError as e:
            release()
            if second_leg:     # the second leg's start failed
                raise pivot.second_leg_error(e, route) from None
            raise
        except BaseException:
            release()
            raise

        def on_usage(usage) -> None:
            request.state.usage = usage
        return sse.ClosingStreamingResponse(sse.events(items, on_usage), release, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @api.get("/v1/models", response_model=ModelsResponse)
    async def models(self):
        """The served models with their languages, configuration and test BLEU; a pool model says so
        and names the pool replicas it is loaded on now (``loaded_on``; [] when none holds it)."""
        loaded_on = {}
        if isinstance(self.backend, PoolBackend):
            from service.pool import where_loaded
            try:
                loaded_on = where_loaded(await asyncio.wait_for(self.backend.residency(), timeout=5))
            except Exception:  # noqa: BLE001 - the directory is starting: nothing known to be loaded
                loaded_on = {}
        pooled = set(self.backend.pooled) if isinstance(self.backend, PoolBackend) else set()

        async def one(c: ModelCard) -> ModelInfo:
            try:   # the replica's own view: the engine settings it really runs with
                engine = (await asyncio.wait_for(self.backend.info(c.id), timeout=5)).engine
            except Exception:  # noqa: BLE001 - still loading: the configured settings
                engine = {**self.engine, **c.engine}
            return ModelInfo(id=c.id, source_lang=c.source_lang, config=c.config.to_dict(),
                             target_lang=None if c.target_languages else c.target_lang, target_langs=list(c.targets),
                             test_bleu=c.test_bleu, metadata=c.metadata, engine=engine,
                             **({"pool": True, "loaded_on": loaded_on.get(c.id, [])} if c.id in pooled else {}))
        return ModelsResponse(data=list(await asyncio.gather(*(one(c) for c in self.cards.values()))),
                              pivots=[PivotInfo(**r.info()) for r in self.pivots.values()])

    @api.get("/healthz")
    async def healthz(self):
        """Liveness: the HTTP ingress answers."""
        return {"status": "ok"}

    @api.get("/readyz", responses={200: {"content": {"application/json": {"schema": READY_SCHEMA}}},
                                   503: {"description": 'a model is still loading ("status": "loading")',
                                         "headers": RETRY_HEADERS,
                                         "content": {"application/json": {"schema": READY_SCHEMA}}}})
    async def readyz(self):
        """Readiness: 200 once every model is loaded and its engine runs, else 503 (within
        READY_PROBE_S: a model whose replica does not exist yet would otherwise hold the probe until
        it does). A model that has answered once stays ready while its replica is merely slow to answer."""
        async def one(name: str) -> bool:
            try:
                ok = bool(await asyncio.wait_for(self.backend.ready(name), timeout=READY_PROBE_S))
            except asyncio.TimeoutError:
                return name in self._ready_seen   # busy, not loading
            except Exception:  # noqa: BLE001 - any other failure means not ready
                return False
            if ok:
                self._ready_seen.add(name)
            return ok
        states = await asyncio.gather(*(one(n) for n in self.cards))
        models = {n: ("ready" if s else "loading") for n, s in zip(self.cards, states)}
        ready = all(states)
        return JSONResponse({"status": "ready" if ready else "loading", "models": models},
                            status_code=200 if ready else 503,
                            headers=None if ready else {"Retry-After": str(RETRY_AFTER_S)})

    @api.get("/metrics", response_class=PlainTextResponse,
             responses={503: {"description": "no Ray metrics agent answered", "headers": RETRY_HEADERS, "content": {
                 "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}})
    async def metrics(self):
        """Prometheus text format: every replica's series, from every node's Ray metrics agent."""
        text = await scrape_metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/", include_in_schema=False)
    async def root(self, request: Request):
        """The attention explorer (service/api/static/explorer.html; docs/explorer.md)."""
        return explorer.page(request)

    @api.get("/explorer/{name}", include_in_schema=False)
    async def explorer_file(self, name: str):
        """The explorer's script and style sheet; 404 for any other name."""
        return explorer.static_file(name)


# The native API first in the OpenAPI document (and Swagger UI), then the route groups as imported
# above: the bases' routes registered before this class's (no two routes share a path pattern, so
# the order decides nothing else).
api.router.routes.sort(key=lambda r: not getattr(getattr(r, "endpoint", None), "__qualname__", "").startswith("Gateway."))
Gateway = serve.ingress(api)(Gateway)
