"""``Pipeline``: what every route does once its wire format is read, free of HTTP and Ray.

    deadline(job, timeout_s)          the job's deadline (timeout_s <= max_timeout_s)
    with_glossary(job, id, scope)     a stored glossary's entries on the job (before the request's own)
    check(model, job, origin)         the model's (or every pivot leg's) limits
    jobs(groups, job_of)              one checked job per model of the routed texts (autodetect.groups)
    run(model, job, origin)           a model's translator, or a pivot route's two legs; run_all: several at once
    open_stream(model, job, origin)   a started stream of StreamItems (a pivot's first leg run whole)

A job goes with its ``JobOrigin`` (the request field of its texts), which the pipeline keeps: the
limits name the texts with it, and so do the errors of a translator, renamed as they come back.

Models run behind a ``Backend`` (``translate(model, job)``, ``stream(model, job)``): in this process
or through Ray handles (``service/api/backends.py``); the pipeline does not know which.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import AsyncIterator, Callable, Iterator, Optional, Protocol

from service.engine import EngineConfig
from service.engine.validation import ModelLimits
from service.protocol import (
    JobOrigin,
    ServiceError,
    StreamItem,
    TranslateJob,
    TranslateResponse,
)
from service.replica import mapped_errors

from . import autodetect, pivot
from .languages import LanguageGraph


class Backend(Protocol):
    """How the pipeline reaches a model's translator (``service/api/backends.py``)."""
    async def translate(self, model: str, job: TranslateJob) -> TranslateResponse: ...

    def stream(self, model: str, job: TranslateJob) -> AsyncIterator[StreamItem]: ...


class GlossaryStore(Protocol):
    """Stored glossaries (``service/api/glossaries.GlossaryClient``)."""
    async def resolve(self, scope: str, glossary_id: str, source_lang: Optional[str],
                      target_lang: Optional[str]) -> tuple[tuple[str, str], ...]: ...


class Pipeline:
    """The one request path below the APIs (module docstring).

    Args:
        graph: the served models and pivot routes.
        backend: where each model's translator runs.
        glossaries: the stored glossaries.
        max_timeout_s: the longest ``timeout_s`` a request may ask for, and every request's deadline.
        engine: EngineConfig fields for every model (a card's ``engine`` overrides them): the limits.
    """

    def __init__(self, graph: LanguageGraph, backend: Backend, glossaries: GlossaryStore,
                 max_timeout_s: float = 60.0, engine: Optional[dict] = None):
        self.graph, self.backend, self.glossaries, self.max_timeout_s = graph, backend, glossaries, max_timeout_s
        self.configure(engine or {})

    def configure(self, engine: dict) -> None:
        """The engine settings every model runs with, and each model's and route's limits from them."""
        self.engine = engine
        self.limits: dict[str, ModelLimits | pivot.RouteLimits] = {
            c.id: ModelLimits.of(c.id, c.config, EngineConfig.from_dict({**engine, **c.engine}))
            for c in self.graph.cards.values()}
        self.limits.update({r.id: pivot.RouteLimits(r, tuple(self.limits[leg.card.id] for leg in r.legs))
                            for r in self.graph.pivots.values()})

    def deadline(self, job: TranslateJob, timeout_s: Optional[float] = None) -> TranslateJob:
        """The job with its deadline: ``timeout_s`` from now, or max_timeout_s. Raises ServiceError 422
        when timeout_s is over max_timeout_s."""
        if timeout_s is not None and timeout_s > self.max_timeout_s:
            raise ServiceError(422, f"timeout_s: must be <= {self.max_timeout_s:g} (the server's max_timeout_s), "
                                    f"got {timeout_s:g}", "timeout_s")
        timeout_s = timeout_s or self.max_timeout_s
        return dataclasses.replace(job, timeout_s=timeout_s, deadline=time.time() + timeout_s)

    async def with_glossary(self, job: TranslateJob, glossary_id: Optional[str], scope: str,
                            source_lang: Optional[str] = None, target_lang: Optional[str] = None) -> TranslateJob:
        """The job with stored glossary ``glossary_id``'s entries (None: as it is), and the job's own
        entries after them (then errors name ``glossary``).
        Raises ServiceError 404 for an unknown name, 409 for a glossary of other languages than
        source_lang -> target_lang."""
        if glossary_id is None:
            return job
        stored = await self.glossaries.resolve(scope, glossary_id, source_lang, target_lang)
        return dataclasses.replace(job, glossary=tuple(stored) + tuple(job.glossary), stored_glossary=not job.glossary)

    def check(self, model: str, job: TranslateJob, origin: JobOrigin = JobOrigin()) -> None:
        """The model's limits (a pivot route's: every leg's), the texts named as ``origin`` says.
        Raises ServiceError 413 or 422."""
        with mapped_errors(model):
            self.limits[model].check(job, origin)

    def jobs(self, groups: dict[str, list[int]], job_of: Callable[[str, list[int]], tuple[TranslateJob, JobOrigin]]
             ) -> dict[str, tuple[TranslateJob, JobOrigin]]:
        """model id -> ``job_of(model, indices of its texts)`` for each model of ``groups``
        (``autodetect.groups``), checked against the model's limits. Raises ServiceError."""
        out = {}
        for model, idx in groups.items():
            out[model] = job_of(model, idx)
            self.check(model, *out[model])
        return out

    async def run(self, model: str, job: TranslateJob, origin: JobOrigin = JobOrigin()) -> TranslateResponse:
        """``job`` on ``model``: a model's translator, or both legs of a pivot route."""
        with named_errors(origin):
            if model in self.graph.pivots:
                return await pivot.run(self.backend.translate, self.graph.pivots[model], job)
            return await self.backend.translate(model, job)

    async def run_all(self, jobs: dict[str, tuple[TranslateJob, JobOrigin]]) -> dict[str, TranslateResponse]:
        """Every model's job at once; the first error is raised once all have ended."""
        answers = await autodetect.gather_all([self.run(m, j, o) for m, (j, o) in jobs.items()])
        return dict(zip(jobs, answers))

    async def open_stream(self, model: str, job: TranslateJob, origin: JobOrigin = JobOrigin(),
                          final: Optional[Callable[[TranslateResponse], TranslateResponse]] = None
                          ) -> AsyncIterator[StreamItem]:
        """The stream of ``job`` on ``model``, started: its ``StreamStart`` is consumed here, so that
        validation and admission errors raise ServiceError before an answer begins. A pivot route
        streams its last leg once the first has run whole; its closing response is the combined one
        (``pivot.combined``). ``final`` rewrites the closing TranslateResponse."""
        with named_errors(origin):
            route = self.graph.pivots.get(model)
            if route is not None:
                first, job = await pivot.first_leg(self.backend.translate, route, job)
                model, outer = route.legs[1].card.id, final or (lambda r: r)

                def final(r, first=first, route=route, outer=outer):
                    return outer(pivot.combined(route, first, r))
            items = self.backend.stream(model, job)
            if final is not None:
                items = _rewrite_final(items, final)
            try:
                await anext(items)
            except StopAsyncIteration:
                raise ServiceError(500, "stream ended before it started") from None
            except ServiceError as e:
                raise pivot.second_leg_error(e, route) if route is not None else e from None
            return items


@contextlib.contextmanager
def named_errors(origin: JobOrigin) -> Iterator[None]:
    """Inside the block, a ServiceError that names a job's text as a translator does (``text[i]``) is
    raised naming it as ``origin`` says (``JobOrigin.named``)."""
    try:
        yield
    except ServiceError as e:
        named = origin.named(e)
        if named is e:
            raise
        raise named from None


async def _rewrite_final(items: AsyncIterator[StreamItem], final) -> AsyncIterator[StreamItem]:
    """The stream's items with its closing TranslateResponse replaced by ``final(response)``."""
    try:
        async for item in items:
            yield final(item) if isinstance(item, TranslateResponse) else item
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
