"""Streaming a request: the token ids of its sentences, decoded concurrently, become in-order text
deltas per text (incremental detokenization).

    engine.stream() per sentence --merge_streams--> (sentence k, token id | TranslationResult)
        --StreamState.token / .finish--> StreamToken(index=text, text=delta, token=piece)
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Optional, Sequence, Union

from service.protocol import StreamToken
from service.engine import TokenStream, TranslationResult

from .text import Piece, Split


class StreamState:
    """Turns per-sentence token ids into in-order text deltas per text.

    Args:
        tok: the target tokenizer (``model.tokenizer.Tokenizer``: ``decode``, ``pieces``).
        splits: per text its Split (None for a text without visible characters: no events).
        pieces: every sentence of every text; piece k is the k in ``token(k, ...)`` / ``finish(k, ...)``.
        text_of: ``text_of(k, tokens, hypothesis)``, piece k's text so far (hypothesis None while it
            streams; the finished hypothesis at the end), or None to hold it back until it finishes
            (the translator's: a sentence with protected spans is placed by attention at the end,
            ``protect.py``). Default: the decoded tokens.

    Invariant: for every text, the concatenated ``text`` of its events equals the final translation
    (leading whitespace, each sentence with the whitespace before it, trailing whitespace). The
    sentences of one text may arrive in any order and interleaved: tokens of a sentence are held back
    until every sentence before it in its text is finished; a delta that would end in an incomplete
    multi-byte character (U+FFFD) waits for the next token.
    """

    def __init__(self, tok, splits: Sequence[Optional[Split]], pieces: Sequence[Piece],
                 text_of: Optional[Callable[[int, list[int], object], Optional[str]]] = None):
        self.tok, self.splits, self.pieces = tok, splits, pieces
        self.text_of = text_of or (lambda k, tokens, hyp: tok.decode(tokens))
        self.hyps: list[object] = [None] * len(pieces)  # piece k's finished hypothesis
        self.order: dict[int, list[int]] = {}           # text index -> its piece keys, in text order
        for k, p in enumerate(pieces):
            self.order.setdefault(p.text_index, []).append(k)
        self.current = {i: 0 for i in self.order}       # position in order[i] now being streamed
        self.tokens: list[list[int]] = [[] for _ in pieces]
        self.emitted: list[str] = ["" for _ in pieces]  # text of piece k already sent
        self.started: list[bool] = [False for _ in pieces]
        self.done: set[int] = set()

    def verbatim(self) -> list[StreamToken]:
        """One event per text that needs no model (a Split without pieces: no letters): its whole text."""
        return [StreamToken(index=i, text=s.join([]), token=None) for i, s in enumerate(self.splits)
                if s is not None and not s.pieces]

    def token(self, k: int, token_id: int) -> list[StreamToken]:
        """A new target token of piece k: the events it releases (none while k waits its turn)."""
        self.tokens[k].append(token_id)
        return self._emit(k, final=False) if self._current(self.pieces[k].text_index) == k else []

    def finish(self, k: int, tokens: Sequence[int], hyp: object = None) -> list[StreamToken]:
        """Piece k is done with these final tokens (the best hypothesis ``hyp``; beam search yields its
        tokens only at the end): the events it releases, its successors' held-back tokens included."""
        self.tokens[k], self.hyps[k] = list(tokens), hyp
        self.done.add(k)
        i = self.pieces[k].text_index
        out: list[StreamToken] = []
        while (cur := self._current(i)) is not None and cur in self.done:
            out += self._emit(cur, final=True)
            self.current[i] += 1
            if self._current(i) is None:
                tail = self.splits[i].glue[-1]
                if tail:
                    out.append(StreamToken(index=i, text=tail, token=None))
        if (cur := self._current(i)) is not None:
            out += self._emit(cur, final=False)     # catch up on tokens held back while it waited
        return out

    def _current(self, i: int) -> Optional[int]:
        order = self.order[i]
        return order[self.current[i]] if self.current[i] < len(order) else None

    def _emit(self, k: int, final: bool) -> list[StreamToken]:
        p = self.pieces[k]
        text = self.text_of(k, self.tokens[k], self.hyps[k] if final else None)
        prev = self.emitted[k]
        if text is None or not text.startswith(prev) or (not final and text.endswith("\ufffd")):
            return []       # e.g. an incomplete multi-byte character: wait for the next token
        glue = "" if self.started[k] else self.splits[p.text_index].glue[p.piece_index]
        delta = text[len(prev):]
        if not delta and (not final or not glue):
            return []       # the whitespace before a sentence goes out with its first token
        self.started[k], self.emitted[k] = True, text
        token = self.tok.pieces(self.tokens[k][-1:])[0] if self.tokens[k] and not final else None
        return [StreamToken(index=p.text_index, text=glue + delta, token=token)]


async def merge_streams(streams: Sequence[TokenStream], later: Sequence[Callable[[], TokenStream]] = ()
                        ) -> AsyncIterator[tuple[int, Union[int, TranslationResult]]]:
    """The items of several engine token streams as they arrive, each with its stream's index.

    ``later``: streams started one per finished stream, in order (indices after ``streams``'), so
    at most len(streams) run at once. Ends after every stream's TranslationResult; raises the first
    error a stream raises (or starting one). Closing the iterator (or an error) cancels every
    stream still running.
    """
    queue: asyncio.Queue = asyncio.Queue()
    streams = list(streams)
    waiting = list(later)

    async def run(k: int, st: TokenStream) -> None:
        try:
            async for item in st:
                queue.put_nowait((k, item))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer, cancellation included
            st.cancel()
            queue.put_nowait((k, e))
            if isinstance(e, asyncio.CancelledError):
                raise

    tasks = [asyncio.create_task(run(k, st)) for k, st in enumerate(streams)]
    try:
        remaining = len(streams) + len(waiting)
        while remaining:
            k, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if not isinstance(item, int):
                remaining -= 1
                if waiting:
                    streams.append(waiting.pop(0)())
                    tasks.append(asyncio.create_task(run(len(streams) - 1, streams[-1])))
            yield k, item
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for st in streams:
            st.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
