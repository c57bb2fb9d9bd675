"""Request deadlines: a translation (or a stream) that runs past its job's ``deadline`` is cancelled
and answered 504.

The deadline is absolute wall-clock time (``time.time()`` seconds, set by the gateway from the
request's ``timeout_s`` or the server's ``max_timeout_s``), so time spent queued in front of a
translator replica counts too. Cancelling the awaiting task is what frees the engine's slots: the
translator cancels its sentences' engine calls, and the engine removes them (waiting or running) at
its next step (``Engine.translate``: "cancelling the awaiting task cancels the request").
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator, Awaitable, Optional, TypeVar

from .errors import ServiceError

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
