"""How the gateway reaches a model's translator: through a Ray Serve handle (one deployment per
model), or in its own process (``ingress: translator``). Both backends have the same typed methods,
and both raise what goes wrong as ``ServiceError`` (``errors.to_service_error``, the one mapping).

A translation is idempotent, so ``RemoteBackend`` retries a call once when the translator replica
that held it died or became unreachable before answering (``replica_lost``: Ray's ``ActorDiedError``
/ ``ActorUnavailableError``, also as a ``RayTaskError``'s cause). Serve's router has by then taken the
dead replica out of rotation, so the retry goes to another one (or waits for the replacement). A
stream that already passed on tokens is resumed: decoding is deterministic, so the retry's stream
repeats them; ``_Resume`` drops what the client already has and passes on the rest, and gives up
(the original 503) if the retry's text differs from what was sent. Errors the replica answered
(``ErrorRecord``: 4xx, a full queue, a deadline) are never retried, and neither is a call whose
deadline has passed: a lost replica then answers the deadline's 504.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import AsyncIterator, Callable, Optional, Protocol, Union

from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.handle import DeploymentHandle

from service.protocol import (
    ErrorRecord,
    ServiceError,
    StreamItem,
    StreamStart,
    StreamToken,
    TranslateJob,
    TranslateResponse,
)
from service.ray_env import handle_transport
from service.replica import mapped_errors, run_within, stream_within, timeout_error
from service.translator import ModelCard, TranslatorInfo, TranslatorSettings

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
    """Whether a failed call is retried: only when its replica was lost. Raises the deadline's
    ServiceError 504 when the replica was lost and the job's deadline has passed (no time is left to
    retry, and the request ran past its timeout_s: the answer a request with a deadline expects)."""
    if not replica_lost(e):
        return False
    if job.deadline is not None and time.time() >= job.deadline:
        raise timeout_error(job.timeout_s) from e
    logger.warning("model %s: translator replica lost (%s); retrying once on another replica", model,
                   type(e).__name__)
    return True


class _Resume:
    """What a stream passed on so far, so that a retry after a lost replica passes on only the rest.

    ``sent[i]``: the text of translation ``i`` the client has; ``replay[i]``: the text the retry
    has produced of it so far. A retry's token inside the sent text is dropped if it matches; one past
    it is passed on (cut to its new part). A mismatch re-raises the lost replica's error.
    """

    def __init__(self):
        self.started = False
        self.sent: dict[int, str] = {}
        self.replay: dict[int, str] | None = None     # None: no retry yet
        self.lost: BaseException | None = None

    def new_part(self, item: StreamItem):
        """The item to pass on (``item`` itself, or cut to its unsent part), or None to drop it."""
        if isinstance(item, StreamStart):
            if self.started:
                return None                 # the retry's own start: the caller has one
            self.started = True
            return item
        if not isinstance(item, StreamToken):
            return item                     # the final response: whole, as the client expects
        have = self.sent.get(item.index, "")
        if self.replay is not None:
            before = self.replay.get(item.index, "")
            now = self.replay[item.index] = before + item.text
            if len(before) < len(have):     # still inside what the client has
                if not (have.startswith(now) or now.startswith(have)):
                    raise self.lost         # the retry decoded differently: give up
                if len(now) <= len(have):
                    return None
                item = StreamToken(index=item.index, text=now[len(have):], token=None)   # part of a piece
        self.sent[item.index] = have + item.text
        return item


class RemoteBackend:
    """Translators in their own Serve deployments (``service.app.TranslatorReplica``), one per model.

    ``on_retry(model, call, ok)``: told of each retry after a lost replica and how it ended (``call``:
    translate, stream, or stream_resumed when the stream had sent tokens); the gateway counts them in
    ``mt_replica_retries_total``.
    """

    def __init__(self, handles: dict[str, DeploymentHandle],
                 on_retry: Optional[Callable[[str, str, bool], None]] = None):
        self.handles = {model: handle_transport(h) for model, h in handles.items()}
        self.on_retry = on_retry or (lambda model, call, ok: None)

    async def translate(self, model: str, job: TranslateJob) -> TranslateResponse:
        with mapped_errors(model):
            try:
                return _unwrap(await self.handles[model].translate.remote(job))
            except Exception as e:  # noqa: BLE001 - only a lost replica is retried
                if not _may_retry(e, job, model):
                    raise
            try:
                out = _unwrap(await self.handles[model].translate.remote(job))
            except Exception:   # (a client that left is no failed retry)
                self.on_retry(model, "translate", False)
                raise
            self.on_retry(model, "translate", True)
            return out

    async def stream(self, model: str, job: TranslateJob) -> AsyncIterator[StreamItem]:
        resume, call = _Resume(), "stream"
        with mapped_errors(model):
            for attempt in range(2):
                try:
                    async for item in self.handles[model].options(stream=True).stream.remote(job):
                        item = resume.new_part(_unwrap(item))
                        if item is not None:
                            yield item
                    if attempt:
                        self.on_retry(model, call, True)
                    return
                except Exception as e:  # noqa: BLE001 - only a lost replica is retried, once
                    if attempt:
                        self.on_retry(model, call, False)
                    if attempt or not _may_retry(e, job, model):
                        raise
                    resume.lost = e
                    resume.replay = {}
                    call = "stream_resumed" if resume.sent else "stream"

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

    def __init__(self, cards: list[ModelCard], num_threads: int, settings: Optional[TranslatorSettings] = None):
        from service.translator import Translator
        self.translators = {c.id: Translator(c, num_threads=num_threads, settings=settings) for c in cards}

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


class _Routed(Mapping):
    """model id -> a handle: the model's own deployment (pinned), or the pool's handle routed to a
    replica that holds the model (``options(multiplexed_model_id=model)``: Serve's model multiplexing)."""

    def __init__(self, pinned: dict[str, DeploymentHandle], pool: DeploymentHandle, pooled: list[str]):
        self.pinned, self.pool, self.pooled = pinned, pool, frozenset(pooled)

    def __getitem__(self, model: str) -> DeploymentHandle:
        if model in self.pinned:
            return self.pinned[model]
        if model in self.pooled:
            return self.pool.options(multiplexed_model_id=model)   # shares the pool handle's router
        raise KeyError(model)

    def __iter__(self):
        return iter([*self.pinned, *sorted(self.pooled - set(self.pinned))])

    def __len__(self) -> int:
        return len(self.pinned) + len(self.pooled - set(self.pinned))


class PoolBackend(RemoteBackend):
    """``RemoteBackend`` over pinned per-model deployments and a model pool (``service/pool.py``):
    a pool model's calls go to the ``Pool`` deployment with the model as their multiplexed model id,
    so Serve routes them to a replica that holds it (which loads it on a miss). A lost pool replica's
    call is retried once as for a pinned one (another replica loads the model if none holds it).

    ``pool``: {"handle": the Pool deployment, "directory": its PoolDirectory, "models": [model ids]}.
    """

    def __init__(self, handles: dict[str, DeploymentHandle], pool: dict,
                 on_retry: Optional[Callable[[str, str, bool], None]] = None):
        super().__init__(handles, on_retry)
        self.pooled = list(pool["models"])
        self.handles = _Routed(self.handles, handle_transport(pool["handle"]), self.pooled)
        self.directory = handle_transport(pool["directory"])

    async def residency(self) -> dict[str, dict]:
        """The pool directory's view: replica id -> what it holds (``PoolReplica.residency``)."""
        return await self.directory.snapshot.remote()
