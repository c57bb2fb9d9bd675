"""Plain text (.txt): each block of lines between blank lines is one segment; the blank lines, the
whitespace around each block and the line breaks between blocks stay as they are. A block longer
than MAX_BLOCK_CHARS is cut at line ends (a single longer line is one segment; the route splits it)."""
from __future__ import annotations

import re

from .common import Segments, decode_text

MAX_BLOCK_CHARS = 4_000      # characters of one segment before a block is cut at its line ends
_BLOCK = re.compile(r"\S(?:.*\S)?", re.S)      # a block without the whitespace around it


class TextDocument:
    def __init__(self, data: bytes):
        text = decode_text(data, "text")
        self.parts: list[str] = []          # the text in pieces: separators and blocks, alternating
        self._seg = Segments()
        lines = text.splitlines(keepends=True)
        i = 0
        sep = ""
        while i < len(lines):
            if not lines[i].strip():
                sep += lines[i]
                i += 1
                continue
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            self.parts.append(sep)
            sep = ""
            for block in _cut("".join(lines[i:j])):
                inner = _BLOCK.search(block)
                self.parts += [block[:inner.start()], "", block[inner.end():]]
                self._seg.add([inner.group()], self._putter(len(self.parts) - 2))
            i = j
        self.parts.append(sep)
        self.segments = self._seg.segments

    def _putter(self, i: int):
        def put(tr: list[str]) -> None:
            self.parts[i] = tr[0]
        return put

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        return "".join(self.parts).encode("utf-8")


def _cut(block: str) -> list[str]:
    """block, or its lines grouped into pieces of at most MAX_BLOCK_CHARS (a longer line alone)."""
    if len(block) <= MAX_BLOCK_CHARS:
        return [block]
    out, cur = [], ""
    for line in block.splitlines(keepends=True):
        if cur and len(cur) + len(line) > MAX_BLOCK_CHARS:
            out.append(cur)
            cur = ""
        cur += line
    return out + [cur] if cur else out


def load(data: bytes) -> TextDocument:
    return TextDocument(data)
