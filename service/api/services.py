"""``Services``: what the routers share, built once per ingress replica and handed to each route by
FastAPI's ``Depends(services)`` (a test builds its own and serves ``http.build_app(its_services)``,
or swaps the dependency with ``app.dependency_overrides[services]``)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from fastapi import Request
from ray.serve.handle import DeploymentHandle

from service.metrics import DetectionMetrics, DocumentMetrics, GuardMetrics, RetryMetrics
from service.pipeline import LanguageGraph, Pipeline, pivot
from service.replica import mapped_errors
from service.translator import ModelCard, TranslatorSettings
from service.translator.langid import LanguageDetector
from service.translator.memory import MemoryStore

from . import glossaries
from .backends import Backend, LocalBackend, PoolBackend, RemoteBackend
from .document_store import DocumentSettings, DocumentStore
from .middleware.caller import caller_of
from .middleware.guard import Guard, GuardSettings


@dataclass(frozen=True)
class IngressConfig:
    """What an ingress replica is built from (``Gateway(cards, handles, config, pool)``), made once
    from the app's config (``service.app.ingress_config``); the defaults serve with everything off."""
    engine: dict = field(default_factory=dict)        # EngineConfig fields for every model (a card's override them)
    num_threads: int = 1                              # torch threads of the in-process translators
    guard: GuardSettings = field(default_factory=GuardSettings)   # API keys, rate limits (middleware/guard.py)
    max_timeout_s: float = 60.0                       # the longest timeout_s a request may ask for, every deadline
    pivot_lang: Optional[str] = pivot.DEFAULT_PIVOT_LANG   # a pair no model serves goes through it; None: off
    documents: DocumentSettings = field(default_factory=DocumentSettings)   # where translated files are kept
    cors_origins: tuple[str, ...] = ("*",)            # origins browsers may call from; (): no CORS
    # the in-process translators' text stages, memory file and result cache; the memory file is also
    # the store of /suggest and /v1/memory (None: suggestions and the memory off)
    translator: TranslatorSettings = field(default_factory=TranslatorSettings)
    glossary_dir: Optional[str] = None                # the shared stored glossaries' files; None: none


@dataclass
class Services:
    """Every shared service a route may use; nothing else is reachable from a route."""
    graph: LanguageGraph                    # served models, pivot routes, the one model resolution
    pipeline: Pipeline                      # deadlines, glossaries, limits, running jobs (service/pipeline)
    backend: Backend                        # where the translators run (also: readiness, engine info)
    detector: LanguageDetector              # source "auto" and /detect
    glossaries: glossaries.GlossaryClient   # stored glossaries (the cluster's store)
    guard: Guard                            # API keys, rate limits, stream caps
    doc_settings: DocumentSettings          # where translated files are kept, chunking
    doc_store: DocumentStore
    memory: Optional[MemoryStore] = None    # the translation memory and /v2/usage counts; None: off
    cors_origins: list[str] = field(default_factory=lambda: ["*"])
    ready_seen: set[str] = field(default_factory=set)   # models that have answered /readyz's probe once
    usage_chars: int = 0                    # /v2/usage's count when there is no memory store
    doc_metrics: Optional[DocumentMetrics] = None   # documents by format and outcome; None: not counted

    @classmethod
    def build(cls, cards: list[ModelCard], handles: Optional[dict[str, DeploymentHandle]] = None,
              config: Optional[IngressConfig] = None, pool: Optional[dict] = None) -> "Services":
        """The services of an ingress replica (``gateway.Gateway``'s arguments: its docstring)."""
        config = config or IngressConfig()
        graph = LanguageGraph(cards, config.pivot_lang)
        if pool is not None:    # pinned models through their deployments, the pool's through Serve's multiplexing
            backend = PoolBackend(handles or {}, pool, RetryMetrics(list(graph.cards)).record)
        elif handles is not None:
            backend = RemoteBackend(handles, RetryMetrics(list(graph.cards)).record)
        else:
            backend = LocalBackend(cards, config.num_threads, config.translator)
        # source "auto": detects among common languages and the served ones; loads in the background (~2 s)
        detector = LanguageDetector(sorted(graph.sources | graph.targets))
        detector.on_detect = DetectionMetrics().record
        threading.Thread(target=detector.load, name="langid-load", daemon=True).start()
        store = glossaries.GlossaryClient.cluster(config.glossary_dir)
        memory_file = config.translator.memory_file
        return cls(graph=graph, pipeline=Pipeline(graph, backend, store, config.max_timeout_s, config.engine),
                   backend=backend, detector=detector, glossaries=store,
                   guard=Guard(config.guard, metrics=GuardMetrics()),
                   doc_settings=config.documents, doc_store=DocumentStore(config.documents),
                   memory=MemoryStore(memory_file) if memory_file else None,
                   cors_origins=list(config.cors_origins), doc_metrics=DocumentMetrics())

    async def reconfigure(self, user_config: dict) -> None:
        """The engine settings of the in-process translators ({"engine": fields for every model,
        "per_model": {model: overrides}}) and the limits they imply; the API keys read again."""
        await self.backend.reconfigure(user_config)
        self.pipeline.configure(user_config.get("engine", {}))
        self.guard.reload()

    def add_usage(self, scope: str, chars: int) -> None:
        """Add ``chars`` to the /v2/usage count of a caller's ``scope`` (``Caller.scope``; DeepL's
        ``character_count``: texts and documents): in the memory's store, else in this replica.
        Raises ServiceError (the memory's)."""
        if self.memory is not None:
            with mapped_errors("memory"):
                self.memory.add_usage(scope, chars)
        else:
            self.usage_chars += chars

    def memory_scope(self, request: Request) -> Optional[str]:
        """The request's translation memory (``TranslateJob.memory_scope``): its key's, "" with keys
        off; None when the memory is off."""
        return caller_of(request).scope if self.memory is not None else None


async def services(request: Request) -> Services:
    """The dependency every route takes: the services of the app serving the request. ``async`` so
    that FastAPI calls it on the event loop: a plain ``def`` dependency is run in a worker thread,
    a thread hand-off per request (about a tenth of a served request's CPU time)."""
    return request.app.state.services
