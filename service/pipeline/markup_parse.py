"""Reading HTML/XML markup for ``markup.HtmlText``: the parser's parts (text, markup, elements kept
as written), decoded references, and the rules every route shares: what is not translated
(``translate="no"``, ``class="notranslate"``, DeepL's ``ignore_tags``: ``translate_state``) and where
sentences end (DeepL's other tag options: ``TagOptions``)."""
from __future__ import annotations

import re
import unicodedata
from array import array
from dataclasses import dataclass, replace
from html import unescape
from html.parser import HTMLParser
from typing import Callable, Optional, Union

from service.translator.text import has_text

MAX_INLINE_DEPTH = 100     # inline elements inside one another around a sentence (deeper: 413)

# Elements that sit inside a sentence (HTML's phrasing content); text around them is one sentence.
_INLINE_TAGS = frozenset("a abbr b bdi bdo cite data dfn em i mark q s small span strong sub sup time u".split())
# Elements whose text is not prose: kept as it is.
_VERBATIM_TAGS = frozenset("script style noscript template textarea pre code kbd samp var".split())
# Elements that hold text only (no blocks): an end tag of another kind closes them (HTML's parser does).
_PHRASING = _INLINE_TAGS | frozenset("code kbd samp var".split())
# Elements without content (no end tag): nothing inherits their translate state.
_VOID_TAGS = frozenset("area base br col embed hr img input link meta param source track wbr".split())
# HTML's implied end tags, in short: these start tags close an open p; each of _SIBLINGS' keys closes
# an open sibling of the names it maps to that is the innermost open element (XML has none).
_CLOSES_P = frozenset("address article aside blockquote details dialog div dl fieldset figcaption figure footer "
                      "form h1 h2 h3 h4 h5 h6 header hgroup hr main menu nav ol p pre section table ul".split())
_SIBLINGS = {"li": ("li",), "dt": ("dt", "dd"), "dd": ("dt", "dd"), "td": ("td", "th"), "th": ("td", "th"),
             "tr": ("tr",), "option": ("option",)}
MARK = re.compile("[\U000F0000-\U0010FFFD]")   # a sentinel (``_Marks``), or another private-use character
_NAME = re.compile(r"</?([^\s/>]+)")    # an element's name as written in its tag (XML: case kept)

Part = tuple[str, str, str]             # (kind, raw, tag): kind is start/end/text/comment/kept/markup
# A character reference, as html.unescape finds them ("&amp;", "&#0;", "&#x110000;", "&notin", "&x;").
REF = re.compile(r"&(?:#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[^\t\n\f <&#;]{1,32};?)")


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


def translate_state(name: str, attrs: dict, parent: str, options: TagOptions) -> str:
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
    __slots__ = ()      # no attribute dictionary: a page holds hundreds of thousands of these

    @property
    def raw(self) -> str:       # without references the text is its source
        return self


class _Decoded(Text):
    """A text node with character references: ``raw`` (its source) kept beside its text."""
    raw = None          # the instance's, set by ``_decode``


class Kept(Text):
    """An element not translated inside a sentence (``translate="no"``, ``notranslate``, an ignored
    tag): a sentinel character the translator keeps as it is (a private-use character: protected, see
    ``service/translator/spans.py``), and ``raw``, the element byte for byte."""
    raw = None          # the instance's, set by ``parse``


class _Marks:
    """Sentinels: private-use characters that are not in the fragment, a new one each call."""

    def __init__(self, html: str):
        self.html, self.next = html, 0xF0000

    def new(self) -> str:
        while chr(self.next) in self.html:
            self.next += 1
        self.next += 1
        return chr(self.next - 1)


@dataclass(eq=False, slots=True)
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
    (``translate_state``) is "markup" and keeps its bytes. The start and end tags of an element not
    translated inside translated text are "nostart" / "noend" (``pairs``: the index of each one's end
    event); an element without content is "empty" (``kept_events`` decides)."""

    def __init__(self, html: str, options: TagOptions, count: Optional[Callable[[], None]] = None):
        super().__init__(convert_charrefs=True)
        self.html, self.options, self.count = html, options, count
        self.line_starts = array("q", [0])     # 8 bytes a line
        self.line_starts.extend(m.end() for m in re.finditer("\n", html))
        self.events: list[tuple[str, str, str, int]] = []    # (kind, data, tag, offset of its raw text)
        # the open elements the translate state is carried through, each with (state, index of its
        # start event): those that change the state and every element opened inside one of them
        self.open = _Open()
        self.pairs: dict[int, int] = {}     # "nostart" event -> its "noend" event
        # XML's outline detection (``TagOptions.between_text``): each open element's [whether it has
        # text of its own, the names of the elements in it], and the fragment's own
        self.tree, self.root = _Open(), [False, []]
        self.between_text: set[str] = set()

    def _at(self) -> int:       # every handler calls it once: the part is counted here
        if self.count is not None:
            self.count()
        line, col = self.getpos()
        return self.line_starts[line - 1] + col

    def _current(self) -> str:
        """The translate state here (``translate_state``)."""
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
        state = translate_state(name, dict(attrs), parent, self.options)
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
        if k < 0 and not self.options.xml and name not in _PHRASING and self.open.items and all(
                n in _PHRASING for n, _ in self.open.items):
            self.open.cut(0)    # the end of an element opened before them ends them too ("<td><code>x</td>")
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


def kept_events(events: list[tuple[str, str, str, int]], pairs: dict[int, int],
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


def parse(html: str, refs: dict[str, str], kept: dict[str, str], options: TagOptions = HTML,
          count: Optional[Callable[[], None]] = None) -> tuple[list[Part], TagOptions]:
    """Parts of html: (kind, raw, tag) for markup, (\"text\", Text, \"\") for text nodes, ("kept", Kept,
    tag) for an element not translated inside a sentence; the raw texts of all parts, in order, are
    the input. Markup the parser leaves unfinished at the end (``<p``, an unclosed comment) is one
    markup part. ``refs``: see ``_decode``; ``kept``: each Kept's sentinel -> its raw text. And
    ``options`` for this fragment (XML: with the elements found between text)."""
    p = _Parts(html, options, count)
    p.feed(html)
    cut = len(html) - (len(p.rawdata) if p.rawdata.startswith("<") else 0)
    p.close()
    if p.between_text:
        options = replace(options, between_text=frozenset(p.between_text))
    events = kept_events([e for e in p.events if e[3] < cut], p.pairs, options)
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
    text = REF.sub(ref, raw)
    if text == raw:
        return Text(raw)
    node = _Decoded(text)
    node.raw = raw
    return node
