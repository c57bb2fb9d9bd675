"""LibreTranslate's ``format=html``: translate the text of an HTML fragment and keep its markup."""
from __future__ import annotations

import re
from html import escape, unescape
from html.parser import HTMLParser
from typing import Optional, Union

# Elements that sit inside a sentence (HTML's phrasing content); text around them is one sentence.
_INLINE_TAGS = frozenset("a abbr b bdi bdo cite data dfn em i mark q s small span strong sub sup time u".split())
# Elements whose text is not prose: kept as it is.
_VERBATIM_TAGS = frozenset("script style noscript template textarea pre code kbd samp var".split())

Part = tuple[str, str, str]             # (kind, raw, tag): kind is start/end/text/markup
RunItem = tuple[str, str, str]          # (start tag, text, end tag); a plain text node has empty tags
Unit = tuple[str, Union[str, list[RunItem]]]   # ("markup" | "text", raw) or ("run", [RunItem, ...])


class _Parts(HTMLParser):
    """An HTML fragment as a flat list of parts, each with its raw source text: markup, comments and
    the content of verbatim elements keep their bytes; text nodes outside them carry their text with
    entities decoded (``convert_charrefs``)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.events: list[tuple[str, str, str, int]] = []    # (kind, data, tag, offset of its raw text)
        self.verbatim: list[str] = []   # open elements whose text is kept as it is

    def _at(self) -> int:
        line, col = self.getpos()
        return self.line_starts[line - 1] + col

    def handle_starttag(self, tag, attrs):
        self.events.append(("markup" if self.verbatim else "start", "", tag, self._at()))
        if tag in _VERBATIM_TAGS:
            self.verbatim.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.events.append(("markup", "", tag, self._at()))

    def handle_endtag(self, tag):
        if tag in self.verbatim:
            del self.verbatim[len(self.verbatim) - 1 - self.verbatim[::-1].index(tag):]
        self.events.append(("markup" if self.verbatim else "end", "", tag, self._at()))

    def handle_data(self, data):
        self.events.append(("markup" if self.verbatim else "text", data, "", self._at()))

    def unknown_decl(self, data):
        self.events.append(("markup", "", "", self._at()))

    handle_comment = handle_decl = handle_pi = unknown_decl


def _parse(html: str) -> list[Part]:
    """Parts of html: (kind, raw, tag) for markup, (\"text\", decoded text, \"\") for text nodes;
    the raw texts of all parts, in order, are the input."""
    p = _Parts()
    p.line_starts = [0] + [m.end() for m in re.finditer("\n", html)]
    p.feed(html)
    p.close()
    parts: list[Part] = []
    ends = [e[3] for e in p.events[1:]] + [len(html)]
    for (kind, data, tag, start), end in zip(p.events, ends):
        raw = html[start:end]
        if kind == "text" and parts and parts[-1][0] == "text":    # one text node the parser cut in two
            parts[-1] = ("text", parts[-1][1] + data, "")
            continue
        parts.append((kind, data if kind == "text" else raw, tag))
    if p.events and p.events[0][3] > 0:
        parts.insert(0, ("markup", html[:p.events[0][3]], ""))
    return parts


class HtmlText:
    """The translatable segments of an HTML fragment, and the fragment rebuilt around their translations.

    Text interrupted only by inline elements with plain-text content (``<b>``, ``<a href=..>``,
    ``<em>``, ...) is translated as one unit, so a sentence split by tags keeps its meaning; each
    inline element is then put back around its own words: its own translation where that occurs in
    the unit's translation (case-insensitive; the approach of Argos Translate's tag handling), else
    the words of it that occur there; else its tags are dropped and its text stays translated in
    the sentence. Other text nodes are translated one by one. Whitespace inside a text (the line
    breaks and tabs of indented HTML) is collapsed to single spaces for the translator, so a sentence
    broken over lines stays one sentence; the whitespace before and after it is kept. Tags (their
    attribute values included), comments, declarations and the content of script, style, code, pre
    and similar elements are copied byte for byte from the input; entities in the model's output
    (Multi30k's text has ``&amp;``) are decoded before escaping.
    """

    def __init__(self, html: str):
        parts = _parse(html)
        self.units: list[Unit] = []
        i = 0
        while i < len(parts):
            items, j = [], i
            while j < len(parts):
                kind, raw, tag = parts[j]
                if kind == "text":
                    items.append(("", raw, ""))
                    j += 1
                elif (kind == "start" and tag in _INLINE_TAGS and j + 2 < len(parts)
                      and parts[j + 1][0] == "text" and parts[j + 1][1].strip()
                      and parts[j + 2][0] == "end" and parts[j + 2][2] == tag):
                    items.append((raw, parts[j + 1][1], parts[j + 2][1]))
                    j += 3
                else:
                    break
            if not items:
                self.units.append(("markup", parts[i][1]))
                i += 1
                continue
            if any(start for start, _, _ in items) and sum(bool(t.strip()) for _, t, _ in items) > 1:
                self.units.append(("run", items))
            else:
                self.units += [("run", [item]) if item[0] else ("text", item[1]) for item in items]
            i = j
        self.segments: list[str] = []       # what to translate, in order, whitespace collapsed
        for kind, unit in self.units:
            if kind == "text" and unit.strip():
                self.segments.append(_collapse(unit))
            elif kind == "run":
                if len(unit) > 1:
                    self.segments.append(_collapse("".join(t for _, t, _ in unit)))      # the whole unit
                self.segments += [_collapse(t) for start, t, _ in unit if start and t.strip()]  # each inline text

    def rebuild(self, translations: list[str]) -> str:
        """The fragment with ``translations`` (one per segment, in order) in place of its text."""
        it = (unescape(t) for t in translations)

        def keep_space(raw: str, translated: str) -> str:
            lead, trail = _space_around(raw)
            return lead + escape(translated.strip(), quote=False) + trail

        out = []
        for kind, unit in self.units:
            if kind == "markup":
                out.append(unit)
            elif kind == "text":
                out.append(keep_space(unit, next(it)) if unit.strip() else unit)
            else:
                whole = next(it) if len(unit) > 1 else None
                pieces = [next(it) if start and t.strip() else None for start, t, _ in unit]
                if whole is not None:
                    out.append(_inject(unit, whole, pieces))
                else:   # a lone inline element
                    out.append("".join(start + (keep_space(t, tr) if tr is not None else t) + end
                                       for (start, t, end), tr in zip(unit, pieces)))
        return "".join(out)


def _collapse(text: str) -> str:
    """Text as the translator gets it: runs of whitespace (line breaks and tabs of indented HTML
    included) as one space, none around it; a browser renders the text the same way."""
    return " ".join(text.split())


def _space_around(raw: str) -> tuple[str, str]:
    """The whitespace before and after the text of ``raw`` (kept around its translation)."""
    return raw[: len(raw) - len(raw.lstrip())], raw[len(raw.rstrip()):]


def _inject(unit: list[RunItem], whole: str, pieces: list[Optional[str]]) -> str:
    """The unit's translation with each inline element around its own words (see HtmlText)."""
    text = "".join(t for _, t, _ in unit)
    lead, trail = _space_around(text)
    whole = whole.strip()
    low, pos, out = whole.lower(), 0, [lead]
    for (start, _, end), tr in zip(unit, pieces):
        if not start:
            continue
        tr = (tr or "").strip()
        span = None
        for cand in dict.fromkeys([tr, tr.rstrip(".!?")]):        # its translation ("Dog." -> "Dog")
            at = low.find(cand.lower(), pos) if cand else -1
            if at >= 0:
                span = (at, at + len(cand))
                break
        if span is None:                                          # else the words of it found there
            hits = [m for w in dict.fromkeys(re.findall(r"\w{3,}", tr.lower()))
                    for m in [re.search(rf"\b{re.escape(w)}\b", low[pos:])] if m]
            if hits:
                first = min(m.start() for m in hits)
                last = max(m.end() for m in hits if m.start() - first <= 40)
                span = (pos + first, pos + last)
        if span is None:                                          # else: tags dropped, text kept
            continue
        out += [escape(whole[pos: span[0]], quote=False), start, escape(whole[span[0]: span[1]], quote=False), end]
        pos = span[1]
    out += [escape(whole[pos:], quote=False), trail]
    return "".join(out)
