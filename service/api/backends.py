"""How the gateway reaches a model's translator: through a Ray Serve handle (one deployment per
model), or in its own process (``ingress: translator``). Both backends have the same typed methods,
and both raise what goes wrong as ``ServiceError`` (``errors.to_service_error``, the one mapping).

A translation is idempotent, so ``RemoteBackend`` retries a call once when the translator replica
that held it died or became unreachable before answering (``replica_lost``: Ray's ``ActorDiedError``
/ ``ActorUnavailableError``, also as a ``RayTaskError``'s cause): a non-streaming request, or a stream
that has yielded nothing past its ``StreamStart``. Serve's router has by then taken the dead replica
out of rotation, so the retry goes to another one (or waits for the replacement). Errors the replica
answered (``ErrorRecord``: 4xx, a full queue, a deadline) are never retried, and neither is a call
whose deadline has passed.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator, Protocol, Union

from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.handle import DeploymentHandle

from service.translator import ModelCard, TranslatorInfo

from .deadline import run_within, stream_within
from .errors import ErrorRecord, ServiceError, mapped_errors
from .schemas import StreamItem, StreamStart, TranslateJob, TranslateResponse

logger = logging.getLogger("ray.serve")
LOST = (ActorDiedError, ActorUnavailableError)   # the replica died or cannot be reached: no answer came


class Backend(Protocol):
    async def translate(self, model: str, job: TranslateJob) -> TranslateResponse: ...

    def stream(self, model: str, job: TranslateJob) -> AsyncIterator[StreamItem]: ...

    async def ready(self, model: str) -> bool: ...

    async def info(self, model: str) -> TranslatorInfo: ...

    async def reconfigure(self, user_config: dict) -> None: ...


def _unwrap(out: Union[TranslateResponse, StreamItem, ErrorRecord]):
    """A replica's answer, or the ServiceError it returned as a record."""
    if isinstance(out, ErrorRecord):
        raise ServiceError.from_record(out)
    return out


def replica_lost(e: BaseException) -> bool:
    """Whether ``e`` says the replica serving the call died or is unreachable (itself, or as the
    cause a ``RayTaskError`` carries), i.e. the call got no answer."""
    return isinstance(e, LOST) or isinstance(getattr(e, "cause", None), LOST)


def _may_retry(e: BaseException, job: TranslateJob, model: str) -> bool:
    if not replica_lost(e) or (job.deadline is not None and time.time() >= job.deadline):
        return False
    logger.warning("model %s: translator replica lost (%s); retrying once on another replica", model,
                   type(e).__name__)
    return True


class RemoteBackend:
    """Translators in their own Serve deployments (``service.app.TranslatorReplica``), one per model."""

    def __init__(self, handles: dict[str, DeploymentHandle]):
        self.handles = handles

    async def translate(self, model: str, job: TranslateJob) -> TranslateResponse:
        with mapped_errors(model):
            try:
                return _unwrap(await self.handles[model].translate.remote(job))
            except Exception as e:  # noqa: BLE001 - only a lost replica is retried
                if not _may_retry(e, job, model):
                    raise
            return _unwrap(await self.handles[model].translate.remote(job))

    async def stream(self, model: str, job: TranslateJob) -> AsyncIterator[StreamItem]:
        started = sent = False      # StreamStart passed on; anything after it passed on
        with mapped_errors(model):
            for attempt in range(2):
                try:
                    async for item in self.handles[model].options(stream=True).stream.remote(job):
                        item = _unwrap(item)
                        if isinstance(item, StreamStart):
                            if started:
                                continue        # the retry's own start: the caller has one
                            started = True
                        else:
                            sent = True
                        yield item
                    return
                except Exception as e:  # noqa: BLE001 - only a lost replica before any token is retried
                    if attempt or sent or not _may_retry(e, job, model):
                        raise

    async def ready(self, model: str) -> bool:
        with mapped_errors(model):
            return await self.handles[model].ready.remote()

    async def info(self, model: str) -> TranslatorInfo:
        with mapped_errors(model):
            return await self.handles[model].info.remote()

    async def reconfigure(self, user_config: dict) -> None:
        pass    # each translator deployment has its own user_config


class LocalBackend:
    """Every model's translator in the ingress replica itself (no extra hop)."""

    def __init__(self, cards: list[ModelCard], num_threads: int):
        from service.translator import Translator
        self.translators = {c.id: Translator(c, num_threads=num_threads) for c in cards}

    async def translate(self, model: str, job: TranslateJob) -> TranslateResponse:
        with mapped_errors(model):
            return await run_within(self.translators[model].translate(job), job.deadline, job.timeout_s)

    async def stream(self, model: str, job: TranslateJob) -> AsyncIterator[StreamItem]:
        with mapped_errors(model):
            async with contextlib.aclosing(stream_within(self.translators[model].stream(job), job.deadline,
                                                         job.timeout_s)) as items:
                async for item in items:
                    yield item

    async def ready(self, model: str) -> bool:
        return self.translators[model].ready()

    async def info(self, model: str) -> TranslatorInfo:
        return self.translators[model].info()

    async def reconfigure(self, user_config: dict) -> None:
        """user_config: {"engine": EngineConfig fields for every model, "per_model": {model: overrides}}."""
        per_model = user_config.get("per_model", {})
        for name, t in self.translators.items():
            await t.reconfigure({**user_config.get("engine", {}), **per_model.get(name, {})})
