"""Text with markup (LibreTranslate's ``format=html``, DeepL's ``tag_handling``, HTML documents):
the text of an HTML fragment translated, its markup kept (``HtmlText``), once for every route.
Reading the markup, what is not translated (``translate="no"``, ``class="notranslate"``, DeepL's
``ignore_tags``) and where sentences end (DeepL's other tag options): ``markup_parse.py``; where the
elements go in a translation: ``placement.py``."""
from __future__ import annotations

import re
from html import escape, unescape
from typing import Callable, Optional

from service.protocol import ServiceError
from service.translator.text import has_text

from .markup_parse import (
    HTML,
    MARK,
    MAX_INLINE_DEPTH,
    REF,
    Element,
    Kept,
    Node,
    Part,
    TagOptions,
    Unit,
    parse,
)
from .placement import WordBounds, empty_at, find, words_at

_SPACE_END = re.compile(r"\s(?:<[^<>]*>)*$")     # rendered text ending in whitespace (and tags only after it)
_SPACE_START = re.compile(r"(?:<[^<>]*>)*\s")      # rendered text starting with whitespace (after tags only)
_ENTITY = re.compile(r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);?")     # what ``unescape`` may decode
_LOOKAHEAD = 100           # characters of the text after an empty element read to place it (its next word)


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
    Text of the translation that continues the source's text is written as the source wrote it (its
    whitespace and references: ``_Written``), so an unchanged run comes back byte for byte.
    An element not translated (``translate_state``) is copied byte for byte too: inline inside a run
    it stays in the run as one sentinel character (``Kept``), which comes back where the translator
    put it (once: ``_each_once``); otherwise it ends the run around it like any other block.
    """

    def __init__(self, html: str, field: str = "q", where: Optional[str] = None, options: TagOptions = HTML,
                 count: Optional[Callable[[], None]] = None):
        """``options``: which elements end a sentence and which are not translated (``TagOptions``).
        Raises ServiceError 413 naming ``where`` (default ``field``: the request field) for inline
        elements nested deeper than MAX_INLINE_DEPTH. (A request's text, tags included, has its own
        cap before it gets here; a document's HTML has the document's limits.) ``count()`` is called
        for each tag, text node or comment as the parser reads it (a document's ``Nodes.add``, which
        raises to stop reading a file past its cap)."""
        where = where or field
        self._refs: dict[str, str] = {}     # character reference kept as written -> its sentinel
        self._kept_raw: dict[str, str] = {}     # sentinel of an element not translated -> the element as written
        parts, options = parse(html, self._refs, self._kept_raw, options, count)
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
        tr = [_decoded(self._sentinels(t), sent).strip() for t, sent in zip(translations, self.segments)]
        if self._kept_raw:      # a run's translation has each of its elements not translated once
            for _, unit in self.units:
                if id(unit) in self._seg:
                    k = self._seg[id(unit)]
                    tr[k] = _each_once(self.segments[k], tr[k], [c for c in self.segments[k] if c in self._kept_raw])
        out = []
        for kind, unit in self.units:
            if kind == "markup":
                out.append(unit)
            elif id(unit) in self._seg:
                self._forms = _Written(unit, self._refs)
                out.append(self._render(unit, tr[self._seg[id(unit)]], tr))
            else:
                out.append(_raw(unit))
        return self._written("".join(out)).translate({ord(mark): raw for mark, raw in self._kept_raw.items()})

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
                while k >= 0 and (not got.strip() or re.fullmatch(r"\s*\w+", got)) and len(got) < _LOOKAHEAD:
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
                        ends = isinstance(prev, str) and re.search(r"[.!?\u2026:;]\s*$", prev) is not None
                        at = empty_at(whole, pos, following, done / total, words, ends)
                    out.append(self._forms.written(whole[pos:at]))
                    spaced = isinstance(prev, str) and prev[-1:].isspace() and following[:1].isspace()
                    if spaced and 0 < at < len(whole) and whole[at].isspace() and not whole[at - 1].isspace():
                        out.append(" ")         # spaced on both sides in the source: so here
                    out.append(_raw([n]))
                    self._forms.placed = True
                    pos, prev = at, n
                    continue
                if id(n) in self._seg:
                    span = find(low, tr[self._seg[id(n)]], pos, (done - size) / total * len(whole))
                else:       # elements not translated only (their sentinels are in ``whole``), or none
                    span = None if _has_words(n.children) else find(low, _collapse(text_of(n)), pos)
                span = span or words_at(whole, pos, (done - size) / total, done / total)
                if span is None:     # no words for it: its tags stay, empty, here; its children looked for here
                    out.append(n.start + n.end)
                    push(n.children)
                    done -= size
                    continue
                before = self._forms.written(whole[pos:span[0]])
                inner = self._render(n.children, whole[span[0]:span[1]], tr)
                if (_SPACE_START.match(inner) and before[-1:].isspace()       # its space inside it: once,
                        and not (isinstance(prev, str) and prev[-1:].isspace())):    # unless both had one
                    before = before.rstrip()
                out += [before, n.start + inner + n.end]
                self._forms.placed = True
                pos, prev = span[1], n
                while _SPACE_END.search(inner) and whole[pos:pos + 1].isspace():      # its space inside it: once
                    pos += 1
            out.append(self._forms.written(whole[pos:]))
        out += [trail, _raw(nodes[last + 1:])]
        return "".join(out)


class _Written:
    """A run's text as the translator got it (whitespace collapsed, references decoded), each
    character with its source form (a run of whitespace: all of it, as written; a reference: as
    written), so that text a translation keeps is written as the source wrote it (``written``)."""

    def __init__(self, nodes: list[Node], refs: dict[str, str]):
        chars: list[tuple[str, str, int]] = []         # (character, its form, its node)
        for n, node in enumerate(_texts(nodes)):
            if node.raw is node or isinstance(node, Kept):      # no references: as written
                chars += [(c, c, n) for c in node]
                continue
            for piece in re.findall(REF.pattern + r"|[\s\S]", node.raw):
                text = refs.get(piece) or unescape(piece)
                chars += [(text[0], piece, n)] + [(c, "", n) for c in text[1:]]
        text: list[str] = []
        self.forms: list[str] = []
        self.placed = False                 # an element was written since the last text
        runs: dict[int, list[list]] = {}    # a collapsed space -> [node, its whitespace] of each node in it
        first = -1                          # the node of the whitespace being collapsed: its own is its form
        for c, form, n in chars:            # as ``_collapse``: whitespace runs one space, none at the ends
            if not c.isspace():
                text.append(c)
                self.forms.append(form)
            elif text and text[-1] == " ":
                self.forms[-1] += form if n == first else ""
                run = runs[len(text) - 1]
                if run[-1][0] == n:
                    run[-1][1] += form
                else:
                    run.append([n, form])
            elif text:
                text.append(" ")
                self.forms.append(form)
                first = n
                runs[len(text) - 1] = [[n, form]]
        # after an element placed inside such a space, the space is written as its last node's
        self.last = {k: run[-1][1] for k, run in runs.items() if len(run) > 1}
        if text and text[-1] == " ":
            text.pop()
            self.forms.pop()
        self.text, self.pos = "".join(text), 0

    def written(self, piece: str) -> str:
        """``piece`` (of a translation) escaped, each character that continues the source's text
        (from where the last one did) written as the source wrote it."""
        out, i = [], 0
        while i < len(piece):
            if i:
                self.placed = False
            j = self.pos
            while self.text[j:j + 1] == " " and piece[i] != " ":
                j += 1
            if j > self.pos and self.text.startswith(piece[i], j):
                self.pos = j       # a space written inside an element, not here
            k = 1           # the characters of the source form at pos (a reference may decode to more)
            while self.pos + k < len(self.forms) and self.forms[self.pos + k] == "":
                k += 1
            if self.text.startswith(piece[i:i + k], self.pos) and len(piece) - i >= k and self.forms[self.pos:self.pos + 1] != [""]:
                out.append(self.last.get(self.pos, self.forms[self.pos]) if i == 0 and self.placed
                           else self.forms[self.pos])
                self.pos, i = self.pos + k, i + k
            else:
                out.append(escape(piece[i], quote=False))
                i += 1
        self.placed = self.placed and not piece
        return "".join(out)


def _texts(nodes: list[Node]):
    """The text nodes under ``nodes``, in order."""
    for n in nodes:
        if isinstance(n, str):
            yield n
        else:
            yield from _texts(n.children)


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
    text = MARK.sub(first, text) if marks else text
    for mark in marks:
        if mark in seen:
            continue
        want = source.index(mark) / max(1, len(source) - 1) * len(text)
        cut = min([0, len(text)] + [m.start() for m in re.finditer(r"\s", text)], key=lambda c: abs(c - want))
        text = (mark + " " + text if cut == 0 else text + " " + mark if cut == len(text)
                else text[:cut] + " " + mark + text[cut:])
    return text


def _decoded(translation: str, sent: str) -> str:
    """A translation with the entities the model wrote decoded (Multi30k's text has ``&amp;``), but not
    one its segment holds as text: the source's ``&amp;#98765432;`` was sent as ``&#98765432;`` and
    comes back as that text."""
    return _ENTITY.sub(lambda m: m.group() if m.group() in sent else unescape(m.group()), translation)


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
    pieces = re.findall(REF.pattern + r"|[\s\S]", raw)         # references and single characters
    space = [unescape(q).isspace() for q in pieces]
    lead = space.index(False)
    trail = space[::-1].index(False)
    return "".join(pieces[:lead]), "".join(pieces[len(pieces) - trail:])
