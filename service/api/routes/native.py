"""The native API and the service's own routes (``router``):

    POST /v1/translate        TranslateRequest -> TranslateResponse, or SSE with "stream": true
    GET  /v1/models           served models, their languages, config, engine settings, test BLEU
    GET  /healthz, /readyz    liveness; readiness of every model
    GET  /metrics             Prometheus text of the whole cluster (service/metrics.py)
    GET  /, /explorer/{name}  the attention explorer page and its files (explorer.py)
"""
# No `from __future__ import annotations`: FastAPI reads the request model from the annotation.
import asyncio
import dataclasses

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from service.metrics import scrape_metrics
from service.pipeline import autodetect
from service.protocol import (
    RETRY_AFTER_S,
    JobOrigin,
    ServiceError,
    TranslateJob,
    TranslateResponse,
    shown,
)
from service.translator import ModelCard

from .. import explorer, glossaries, libretranslate, sse
from ..backends import PoolBackend
from ..schemas import ModelInfo, ModelsResponse, PivotInfo, TranslateRequest
from ..services import Services, services
from .common import NATIVE_ERRORS, RETRY_HEADERS

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

router = APIRouter()


@router.post("/v1/translate", response_model=TranslateResponse,
             responses={200: {"content": SSE_CONTENT}, **NATIVE_ERRORS})
async def translate(body: TranslateRequest, request: Request, svc: Services = Depends(services)):
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
                                f"language code (one of {', '.join(sorted(svc.graph.targets))}) or null", "target_lang")
    headers = {libretranslate.IGNORED_HEADER: ", ".join(body.ignored)} if body.ignored else None
    if autodetect.is_auto(body.source_lang):
        response = await _translate_auto(body, request, svc)
        if headers and isinstance(response, TranslateResponse):
            response = Response(response.model_dump_json(), media_type="application/json")
        if headers:
            response.headers.update(headers)
        return response
    card = svc.graph.resolve(body.model, body.source_lang, body.target_lang)
    request.state.model = card.id
    job, origin = svc.graph.bind(card, await _job(body, request, svc, card), body.source_lang), body.origin()
    svc.pipeline.check(card.id, job, origin)
    if not body.stream:
        result = await svc.pipeline.run(card.id, job, origin)
        request.state.usage = result.usage
        return Response(result.body_bytes(), media_type="application/json", headers=headers)
    response = await _stream(card.id, job, origin, request, svc)
    response.headers.update(headers or {})
    return response


async def _job(body: TranslateRequest, request: Request, svc: Services, card: ModelCard = None) -> TranslateJob:
    """The request's job: its deadline, stored glossary (checked against ``card``'s languages) and
    memory scope."""
    job = svc.pipeline.deadline(body.job(), body.timeout_s)
    source, target = (card.source_lang, card.target_lang) if card else (None, None)
    if card is not None and card.lang_tokens:      # NLLB-200 / M2M100 / mBART-50: the request's pair
        source, target = svc.graph.code(body.source_lang, svc.graph.sources), svc.graph.code(body.target_lang, svc.graph.targets)
    job = await svc.pipeline.with_glossary(job, body.glossary_id, glossaries.scope_of(request), source, target)
    if body.memory_threshold is not None and svc.memory is None:
        raise ServiceError(422, "memory_threshold: the translation memory is off on this server", "memory_threshold")
    return dataclasses.replace(job, memory_scope=svc.memory_scope(request))


async def _translate_auto(body: TranslateRequest, request: Request, svc: Services):
    """source_lang "auto": each text's language detected, each text translated by the model that
    reads it (one job per model, run together), passed through when it has no letters or is in
    target_lang already (autodetect.py)."""
    graph = svc.graph
    texts, is_list = body.texts, isinstance(body.text, list)
    autodetect.check_sizes(texts, JobOrigin("text", is_list))
    known = graph.targets | graph.sources
    target = graph.code(body.target_lang, known)      # match_language, and a family model's codes
    if target is not None and target not in known:
        raise ServiceError(404, f"target_lang: no model translates into {shown(body.target_lang)}; target "
                                f"languages: {', '.join(sorted(graph.targets))}", "target_lang")
    named = graph.cards.get(body.model) if body.model is not None else None
    if target is None and named is not None and not named.target_languages:
        target = named.target_lang      # the named model's one target: text already in it passes through
    detections = await autodetect.detect_texts(svc.detector, texts, top=0)
    routed = autodetect.route(texts, detections, target,
                              lambda lang: graph.resolve(body.model, lang, body.target_lang).id,
                              JobOrigin("text", is_list), "source_lang", graph.describe())
    base = await _job(body, request, svc)

    def job_of(model: str, idx: list[int]) -> tuple[TranslateJob, JobOrigin]:   # errors name text[i] when alone in its job
        one = is_list and len(idx) == 1
        job = dataclasses.replace(base, texts=[texts[i] for i in idx])
        return (graph.bind(graph.cards.get(model), job, None, [routed[i].language for i in idx]),
                JobOrigin(f"text[{idx[0]}]" if one else "text", is_list and not one))
    by_model = autodetect.groups(routed)
    jobs = svc.pipeline.jobs(by_model, job_of)
    request.state.model = next(iter(jobs)) if len(jobs) == 1 else "auto"

    def merged(results: dict) -> TranslateResponse:
        return autodetect.merged(texts, routed, results, by_model)
    if not body.stream:
        result = merged(await svc.pipeline.run_all(jobs))
        request.state.usage = result.usage
        return Response(result.body_bytes(), media_type="application/json")
    if len(jobs) != 1 or any(r.passthrough for r in routed):
        found = ", ".join(f"{r.language}{' (unchanged)' if r.passthrough else ''}" for r in routed)
        raise ServiceError(422, "stream: with source_lang auto, a stream takes texts that one model translates "
                                f"(detected: {found}); send them without stream, or one language per request",
                           "stream")
    (model, (job, origin)), = jobs.items()
    return await _stream(model, job, origin, request, svc, lambda r: merged({model: r}))


async def _stream(model: str, job: TranslateJob, origin: JobOrigin, request: Request, svc: Services, final=None):
    """The SSE answer of ``job`` on ``model`` (``Pipeline.open_stream``), counted against the
    caller's open streams (429 over the cap); ``final`` rewrites the closing TranslateResponse."""
    request.state.stream = True
    decision = request.scope.get("state", {}).get("guard_decision")
    release = svc.guard.open_stream(decision.who, decision.key) if decision else (lambda: None)   # or 429
    try:
        items = await svc.pipeline.open_stream(model, job, origin, final)
    except BaseException:
        release()
        raise

    def on_usage(usage) -> None:
        request.state.usage = usage
    return sse.ClosingStreamingResponse(sse.events(items, on_usage), release, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/v1/models", response_model=ModelsResponse)
async def models(svc: Services = Depends(services)):
    """The served models with their languages, configuration and test BLEU; a pool model says so
    and names the pool replicas it is loaded on now (``loaded_on``; [] when none holds it)."""
    loaded_on, pooled = {}, set()
    if isinstance(svc.backend, PoolBackend):
        from service.pool import where_loaded
        pooled = set(svc.backend.pooled)
        try:
            loaded_on = where_loaded(await asyncio.wait_for(svc.backend.residency(), timeout=5))
        except Exception:  # noqa: BLE001 - the directory is starting: nothing known to be loaded
            loaded_on = {}

    async def one(c: ModelCard) -> ModelInfo:
        try:   # the replica's own view: the engine settings it really runs with
            engine = (await asyncio.wait_for(svc.backend.info(c.id), timeout=5)).engine
        except Exception:  # noqa: BLE001 - still loading: the configured settings
            engine = {**svc.pipeline.engine, **c.engine}
        return ModelInfo(id=c.id, source_lang=c.source_lang, source_langs=list(c.sources), config=c.config.to_dict(),
                         target_lang=None if c.target_languages else c.target_lang, target_langs=list(c.targets),
                         test_bleu=c.test_bleu, metadata=c.metadata, engine=engine,
                         **({"pool": True, "loaded_on": loaded_on.get(c.id, [])} if c.id in pooled else {}))
    return ModelsResponse(data=list(await asyncio.gather(*(one(c) for c in svc.graph.cards.values()))),
                          pivots=[PivotInfo(**r.info()) for r in svc.graph.pivots.values()])


@router.get("/healthz")
async def healthz():
    """Liveness: the HTTP ingress answers."""
    return {"status": "ok"}


@router.get("/readyz", responses={200: {"content": {"application/json": {"schema": READY_SCHEMA}}},
                                  503: {"description": 'a model is still loading ("status": "loading")',
                                        "headers": RETRY_HEADERS,
                                        "content": {"application/json": {"schema": READY_SCHEMA}}}})
async def readyz(svc: Services = Depends(services)):
    """Readiness: 200 once every model is loaded and its engine runs, else 503 (within
    READY_PROBE_S: a model whose replica does not exist yet would otherwise hold the probe until
    it does). A model that has answered once stays ready while its replica is merely slow to answer."""
    async def one(name: str) -> bool:
        try:
            ok = bool(await asyncio.wait_for(svc.backend.ready(name), timeout=READY_PROBE_S))
        except asyncio.TimeoutError:
            return name in svc.ready_seen   # busy, not loading
        except Exception:  # noqa: BLE001 - any other failure means not ready
            return False
        if ok:
            svc.ready_seen.add(name)
        return ok
    names = list(svc.graph.cards)
    states = await asyncio.gather(*(one(n) for n in names))
    models = {n: ("ready" if s else "loading") for n, s in zip(names, states)}
    ready = all(states)
    return JSONResponse({"status": "ready" if ready else "loading", "models": models},
                        status_code=200 if ready else 503,
                        headers=None if ready else {"Retry-After": str(RETRY_AFTER_S)})


@router.get("/metrics", response_class=PlainTextResponse,
            responses={503: {"description": "no Ray metrics agent answered", "headers": RETRY_HEADERS, "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}})
async def metrics():
    """Prometheus text format: every replica's series, from every node's Ray metrics agent."""
    text = await scrape_metrics()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/", include_in_schema=False)
async def root(request: Request):
    """The attention explorer (service/api/static/explorer.html; docs/explorer.md)."""
    return explorer.page(request)


@router.get("/explorer/{name}", include_in_schema=False)
async def explorer_file(name: str):
    """The explorer's script and style sheet; 404 for any other name."""
    return explorer.static_file(name)
