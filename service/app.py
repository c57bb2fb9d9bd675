"""The Ray Serve application, built from one config shape (``AppArgs``): ``build_app(args)``, a Serve
config's ``applications[].args`` and ``python -m service --config FILE`` take the same keys.

    serve run service.app:build_app                                  # every model under model/checkpoints/ (de-en first)
    serve run service.app:build_app engine='{"max_num_seqs": 32}'    # or a serve config's `args:`

Layouts (``ingress``; docs/deploy.md#configuration):
    translator (default): HTTP proxy -> Gateway replicas, each holding every model's Translator
        (``service.api.gateway.Gateway``: FastAPI, validation, routing, SSE, /metrics; model +
        continuous-batching Engine in the same process, no hop between processes)
    separate: HTTP proxy -> Gateway -> Translator-<model> replicas (``TranslatorReplica``), one
        deployment per model with its own replicas, resources and autoscaling
    separate + ``pool:``: also a ``Pool`` deployment whose replicas load the pool's models on demand
        (Serve's model multiplexing, ``service/pool.py``) next to the pinned per-model deployments
Concurrent requests reach a translator directly (no @serve.batch): each sentence is one engine call,
and the engine merges all of them into its prefill and decode batches. ``engine`` reaches the
replicas as their ``user_config`` and applies in place (``reconfigure``). ``max_ongoing_requests`` is
sized from the engine's ``max_num_seqs`` so Serve never caps a batch, ``max_queued_requests`` bounds
the queue in front of it; both Ray's back-pressure error and the engine's full queue become HTTP 503
with Retry-After.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Literal, Optional, Union

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve.schema import DeploymentSchema

from model.checkpoint import DEFAULT_CHECKPOINT
from service.protocol import StreamItem, TranslateJob, TranslateResponse

from .api.document_store import DocumentSettings
from .api.gateway import Gateway
from .api.middleware.access_log import flush_serve_log
from .api.middleware.guard import GuardSettings, RateLimit
from .api.services import IngressConfig
from .config import with_environment
from .engine import EngineConfig
from .protocol import RETRY_AFTER_S, ErrorRecord
from .replica import error_record, run_within, stream_within
from .state import state_dir
from .translator import TextConfig, Translator, TranslatorInfo, TranslatorSettings, model_card

logger = logging.getLogger("ray.serve")

# Serve's own access log repeats, for every HTTP request and again for every handle call to a
# translator, what the gateway's access log writes (service/api/middleware/access_log.py: request id, status,
# latency, tokens), and costs CPU per request on the serving path. Pass as ``serve.run(..., logging_config=LOGGING_CONFIG)``; the deploy/ configs say the same.
LOGGING_CONFIG = {"enable_access_log": False}


class ModelSpec(BaseModel):
    """One served model."""
    model_config = ConfigDict(extra="forbid")
    name: str = "de-en"                                   # model id in requests and /v1/models
    checkpoint: str = str(DEFAULT_CHECKPOINT)             # checkpoint directory (model/checkpoint.py)
    source_lang: Optional[str] = None                     # default: the checkpoint's metadata.json
    target_lang: Optional[str] = None
    engine: dict = Field(default_factory=dict)            # EngineConfig overrides for this model
    deployment: dict = Field(default_factory=dict)        # Serve deployment option overrides for this model


class PoolSpec(BaseModel):
    """The model pool (``ingress: separate`` only; docs/deploy.md#model-pool): replicas that load a
    model on its first request and evict the least recently used idle one."""
    model_config = ConfigDict(extra="forbid")
    models: list[ModelSpec] = Field(default_factory=list)   # declared one by one (name + checkpoint)
    models_dir: Optional[str] = None      # and/or: each checkpoint or MarianMT folder under it, named by folder
    max_models_per_replica: int = Field(3, ge=1)            # Serve's max_num_models_per_replica
    memory_budget_mb: Optional[float] = Field(None, gt=0, allow_inf_nan=False)   # weights + KV caches per replica
    engine: dict = Field(default_factory=dict)        # EngineConfig overrides for every pool model (user_config)
    deployment: dict = Field(default_factory=dict)    # Serve options of the Pool deployment (replicas, autoscaling)

    @field_validator("models", "engine", "deployment", mode="before")
    @classmethod
    def _json_text(cls, v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

    def specs(self, pinned: frozenset = frozenset()) -> list[ModelSpec]:
        """The pool's models: the listed ones, then one per model folder under ``models_dir``
        (``service.pool.discover_models``; FileNotFoundError when it is missing or holds none)
        except those named in ``pinned`` (served by their own deployments instead)."""
        from .pool import discover_models
        found = discover_models(self.models_dir) if self.models_dir else {}
        return list(self.models) + [ModelSpec(name=n, checkpoint=str(p)) for n, p in found.items() if n not in pinned]


def shipped_models(directory: Path = DEFAULT_CHECKPOINT.parent) -> list[ModelSpec]:
    """The models served when none are named: de-en (the default, reported missing if absent) and
    every other checkpoint directory under ``directory`` (model/checkpoints/) with its config.json
    and weights, named by folder, in name order: adding model/checkpoints/en-fr serves en->fr, and
    de->fr through en (pivot_lang)."""
    found = sorted(d for d in directory.iterdir() if d.is_dir() and d.name != DEFAULT_CHECKPOINT.name and
                   (d / "config.json").exists() and (d / "model.safetensors").exists()) if directory.is_dir() else []
    return [ModelSpec(name=DEFAULT_CHECKPOINT.name, checkpoint=str(directory / DEFAULT_CHECKPOINT.name))] + \
        [ModelSpec(name=d.name, checkpoint=str(d)) for d in found]


# Serve deployment options that ``translator:`` / ``gateway:`` / a model's ``deployment:`` may set:
# build_app names the deployments, and their user_config is ``engine``.
DEPLOYMENT_OPTIONS = frozenset(DeploymentSchema.model_fields) - {"name", "user_config"}


def _deployment_options(opts: dict) -> dict:
    unknown = sorted(set(opts) - DEPLOYMENT_OPTIONS)
    if unknown:
        raise ValueError(f"unknown Serve deployment option {unknown[0]!r} (engine settings go in engine:); "
                         f"choose from {sorted(DEPLOYMENT_OPTIONS)}")
    DeploymentSchema.model_validate({"name": "x", **opts})     # Serve's own checks of the values
    return opts


class AppArgs(BaseModel):
    """The application's one config shape: ``build_app`` arguments = a Serve config's ``args:`` =
    ``python -m service --config FILE`` (docs/deploy.md#configuration)."""
    model_config = ConfigDict(extra="forbid")
    models: list[ModelSpec] = Field(default_factory=lambda: shipped_models())   # the first is the default
    engine: dict = Field(default_factory=dict)            # EngineConfig fields for every model (user_config)
    # translator: every ingress replica holds every model's translator; separate: a Gateway in front
    # of one translator deployment per model
    ingress: Literal["translator", "separate"] = "translator"
    translator: dict = Field(default_factory=dict)        # Serve options of the replicas holding translators
    gateway: dict = Field(default_factory=dict)           # Serve options of the Gateway (ingress: separate)
    num_cpus: float = 0.8                                 # per translator replica (fractional: 2 fit on 2 cores)
    num_gpus: Optional[float] = None                      # per translator replica; None = 1 if the cluster has GPUs
    # hardening (docs/limits.md): all off by default
    api_keys_file: Optional[str] = None                   # keys one per line (MT_API_KEYS adds more); None = keys off
    protect_metrics: bool = False                         # with keys on, /metrics needs a key too
    protect_docs: bool = False                            # with keys on, /docs and /openapi.json need a key too
    protect_explorer: bool = False                        # with keys on, the explorer page (/) needs a key too
    rate_limit: Optional[RateLimit] = None                # token bucket per key (or client address); None = off
    max_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)   # every request's deadline; the largest timeout_s
    max_streams_per_key: Optional[int] = Field(None, ge=1)  # open SSE streams per key (or client address); None = off
    # failed key checks per client address before 429s; GET /metrics without a key per client (docs/security.md)
    failed_key_limit: Optional[RateLimit] = GuardSettings.model_fields["failed_key_limit"].default
    metrics_rate_limit: Optional[RateLimit] = GuardSettings.model_fields["metrics_rate_limit"].default
    # graceful shutdown (docs/deploy.md#graceful-shutdown-and-redeploys): how long a stopping replica
    # may finish what it accepted; None = max_timeout_s + 5 s, so every accepted request's deadline fits
    drain_timeout_s: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    # a pair no model serves is translated through this language when source -> it -> target models
    # exist (service/pipeline/pivot.py, docs/controls.md#pivoting); None: pivoting off
    pivot_lang: Optional[str] = Field("en", min_length=1)
    # document translation (docs/documents.md): store_dir shared by every ingress replica, ttl_s,
    # max_store_bytes, chunk_segments, parallel_chunks, public_url
    documents: DocumentSettings = Field(default_factory=DocumentSettings)
    text: TextConfig = Field(default_factory=TextConfig)  # the translators' text stages and stored keep list
    glossary_dir: Optional[str] = None                    # shared stored glossaries (*.tsv, *.csv); None: none
    state_dir: Optional[str] = None                       # memory, documents, key secret; None: the XDG one
    # clients (docs/clients.md): CORS, LibreTranslate's suggestions and the translation memory
    cors_origins: list[str] = Field(default_factory=lambda: ["*"])   # origins browsers may call from; [] = no CORS
    suggestions: bool = True                              # POST /suggest and /v1/memory; false: 403, memory unused
    memory_file: Optional[str] = None                     # the memory's SQLite file; None = {state dir}/memory.sqlite3
    memory_cache_entries: int = Field(0, ge=0)            # LRU cache of the model's translations per replica; 0 = off

    # models loaded on demand across a replica pool (ingress: separate; None = no pool)
    pool: Optional[PoolSpec] = None

    @model_validator(mode="before")
    @classmethod
    def _environment(cls, data: Any) -> Any:
        return with_environment(data)     # MT_* variables under the config's own values (service/config.py)

    @field_validator("models", "engine", "translator", "gateway", "rate_limit", "failed_key_limit",
                     "metrics_rate_limit", "documents", "text", "cors_origins", "pool",
                     mode="before")
    @classmethod
    def _json_text(cls, v: Any) -> Any:
        # `serve run service.app:build_app engine='{"max_num_seqs": 32}'` passes strings
        return json.loads(v) if isinstance(v, str) else v

    @field_validator("text")
    @classmethod
    def _keep_file(cls, v: TextConfig) -> TextConfig:
        # replicas may run in another working directory: an absolute path, checked now
        if not v.keep_file:
            return v
        return dataclasses.replace(v, keep_file=_existing(v.keep_file, "file", "text.keep_file"))

    @field_validator("glossary_dir")
    @classmethod
    def _glossary_dir(cls, v: Optional[str]) -> Optional[str]:
        return _existing(v, "directory", "glossary_dir") if v else None

    @field_validator("translator", "gateway")
    @classmethod
    def _serve_options(cls, v: dict) -> dict:
        return _deployment_options(v)

    @model_validator(mode="after")
    def _consistent(self) -> "AppArgs":
        try:
            pooled = self.pool.specs(self.pinned()) if self.pool is not None else []
        except FileNotFoundError as e:       # a models_dir that is missing or holds no model
            raise ValueError(str(e)) from None
        names = [m.name for m in (*self.models, *pooled)]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"models, pool: expected at least one model, with unique names, got {names}")
        for m in self.models:      # each model's engine settings, refused here naming the field
            EngineConfig.from_dict({**self.engine, **m.engine})
        if self.pool is not None:
            if self.ingress != "separate":
                raise ValueError("pool: a model pool needs ingress: separate (a Gateway in front of the Pool deployment)")
            _deployment_options(self.pool.deployment)
            for m in pooled:
                EngineConfig.from_dict({**self.engine, **self.pool.engine, **m.engine})
        for m in self.models:
            _deployment_options(m.deployment)
        if self.ingress == "translator":
            if self.gateway:
                raise ValueError("gateway: options of the separate layout's Gateway; with ingress: translator "
                                 "the one deployment takes translator: options")
            if any(m.deployment for m in self.models):
                raise ValueError("models[].deployment: per-model replicas need ingress: separate; with ingress: "
                                 "translator every replica holds every model (translator: options)")
        return self


    def pinned(self) -> frozenset:
        """Names of the models with their own deployments (a pool's models_dir skips them)."""
        return frozenset(m.name for m in self.models)


def _existing(path: str, kind: str, name: str) -> str:
    """``path`` made absolute; ValueError naming the field ``name`` unless it is an existing ``kind``
    ("file" or "directory")."""
    p = Path(path).expanduser().resolve()
    if not (p.is_file() if kind == "file" else p.is_dir()):
        raise ValueError(f"{name}: {path} is not an existing {kind}")
    return str(p)


def _cluster_has_gpu() -> bool:
    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch
    return torch.cuda.is_available()


def lifecycle(args: AppArgs) -> dict:
    """Serve's health-check and graceful-shutdown options of every deployment: a stopping replica
    (SIGTERM, a redeploy, a scale-down) leaves the routing, Serve waits (polling every 0.2 s) for its
    ongoing requests up to ``drain_timeout_s``, then runs its ``__del__`` (the translator's waits for
    the engine to empty) and kills it."""
    drain = args.drain_timeout_s if args.drain_timeout_s is not None else args.max_timeout_s + 5
    return {"health_check_period_s": 5, "graceful_shutdown_timeout_s": drain, "graceful_shutdown_wait_loop_s": 0.2}


def translator_options(args: AppArgs, spec: ModelSpec) -> dict:
    """Serve deployment options of one model's translator deployment."""
    engine = {**args.engine, **spec.engine}
    seqs = int(engine.get("max_num_seqs", EngineConfig.max_num_seqs))
    num_gpus = args.num_gpus if args.num_gpus is not None else (1 if _cluster_has_gpu() else 0)
    opts: dict[str, Any] = {
        "name": f"Translator-{spec.name}",
        "ray_actor_options": {"num_cpus": args.num_cpus, "num_gpus": num_gpus},
        # A greedy sentence holds one engine slot: 2x max_num_seqs keeps the batch full with a
        # next prefill waiting, so Serve never caps the engine's batch.
        "max_ongoing_requests": 2 * seqs,
        "max_queued_requests": 4 * seqs,
        "backpressure_config": {"status_code": 503, "retry_after_s": RETRY_AFTER_S},
        "user_config": engine, **lifecycle(args),
    }
    opts.update(args.translator)
    opts.update(spec.deployment)
    if "autoscaling_config" in opts:
        opts.pop("num_replicas", None)
    return opts


def pool_options(args: AppArgs) -> dict:
    """Serve deployment options of the ``Pool`` deployment: a translator deployment's (CPUs, queue
    bounds, autoscaling on its ongoing requests, drain), with ``translator:`` and then
    ``pool.deployment`` over them; user_config is ``engine`` with ``pool.engine`` over it."""
    pool = args.pool
    spec = ModelSpec(name="pool", engine=pool.engine, deployment=pool.deployment)
    opts = translator_options(args, spec)
    opts.update(name="Pool", user_config={**args.engine, **pool.engine})
    return opts


def gateway_options(args: AppArgs) -> dict:
    """Serve deployment options of the ingress deployment."""
    opts: dict[str, Any] = {
        "name": "Gateway",
        "ray_actor_options": {"num_cpus": 0.2},
        "max_ongoing_requests": 1024,
        "max_queued_requests": 1024,
        "backpressure_config": {"status_code": 503, "retry_after_s": RETRY_AFTER_S},
        # a replaced gateway keeps serving until its replacement is ready: without the surge, a
        # one-replica gateway left the HAProxy ingress with no route for a moment (404s)
        "max_surge_percent": 100,
        **lifecycle(args),
    }
    opts.update(args.gateway)
    return opts


def guard_settings(args: AppArgs, ingress: dict) -> GuardSettings:
    """The ingress's GuardSettings: each of its replicas enforces 1/n of the rate limits (n = its
    num_replicas, or max_replicas when it autoscales)."""
    auto = ingress.get("autoscaling_config")
    n = (auto.get("max_replicas", 1) if isinstance(auto, dict) else 1) if auto else ingress.get("num_replicas", 1)
    keys_file = args.api_keys_file
    if keys_file is not None:    # replicas may run elsewhere: an absolute path, checked now
        keys_file = str(Path(keys_file).resolve(strict=True))
    return GuardSettings(api_keys_file=keys_file, protect_metrics=args.protect_metrics,
                         protect_docs=args.protect_docs, protect_explorer=args.protect_explorer,
                         rate_limit=args.rate_limit,
                         max_streams_per_key=args.max_streams_per_key, failed_key_limit=args.failed_key_limit,
                         metrics_rate_limit=args.metrics_rate_limit,
                         key_secret_file=str((state_dir(args.state_dir) / "key-secret").expanduser().resolve()),
                         gateway_replicas=n if isinstance(n, int) and n > 0 else 1)


def translator_settings(args: AppArgs) -> TranslatorSettings:
    """Every translator's settings: the text stages, and the memory file as an absolute path every
    replica of the node opens (created with its directory on first use; None: suggestions off)."""
    memory_file = None
    if args.suggestions:
        memory_file = str(Path(args.memory_file or state_dir(args.state_dir) / "memory.sqlite3").expanduser()
                          .resolve())
    return TranslatorSettings(text=args.text, memory_file=memory_file, cache_entries=args.memory_cache_entries)


def ingress_config(args: AppArgs, ingress: dict, num_threads: int = 1) -> IngressConfig:
    """What the ingress replicas are built from (``ingress``: their Serve options; ``num_threads``:
    torch threads of in-process translators). The documents' directory is an absolute path."""
    store_dir = Path(args.documents.store_dir or state_dir(args.state_dir) / "documents").expanduser().resolve()
    return IngressConfig(engine=dict(args.engine), num_threads=num_threads, guard=guard_settings(args, ingress),
                         max_timeout_s=args.max_timeout_s, pivot_lang=args.pivot_lang,
                         documents=args.documents.model_copy(update={"store_dir": str(store_dir)}),
                         cors_origins=tuple(args.cors_origins), translator=translator_settings(args),
                         glossary_dir=args.glossary_dir)


class TranslatorReplica:
    """A Serve replica around one model's Translator: torch threads = its CPU share, GPU when assigned one.

    What the client should see as an HTTP error (a ``ServiceError``, or an engine error that maps to
    one) is returned (or yielded) as an ``ErrorRecord``, not raised: it is an answer, not a replica failure.
    """

    async def __init__(self, card, drain_timeout_s: float = 10.0, settings: Optional[TranslatorSettings] = None):
        import torch
        self.drain_timeout_s = drain_timeout_s
        resources = ray.get_runtime_context().get_assigned_resources() if ray.is_initialized() else {}
        threads = max(1, round(resources.get("CPU", 1)))
        device = "cuda" if resources.get("GPU", 0) > 0 and torch.cuda.is_available() else "cpu"
        self.translator = Translator(card, device=device, num_threads=threads, settings=settings)

    async def reconfigure(self, user_config: dict) -> None:
        """user_config = EngineConfig fields (max_num_seqs, max_prefill_tokens, max_waiting, policy, ...)."""
        await self.translator.reconfigure(user_config)

    async def translate(self, job: TranslateJob) -> Union[TranslateResponse, ErrorRecord]:
        try:
            return await run_within(self.translator.translate(job), job.deadline, job.timeout_s)
        except Exception as e:  # noqa: BLE001 - an answer if it maps to one, else a failure
            return error_record(e, self.translator.name)

    async def stream(self, job: TranslateJob) -> AsyncIterator[Union[StreamItem, ErrorRecord]]:
        try:
            async for item in stream_within(self.translator.stream(job), job.deadline, job.timeout_s):
                yield item
        except Exception as e:  # noqa: BLE001
            yield error_record(e, self.translator.name)

    def ready(self) -> bool:
        return self.translator.ready()

    def info(self) -> TranslatorInfo:
        return self.translator.info()

    def stats(self) -> dict:
        return self.translator.stats()

    async def __del__(self):
        """Serve's shutdown hook, after its drain of ongoing calls: wait for the engine to empty too
        (sentences of cancelled calls leave at its next step), then stop it, and write out the log
        lines Serve still buffers (``access_log.flush_serve_log``) before the process is killed."""
        left = await self.translator.drain(self.drain_timeout_s)
        if left:
            logger.warning("translator %s stopping with %d requests unfinished", self.translator.name, left)
        await self.translator.stop()
        flush_serve_log()


def deployment_options(args: AppArgs) -> dict[str, dict]:
    """Serve options of every deployment ``build_app(args)`` makes, by name (no checkpoint is read):
    ``Gateway`` alone, its replicas holding every model's translator (ingress: translator), or
    ``Gateway`` and one ``Translator-<model>`` per model (separate)."""
    if args.ingress == "translator":
        opts = translator_options(args, args.models[0])
        opts.update(name="Gateway", user_config={"engine": args.engine,
                                                 "per_model": {s.name: s.engine for s in args.models}})
        return {"Gateway": opts}
    translators = [translator_options(args, s) for s in args.models]
    if args.pool is not None:
        translators.append(pool_options(args))
    return {"Gateway": gateway_options(args), **{o["name"]: o for o in translators}}


def build_app(args: dict | AppArgs | None = None) -> serve.Application:
    """The bound application for ``serve.run`` / ``serve run`` / a serve config's ``import_path``.

    args: ``AppArgs`` or its fields. Raises FileNotFoundError / ValueError for a missing or incomplete
    checkpoint, ValueError (pydantic's ValidationError) for arguments AppArgs does not take.
    """
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    cards = [dataclasses.replace(model_card(s.name, s.checkpoint, s.source_lang, s.target_lang), engine=s.engine)
             for s in args.models]
    pool_cards = [dataclasses.replace(model_card(s.name, s.checkpoint, s.source_lang, s.target_lang),
                                      engine={**args.pool.engine, **s.engine}) for s in args.pool.specs(args.pinned())] if args.pool is not None else []
    opts = deployment_options(args)
    gateway = opts["Gateway"]
    if args.ingress == "translator":
        threads = max(1, round(gateway["ray_actor_options"].get("num_cpus", 1)))
        return serve.deployment(Gateway, **gateway).bind(cards, None, ingress_config(args, gateway, threads))
    settings = translator_settings(args)
    handles = {s.name: serve.deployment(TranslatorReplica, **(o := opts[f"Translator-{s.name}"])).bind(
                   card, o["graceful_shutdown_timeout_s"], settings)
               for s, card in zip(args.models, cards)}
    pool = None
    if args.pool is not None:
        from .pool import PoolDirectory, PoolReplica
        o = opts["Pool"]
        directory = serve.deployment(PoolDirectory, name="PoolDirectory", num_replicas=1,
                                     ray_actor_options={"num_cpus": 0}).bind()
        budget = int(args.pool.memory_budget_mb * 2 ** 20) if args.pool.memory_budget_mb else None
        pool = {"handle": serve.deployment(PoolReplica, **o).bind(pool_cards, args.pool.max_models_per_replica, budget,
                                                                  o["graceful_shutdown_timeout_s"], directory, settings),
                "directory": directory, "models": [c.id for c in pool_cards]}
    config = ingress_config(args, gateway)
    return serve.deployment(Gateway, **gateway).bind(cards + pool_cards, handles, config, pool)
