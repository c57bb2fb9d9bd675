"""Server-Sent Events of a streamed translation (``"stream": true``):

    event: token      data: {"index", "text", "token"}     one per text delta (StreamToken)
    event: response   data: <the TranslateResponse>        once, at the end
    event: error      data: {"error": {"type", "message", "field"}}   if it fails midway
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from service.protocol import ServiceError, StreamItem, TranslateResponse, Usage


def format_event(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def events(items: AsyncIterator[StreamItem], on_usage: Callable[[Usage], None]) -> AsyncIterator[str]:
    """The SSE text of a translator's stream after its StreamStart. The HTTP status line is sent by
    then, so an error midway becomes an ``error`` event (``on_usage`` gets the final usage)."""
    try:
        async for item in items:
            if isinstance(item, TranslateResponse):
                on_usage(item.usage)
                yield format_event("response", item.body())
            else:
                yield format_event("token", item.model_dump())
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
        err = e if isinstance(e, ServiceError) else ServiceError(500, f"internal error: {type(e).__name__}")
        yield format_event("error", {"error": {"type": err.type, "message": err.message, "field": err.field}})


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls ``on_close()`` once it has ended in any way: sent in full,
    failed, or cancelled because the client went away (the guard's open-stream count is released)."""

    def __init__(self, content, on_close: Callable[[], None], **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
