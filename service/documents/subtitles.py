"""Subtitles: SubRip (.srt, the ``srt`` library) and WebVTT (.vtt, ``webvtt-py``). Each cue's text is
one segment unit, translated through the HTML route's ``HtmlText`` with its markup kept verbatim in
place (``Cue``): tags around words (``<i>``, ``<b>``, ``<font color=..>``, WebVTT's ``<c.x>``, ``<v Name>``
... ``</v>``) go around their words' translation; tags without an end and marks between words (WebVTT's
timestamps ``<00:00:03.500>``, an unclosed ``<v Name>``, SubRip's override blocks ``{\an8}``) and each
line break stay at their place between the words, never sent to the model. SubRip text is literal
(``&`` is a character); WebVTT's references are kept as written. Numbers, timings, cue identifiers and
settings, STYLE/REGION blocks and NOTE comments stay exactly as they were: both are edited in place
(each cue's text replaced where the file has it). Cues and the HTML parts of
their text are counted (MAX_PARSED_NODES): SubRip's as they are read, WebVTT's once webvtt-py has
read the file."""
from __future__ import annotations

import io
import re
from html import escape, unescape
from typing import Optional

import srt
import webvtt
from webvtt.errors import MalformedCaptionError, MalformedFileError

from service.pipeline.markup import HtmlText
from service.protocol import ServiceError

from .common import DocumentError, Nodes, Segments, decode_text

_MARK = re.compile(r"<[^<>\n]*>|\{\\[^{}\n]*\}")     # a tag, a timestamp, an override block {\an8}
_NAME = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9]*)")    # a tag's name (WebVTT's class after a dot: not its name)
_BREAK = re.compile(r"[ \t]*\r?\n[ \t]*")
_PLACED = re.compile(r'<!--c(\d+)-->|<span data-c="(\d+)">|</span>|&[^;\s<&]*;?')
_BROKE = re.compile("[ \t]*\x00(\\d+)\x00[ \t]*")     # a line break placed, with the spaces around it


class Cue:
    """A cue's text as HTML for ``HtmlText``: each tag with an end as ``<span data-c=k>`` .. ``</span>``,
    each other mark and each line break (with the spaces around it) as ``<!--ck-->``, text escaped
    (SubRip's ``literal`` text) or as written; ``text(html)`` turns a rebuilt one back."""

    def __init__(self, text: str, literal: bool):
        self.literal = literal
        # a blank line in it: a SubRip cue without its timing line is read as part of the one before
        self.blank = re.search(r"\n[ \t]*\r?\n", text) is not None
        self.raw: list[str] = []            # mark k as written
        self.ends: dict[int, str] = {}      # k -> the end tag of mark k
        self.breaks: set[int] = set()       # the marks that are line breaks
        pieces = []                         # (kind, raw): text, tag, break
        seps = _BREAK.findall(text)
        for n, line in enumerate(_BREAK.split(text)):
            if n:
                pieces.append(("break", seps[n - 1]))
            at = 0
            for m in _MARK.finditer(line):
                pieces += [("text", line[at:m.start()]), ("tag", m.group())]
                at = m.end()
            pieces.append(("text", line[at:]))
        opened: list[tuple[str, int]] = []
        closes: dict[int, int] = {}         # piece of an end tag -> piece of its start tag
        for i, (kind, raw) in enumerate(pieces):
            m = _NAME.match(raw) if kind == "tag" else None
            if m and not m.group(1):
                opened.append((m.group(2).lower(), i))
            elif m and opened and opened[-1][0] == m.group(2).lower():
                closes[i] = opened.pop()[1]
        starts = set(closes.values())
        key: dict[int, int] = {}            # piece of a start tag -> its mark
        html = []
        for i, (kind, raw) in enumerate(pieces):
            if kind == "text":
                html.append(escape(raw, quote=False) if literal else raw)
                continue
            if i in closes:
                html.append("</span>")
                self.ends[key[closes[i]]] = raw
                continue
            key[i] = k = len(self.raw)
            self.raw.append(raw)
            if i in starts:
                html.append(f'<span data-c="{k}">')
            elif kind == "break":
                self.breaks.add(k)
                html.append(f" <!--c{k}--> ")       # between words
            else:
                html.append(f"<!--c{k}-->")
        self.html = "".join(html)

    def text(self, html: str) -> str:
        """A rebuilt ``html`` as cue text: its marks as written, its text unescaped (SubRip's)."""
        opened: list[int] = []

        def put(m: re.Match) -> str:
            if m.group(1) is not None:
                k = int(m.group(1))
                return f"\x00{k}\x00" if k in self.breaks else self.raw[k]
            if m.group(2) is not None:
                opened.append(int(m.group(2)))
                return self.raw[int(m.group(2))]
            if m.group() == "</span>":
                return self.ends[opened.pop()]
            return unescape(m.group()) if self.literal else m.group()
        out = _BROKE.sub(lambda m: self.raw[int(m.group(1))], _PLACED.sub(put, html))
        lines = out.split("\n")
        if len(lines) > 1 and not all(line.strip() for line in lines):    # a break at an edge: no blank line
            while lines and not lines[0].strip():
                lines.pop(0)
            while lines and not lines[-1].strip():
                lines.pop()
            out = "\n".join(lines if self.blank else [line for line in lines if line.strip()])
        return out


def _cue(text: str, segs: Segments, done, literal: bool) -> None:
    """Register a cue's text (``Cue``); ``done(new_text)`` gets it rebuilt around its translation."""
    cue = Cue(text, literal)
    try:
        h = HtmlText(cue.html, "file", count=segs.nodes.add)
    except DocumentError:       # MAX_PARSED_NODES
        raise
    except ServiceError as e:
        raise DocumentError(e.status, e.message.removeprefix("file: ")) from None
    segs.add(h.segments, lambda tr: done(cue.text(h.rebuild(tr))))


class SrtDocument:
    def __init__(self, data: bytes):
        self.source = decode_text(data, "SubRip")
        self._edits: list[tuple[int, int, str]] = []      # (start, end, new text) of each cue's text
        self._seg = Segments(Nodes())
        try:
            for _ in srt.parse(self.source, ignore_errors=False):     # checks the file, one cue at a time
                self._seg.nodes.add()
        except (srt.SRTParseError, ValueError) as e:
            raise DocumentError(422, f"not a valid SubRip (.srt) file: {e}") from None
        for m in srt.SRT_REGEX.finditer(self.source):             # the same cues, with their text's place
            a, b = m.span(5)
            _cue(m.group(5), self._seg, lambda t, a=a, b=b: self._edits.append((a, b, t)), literal=True)
        self.segments = self._seg.segments

    def rebuild(self, translations: list[str]) -> bytes:
        self._edits.clear()
        self._seg.apply(translations)
        return _edited(self.source, self._edits).encode("utf-8")


class VttDocument:
    """Checked and read by webvtt-py, edited in place: each cue's text replaced where the file has
    it (``_cue_texts``), the rest byte for byte; a file whose cues cannot be found as webvtt-py read
    them is written back by webvtt-py."""

    def __init__(self, data: bytes):
        self.source = decode_text(data, "WebVTT")
        try:
            self.vtt = webvtt.from_buffer(io.StringIO(self.source))
        except (MalformedFileError, MalformedCaptionError, ValueError) as e:
            raise DocumentError(422, f"not a valid WebVTT (.vtt) file: {e}") from None
        self._edits: list[tuple[int, int, str]] = []
        self._seg = Segments(Nodes())
        places = _matched(self.source, _cue_texts(self.source), [c.raw_text for c in self.vtt.captions])
        self.in_place = places is not None
        for k, cue in enumerate(self.vtt.captions):
            self._seg.nodes.add()
            if places is None:
                _cue(cue.raw_text, self._seg, lambda t, cue=cue: setattr(cue, "text", t), literal=False)
            else:
                a, b = places[k]
                _cue(self.source[a:b], self._seg, lambda t, a=a, b=b: self._edits.append((a, b, t)), literal=False)
        self.segments = self._seg.segments

    def rebuild(self, translations: list[str]) -> bytes:
        self._edits.clear()
        self._seg.apply(translations)
        if not self.in_place:
            return self.vtt.content.encode("utf-8")
        return _edited(self.source, self._edits).encode("utf-8")


def _cue_texts(source: str) -> list[tuple[int, int]]:
    """(start, end) of each cue's text in a WebVTT file: the lines after a timing line (one with
    ``-->``) up to an empty line, the next timing line or the end, without the last line break."""
    out, at, start, last = [], 0, None, 0
    for line in source.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        if start is not None and (not body.strip() or "-->" in body):
            out.append((start, max(start, last)))
            start = None
        if start is None and "-->" in body:
            start = last = at + len(line)
        elif start is not None:
            last = at + len(body)
        at += len(line)
    if start is not None:
        out.append((start, max(start, last)))
    return out


def _matched(source: str, places: list[tuple[int, int]], texts: list[str]) -> Optional[list[tuple[int, int]]]:
    """Of ``places``, those of webvtt-py's cues, in order (a cue it skipped, as one with a malformed
    timing, stays as it is); None when its cues are not all found."""
    out: list[tuple[int, int]] = []
    for a, b in places:
        if len(out) < len(texts) and source[a:b].replace("\r\n", "\n") == texts[len(out)]:
            out.append((a, b))
    return out if len(out) == len(texts) else None


def _edited(source: str, edits: list[tuple[int, int, str]]) -> str:
    """``source`` with each (start, end) replaced by its text."""
    out, pos = [], 0
    for a, b, text in sorted(edits):
        out += [source[pos:a], text]
        pos = b
    out.append(source[pos:])
    return "".join(out)


def load_srt(data: bytes) -> SrtDocument:
    return SrtDocument(data)


def load_vtt(data: bytes) -> VttDocument:
    return VttDocument(data)
