"""The Ray Serve application: an HTTP ingress (FastAPI) in front of one translator deployment per model.

    serve run service.deployment:app                         # the shipped de->en model
    serve run service.deployment:build_app engine='{"max_num_seqs": 32}'   # or a config's `args:`

Layout (``build_app``):
    HTTP proxy -> Gateway (FastAPI, @serve.ingress; validation, routing, SSE, /metrics)
               -> Translator-<model> replicas (model + continuous-batching Engine, one deployment per model)
Concurrent requests reach a translator replica directly (no @serve.batch): each sentence is one
engine call, and the engine merges all of them into its prefill and decode batches. Engine knobs come
from the deployment's ``user_config`` (``Translator.reconfigure``). ``max_ongoing_requests`` is sized
from the engine's ``max_num_seqs`` so Serve never caps a batch, ``max_queued_requests`` bounds the
queue in front of it; both Ray's back-pressure error and the engine's full queue become HTTP 503 with
Retry-After. With ``ingress: translator`` the translators run inside the ingress replica instead
(one process, no extra hop; see README for the measured cost of the hop).
"""

import asyncio
import json
import re
import logging
import math
import time
import urllib.parse
from typing import Any, Literal, Optional

import httpx
import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.checkpoint import DEFAULT_CHECKPOINT

from .metrics import HttpMetrics
from .translator import Translator, model_card
from .schemas import (MAX_BEAM_SIZE, ErrorResponse, LibreLanguage, ModelsResponse, ServiceError, TranslateRequest,
                      TranslateResponse, format_validation_error)

logger = logging.getLogger("ray.serve")

RETRY_AFTER_S = 1
READY_PROBE_S = 1.0     # /readyz: how long a model may take to say it is ready before it counts as loading
ERROR_KEY = "__service_error__"     # a ServiceError returned by a translator replica (its args)
LANGUAGE_NAMES = {"de": "German", "en": "English", "fr": "French", "es": "Spanish", "it": "Italian",
                  "nl": "Dutch", "pt": "Portuguese", "cs": "Czech", "ru": "Russian", "zh": "Chinese",
                  "ja": "Japanese", "pl": "Polish", "sv": "Swedish", "tr": "Turkish", "ar": "Arabic"}


# ---- configuration -----------------------------------------------------------------------------
class ModelSpec(BaseModel):
    """One served model."""
    model_config = ConfigDict(extra="forbid")
    name: str = "de-en"                                   # model id in requests and /v1/models
    checkpoint: str = str(DEFAULT_CHECKPOINT)             # checkpoint directory (model/checkpoint.py)
    source_lang: Optional[str] = None                     # default: the checkpoint's metadata.json
    target_lang: Optional[str] = None
    engine: dict = Field(default_factory=dict)            # EngineConfig overrides for this model
    deployment: dict = Field(default_factory=dict)        # Serve deployment option overrides for this model


class AppArgs(BaseModel):
    """``build_app`` arguments (``serve run ... key=value`` or a serve config's ``args:``)."""
    model_config = ConfigDict(extra="forbid")
    models: list[ModelSpec] = Field(default_factory=lambda: [ModelSpec()])   # the first is the default
    engine: dict = Field(default_factory=dict)            # EngineConfig fields for every model (user_config)
    translator: dict = Field(default_factory=dict)        # Serve options of translator deployments
    gateway: dict = Field(default_factory=dict)           # Serve options of the ingress deployment
    ingress: Literal["separate", "translator"] = "separate"
    num_cpus: float = 0.8                                 # per translator replica (fractional: 2 fit on 2 cores)
    num_gpus: Optional[float] = None                      # per translator replica; None = 1 if the cluster has GPUs

    @field_validator("models", "engine", "translator", "gateway", mode="before")
    @classmethod
    def _json_text(cls, v: Any) -> Any:
        # `serve run service.deployment:build_app engine='{"max_num_seqs": 32}'` passes strings
        return json.loads(v) if isinstance(v, str) else v


def _max_num_seqs(engine: dict) -> int:
    from .engine import EngineConfig
    return int(engine.get("max_num_seqs", EngineConfig.max_num_seqs))


def _cluster_has_gpu() -> bool:
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch
    return torch.cuda.is_available()


def translator_options(args: AppArgs, spec: ModelSpec) -> dict:
    """Serve deployment options of one model's translator deployment."""
    engine = {**args.engine, **spec.engine}
    seqs = _max_num_seqs(engine)
    num_gpus = args.num_gpus if args.num_gpus is not None else (1 if _cluster_has_gpu() else 0)
    opts: dict[str, Any] = {
        "name": f"Translator-{spec.name}",
        "ray_actor_options": {"num_cpus": args.num_cpus, "num_gpus": num_gpus},
        # A greedy sentence holds one engine slot: 2x max_num_seqs keeps the batch full with a
        # next prefill waiting, so Serve never caps the engine's batch.
        "max_ongoing_requests": 2 * seqs,
        "max_queued_requests": 4 * seqs,
        "backpressure_config": {"status_code": 503, "retry_after_s": RETRY_AFTER_S},
        "user_config": engine,
        "health_check_period_s": 5, "graceful_shutdown_timeout_s": 10, "graceful_shutdown_wait_loop_s": 0.5,
    }
    opts.update(args.translator)
    opts.update(spec.deployment)
    if "autoscaling_config" in opts:
        opts.pop("num_replicas", None)
    return opts


def gateway_options(args: AppArgs) -> dict:
    opts: dict[str, Any] = {
        "name": "Gateway",
        "ray_actor_options": {"num_cpus": 0.2},
        "max_ongoing_requests": 1024,
        "max_queued_requests": 1024,
        "backpressure_config": {"status_code": 503, "retry_after_s": RETRY_AFTER_S},
        "health_check_period_s": 5, "graceful_shutdown_timeout_s": 10, "graceful_shutdown_wait_loop_s": 0.5,
    }
    opts.update(args.gateway)
    return opts


# ---- metrics scrape ------------------------------------------------------------------------------
async def scrape_metrics(timeout_s: float = 5.0) -> str:
    """The Prometheus text of every alive node's Ray metrics agent (the local one reached on 127.0.0.1).

    Every replica's series are exported by the agent of its node, so this is the whole cluster.
    Families that appear on several nodes are merged so each has one HELP/TYPE header.
    """
    nodes = await asyncio.to_thread(ray.nodes)
    local = ray.get_runtime_context().get_node_id()
    urls = []
    for n in nodes:
        port = n.get("MetricsExportPort")
        if not n.get("Alive") or not port:
            continue
        host = "127.0.0.1" if n.get("NodeID") == local else n.get("NodeManagerAddress")
        urls.append(f"http://{host}:{port}/metrics")
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        texts = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
    ok = [r.text for r in texts if isinstance(r, httpx.Response) and r.status_code == 200]
    if len(urls) > 0 and not ok:
        raise ServiceError(503, "metrics: no Ray metrics agent answered", retry_after=RETRY_AFTER_S)
    return ok[0] if len(ok) == 1 else _merge_prometheus(ok)


def _merge_prometheus(texts: list[str]) -> str:
    """Concatenate Prometheus text expositions, keeping one HELP/TYPE per family."""
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                headers.setdefault(family, [])
                if len(headers[family]) < 2 and line not in headers[family]:
                    headers[family].append(line)
                families.setdefault(family, [])
            elif line and not line.startswith("#"):
                families.setdefault(family or line.split("{")[0].split(" ")[0], []).append(line)
    out = []
    for fam, lines in families.items():
        out += headers.get(fam, []) + lines
    return "\n".join(out) + "\n"


# ---- backends: translators behind handles, or in this process ------------------------------------
class _RemoteBackend:
    def __init__(self, handles: dict[str, DeploymentHandle]):
        self.handles = handles

    async def call(self, model: str, method: str, *args):
        result = await getattr(self.handles[model], method).remote(*args)
        if isinstance(result, dict) and ERROR_KEY in result:
            raise ServiceError(*result[ERROR_KEY])
        return result

    def stream(self, model: str, req: dict):
        return self.handles[model].options(stream=True).stream.remote(req)

    async def reconfigure(self, user_config: dict) -> None:
        pass


class _LocalBackend:
    def __init__(self, cards: list[dict], num_threads: int):
        self.translators = {c["id"]: Translator(c, num_threads=num_threads) for c in cards}

    async def call(self, model: str, method: str, *args):
        result = getattr(self.translators[model], method)(*args)
        return await result if asyncio.iscoroutine(result) else result

    def stream(self, model: str, req: dict):
        return self.translators[model].stream(req)

    async def reconfigure(self, user_config: dict) -> None:
        per_model = user_config.get("per_model", {})
        for name, t in self.translators.items():
            await t.reconfigure({**user_config.get("engine", {}), **per_model.get(name, {})})


# ---- the HTTP app ----------------------------------------------------------------------------------
api = FastAPI(
    title="Transformer MT service",
    version="0.1.0",
    description="Machine translation with the original Transformer, continuous batching on Ray Serve. "
                "Native API under /v1, LibreTranslate-compatible /translate and /languages, Prometheus /metrics.",
)

_ENDPOINTS = {"/v1/translate", "/v1/models", "/healthz", "/readyz", "/metrics", "/translate", "/languages",
              "/docs", "/openapi.json", "/"}


class AccessLogMiddleware:
    """Per request: one access-log line (request id, status, latency, token counts) and the HTTP metrics.

    Pure ASGI so the latency of a streamed response is measured to its last byte. Handlers put
    ``model`` and ``usage`` into ``request.state``.
    """

    def __init__(self, app):
        self.app = app
        self.metrics: Optional[HttpMetrics] = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.metrics is None:
            self.metrics = HttpMetrics()   # created in the replica process, on its first request
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        status = {"code": 500}
        headers = dict((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", []))
        rid = headers.get("x-request-id") or serve.context._get_serve_request_context().request_id

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            seconds = time.perf_counter() - t0
            path = scope.get("path", "")
            endpoint = path if path in _ENDPOINTS else "other"
            model = state.get("model") or "none"
            usage = state.get("usage") or {}
            self.metrics.record(model, endpoint, status["code"], seconds)
            logger.info("access request_id=%s method=%s path=%s status=%d latency_ms=%.1f model=%s "
                        "source_tokens=%s generated_tokens=%s stream=%s", rid, scope.get("method"), path,
                        status["code"], seconds * 1000, model, usage.get("source_tokens", 0),
                        usage.get("generated_tokens", 0), bool(state.get("stream")))


api.add_middleware(AccessLogMiddleware)


def _error(status: int, message: str, field: Optional[str] = None, type: Optional[str] = None,
           retry_after: Optional[float] = None, details: Optional[list] = None) -> JSONResponse:
    err = ServiceError(status, message, field, retry_after, type)
    body = {"error": {"type": err.type, "message": message, "field": field}}
    if details:
        body["error"]["details"] = details
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


def _libre_route(request: Request) -> bool:
    return request.url.path in ("/translate", "/languages")


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method == "POST" and ctype != "application/json" and not ctype.endswith("+json"):
        # FastAPI did not parse the body at all: say so instead of "body: must be an object"
        return _error(415, f"Content-Type: {request.url.path} takes a JSON body (application/json), "
                           f"got {ctype or 'none'}", "Content-Type")
    details = []
    for err in exc.errors():
        field, msg = format_validation_error(err)
        details.append({"field": field, "message": msg})
    first = details[0] if details else {"field": None, "message": "invalid request"}
    return _error(422, first["message"], first["field"], details=details if len(details) > 1 else None)


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    """Framework errors (unknown path, wrong method, unparsable body) in the service's error shape."""
    message = exc.detail if isinstance(exc.detail, str) else "invalid request"
    if _libre_route(request):
        return _libre_error(ServiceError(exc.status_code, message))
    if exc.status_code == 400:  # the body could not be parsed (e.g. invalid UTF-8 in JSON)
        return _error(422, f"body: {message} (send UTF-8 JSON)", "body")
    return _error(exc.status_code, f"{request.method} {request.url.path}: {message}", None)


@api.exception_handler(ServiceError)
async def _service_error(request: Request, exc: ServiceError):
    if _libre_route(request):
        return _libre_error(exc)
    return _error(exc.status, exc.message, exc.field, exc.type, exc.retry_after)


def _libre_error(exc: ServiceError) -> JSONResponse:
    """LibreTranslate's error format: {"error": message}; invalid input is a 400 there."""
    status = 400 if exc.status in (404, 413, 422) else exc.status
    headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))} if exc.retry_after is not None else None
    return JSONResponse({"error": exc.message}, status_code=status, headers=headers)


def _as_service_error(e: BaseException, model: str) -> Optional[ServiceError]:
    """Map what a handle call can raise to a ServiceError (None: not ours, re-raise)."""
    cause = getattr(e, "cause", None)
    if isinstance(e, ServiceError):
        return ServiceError(*e.args) if not hasattr(e, "status") else e
    if isinstance(cause, ServiceError):
        return cause
    if isinstance(e, BackPressureError) or isinstance(cause, BackPressureError):
        return ServiceError(503, f"model {model} is overloaded ({e}); retry later", retry_after=RETRY_AFTER_S)
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)) or \
            type(e).__name__ in ("DeploymentUnavailableError",):
        return ServiceError(503, f"model {model} is unavailable ({type(e).__name__}); retry later",
                            retry_after=RETRY_AFTER_S)
    return None


def _unique(seq: list[str], exclude: str) -> list[str]:
    seen, out = {exclude, ""}, []
    for s in seq:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


async def _libre_fields(request: Request) -> dict:
    """The request fields from a JSON body or a form body (urlencoded or multipart), like LibreTranslate."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json" or ctype.endswith("+json"):
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):   # RecursionError: absurd nesting
            raise ServiceError(400, "Invalid JSON format")
        if not isinstance(body, dict):
            raise ServiceError(400, "Invalid JSON format")
        return body
    fields: dict[str, Any] = dict(request.query_params)
    if ctype in ("application/x-www-form-urlencoded", "multipart/form-data"):
        if ctype == "multipart/form-data":
            form = await request.form()
            pairs = [(k, v) for k, v in form.multi_items() if isinstance(v, str)]
        else:
            # Decoded as UTF-8 ourselves: clients (curl -d) send raw UTF-8 bytes unescaped, and a
            # Latin-1 reading would garble them.
            try:
                text = (await request.body()).decode("utf-8")
            except UnicodeDecodeError:
                raise ServiceError(400, "Invalid request: the form body is not valid UTF-8")
            try:  # percent-escapes must decode to UTF-8 too
                pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, encoding="utf-8", errors="strict")
            except UnicodeDecodeError:
                raise ServiceError(400, "Invalid request: a form field is not valid UTF-8 once percent-decoded")
        grouped: dict[str, list[str]] = {}
        for k, v in pairs:
            grouped.setdefault(k, []).append(v)
        for key, values in grouped.items():
            if values:
                # A repeated q is a batch; LibreTranslate normalises form line endings to \n.
                values = ["\n".join(v.splitlines()) if key == "q" else v for v in values]
                fields[key] = values if key == "q" and len(values) > 1 else values[0]
    return fields


# Elements that sit inside a sentence (HTML's phrasing content); text around them is one sentence.
_INLINE_TAGS = frozenset("a abbr b bdi bdo cite data dfn em i mark q s small span strong sub sup time u".split())
# Elements whose text is not prose: kept as it is.
_VERBATIM_TAGS = frozenset("script style noscript template textarea pre code kbd samp var".split())


class _HtmlText:
    """LibreTranslate's format=html: translate the text of an HTML fragment and keep the markup.

    Text interrupted only by inline elements with plain-text content (``<b>``, ``<a href=..>``,
    ``<em>``, ...) is translated as one unit, so a sentence split by tags keeps its meaning; each
    inline element is then put back around its own words: its own translation where that occurs in
    the unit's translation (case-insensitive; the approach of Argos Translate's tag handling), else
    the words of it that occur there; else its tags are dropped and its text stays translated in
    the sentence. Other text nodes are translated one by one, whitespace around them kept. Text in
    script, style, code, pre and similar elements is left as it is; entities in the model's output
    (Multi30k's text has ``&amp;``) are decoded before escaping.
    """

    def __init__(self, html: str):
        from html.parser import HTMLParser
        from html import escape
        parts: list[tuple[str, str, str]] = []   # (kind, raw, tag): kind is start/end/text/markup
        verbatim: list[str] = []                 # open elements whose text is kept as it is

        class P(HTMLParser):
            def handle_starttag(self, tag, attrs):
                parts.append(("start", self.get_starttag_text(), tag))
                if tag in _VERBATIM_TAGS:
                    verbatim.append(tag)

            def handle_startendtag(self, tag, attrs):
                parts.append(("markup", self.get_starttag_text(), tag))

            def handle_endtag(self, tag):
                parts.append(("end", f"</{tag}>", tag))
                if tag in verbatim:
                    del verbatim[len(verbatim) - 1 - verbatim[::-1].index(tag):]

            def handle_data(self, data):
                if verbatim:   # script/style data arrive raw; other text was unescaped
                    parts.append(("markup", data if verbatim[-1] in self.CDATA_CONTENT_ELEMENTS
                                  else escape(data, quote=False), ""))
                else:
                    parts.append(("text", data, ""))

            def handle_comment(self, data):
                parts.append(("markup", f"<!--{data}-->", ""))

            def handle_entityref(self, name):
                parts.append(("markup", f"&{name};", ""))

            def handle_charref(self, name):
                parts.append(("markup", f"&#{name};", ""))

            def handle_decl(self, decl):
                parts.append(("markup", f"<!{decl}>", ""))

        p = P(convert_charrefs=True)
        p.feed(html)
        p.close()
        # units: ("markup", raw) | ("text", raw) | ("run", [(start tag, text, end tag), ...]); in a
        # run, plain text nodes have empty tags
        self.units: list[tuple[str, Any]] = []
        i = 0
        while i < len(parts):
            items, j = [], i
            while j < len(parts):
                kind, raw, tag = parts[j]
                if kind == "text":
                    items.append(("", raw, ""))
                    j += 1
                elif (kind == "start" and tag in _INLINE_TAGS and j + 2 < len(parts)
                      and parts[j + 1][0] == "text" and parts[j + 1][1].strip()
                      and parts[j + 2][0] == "end" and parts[j + 2][2] == tag):
                    items.append((raw, parts[j + 1][1], parts[j + 2][1]))
                    j += 3
                else:
                    break
            if not items:
                self.units.append(("markup", parts[i][1]))
                i += 1
                continue
            if any(start for start, _, _ in items) and sum(bool(t.strip()) for _, t, _ in items) > 1:
                self.units.append(("run", items))
            else:
                self.units += [("run", [item]) if item[0] else ("text", item[1]) for item in items]
            i = j
        self.segments: list[str] = []
        for kind, unit in self.units:
            if kind == "text" and unit.strip():
                self.segments.append(unit)
            elif kind == "run":
                if len(unit) > 1:
                    self.segments.append("".join(t for _, t, _ in unit))      # the whole unit
                self.segments += [t for start, t, _ in unit if start and t.strip()]  # each inline element's text

    def rebuild(self, translations: list[str]) -> str:
        from html import escape, unescape
        it = (unescape(t) for t in translations)

        def keep_space(raw: str, translated: str) -> str:
            lead, trail = _HtmlText._space_around(raw)
            return lead + escape(translated.strip(), quote=False) + trail

        out = []
        for kind, unit in self.units:
            if kind == "markup":
                out.append(unit)
            elif kind == "text":
                out.append(keep_space(unit, next(it)) if unit.strip() else unit)
            else:
                whole = next(it) if len(unit) > 1 else None
                pieces = [next(it) if start and t.strip() else None for start, t, _ in unit]
                if whole is not None:
                    out.append(self._inject(unit, whole, pieces))
                else:   # a lone inline element
                    out.append("".join(start + (keep_space(t, tr) if tr is not None else t) + end
                                       for (start, t, end), tr in zip(unit, pieces)))
        return "".join(out)

    @staticmethod
    def _space_around(raw: str) -> tuple[str, str]:
        """The whitespace before and after the text of ``raw`` (kept around its translation)."""
        return raw[: len(raw) - len(raw.lstrip())], raw[len(raw.rstrip()):]

    @staticmethod
    def _inject(unit, whole: str, pieces: list) -> str:
        """The unit's translation with each inline element around its own words (see the class doc)."""
        from html import escape
        text = "".join(t for _, t, _ in unit)
        lead, trail = _HtmlText._space_around(text)
        whole = whole.strip()
        low, pos, out = whole.lower(), 0, [lead]
        for (start, _, end), tr in zip(unit, pieces):
            if not start:
                continue
            tr = (tr or "").strip()
            span = None
            for cand in dict.fromkeys([tr, tr.rstrip(".!?")]):        # its translation ("Dog." -> "Dog")
                at = low.find(cand.lower(), pos) if cand else -1
                if at >= 0:
                    span = (at, at + len(cand))
                    break
            if span is None:                                          # else the words of it found there
                hits = [m for w in dict.fromkeys(re.findall(r"\w{3,}", tr.lower()))
                        for m in [re.search(rf"\b{re.escape(w)}\b", low[pos:])] if m]
                if hits:
                    first = min(m.start() for m in hits)
                    last = max(m.end() for m in hits if m.start() - first <= 40)
                    span = (pos + first, pos + last)
            if span is None:                                          # else: tags dropped, text kept
                continue
            out += [escape(whole[pos: span[0]], quote=False), start, escape(whole[span[0]: span[1]], quote=False), end]
            pos = span[1]
        out += [escape(whole[pos:], quote=False), trail]
        return "".join(out)


def _sse_event(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


@serve.ingress(api)
class Gateway:
    """The HTTP ingress: validates, routes to a model's translator, streams, serves metrics and docs."""

    def __init__(self, cards: list[dict], handles: Optional[dict[str, DeploymentHandle]] = None,
                 engine: Optional[dict] = None, num_threads: int = 1):
        self.cards = {c["id"]: c for c in cards}
        self.default = cards[0]["id"]
        self.engine_config = engine or {}
        self.backend = _RemoteBackend(handles) if handles is not None else _LocalBackend(cards, num_threads)
        self._ready_seen: set[str] = set()   # models that have answered /readyz's probe once

    async def reconfigure(self, user_config: dict) -> None:
        """Only used with ``ingress: translator``: the engine settings of the in-process translators."""
        self.engine_config = user_config.get("engine", {})
        await self.backend.reconfigure(user_config)

    # ---- routing ----
    def resolve(self, model: Optional[str], source_lang: Optional[str], target_lang: Optional[str]) -> dict:
        """The card of the model that serves this request. Raises ServiceError 404."""
        pairs = ", ".join(f"{c['source_lang']}->{c['target_lang']} ({c['id']})" for c in self.cards.values())
        if model is not None:
            card = self.cards.get(model)
            if card is None:
                raise ServiceError(404, f"model: unknown model {model!r}; available: {sorted(self.cards)}", "model")
            for field, want, have in (("source_lang", source_lang, card["source_lang"]),
                                      ("target_lang", target_lang, card["target_lang"])):
                if want is not None and want != have:
                    raise ServiceError(404, f"{field}: model {model!r} translates {card['source_lang']}->"
                                            f"{card['target_lang']}, not {want!r}", field)
            return card
        if source_lang is None and target_lang is None:
            return self.cards[self.default]
        for card in self.cards.values():
            if source_lang in (None, card["source_lang"]) and target_lang in (None, card["target_lang"]):
                return card
        field = "source_lang" if source_lang is not None and not any(
            c["source_lang"] == source_lang for c in self.cards.values()) else "target_lang"
        raise ServiceError(404, f"{field}: no model for {source_lang or '*'}->{target_lang or '*'}; available "
                                f"pairs: {pairs}", field)

    async def _call(self, model: str, method: str, *args):
        try:
            return await self.backend.call(model, method, *args)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped or re-raised
            mapped = _as_service_error(e, model)
            if mapped is None:
                raise
            raise mapped from None

    # ---- native API ----
    @api.post("/v1/translate", response_model=TranslateResponse,
              responses={404: {"model": ErrorResponse}, 413: {"model": ErrorResponse},
                         422: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    async def translate(self, body: TranslateRequest, request: Request):
        """Translate one text or a list of texts (paragraphs are split into sentences and rejoined).

        With ``"stream": true`` the answer is Server-Sent Events: ``event: token`` per new target token
        (``{"index", "text", "token"}``; the concatenated ``text`` of an index is its translation), then
        ``event: response`` with the whole response; ``event: error`` if it fails midway.
        """
        card = self.resolve(body.model, body.source_lang, body.target_lang)
        request.state.model = card["id"]
        req = body.model_dump()
        req["texts"], req["is_list"] = body.texts, isinstance(body.text, list)
        if not body.stream:
            result = await self._call(card["id"], "translate", req)
            request.state.usage = result["usage"]
            return JSONResponse(result)
        request.state.stream = True
        return await self._sse(card["id"], req, request)

    async def _sse(self, model: str, req: dict, request: Request) -> StreamingResponse:
        gen = self.backend.stream(model, req)
        try:
            first = await gen.__anext__()     # validation and admission errors become HTTP errors
        except StopAsyncIteration:
            raise ServiceError(500, "stream ended before it started")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            mapped = _as_service_error(e, model)
            if mapped is None:
                raise
            raise mapped from None
        if ERROR_KEY in first:
            raise ServiceError(*first[ERROR_KEY])

        async def events():
            try:
                async for ev in gen:
                    if ERROR_KEY in ev:
                        raise ServiceError(*ev[ERROR_KEY])
                    if ev["event"] == "response":
                        request.state.usage = ev["data"]["usage"]
                        yield _sse_event("response", ev["data"])
                    else:
                        yield _sse_event("token", {k: ev[k] for k in ("index", "text", "token")})
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
                err = _as_service_error(e, model) or ServiceError(500, f"internal error: {type(e).__name__}")
                yield _sse_event("error", {"error": {"type": err.type, "message": err.message,
                                                     "field": err.field}})

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @api.get("/v1/models", response_model=ModelsResponse)
    async def models(self):
        """The served models with their languages, configuration and test BLEU."""
        async def one(c: dict) -> dict:
            try:   # the replica's own view: the engine settings it really runs with
                info = await asyncio.wait_for(self._call(c["id"], "info"), timeout=5)
                engine = info.get("engine", {})
            except Exception:  # noqa: BLE001 - still loading: the configured settings
                engine = {**self.engine_config.get("engine", {}), **c.get("engine", {})}
            return {"id": c["id"], "source_lang": c["source_lang"], "target_lang": c["target_lang"],
                    "config": c["config"], "test_bleu": c.get("test_bleu"), "metadata": c["metadata"],
                    "engine": engine}
        return {"object": "list", "data": list(await asyncio.gather(*(one(c) for c in self.cards.values())))}

    @api.get("/healthz")
    async def healthz(self):
        """Liveness: the HTTP ingress answers."""
        return {"status": "ok"}

    @api.get("/readyz")
    async def readyz(self):
        """Readiness: 200 once every model is loaded and its engine runs, else 503 (within ~1 s: a
        model whose replica does not exist yet would otherwise hold the probe until it does).
        A model that has answered once stays ready while its replica is merely slow to answer."""
        async def one(name: str) -> bool:
            try:
                ok = bool(await asyncio.wait_for(self._call(name, "ready"), timeout=READY_PROBE_S))
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

    @api.get("/metrics", response_class=PlainTextResponse)
    async def metrics(self):
        """Prometheus text format: every replica's series, from every node's Ray metrics agent."""
        text = await scrape_metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/", include_in_schema=False)
    async def root(self):
        return RedirectResponse("/docs")

    # ---- LibreTranslate-compatible API ----
    @api.get("/languages", response_model=list[LibreLanguage])
    async def languages(self):
        """LibreTranslate: every language with the codes it translates into."""
        codes: dict[str, set] = {}
        for c in self.cards.values():
            codes.setdefault(c["source_lang"], set()).add(c["target_lang"])
            codes.setdefault(c["target_lang"], set())
        return [{"code": code, "name": LANGUAGE_NAMES.get(code, code), "targets": sorted(t)}
                for code, t in codes.items()]

    @api.post("/translate", responses={400: {"description": '{"error": message}'}})
    async def libre_translate(self, request: Request):
        """LibreTranslate: ``q`` (string or list), ``source``, ``target``, ``format`` (text|html),
        ``alternatives``, ``api_key`` as JSON, form-urlencoded or multipart form. Answers
        ``{"translatedText": ...}`` (plus ``alternatives`` when asked); errors ``{"error": message}``.
        """
        try:
            fields = await _libre_fields(request)
            req, card, n_alt, html_mode, batch = self._libre_request(fields)
            auto = fields.get("source") == "auto"
        except ServiceError as e:
            return _libre_error(e)
        request.state.model = card["id"]
        try:
            if html_mode:
                texts = req["texts"]
                htmls = [_HtmlText(t) for t in texts]
                req["texts"] = [s for h in htmls for s in h.segments]
                result = await self._call(card["id"], "translate", req)
                out, k = [], 0
                for h in htmls:
                    n = len(h.segments)
                    out.append(h.rebuild([t["text"] for t in result["translations"][k:k + n]]))
                    k += n
                alts = [[] for _ in texts]
            else:
                result = await self._call(card["id"], "translate", req)
                out = [t["text"] for t in result["translations"]]
                alts = [_unique([a["text"] for a in t["alternatives"]], t["text"])[:n_alt]
                        for t in result["translations"]]
        except ServiceError as e:
            return _libre_error(e)
        request.state.usage = result["usage"]
        body: dict[str, Any] = {"translatedText": out if batch else out[0]}
        if auto:    # no detection: "auto" resolved to the only source language served for the target
            detected = {"confidence": 100.0, "language": card["source_lang"]}
            body["detectedLanguage"] = [detected] * len(out) if batch else detected
        if n_alt > 0:
            body["alternatives"] = alts if batch else alts[0]
        return JSONResponse(body)

    def _libre_request(self, f: dict) -> tuple[dict, dict, int, bool, bool]:
        q, source, target = f.get("q"), f.get("source"), f.get("target")
        for name, value in (("q", q), ("source", source), ("target", target)):
            if not value:
                raise ServiceError(400, f"Invalid request: missing {name} parameter", name)
        batch = isinstance(q, list)
        if not (isinstance(q, str) or (batch and all(isinstance(t, str) for t in q))):
            raise ServiceError(400, "Invalid request: q must be a string or a list of strings", "q")
        for name, value in (("source", source), ("target", target)):
            if not isinstance(value, str):
                raise ServiceError(400, f"Invalid request: {name} must be a string", name)
        fmt = f.get("format") or "text"
        if fmt not in ("text", "html"):
            raise ServiceError(400, f"{fmt} format is not supported", "format")
        try:
            n_alt = int(f.get("alternatives") or 0)
        except (TypeError, ValueError):
            raise ServiceError(400, "Invalid request: alternatives parameter is not a number", "alternatives")
        if n_alt < 0:
            raise ServiceError(400, "Invalid request: alternatives parameter must be >= 0", "alternatives")
        if n_alt > MAX_BEAM_SIZE - 1:
            raise ServiceError(400, f"Invalid request: alternatives parameter must be <= {MAX_BEAM_SIZE - 1}",
                               "alternatives")
        sources = {c["source_lang"] for c in self.cards.values()}
        targets = {c["target_lang"] for c in self.cards.values()}
        if source == "auto":
            candidates = [c for c in self.cards.values() if c["target_lang"] == target]
            if len({c["source_lang"] for c in candidates}) != 1:
                raise ServiceError(400, "auto is not supported: give the source language "
                                        f"(one of {sorted(sources)})", "source")
            source = candidates[0]["source_lang"]
        if source not in sources:
            raise ServiceError(400, f"{source} is not supported", "source")
        if target not in targets and target not in sources:
            raise ServiceError(400, f"{target} is not supported", "target")
        card = next((c for c in self.cards.values() if c["source_lang"] == source and c["target_lang"] == target),
                    None)
        if card is None:
            raise ServiceError(400, f"{LANGUAGE_NAMES.get(target, target)} ({target}) is not available as a target "
                                    f"language from {LANGUAGE_NAMES.get(source, source)} ({source})", "target")
        n_best = n_alt + 1
        req = {"texts": list(q) if batch else [q], "is_list": batch, "field": "q",
               "beam_size": max(4, n_best), "n_best": n_best, "max_new_tokens": None, "length_penalty": 1.0,
               "return_attention": False, "attention": {"kinds": ["cross"], "layers": None, "heads": None}}
        return req, card, n_alt, fmt == "html", batch


# ---- the application -------------------------------------------------------------------------------
class TranslatorReplica:
    """A Serve replica around one model's Translator: torch threads = its CPU share, GPU when assigned one."""

    async def __init__(self, card: dict):
        import torch
        resources = ray.get_runtime_context().get_assigned_resources() if ray.is_initialized() else {}
        threads = max(1, round(resources.get("CPU", 1)))
        device = "cuda" if resources.get("GPU", 0) > 0 and torch.cuda.is_available() else "cpu"
        self.translator = Translator(card, device=device, num_threads=threads)

    async def reconfigure(self, user_config: dict) -> None:
        """user_config = EngineConfig fields (max_num_seqs, max_prefill_tokens, max_waiting, policy, ...)."""
        await self.translator.reconfigure(user_config)

    # A ServiceError (a 4xx/503 for the client) travels back as a value, not as a replica failure.
    async def translate(self, req: dict) -> dict:
        try:
            return await self.translator.translate(req)
        except ServiceError as e:
            return {ERROR_KEY: list(e.args)}

    async def stream(self, req: dict):
        try:
            async for ev in self.translator.stream(req):
                yield ev
        except ServiceError as e:
            yield {"event": "error", ERROR_KEY: list(e.args)}

    def ready(self) -> bool:
        return self.translator.ready()

    def info(self) -> dict:
        return self.translator.info()

    def stats(self) -> dict:
        return self.translator.stats()

    async def __del__(self):
        await self.translator.stop()


def build_app(args: dict | AppArgs | None = None) -> serve.Application:
    """The bound application for ``serve.run`` / ``serve run`` / a serve config's ``import_path``.

    args: see AppArgs (models, engine, translator/gateway deployment options, ingress layout,
    num_cpus, num_gpus). Raises FileNotFoundError / ValueError for a missing or incomplete checkpoint.
    """
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    cards = []
    for spec in args.models:
        card = model_card(spec.name, spec.checkpoint, spec.source_lang, spec.target_lang)
        card["engine"] = spec.engine
        cards.append(card)
    if len({c["id"] for c in cards}) != len(cards):
        raise ValueError(f"model names must be unique: {[c['id'] for c in cards]}")
    if args.ingress == "translator":
        # One deployment: the ingress replica hosts every model's translator itself.
        opts = translator_options(args, args.models[0])
        opts["name"] = "Gateway"
        opts["user_config"] = {"engine": args.engine, "per_model": {s.name: s.engine for s in args.models}}
        threads = max(1, round(opts["ray_actor_options"].get("num_cpus", 1)))
        return serve.deployment(Gateway, **opts).bind(cards, None, {"engine": args.engine}, threads)
    handles = {}
    for spec, card in zip(args.models, cards):
        handles[spec.name] = serve.deployment(TranslatorReplica, **translator_options(args, spec)).bind(card)
    return serve.deployment(Gateway, **gateway_options(args)).bind(cards, handles, {"engine": args.engine})


def __getattr__(name: str):
    # `serve run service.deployment:app`: built on first access, so importing this module needs no checkpoint.
    if name == "app":
        return build_app({})
    raise AttributeError(name)
