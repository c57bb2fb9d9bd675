"""Subtitles: SubRip (.srt, the ``srt`` library) and WebVTT (.vtt, ``webvtt-py``). Each cue's text is
one segment, its markup (``<i>``, ``<b>``, ``<u>``, entities) kept around the translated words by the
HTML route's ``HtmlText``; its line breaks are layout: the translation is wrapped again into as many
lines as the cue had (at the spaces nearest equal parts, outside tags). Numbers, timings, cue
identifiers and settings, STYLE/REGION blocks and NOTE comments stay exactly as they were. Cues and
the HTML parts of their text are counted (MAX_PARSED_NODES): SubRip's as they are read, WebVTT's once
webvtt-py has read the file."""
from __future__ import annotations

import io

import srt
import webvtt
from webvtt.errors import MalformedCaptionError, MalformedFileError

from service.pipeline.markup import HtmlText
from service.protocol import ServiceError

from .common import DocumentError, Nodes, Segments, decode_text


def _cue(text: str, segs: Segments, done) -> None:
    """Register a cue's text (lines joined by a space); ``done(new_text)`` gets its translation."""
    segs.nodes.add()
    lines = text.split("\n")
    try:
        h = HtmlText(" ".join(line.strip() for line in lines), "file", count=segs.nodes.add)
    except DocumentError:       # MAX_PARSED_NODES
        raise
    except ServiceError as e:
        raise DocumentError(e.status, e.message.removeprefix("file: ")) from None
    segs.add(h.segments, lambda tr: done(wrap(h.rebuild(tr), len(lines))))


def wrap(text: str, n_lines: int) -> str:
    """``text`` in ``n_lines`` lines, broken at the spaces (outside tags) nearest equal shares."""
    if n_lines <= 1:
        return text
    spaces, depth = [], 0
    for i, c in enumerate(text):
        depth += c == "<"
        depth -= c == ">" and depth > 0
        if c == " " and depth == 0:
            spaces.append(i)
    cuts = []
    for k in range(1, n_lines):
        free = [i for i in spaces if i not in cuts and (not cuts or i > cuts[-1])]
        if not free:
            break
        cuts.append(min(free, key=lambda i: abs(i - k * len(text) / n_lines)))
    out = list(text)
    for i in cuts:
        out[i] = "\n"
    return "".join(out)


class SrtDocument:
    def __init__(self, data: bytes):
        self.cues: list[srt.Subtitle] = []
        self._seg = Segments(Nodes())
        try:
            for cue in srt.parse(decode_text(data, "SubRip"), ignore_errors=False):    # one at a time
                self.cues.append(cue)
                _cue(cue.content, self._seg, lambda t, cue=cue: setattr(cue, "content", t))
        except (srt.SRTParseError, ValueError) as e:
            raise DocumentError(422, f"not a valid SubRip (.srt) file: {e}") from None
        self.segments = self._seg.segments

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        return srt.compose(self.cues, reindex=False).encode("utf-8")


class VttDocument:
    def __init__(self, data: bytes):
        try:
            self.vtt = webvtt.from_buffer(io.StringIO(decode_text(data, "WebVTT")))
        except (MalformedFileError, MalformedCaptionError, ValueError) as e:
            raise DocumentError(422, f"not a valid WebVTT (.vtt) file: {e}") from None
        self._seg = Segments(Nodes())
        for cue in self.vtt.captions:
            _cue(cue.raw_text, self._seg, lambda t, cue=cue: setattr(cue, "text", t))
        self.segments = self._seg.segments

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        return self.vtt.content.encode("utf-8")


def load_srt(data: bytes) -> SrtDocument:
    return SrtDocument(data)


def load_vtt(data: bytes) -> VttDocument:
    return VttDocument(data)
