"""Text with markup (LibreTranslate's ``format=html``, DeepL's ``tag_handling``, HTML documents):
the text of an HTML fragment translated, its markup kept (``HtmlText``); what is not translated
(``translate="no"``, ``class="notranslate"``, DeepL's ``ignore_tags``: ``_translate_state``) and
where sentences end (DeepL's other tag options: ``TagOptions``) decided here, once, for every route;
where the elements go in a translation: ``placement.py``."""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, replace
from html import escape, unescape
from html.parser import HTMLParser
from typing import Optional, Union

from service.protocol import ServiceError
from service.translator.text import has_text

from .placement import WordBounds, empty_at, find, words_at

MAX_INLINE_DEPTH = 100     # inline elements inside one another around a sentence (deeper: 413)
_LOOKAHEAD = 100           # characters of the text after an empty element read to place it (its next word)

# Elements that sit inside a sentence (HTML's phrasing content); text around them is one sentence.
_INLINE_TAGS = frozenset("a abbr b bdi bdo cite data dfn em i mark q s small span strong sub sup time u".split())
# Elements whose text is not prose: kept as it is.
_VERBATIM_TAGS = frozenset("script style noscript template textarea pre code kbd samp var".split())
# Elements without content (no end tag): nothing inherits their translate state.
_VOID_TAGS = frozenset("area base br col embed hr img input link meta param source track wbr".split())
# HTML's implied end tags, in short: these start tags close an open p; each of _SIBLINGS' keys closes
# an open sibling of the names it maps to that is the innermost open element (XML has none).
_CLOSES_P = frozenset("address article aside blockquote details dialog div dl fieldset figcaption figure footer "
                      "form h1 h2 h3 h4 h5 h6 header hgroup hr main menu nav ol p pre section table ul".split())
_SIBLINGS = {"li": ("li",), "dt": ("dt", "dd"), "dd": ("dt", "dd"), "td": ("td", "th"), "th": ("td", "th"),
             "tr": ("tr",), "option": ("option",)}
_MARK = re.compile("[\U000F0000-\U0010FFFD]")   # a sentinel (``_Marks``), or another private-use character
_NAME = re.compile(r"</?([^\s/>]+)")    # an element's name as written in its tag (XML: case kept)

Part = tuple[str, str, str]             # (kind, raw, tag): kind is start/end/text/comment/kept/markup
# A character reference, as html.unescape finds them ("&amp;", "&#0;", "&#x110000;", "&notin", "&x;").
_REF = re.compile(r"&(?:#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[^\t\n\f <&#;]{1,32};?)")


@dataclass(frozen=True)
class TagOptions:
    """Which elements end a sentence and which are not translated, beyond HTML's own rules (DeepL's
    tag options; ``tags(...)`` builds one). The default (outline detection): HTML's phrasing elements
    (``_INLINE_TAGS``) sit inside a sentence, and in XML every element that occurs between text (in
    an element with text of its own: ``Press <x>Continue</x> to go on``); every other element ends one."""
    ignore: frozenset[str] = frozenset()         # elements whose content is kept as it is (DeepL's ignore_tags)
    splitting: frozenset[str] = frozenset()      # elements that always end a sentence (splitting_tags)
    non_splitting: frozenset[str] = frozenset()  # elements inside a sentence (non_splitting_tags)
    outline: bool = True                         # False: only ``splitting`` end a sentence (outline_detection)
    xml: bool = False                            # names compared as written (XML); else in lower case (HTML)
    between_text: frozenset[str] = frozenset()   # XML's elements found between text (``_Parts``), per fragment

    def inline(self, name: str) -> bool:
        """Whether an element ``name`` sits inside a sentence (else it ends one)."""
        if name in self.splitting:
            return False
        return (name in self.non_splitting or not self.outline or name.lower() in _INLINE_TAGS
                or name in self.between_text)


HTML = TagOptions()


def tags(ignore=(), splitting=(), non_splitting=(), outline: bool = True, xml: bool = False) -> TagOptions:
    """TagOptions of these element names (HTML's: compared in lower case, as its parser reads tags)."""
    def names(given) -> frozenset[str]:
        return frozenset(given if xml else (n.lower() for n in given))
    return TagOptions(names(ignore), names(splitting), names(non_splitting), outline, xml)


def _translate_state(name: str, attrs: dict, parent: str, options: TagOptions) -> str:
    """An element's translate state: "never" (script, code, ... and ``options.ignore``: nothing inside
    translated), "no" (``translate="no"`` or Google's ``class="notranslate"``: not translated, but a
    descendant with ``translate="yes"`` is), "yes"; else its parent's (HTML's translate attribute:
    inherited; an invalid value is no value)."""
    if parent == "never" or name.lower() in _VERBATIM_TAGS or name in options.ignore:
        return "never"
    if "translate" in attrs:
        value = (attrs["translate"] or "").strip().lower()
        if value in ("", "yes"):
            return "yes"
        if value == "no":
            return "no"
    if "notranslate" in (attrs.get("class") or "").split():
        return "no"
    return parent


class Text(str):
    """A text node: its text with entities decoded (a reference the model cannot translate as a
    sentinel character, see ``_decode``), and ``raw``, its source text byte for byte."""
    raw: str


class Kept(Text):
    """An element not translated inside a sentence (``translate="no"``, ``notranslate``, an ignored
    tag): a sentinel character the translator keeps as it is (a private-use character: protected, see
    ``service/translator/spans.py``), and ``raw``, the element byte for byte."""


class _Marks:
    """Sentinels: private-use characters that are not in the fragment, a new one each call."""

    def __init__(self, html: str):
        self.html, self.next = html, 0xF0000

    def new(self) -> str:
        while chr(self.next) in self.html:
            self.next += 1
        self.next += 1
        return chr(self.next - 1)


@dataclass(eq=False)
class Element:
    """An inline element of a run: its tags as written and what is between them."""
    start: str                      # the start tag, byte for byte
    children: list["Node"]          # text (str, entities decoded) and elements, in order
    end: str                        # the end tag, byte for byte


Node = Union[str, Element]
Unit = tuple[str, Union[str, list[Node]]]   # ("markup", raw) or ("run", [Node, ...])


class _Open:
    """The open elements, innermost last, each with an item; the last one of a name found in
    constant time (a fragment of thousands of tags stays linear)."""

    def __init__(self):
        self.items: list[tuple[str, object]] = []      # (name, item)
        self._at: dict[str, list[int]] = {}            # name -> its positions in items, ascending

    def push(self, name: str, item) -> None:
        self._at.setdefault(name, []).append(len(self.items))
        self.items.append((name, item))

    def last(self, name: str) -> int:
        """The position of the innermost open element ``name``; -1: none."""
        at = self._at.get(name)
        return at[-1] if at else -1

    def cut(self, k: int) -> list[tuple[str, object]]:
        """Close the elements from position k on; returns them."""
        closed = self.items[k:]
        for name, _ in closed:
            self._at[name].pop()
        del self.items[k:]
        return closed


class _Parts(HTMLParser):
    """An HTML fragment as a flat list of events, each with the offset of its raw source text: text
    nodes carry their text with entities decoded (``convert_charrefs``); what is not translated
    (``_translate_state``) is "markup" and keeps its bytes. The start and end tags of an element not
    translated inside translated text are "nostart" / "noend" (``pairs``: the index of each one's end
    event); an element without content is "empty" (``_kept`` decides)."""

    def __init__(self, html: str, options: TagOptions):
        super().__init__(convert_charrefs=True)
        self.html, self.options = html, options
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", html)]
        self.events: list[tuple[str, str, str, int]] = []    # (kind, data, tag, offset of its raw text)
        # the open elements the translate state is carried through, each with (state, index of its
        # start event): those that change the state and every element opened inside one of them
        self.open = _Open()
        self.pairs: dict[int, int] = {}     # "nostart" event -> its "noend" event
        # XML's outline detection (``TagOptions.between_text``): each open element's [whether it has
        # text of its own, the names of the elements in it], and the fragment's own
        self.tree, self.root = _Open(), [False, []]
        self.between_text: set[str] = set()

    def _at(self) -> int:
        line, col = self.getpos()
        return self.line_starts[line - 1] + col

    def _current(self) -> str:
        """The translate state here (``_translate_state``)."""
        return self.open.items[-1][1][0] if self.open.items else "yes"

    def _name(self, tag: str) -> str:
        """The element's name: HTML's in lower case (as the parser gives it), XML's as written."""
        if not self.options.xml:
            return tag
        m = _NAME.match(self.html, self._at())
        return m.group(1) if m and m.group(1).lower() == tag else tag

    def _implied_ends(self, name: str) -> None:
        if self.options.xml or not self.open.items:
            return
        if name in _CLOSES_P and self.open.last("p") >= 0:
            self.open.cut(self.open.last("p"))
        elif self.open.items[-1][0] in _SIBLINGS.get(name, ()):
            self.open.cut(len(self.open.items) - 1)

    def _outline(self, kind: str, name: str = "", text: str = "") -> None:
        """Follow the element tree for XML's outline detection; kind: start, empty, end, text or close
        (the end of the fragment)."""
        if not (self.options.xml and self.options.outline):
            return
        top = self.tree.items[-1][1] if self.tree.items else self.root
        if kind == "text":
            top[0] = top[0] or has_text(text)
        elif kind in ("start", "empty"):
            top[1].append(name)
            if kind == "start":
                self.tree.push(name, [False, []])
        elif kind == "close" or self.tree.last(name) >= 0:
            closed = [item for _, item in self.tree.cut(0 if kind == "close" else self.tree.last(name))]
            for own_text, inside in closed + ([self.root] if kind == "close" else []):
                if own_text:
                    self.between_text.update(inside)

    def handle_starttag(self, tag, attrs):
        name = self._name(tag)
        self._implied_ends(name)
        void = name.lower() in _VOID_TAGS
        self._outline("empty" if void else "start", name)
        parent = self._current()
        if void:
            self.events.append(("start" if parent == "yes" else "markup", "", name, self._at()))
            return
        state = _translate_state(name, dict(attrs), parent, self.options)
        kind = "markup" if parent != "yes" else "start" if state == "yes" else "nostart"
        if self.open.items or state != parent:
            self.open.push(name, (state, len(self.events)))
        self.events.append((kind, "", name, self._at()))

    def handle_startendtag(self, tag, attrs):
        name = self._name(tag)
        self._outline("empty", name)
        self.events.append(("empty" if self._current() == "yes" else "markup", "", name, self._at()))

    def handle_endtag(self, tag):
        name = self._name(tag)
        self._outline("end", name)
        k = self.open.last(name)
        if k < 0:
            self.events.append(("end" if self._current() == "yes" else "markup", "", name, self._at()))
            return
        parent = self.open.items[k - 1][1][0] if k else "yes"
        state, start = self.open.cut(k)[0][1]
        kind = "markup" if parent != "yes" else "end" if state == "yes" else "noend"
        if kind == "noend":
            self.pairs[start] = len(self.events)
        self.events.append((kind, "", name, self._at()))

    def handle_data(self, data):
        self._outline("text", text=data)
        self.events.append(("text" if self._current() == "yes" else "markup", data, "", self._at()))

    def unknown_decl(self, data):
        self.events.append(("markup", "", "", self._at()))

    def handle_comment(self, data):     # inside a sentence it is part of the run, like an empty element
        self.events.append(("comment" if self._current() == "yes" else "markup", "", "", self._at()))

    handle_decl = handle_pi = unknown_decl

    def close(self):
        super().close()
        self._outline("close")


def _kept(events: list[tuple[str, str, str, int]], pairs: dict[int, int],
          options: TagOptions) -> list[tuple[str, str, str, int]]:
    """events with each element not translated that sits inside a sentence (inline, closed, nothing
    translated in it) as one "kept" event, the tags of the others as "markup"; an element without
    content ("empty") inside a sentence as a "comment" (kept where it is), else "markup"."""
    out, i = [], 0
    while i < len(events):
        kind, data, tag, at = events[i]
        if kind == "empty":
            kind = "comment" if options.inline(tag) else "markup"
        if kind == "nostart":
            j = pairs.get(i, len(events))
            if j < len(events) and options.inline(tag) and all(e[0] == "markup" for e in events[i + 1:j]):
                out.append(("kept", "", tag, at))
                i = j + 1
                continue
        out.append(("markup" if kind in ("nostart", "noend") else kind, data, tag, at))
        i += 1
    return out


def _parse(html: str, refs: dict[str, str], kept: dict[str, str],
           options: TagOptions = HTML) -> tuple[list[Part], TagOptions]:
    """Parts of html: (kind, raw, tag) for markup, (\"text\", Text, \"\") for text nodes, ("kept", Kept,
    tag) for an element not translated inside a sentence; the raw texts of all parts, in order, are
    the input. Markup the parser leaves unfinished at the end (``<p``, an unclosed comment) is one
    markup part. ``refs``: see ``_decode``; ``kept``: each Kept's sentinel -> its raw text. And
    ``options`` for this fragment (XML: with the elements found between text)."""
    p = _Parts(html, options)
    p.feed(html)
    cut = len(html) - (len(p.rawdata) if p.rawdata.startswith("<") else 0)
    p.close()
    if p.between_text:
        options = replace(options, between_text=frozenset(p.between_text))
    events = _kept([e for e in p.events if e[3] < cut], p.pairs, options)
    marks = _Marks(html)
    parts: list[Part] = []
    ends = [e[3] for e in events[1:]] + [cut]
    for (kind, data, tag, start), end in zip(events, ends):
        raw = html[start:end]
        if kind == "text" and parts and parts[-1][0] == "text":    # one text node the parser cut in two
            raw = parts.pop()[1].raw + raw
        if kind == "text":
            raw = _decode(raw, refs, marks)
        elif kind == "kept":
            node = Kept(marks.new())
            node.raw, kept[node] = raw, raw
            raw = node
        parts.append((kind, raw, tag))
    if events and events[0][3] > 0:
        parts.insert(0, ("markup", html[:events[0][3]], ""))
    if cut < len(html):
        parts.append(("markup", html[cut:], ""))
    return parts, options


def _decode(raw: str, refs: dict[str, str], marks: _Marks) -> Text:
    """The text node of source text ``raw``, references decoded as html.unescape does; one that
    decodes to nothing visible the model could translate (``&#0;``, ``&#xD800;``, ``&#1;``, an
    unknown name) becomes a sentinel (``marks``), recorded in ``refs`` (raw reference -> sentinel)
    to be sent and put back as written."""
    def ref(m: re.Match) -> str:
        text = unescape(m.group())
        if text and text != m.group() and "\ufffd" not in text and all(
                c.isspace() or unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co", "Cn") for c in text):
            return text
        if m.group() not in refs:
            refs[m.group()] = marks.new()
        return refs[m.group()]
    node = Text(_REF.sub(ref, raw))
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
    An element not translated (``_translate_state``) is copied byte for byte too: inline inside a run
    it stays in the run as one sentinel character (``Kept``), which comes back where the translator
    put it (once: ``_each_once``); otherwise it ends the run around it like any other block.
    """

    def __init__(self, html: str, field: str = "q", where: Optional[str] = None, options: TagOptions = HTML):
        """``options``: which elements end a sentence and which are not translated (``TagOptions``).
        Raises ServiceError 413 naming ``where`` (default ``field``: the request field) for inline
        elements nested deeper than MAX_INLINE_DEPTH. (A request's text, tags included, has its own
        cap before it gets here; a document's HTML has the document's limits.)"""
        where = where or field
        self._refs: dict[str, str] = {}     # character reference kept as written -> its sentinel
        self._kept: dict[str, str] = {}     # sentinel of an element not translated -> the element as written
        parts, options = _parse(html, self._refs, self._kept, options)
        self.units: list[Unit] = []     # ("markup", raw) or ("run", [Node, ...])
        parts = _void_unclosed(parts, options)
        i = 0
        while i < len(parts):
            end = _run_end(parts, i, options)
            if end == i:
                self.units.append(("markup", parts[i][1]))
                i += 1
            else:
                self.units.append(("run", _tree(parts[i:end], field, where)))
                i = end
        self.segments: list[str] = []       # what to translate, in order, whitespace collapsed
        self._seg: dict[int, int] = {}       # id(node list or element) -> index of its segment
        for kind, unit in self.units:
            if kind == "run" and _has_words(unit):
                self._seg[id(unit)] = len(self.segments)
                self.segments.append(self._written(_collapse(_text(unit))))
                self._add_segments(unit)

    def _add_segments(self, nodes: list[Node]) -> None:
        """A segment for each element under ``nodes`` that does not hold all of its level's text (one
        holding only elements not translated has none: their sentinels are found as they are)."""
        shown = [n for n in nodes if _visible([n])]
        for n in nodes:
            if isinstance(n, Element):
                if _has_words(n.children) and shown != [n]:
                    self._seg[id(n)] = len(self.segments)
                    self.segments.append(self._written(_collapse(_text(n.children))))
                self._add_segments(n.children)

    def rebuild(self, translations: list[str]) -> str:
        """The fragment with ``translations`` (one per segment, in order) in place of its text."""
        if len(translations) != len(self.segments):
            raise ValueError(f"expected {len(self.segments)} translations, got {len(translations)}")
        tr = [unescape(self._sentinels(t)).strip() for t in translations]
        if self._kept:      # a run's translation has each of its elements not translated once
            for _, unit in self.units:
                if id(unit) in self._seg:
                    k = self._seg[id(unit)]
                    tr[k] = _each_once(self.segments[k], tr[k], [c for c in self.segments[k] if c in self._kept])
        out = []
        for kind, unit in self.units:
            if kind == "markup":
                out.append(unit)
            elif id(unit) in self._seg:
                out.append(self._render(unit, tr[self._seg[id(unit)]], tr))
            else:
                out.append(_raw(unit))
        return self._written("".join(out)).translate({ord(mark): raw for mark, raw in self._kept.items()})

    def _written(self, text: str) -> str:
        """text with each reference's sentinel replaced by the reference, as written in the source
        (the sentinels of elements not translated stay: the translator keeps them as they are)."""
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
                if id(n) in self._seg:
                    span = find(low, tr[self._seg[id(n)]], pos)
                else:       # elements not translated only (their sentinels are in ``whole``), or none
                    span = None if _has_words(n.children) else find(low, _collapse(text_of(n)), pos)
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


def _void_unclosed(parts: list[Part], options: TagOptions = HTML) -> list[Part]:
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
        if kind == "start" and options.inline(tag):
            depth_of.setdefault(tag, []).append(len(stack))
            stack.append((tag, j))
        elif kind == "end" and depth_of.get(tag):
            k = depth_of[tag][-1]
            close_from(k + 1, void=True)            # opened inside it, never closed
            close_from(k, void=False)
        elif kind not in ("text", "comment", "kept"):
            close_from(0, void=True)
    close_from(0, void=True)
    return out


def _run_end(parts: list[Part], i: int, options: TagOptions = HTML) -> int:
    """Where the run of text and inline elements starting at ``parts[i]`` ends: the last point from
    which every inline element opened in it is closed again (``i``: no run starts there). On parts
    from ``_void_unclosed`` every element opened is closed before the next other part, so a run ends
    there and the scans of a fragment's runs pass each part once."""
    open_tags: list[str] = []
    end = i
    for j in range(i, len(parts)):
        kind, _, tag = parts[j]
        if kind == "start" and options.inline(tag):
            open_tags.append(tag)
        elif kind == "end" and open_tags and open_tags[-1] == tag:
            open_tags.pop()
        elif kind not in ("text", "comment", "kept"):
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
        if kind in ("text", "kept"):         # an element not translated: its sentinel, as text
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


def _has_words(nodes: list[Node]) -> bool:
    """Whether nodes have visible text besides the elements not translated (``Kept``)."""
    return any(_has_words(n.children) if isinstance(n, Element) else not isinstance(n, Kept) and has_text(n)
               for n in nodes)


def _each_once(source: str, text: str, marks: list[str]) -> str:
    """text (a translation of ``source``) with each of ``marks`` (sentinels of ``source``) once: a
    repeat dropped; one the model left out put back at the space nearest its place in the source."""
    wanted, seen = set(marks), set()

    def first(m: re.Match) -> str:
        mark = m.group()
        if mark not in wanted:
            return mark
        if mark in seen:
            return ""
        seen.add(mark)
        return mark
    text = _MARK.sub(first, text) if marks else text
    for mark in marks:
        if mark in seen:
            continue
        want = source.index(mark) / max(1, len(source) - 1) * len(text)
        cut = min([0, len(text)] + [m.start() for m in re.finditer(r"\s", text)], key=lambda c: abs(c - want))
        text = (mark + " " + text if cut == 0 else text + " " + mark if cut == len(text)
                else text[:cut] + " " + mark + text[cut:])
    return text


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
