"""Text with markup (LibreTranslate's ``format=html``, DeepL's ``tag_handling``, HTML documents):
the text of an HTML fragment translated, its markup kept (``HtmlText``); where the elements go in a
translation: ``placement.py``."""
from __future__ import annotations

import re
import unicodedata
from array import array
from dataclasses import dataclass
from html import escape, unescape
from html.parser import HTMLParser
from typing import Callable, Optional, Union

from service.protocol import ServiceError
from service.translator.text import has_text

from .placement import WordBounds, empty_at, find, words_at

MAX_INLINE_DEPTH = 100     # inline elements inside one another around a sentence (deeper: 413)
_LOOKAHEAD = 100           # characters of the text after an empty element read to place it (its next word)

# Elements that sit inside a sentence (HTML's phrasing content); text around them is one sentence.
_INLINE_TAGS = frozenset("a abbr b bdi bdo cite data dfn em i mark q s small span strong sub sup time u".split())
# Elements whose text is not prose: kept as it is.
_VERBATIM_TAGS = frozenset("script style noscript template textarea pre code kbd samp var".split())

Part = tuple[str, str, str]             # (kind, raw, tag): kind is start/end/text/comment/markup
# A character reference, as html.unescape finds them ("&amp;", "&#0;", "&#x110000;", "&notin", "&x;").
_REF = re.compile(r"&(?:#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[^\t\n\f <&#;]{1,32};?)")


class Text(str):
    """A text node: its text with entities decoded (a reference the model cannot translate as a
    sentinel character, see ``_decode``), and ``raw``, its source text byte for byte."""
    __slots__ = ()      # no attribute dictionary: a page holds hundreds of thousands of these

    @property
    def raw(self) -> str:       # without references the text is its source
        return self


class _Decoded(Text):
    """A text node with character references: ``raw`` (its source) kept beside its text."""
    raw = None          # the instance's, set by ``_decode``


@dataclass(eq=False, slots=True)
class Element:
    """An inline element of a run: its tags as written and what is between them."""
    start: str                      # the start tag, byte for byte
    children: list["Node"]          # text (str, entities decoded) and elements, in order
    end: str                        # the end tag, byte for byte


Node = Union[str, Element]
Unit = tuple[str, Union[str, list[Node]]]   # ("markup", raw) or ("run", [Node, ...])


class _Parts(HTMLParser):
    """An HTML fragment as a flat list of parts, each with its raw source text: markup, comments and
    the content of verbatim elements keep their bytes; text nodes outside them carry their text with
    entities decoded (``convert_charrefs``). ``count()`` is called once per part as it is read."""

    def __init__(self, count: Optional[Callable[[], None]] = None):
        super().__init__(convert_charrefs=True)
        self.events: list[tuple[str, str, str, int]] = []    # (kind, data, tag, offset of its raw text)
        self.verbatim: list[str] = []   # open elements whose text is kept as it is
        self.count = count

    def _at(self) -> int:       # every handler calls it once: the part is counted here
        if self.count is not None:
            self.count()
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

    def handle_comment(self, data):     # inside a sentence it is part of the run, like an empty element
        self.events.append(("markup" if self.verbatim else "comment", "", "", self._at()))

    handle_decl = handle_pi = unknown_decl


def _parse(html: str, refs: dict[str, str], count: Optional[Callable[[], None]] = None) -> list[Part]:
    """Parts of html: (kind, raw, tag) for markup, (\"text\", Text, \"\") for text nodes; the raw
    texts of all parts, in order, are the input. Markup the parser leaves unfinished at the end
    (``<p``, an unclosed comment) is one markup part. ``refs``: see ``_decode``; ``count``: see ``_Parts``."""
    p = _Parts(count)
    p.line_starts = array("q", [0])     # 8 bytes a line
    p.line_starts.extend(m.end() for m in re.finditer("\n", html))
    p.feed(html)
    cut = len(html) - (len(p.rawdata) if p.rawdata.startswith("<") else 0)
    p.close()
    events = [e for e in p.events if e[3] < cut]
    parts: list[Part] = []
    ends = [e[3] for e in events[1:]] + [cut]
    for (kind, data, tag, start), end in zip(events, ends):
        raw = html[start:end]
        if kind == "text" and parts and parts[-1][0] == "text":    # one text node the parser cut in two
            raw = parts.pop()[1].raw + raw
        parts.append((kind, _decode(raw, refs, html) if kind == "text" else raw, tag))
    if events and events[0][3] > 0:
        parts.insert(0, ("markup", html[:events[0][3]], ""))
    if cut < len(html):
        parts.append(("markup", html[cut:], ""))
    return parts


def _decode(raw: str, refs: dict[str, str], html: str) -> Text:
    """The text node of source text ``raw``, references decoded as html.unescape does; one that
    decodes to nothing visible the model could translate (``&#0;``, ``&#xD800;``, ``&#1;``, an
    unknown name) becomes a sentinel (a private-use character not in ``html``), recorded in
    ``refs`` (raw reference -> sentinel) to be sent and put back as written."""
    def ref(m: re.Match) -> str:
        text = unescape(m.group())
        if text and text != m.group() and "\ufffd" not in text and all(
                c.isspace() or unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co", "Cn") for c in text):
            return text
        if m.group() not in refs:
            code = 0xF0000 + len(refs)
            while chr(code) in html:
                code += 1
            refs[m.group()] = chr(code)
        return refs[m.group()]
    text = _REF.sub(ref, raw)
    if text == raw:
        return Text(raw)
    node = _Decoded(text)
    node.raw = raw
    return node


class HtmlText:
    """The translatable segments of an HTML fragment, and the fragment rebuilt around their translations.

    A run of text and inline elements (``<b>``, ``<a href=..>``, ``<em>``, ..., nested to any depth,
    each closed inside the run; one never closed counts as an element without text, ``_void_unclosed``)
    is translated as one unit, so a sentence split by tags keeps its meaning. Each inline element is then put back around its own words, level by level inside the
    words of its parent: an element holding all the text of its parent gets all of it; any other is
    translated on its own too, and goes around that translation where it occurs in the parent's
    (case-insensitive; the approach of Argos Translate's tag handling), else around the words of it
    that occur there; else its tags stay, empty, at its place (its text stays translated in the
    sentence) and its children are looked for in the parent's words instead. Text is never repeated.
    An inline element without visible text (``<a id=x></a>``), or a comment inside the run, stays at
    the run's edges where it is one, next to a placed sibling it follows, else goes next to its word
    (``empty_at``). Other text nodes are translated one by
    one. Whitespace inside a text (the line breaks and tabs of indented HTML) is collapsed to single
    spaces for the translator, so a sentence broken over lines stays one sentence; the whitespace before
    and after it is kept. Tags (their attribute values included), comments, declarations and the content
    of script, style, code, pre and similar elements, unfinished markup at the end, the whitespace
    around a text and character references the model cannot translate are copied byte for byte from the
    input; entities in the model's output (Multi30k's text has ``&amp;``) are decoded before escaping.
    """

    def __init__(self, html: str, field: str = "q", where: Optional[str] = None,
                 count: Optional[Callable[[], None]] = None):
        """Raises ServiceError 413 naming ``where`` (default ``field``: the request field) for inline
        elements nested deeper than MAX_INLINE_DEPTH. (A request's text, tags included, has its own
        cap before it gets here; a document's HTML has the document's limits.) ``count()`` is called
        for each tag, text node or comment as the parser reads it (a document's ``Nodes.add``, which
        raises to stop reading a file past its cap)."""
        where = where or field
        self._refs: dict[str, str] = {}     # character reference kept as written -> its sentinel
        parts = _parse(html, self._refs, count)
        self.units: list[Unit] = []     # ("markup", raw) or ("run", [Node, ...])
        parts = _void_unclosed(parts)
        i = 0
        while i < len(parts):
            end = _run_end(parts, i)
            if end == i:
                self.units.append(("markup", parts[i][1]))
                i += 1
            else:
                self.units.append(("run", _tree(parts[i:end], field, where)))
                i = end
        self.segments: list[str] = []       # what to translate, in order, whitespace collapsed
        self._seg: dict[int, int] = {}       # id(node list or element) -> index of its segment
        for kind, unit in self.units:
            if kind == "run" and _visible(unit):
                self._seg[id(unit)] = len(self.segments)
                self.segments.append(self._written(_collapse(_text(unit))))
                self._add_segments(unit)

    def _add_segments(self, nodes: list[Node]) -> None:
        """A segment for each element under ``nodes`` that does not hold all of its level's text."""
        shown = [n for n in nodes if _visible([n])]
        for n in nodes:
            if isinstance(n, Element):
                if _visible(n.children) and shown != [n]:
                    self._seg[id(n)] = len(self.segments)
                    self.segments.append(self._written(_collapse(_text(n.children))))
                self._add_segments(n.children)

    def rebuild(self, translations: list[str]) -> str:
        """The fragment with ``translations`` (one per segment, in order) in place of its text."""
        if len(translations) != len(self.segments):
            raise ValueError(f"expected {len(self.segments)} translations, got {len(translations)}")
        tr = [unescape(self._sentinels(t)).strip() for t in translations]
        out = []
        for kind, unit in self.units:
            if kind == "markup":
                out.append(unit)
            elif id(unit) in self._seg:
                out.append(self._render(unit, tr[self._seg[id(unit)]], tr))
            else:
                out.append(_raw(unit))
        return self._written("".join(out))

    def _written(self, text: str) -> str:
        """text with each sentinel replaced by its character reference, as written in the source."""
        for ref, mark in self._refs.items():
            text = text.replace(mark, ref)
        return text

    def _sentinels(self, text: str) -> str:
        """A translation with the kept references (the model copies them) as their sentinels."""
        for ref in sorted(self._refs, key=len, reverse=True):
            text = text.replace(ref, self._refs[ref])
        return text

    def _render(self, nodes: list[Node], whole: str, tr: list[str]) -> str:
        """``nodes`` with ``whole`` (their translation, unescaped) in place of their text; see the class."""
        shown = [k for k, n in enumerate(nodes) if _visible([n])]
        first, last = shown[0], shown[-1]
        lead = _space_around(nodes[first].raw)[0] if isinstance(nodes[first], str) else ""
        trail = _space_around(nodes[last].raw)[1] if isinstance(nodes[last], str) else ""
        out = [_raw(nodes[:first]), lead]
        if first == last and isinstance(nodes[first], Element):      # one element holds all the words
            n = nodes[first]
            out.append(n.start + self._render(n.children, whole, tr) + n.end)
        else:
            low, pos, done, total = whole.lower(), 0, 0, len(_text(nodes))
            # what is left, the next node last (a stack: an element placed nowhere puts its children
            # back on top), and per entry the nearest entry at or below it with text (-1: none), so
            # that the text after a node is found without joining all that is left
            todo: list[Node] = []
            with_text: list[int] = []
            texts: dict[int, str] = {}          # id(node) -> its text

            def text_of(n: Node) -> str:
                if id(n) not in texts:
                    texts[id(n)] = n if isinstance(n, str) else _text(n.children)
                return texts[id(n)]

            def push(items: list[Node]) -> None:
                for item in reversed(items):
                    below = with_text[-1] if with_text else -1
                    todo.append(item)
                    with_text.append(len(todo) - 1 if text_of(item) else below)

            def after() -> str:     # the start of the text after the current node: its first word or character
                got, k = "", with_text[-1] if with_text else -1
                while k >= 0 and (not got or re.fullmatch(r"\w+", got)) and len(got) < _LOOKAHEAD:
                    got += text_of(todo[k])
                    k = with_text[k - 1] if k > 0 else -1
                return got

            push(nodes[first:last + 1])
            prev, words = None, None
            while todo:
                n = todo.pop()
                with_text.pop()
                size = len(text_of(n))
                done += size                                 # source characters up to the end of n
                if isinstance(n, str):
                    prev = n
                    continue                                 # its words are in the gaps
                if not _visible(n.children):
                    following = after()
                    if isinstance(prev, Element) and not following[:1].strip():
                        at = pos
                    else:
                        words = words or WordBounds(whole)
                        at = empty_at(whole, pos, following, done / total, words)
                    out += [escape(whole[pos:at], quote=False), _raw([n])]
                    pos, prev = at, n
                    continue
                span = find(low, tr[self._seg[id(n)]], pos) if id(n) in self._seg else None
                span = span or words_at(whole, pos, (done - size) / total, done / total)
                if span is None:     # no words for it: its tags stay, empty, here; its children looked for here
                    out.append(n.start + n.end)
                    push(n.children)
                    done -= size
                    continue
                out += [escape(whole[pos:span[0]], quote=False),
                        n.start + self._render(n.children, whole[span[0]:span[1]], tr) + n.end]
                pos, prev = span[1], n
            out.append(escape(whole[pos:], quote=False))
        out += [trail, _raw(nodes[last + 1:])]
        return "".join(out)


def _void_unclosed(parts: list[Part]) -> list[Part]:
    """parts with each inline start tag that is never closed ("<p>Ein <b>Hund</p>", "Ein <i>Hund
    läuft.") as a part of kind "comment": an element without text, kept byte for byte, that does not
    split the sentence around it (a browser closes such elements at the end of their block). An end tag
    closes the innermost open element of its name, leaving those opened inside it unclosed; other
    markup (a block tag, a line break, a stray end tag) leaves every open one unclosed."""
    out = list(parts)
    stack: list[tuple[str, int]] = []       # open inline elements: (tag, index of the start tag)
    depth_of: dict[str, list[int]] = {}     # tag -> the stack positions of its open elements, ascending

    def close_from(k: int, void: bool) -> None:     # every open element from stack position k up
        for tag, j in stack[k:]:
            depth_of[tag].pop()
            if void:
                out[j] = ("comment", parts[j][1], "")
        del stack[k:]

    for j, (kind, _, tag) in enumerate(parts):
        if kind == "start" and tag in _INLINE_TAGS:
            depth_of.setdefault(tag, []).append(len(stack))
            stack.append((tag, j))
        elif kind == "end" and depth_of.get(tag):
            k = depth_of[tag][-1]
            close_from(k + 1, void=True)            # opened inside it, never closed
            close_from(k, void=False)
        elif kind not in ("text", "comment"):
            close_from(0, void=True)
    close_from(0, void=True)
    return out


def _run_end(parts: list[Part], i: int) -> int:
    """Where the run of text and inline elements starting at ``parts[i]`` ends: the last point from
    which every inline element opened in it is closed again (``i``: no run starts there). On parts
    from ``_void_unclosed`` every element opened is closed before the next other part, so a run ends
    there and the scans of a fragment's runs pass each part once."""
    open_tags: list[str] = []
    end = i
    for j in range(i, len(parts)):
        kind, _, tag = parts[j]
        if kind == "start" and tag in _INLINE_TAGS:
            open_tags.append(tag)
        elif kind == "end" and open_tags and open_tags[-1] == tag:
            open_tags.pop()
        elif kind not in ("text", "comment"):
            break
        if not open_tags:
            end = j + 1
    return end


def _tree(parts: list[Part], field: str = "q", where: str = "q") -> list[Node]:
    """The nodes of a run (balanced, see ``_run_end``): text as str, inline elements as Element.
    Raises ServiceError 413 for inline elements nested deeper than MAX_INLINE_DEPTH."""
    top: list[Node] = []
    stack = [top]
    for kind, raw, _ in parts:
        if kind == "text":
            stack[-1].append(raw)
        elif kind == "comment":         # kept byte for byte where it was, like an element without text
            stack[-1].append(Element(raw, [], ""))
        elif kind == "start":
            if len(stack) > MAX_INLINE_DEPTH:
                raise ServiceError(413, f"{where}: inline HTML elements nested more than {MAX_INLINE_DEPTH} levels "
                                        f"deep around one sentence ({raw[:40]!r}...)", field)
            element = Element(raw, [], "")
            stack[-1].append(element)
            stack.append(element.children)
        else:
            stack.pop()
            stack[-1][-1].end = raw
    return top


def _text(nodes: list[Node]) -> str:
    """The text of nodes, entities decoded, tags left out."""
    return "".join(n if isinstance(n, str) else _text(n.children) for n in nodes)


def _visible(nodes: list[Node]) -> bool:
    return has_text(_text(nodes))


def _raw(nodes: list[Node]) -> str:
    """Nodes as HTML again (text without visible characters, tags byte for byte)."""
    return "".join(n.raw if isinstance(n, str) else n.start + _raw(n.children) + n.end for n in nodes)


def _collapse(text: str) -> str:
    """Text as the translator gets it: runs of whitespace (line breaks and tabs of indented HTML
    included) as one space, none around it; a browser renders the text the same way."""
    return " ".join(text.split())


def _space_around(raw: str) -> tuple[str, str]:
    """The whitespace before and after the text of ``raw`` (a text node's source, kept around its
    translation as written: ``&nbsp;`` stays ``&nbsp;``); raw must have a visible character."""
    pieces = re.findall(_REF.pattern + r"|[\s\S]", raw)         # references and single characters
    space = [unescape(q).isspace() for q in pieces]
    lead = space.index(False)
    trail = space[::-1].index(False)
    return "".join(pieces[:lead]), "".join(pieces[len(pieces) - trail:])
