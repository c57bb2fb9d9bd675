"""``local_services``: the routers' ``Services`` over a translate function in this process (no Ray,
no model unless ``run`` uses one), for tests that call an API's functions or serve
``http.build_app(services)``."""
from __future__ import annotations

from typing import Awaitable, Callable, Optional

from service.api.document_store import DocumentSettings, DocumentStore
from service.api.glossaries import GlossaryClient, GlossaryStore
from service.api.middleware.guard import Guard, GuardSettings
from service.api.services import Services
from service.pipeline import LanguageGraph, Pipeline
from service.protocol import TranslateJob, TranslateResponse, Translation, Usage
from service.translator.langid import LanguageDetector
from service.translator.memory import MemoryStore


class FunctionBackend:
    """A backend whose every model is ``run(model, job)``."""

    def __init__(self, run: Callable[[str, TranslateJob], Awaitable[TranslateResponse]]):
        self.run = run

    async def translate(self, model: str, job: TranslateJob) -> TranslateResponse:
        return await self.run(model, job)

    def stream(self, model: str, job: TranslateJob):
        raise NotImplementedError("FunctionBackend does not stream")

    async def ready(self, model: str) -> bool:
        return True

    async def reconfigure(self, user_config: dict) -> None:
        pass


def answering(transform: Callable[[str], str], jobs: Optional[list] = None,
              with_model: bool = False) -> Callable[[str, TranslateJob], Awaitable[TranslateResponse]]:
    """A ``run`` that answers each text as ``transform(text)``, appending each job (``(model, job)``
    with ``with_model``) to ``jobs`` when given."""
    async def run(model: str, job: TranslateJob) -> TranslateResponse:
        if jobs is not None:
            jobs.append((model, job) if with_model else job)
        return TranslateResponse(model=model, usage=Usage(source_tokens=1, generated_tokens=1), translations=[
            Translation(text=transform(t), tokens=[], source_tokens=[], score=0.0, finish_reason="eos")
            for t in job.texts])
    return run


def upper_cased(jobs: list, with_model: bool = False) -> Callable[[str, TranslateJob], Awaitable[TranslateResponse]]:
    """A ``run`` that answers each text upper-cased (a translation that shows), appending each job
    (``(model, job)`` with ``with_model``) to ``jobs``."""
    return answering(str.upper, jobs, with_model)


def identity(jobs: Optional[list] = None) -> Callable[[str, TranslateJob], Awaitable[TranslateResponse]]:
    """A ``run`` that answers each text unchanged (the identity round trip)."""
    return answering(lambda t: t, jobs)


OPEN, CLOSE = "\u27e6", "\u27e7"      # the markers ``marked`` wraps each text in


def marked(jobs: Optional[list] = None) -> Callable[[str, TranslateJob], Awaitable[TranslateResponse]]:
    """A ``run`` that answers each text wrapped in OPEN .. CLOSE (what was sent, and where it went)."""
    return answering(lambda t: OPEN + t + CLOSE, jobs)


def local_services(cards, run, engine: Optional[dict] = None, detector: Optional[LanguageDetector] = None,
                   glossaries: Optional[GlossaryClient] = None, guard: Optional[Guard] = None,
                   store_dir: Optional[str] = None, pivot_lang: Optional[str] = "en",
                   memory_file: Optional[str] = None) -> Services:
    """Services over ``cards`` whose translations are ``run(model, job)``; ``engine``: EngineConfig
    fields of the limits; ``store_dir``: where documents are kept; ``memory_file``: the translation
    memory's file (None: the memory is off)."""
    graph = LanguageGraph(list(cards), pivot_lang)
    backend = FunctionBackend(run)
    store = glossaries or GlossaryClient(GlossaryStore(""))
    doc_settings = DocumentSettings(store_dir=store_dir) if store_dir else DocumentSettings()
    return Services(graph=graph, pipeline=Pipeline(graph, backend, store, engine=engine), backend=backend,
                    detector=detector or LanguageDetector(), glossaries=store,
                    guard=guard or Guard(GuardSettings(), env=""), doc_settings=doc_settings,
                    doc_store=DocumentStore(doc_settings),
                    memory=MemoryStore(memory_file) if memory_file else None)
