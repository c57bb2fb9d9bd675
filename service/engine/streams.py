"""A request inside the engine (``_Request``) and the async iterator over its tokens (``TokenStream``)."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from .records import GenerationOptions, TranslationResult

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(eq=False)
class _Request:
    request_id: int
    src_ids: list[int]
    options: GenerationOptions                # validated, max_new_tokens resolved
    future: asyncio.Future
    stream: bool = False
    queue: Optional[asyncio.Queue] = None     # streamed items (token ids, then the result or an error)
    t_submit: float = 0.0
    t_prefill_start: float = math.nan
    t_first_token: float = math.nan
    prefill_s: float = 0.0
    num_steps: int = 0
    cancelled: bool = False
    done: bool = False


class TokenStream:
    """Async iterator over a request's new token ids, then its ``TranslationResult``.

    Greedy requests yield each token as it is decoded; beam requests yield the best hypothesis'
    tokens when the search ends. Closing it (``aclose``, ``async with``, or dropping it) cancels the
    request. Errors raised by the engine (EngineError) are raised from iteration.
    """

    def __init__(self, engine: "Engine", req: _Request):
        self._engine, self._req, self._finished = engine, req, False

    @property
    def request_id(self) -> int:
        return self._req.request_id

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> Union[int, TranslationResult]:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._req.queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        if isinstance(item, TranslationResult):
            self._finished = True
        return item

    def cancel(self) -> None:
        self._finished = True
        self._engine._cancel(self._req)

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> "TokenStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()

    def __del__(self) -> None:
        try:
            if not self._req.done:
                self._engine._cancel_threadsafe(self._req)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
