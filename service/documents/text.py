"""Plain text (.txt): each block of lines between blank lines is one segment; the blank lines, the
whitespace around each block and the line breaks between blocks stay as they are. A block longer
than MAX_BLOCK_CHARS is cut at line ends (a single longer line is one segment; the route splits it).
The file is read line by line without keeping its lines: what it holds is its segments and the text
between them, so the segment and character caps refuse a large file as they are passed."""
from __future__ import annotations

import re

from .common import Segments, decode_text, lines

MAX_BLOCK_CHARS = 4_000      # characters of one segment before a block is cut at its line ends
_BLOCK = re.compile(r"\S(?:.*\S)?", re.S)      # a block without the whitespace around it
_VISIBLE = re.compile(r"\S")                    # a line that is not blank


class TextDocument:
    def __init__(self, data: bytes):
        text = decode_text(data, "text")
        self.parts: list[str] = []          # the text in pieces: separators and blocks, alternating
        self._seg = Segments()
        sep, block = 0, None                # where the blank lines before the next block start; the block's start
        for start, end in lines(text):
            if _VISIBLE.search(text, start, end) is None:
                if block is not None:
                    self._add(text, block, start)
                    sep, block = start, None
            elif block is None:
                self.parts.append(text[sep:start])
                block = start
        if block is not None:
            self._add(text, block, len(text))
            sep = len(text)
        self.parts.append(text[sep:])
        self.segments = self._seg.segments

    def _add(self, text: str, start: int, end: int) -> None:
        """The block ``text[start:end]``: a segment for each piece ``_cut`` makes of it, with the
        whitespace around it kept as it is."""
        for a, b in _cut(text, start, end):
            inner = _BLOCK.search(text, a, b)
            self.parts += [text[a:inner.start()], "", text[inner.end():b]]
            self._seg.add([inner.group()], self._putter(len(self.parts) - 2))

    def _putter(self, i: int):
        def put(tr: list[str]) -> None:
            self.parts[i] = tr[0]
        return put

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        return "".join(self.parts).encode("utf-8")


def _cut(text: str, start: int, end: int):
    """(start, end) of the block ``text[start:end]``, or of its lines grouped into pieces of at most
    MAX_BLOCK_CHARS (a longer line alone)."""
    if end - start <= MAX_BLOCK_CHARS:
        yield start, end
        return
    piece = start
    for a, b in lines(text, start, end):
        if a > piece and b - piece > MAX_BLOCK_CHARS:
            yield piece, a
            piece = a
    if end > piece:
        yield piece, end


def load(data: bytes) -> TextDocument:
    return TextDocument(data)
