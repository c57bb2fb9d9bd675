"""``Texts``: a request's texts as the units its models translate: each text whole, or, for text
with markup (HTML or XML: LibreTranslate's ``format=html``, DeepL's ``tag_handling``), the segments
of each (``markup.HtmlText``), rebuilt around their translations. Parsing and rebuilding run in a
worker thread: a large fragment must not hold up the replica's event loop."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from service.protocol import JobOrigin, Translation

from .markup import HtmlText
from .markup_parse import HTML, TagOptions


@dataclass
class Texts:
    texts: list[str]                # as the client sent them
    markup: list[HtmlText]          # each text's segments and markup; [] for plain text

    @classmethod
    async def read(cls, texts: Sequence[str], markup: bool, origin: JobOrigin, options: TagOptions = HTML) -> "Texts":
        """The texts; with ``markup``, parsed with ``options`` (errors name each text as ``origin``
        does: ``field[i]``, or ``field`` for one text). Raises ServiceError as ``HtmlText`` does."""
        texts = list(texts)
        if not markup:
            return cls(texts, [])
        return cls(texts, await asyncio.to_thread(
            lambda: [HtmlText(t, origin.field, origin.where(i), options) for i, t in enumerate(texts)]))

    def plain(self) -> list[str]:
        """Each text's words without markup (what language detection reads)."""
        return [" ".join(h.segments) for h in self.markup] if self.markup else self.texts

    def units(self, idx: Sequence[int]) -> list[str]:
        """What the model translates for the texts ``idx``, in order: the texts, or their segments."""
        if self.markup:
            return [s for i in idx for s in self.markup[i].segments]
        return [self.texts[i] for i in idx]

    def split(self, idx: Sequence[int], translations: Sequence[Translation]) -> list[list[Translation]]:
        """``translations`` of ``units(idx)`` as one list per text of ``idx``."""
        out, k = [], 0
        for i in idx:
            n = len(self.markup[i].segments) if self.markup else 1
            out.append(list(translations[k:k + n]))
            k += n
        return out

    async def rebuilt(self, idx: Sequence[int], translations: Sequence[Translation]) -> list[str]:
        """Each text of ``idx`` translated: its translation, or its markup around its segments'."""
        parts = self.split(idx, translations)
        if not self.markup:
            return [p[0].text for p in parts]
        return await asyncio.to_thread(lambda: [self.markup[i].rebuild([t.text for t in p]) for i, p in zip(idx, parts)])
