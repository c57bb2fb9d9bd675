"""The replica side of a call to a translator (``app.TranslatorReplica``, ``pool.Pool``, and the
in-process backend): request deadlines, the one mapping of the service's and Ray's exceptions to a
``ServiceError`` (``to_service_error``), and errors returned as values (``error_record``).

Deadlines: a translation (or a stream) that runs past its job's ``deadline`` is cancelled and
answered 504. The deadline is absolute wall-clock time (``time.time()`` seconds, set by the request
pipeline from the request's ``timeout_s`` or the server's ``max_timeout_s``), so time spent queued in
front of a translator replica counts too. Cancelling the awaiting task is what frees the engine's
slots: the translator cancels its sentences' engine calls, and the engine removes them (waiting or
running) at its next step (``Engine.translate``: "cancelling the awaiting task cancels the request").
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Awaitable, Iterator, Optional, TypeVar

import ray
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from service.engine.errors import (
    EngineError,
    EngineStoppedError,
    EngineValidationError,
    QueueFullError,
)
from service.protocol import RETRY_AFTER_S, ErrorRecord, ServiceError, TranslationError


# ---- the one mapping of errors ------------------------------------------------------------------
def engine_message(e: EngineValidationError) -> str:
    """``field: message`` (the engine's message, prefixed with its field once)."""
    msg = e.message or str(e)
    return msg if not e.field or msg.startswith(e.field) else f"{e.field}: {msg}"


def to_service_error(e: BaseException, model: str) -> Optional[ServiceError]:
    """The ServiceError that an exception from the engine or from a Ray handle call means; None for
    anything else (a bug: let it propagate as a 500)."""
    cause = getattr(e, "cause", None)   # Ray's RayTaskError carries the replica's exception
    if isinstance(cause, BaseException) and cause is not e:
        mapped = to_service_error(cause, model)
        if mapped is not None:
            return mapped
    if isinstance(e, ServiceError):
        return e
    if isinstance(e, QueueFullError):
        return ServiceError(503, f"engine queue is full: {e}; retry later", retry_after=RETRY_AFTER_S)
    if isinstance(e, EngineValidationError):
        return ServiceError(422, engine_message(e), e.field)
    if isinstance(e, EngineStoppedError):
        return ServiceError(503, f"engine is restarting: {e}; retry later", retry_after=RETRY_AFTER_S)
    if isinstance(e, EngineError):
        return ServiceError(500, f"engine error: {e}")
    if isinstance(e, TranslationError):
        retry = (e.retry_after or RETRY_AFTER_S) if e.status == 503 else None
        return ServiceError(e.status, e.message, e.field, retry)
    if isinstance(e, BackPressureError):
        return ServiceError(503, f"model {model} is overloaded ({e}); retry later", retry_after=RETRY_AFTER_S)
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                      DeploymentUnavailableError)):
        return ServiceError(503, f"model {model} is unavailable ({type(e).__name__}); retry later",
                            retry_after=RETRY_AFTER_S)
    return None


@contextlib.contextmanager
def mapped_errors(model: str) -> Iterator[None]:
    """Inside the block, an engine or Ray handle error is raised as the ServiceError it means."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - mapped, or re-raised as it is
        mapped = to_service_error(e, model)
        if mapped is None or mapped is e:
            raise
        raise mapped from None


def error_record(e: Exception, model: str) -> ErrorRecord:
    """What a replica answers for ``e``: its ``ErrorRecord`` (an answer, not a replica failure).
    Re-raises ``e`` when it maps to no ServiceError (a bug: the call fails)."""
    err = to_service_error(e, model)
    if err is None:
        raise e
    return err.record


# ---- deadlines ----------------------------------------------------------------------------------
T = TypeVar("T")


def timeout_error(timeout_s: Optional[float]) -> ServiceError:
    what = f"{timeout_s:g} s" if timeout_s is not None else "its deadline"
    return ServiceError(504, f"timeout_s: the request ran past {what}; its sentences were cancelled",
                        "timeout_s", type="timeout")


def remaining(deadline: Optional[float]) -> Optional[float]:
    """Seconds left until ``deadline`` (never below 0), or None without one."""
    return None if deadline is None else max(0.0, deadline - time.time())


async def run_within(aw: Awaitable[T], deadline: Optional[float], timeout_s: Optional[float] = None) -> T:
    """``await aw``, cancelled at ``deadline``. Raises ServiceError 504 when the deadline passes."""
    left = remaining(deadline)
    if left is None:
        return await aw
    try:
        async with asyncio.timeout(left):
            return await aw
    except TimeoutError:
        raise timeout_error(timeout_s) from None


async def stream_within(items: AsyncIterator[T], deadline: Optional[float],
                        timeout_s: Optional[float] = None) -> AsyncIterator[T]:
    """The items of ``items`` until ``deadline``; then ``items`` is closed (its sentences cancelled)
    and ServiceError 504 is raised (before a stream's first item, an HTTP 504; after it, an SSE
    ``error`` event)."""
    async with contextlib.aclosing(items) as it:
        while True:
            try:
                # The timeout covers only the wait for the next item, never the consumer's work.
                async with asyncio.timeout(remaining(deadline)):
                    item = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise timeout_error(timeout_s) from None
            yield item
