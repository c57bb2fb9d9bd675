"""What every document format shares: the ``Document`` interface (segments out, translations in, the
file's bytes back), the limits on untrusted files, and ``RichText``, a paragraph of formatting runs
carried through the HTML route's inline-element placement (``service/pipeline/markup.HtmlText``).

    load(data) -> Document          a format module parses (and checks) the file
    document.segments               the texts to translate, in document order
    document.rebuild(translations)  the file with each segment's translation in its place (bytes)
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from html import escape
from html.parser import HTMLParser
from typing import Callable, Optional, Protocol, Union

from service.pipeline.markup import MAX_INLINE_DEPTH, HtmlText
from service.protocol import (  # noqa: F401 - the limits
    MAX_ARCHIVE_MEMBERS,
    MAX_COMPRESSION_RATIO,
    MAX_DOCUMENT_BYTES,
    MAX_DOCUMENT_CHARS,
    MAX_DOCUMENT_SEGMENTS,
    MAX_PARSED_NODES,
    MAX_UNCOMPRESSED_BYTES,
    MAX_XML_BYTES,
    MAX_XML_DEPTH,
    MAX_XML_ELEMENTS,
    ServiceError,
)


class DocumentError(ServiceError):
    """A file the service refuses (status 4xx): the message names the limit or what is wrong."""

    def __init__(self, status: int, message: str):
        super().__init__(status, f"file: {message}", "file")


def not_valid(what: str, e: Exception) -> DocumentError:
    """A library's failure on an untrusted file, reported as the file's (422), naming ``what`` it is not."""
    return DocumentError(422, f"not a valid {what} file: {type(e).__name__}: {str(e)[:200]}")


class Document(Protocol):
    segments: list[str]

    def rebuild(self, translations: list[str]) -> bytes: ...


class Nodes:
    """What a text format's parsers have built for one document (HTML tags, text nodes and comments,
    Markdown lines and tokens, subtitle cues), counted as they are built: ``add`` raises DocumentError
    413 past MAX_PARSED_NODES, so a file is refused before its whole tree exists (each node takes a
    few hundred bytes, whatever the file's size; an archive's formats have MAX_XML_ELEMENTS)."""

    def __init__(self):
        self.count = 0

    def add(self, n: int = 1) -> None:
        self.count += n
        if self.count > MAX_PARSED_NODES:
            raise DocumentError(413, f"the file parses into more than {MAX_PARSED_NODES} nodes: tags, text, lines, "
                                     "tokens, cues (MAX_PARSED_NODES)")


class Segments:
    """The segments of a document, gathered unit by unit, and each unit's translations handed back
    to it (``apply``) in the same order. ``nodes``: a text format's count, which each paragraph's
    ``RichText`` adds its HTML parts to."""

    def __init__(self, nodes: Optional[Nodes] = None):
        self.segments: list[str] = []
        self.chars = 0                                         # characters of the segments
        self.nodes = nodes
        self._units: list[tuple[int, int, object]] = []      # (first segment, count, callback)

    @classmethod
    def of_paragraphs(cls, paragraphs, read) -> "Segments":
        """Each paragraph a ``RichText`` unit: ``read(paragraph)`` gives its ``(items, put)`` for
        ``add_runs``."""
        seg = cls()
        for p in paragraphs:
            seg.add_runs(*read(p))
        return seg

    def add(self, texts: list[str], put) -> None:
        """Register ``texts``; ``put(translations)`` is called with theirs by ``apply``."""
        if texts:
            self._units.append((len(self.segments), len(texts), put))
            self.segments.extend(texts)
            self.chars += sum(len(t) for t in texts)
            check_size(len(self.segments), self.chars)

    def add_runs(self, items: list[Item], put: Callable[[list[Item]], None]) -> None:
        """Register a paragraph of runs as one ``RichText`` unit (nothing when no run has text);
        ``put(items)`` is called by ``apply`` with its items rebuilt around the translation."""
        if any(isinstance(it, Run) and it.style is not None and it.text.strip() for it in flat(items)):
            rich = RichText(items, self.nodes)
            self.add(rich.segments, lambda translations: put(rich.rebuild(translations)))

    def apply(self, translations: list[str]) -> None:
        if len(translations) != len(self.segments):
            raise ValueError(f"expected {len(self.segments)} translations, got {len(translations)}")
        for start, n, put in self._units:
            put(translations[start:start + n])


def saved(save: Callable[[io.BytesIO], None]) -> bytes:
    """The bytes a library's ``save(file)`` writes (python-docx, python-pptx, odfpy)."""
    out = io.BytesIO()
    save(out)
    return out.getvalue()


def check_size(segments: int, chars: int) -> None:
    """Raises DocumentError 413 past MAX_DOCUMENT_SEGMENTS segments or MAX_DOCUMENT_CHARS characters."""
    if segments > MAX_DOCUMENT_SEGMENTS:
        raise DocumentError(413, f"more than {MAX_DOCUMENT_SEGMENTS} pieces of text to translate (MAX_DOCUMENT_SEGMENTS)")
    if chars > MAX_DOCUMENT_CHARS:
        raise DocumentError(413, f"more than {MAX_DOCUMENT_CHARS} characters to translate (MAX_DOCUMENT_CHARS)")


_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"       # where str.splitlines breaks (and after "\r\n")
LINE_BREAK = re.compile(f"\r\n|[{_BREAKS}]")


def lines(text: str, start: int = 0, end: Optional[int] = None):
    """(start, end) of each line of ``text[start:end]``, its line break included, as ``splitlines(keepends=True)``
    cuts them, one at a time (no list of a file's lines)."""
    end = len(text) if end is None else end
    for m in LINE_BREAK.finditer(text, start, end):
        yield start, m.end()
        start = m.end()
    if start < end:
        yield start, end


def count_lines(text: str) -> int:
    """``len(text.splitlines())``, without making the lines."""
    return (sum(text.count(c) for c in _BREAKS) - text.count("\r\n")
            + (bool(text) and text[-1] not in _BREAKS))


def decode_text(data: bytes, what: str) -> str:
    """A text file's characters: UTF-8 (a byte-order mark is dropped). Raises DocumentError 422."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DocumentError(422, f"a {what} file must be UTF-8; byte {e.start} is not") from None


# ---- a paragraph of formatting runs ----------------------------------------------------------------
@dataclass
class Run:
    """A stretch of text with one formatting: ``key`` names its template in the format module (a docx
    ``w:r``, an odt text node); ``style`` is what makes two runs look alike (None: an atomic run, an
    image, a field, a line break, kept as it is, its text not translated)."""
    key: int
    text: str
    style: Optional[object] = ""
    space: bool = False          # an atomic run that separates words (a tab, a line break)
    kept: bool = False           # a text run kept as it is in the sentence (Markdown's inline code): not translated


@dataclass
class Group:
    """Runs inside a container with its own markup: a hyperlink, an odt ``text:span``."""
    key: int
    items: list["Item"] = field(default_factory=list)


Item = Union[Run, Group]


class RichText:
    """One paragraph of runs, translated as one sentence unit with each run put back around the words
    that translate it, by the HTML route's placement (``HtmlText``: an inline element goes around its
    own translation where the paragraph's translation holds it, else around the words at its place).

    In each container the style with the most characters is the plain text (``<p>`` text); every
    other run is an inline element ``<span data-k=key>`` around its text (a ``kept`` run's with
    ``translate="no"``: in the sentence as a placeholder the translator keeps); an atomic run is an empty
    ``<span data-k=key></span>`` (kept at its place, never translated); a group is ``<a data-k=key>``.
    ``rebuild`` gives the new items: plain text as runs of the container's first plain run's key (so a
    key may occur more than once, or not at all when its text merged into another), every other key
    exactly once (an atomic run's once, with its original text)."""

    def __init__(self, items: list[Item], nodes: Optional[Nodes] = None):
        self.items = items
        self.atomic: dict[int, Run] = {}
        self.kept: set[int] = {it.key for it in flat(items) if isinstance(it, Run) and it.kept}
        self.base: dict[int, Optional[int]] = {}      # id(container items) -> key of its plain text
        self.html = self._html(items)
        try:
            self.text = HtmlText(self.html, "file", count=nodes.add if nodes is not None else None)
        except DocumentError:           # MAX_PARSED_NODES
            raise
        except ServiceError as e:       # the HTML route's MAX_INLINE_DEPTH, named for a document
            raise DocumentError(e.status, f"formatting runs nested more than {MAX_INLINE_DEPTH} deep in one "
                                          "paragraph (MAX_INLINE_DEPTH)") from None
        self.segments = self.text.segments

    def _html(self, items: list[Item]) -> str:
        weight: dict[object, int] = {}
        for it in items:
            if isinstance(it, Run) and it.style is not None and not it.kept:
                weight[it.style] = weight.get(it.style, 0) + len(it.text.strip())
        base = max(weight, key=lambda s: weight[s]) if weight else None
        self.base[id(items)] = next((it.key for it in items if isinstance(it, Run) and it.style == base
                                     and base is not None), None)
        out = []
        for it in items:
            if isinstance(it, Group):
                out.append(f'<a data-k="{it.key}">{self._html(it.items)}</a>')
            elif it.style is None:      # a separator gets a space before it: the words stay apart
                self.atomic[it.key] = it
                out.append(f'{" " if it.space else ""}<span data-k="{it.key}"></span>')
            elif it.style == base:
                out.append(escape(it.text, quote=False))
            else:   # its edge whitespace outside the element (inside, the placement would double it)
                core = it.text.strip()
                lead = it.text[:len(it.text) - len(it.text.lstrip())] if core else it.text
                trail = it.text[len(lead) + len(core):]
                no = ' translate="no"' if it.kept else ""
                out.append(f'{escape(lead, quote=False)}<span data-k="{it.key}"{no}>{escape(core, quote=False)}</span>'
                           f'{escape(trail, quote=False)}')
        return "".join(out)

    def rebuild(self, translations: list[str]) -> list[Item]:
        """The paragraph's items with the translations (one per segment) in place of its text."""
        parser = _Items(self)
        parser.feed(self.text.rebuild(translations))
        parser.close()
        _trim(parser.root)
        return parser.root


def flat(items: list[Item]):
    """Every item, depth first: a group, then its items."""
    for it in items:
        yield it
        if isinstance(it, Group):
            yield from flat(it.items)


def build(items: list[Item], templates: dict, text: Callable, group: Optional[Callable] = None,
          atomic: Callable = lambda template: template) -> list:
    """A format's nodes for rebuilt items (``RichText.rebuild``), each made from ``templates[key]``
    (what the format module recorded for that key when it read the paragraph): ``text(template,
    new_text)`` for a text run (a run whose text merged into another's gives nothing),
    ``group(template, nodes)`` for a group, with its items' nodes, ``atomic(template)`` for an atomic
    run (by default the template itself, kept as it was)."""
    out = []
    for it in items:
        template = templates[it.key]
        if isinstance(it, Group):
            out.append(group(template, build(it.items, templates, text, group, atomic)))
        elif it.style is None and not it.text:
            out.append(atomic(template))
        elif it.text:
            out.append(text(template, it.text))
    return out


def replace_children(parent, old: list, new: Callable[[], list]) -> None:
    """In an lxml element, the children ``old`` replaced by the elements ``new()`` makes once they are
    detached, at the place of the first."""
    at = list(parent).index(old[0])
    for child in old:
        parent.remove(child)
    for k, el in enumerate(new()):
        parent.insert(at + k, el)


def _trim(items: list[Item]) -> None:
    """Drop the whitespace of text runs next to a separator (it stands for that whitespace)."""
    for i, it in enumerate(items):
        if isinstance(it, Group):
            _trim(it.items)
        elif it.space:
            if i > 0 and isinstance(items[i - 1], Run) and items[i - 1].style is not None:
                items[i - 1].text = items[i - 1].text.rstrip()
            if i + 1 < len(items) and isinstance(items[i + 1], Run) and items[i + 1].style is not None:
                items[i + 1].text = items[i + 1].text.lstrip()


class _Items(HTMLParser):
    """Reads ``RichText``'s rebuilt HTML back into runs and groups."""

    def __init__(self, rich: RichText):
        super().__init__(convert_charrefs=True)
        self.rich = rich
        self.root: list[Item] = []
        self.stack: list[tuple[list[Item], list[Item]]] = [(self.root, rich.items)]  # (output, source items)
        self.span: Optional[int] = None

    def _source(self, items: list[Item], key: int) -> list[Item]:
        for it in items:
            if isinstance(it, Group):
                if it.key == key:
                    return it.items
                found = self._source(it.items, key)
                if found is not None:
                    return found
        return None

    def handle_starttag(self, tag, attrs):
        key = int(dict(attrs)["data-k"])
        out, source = self.stack[-1]
        if tag == "a":
            group = Group(key)
            out.append(group)
            self.stack.append((group.items, self._source(self.rich.items, key) or []))
        elif key in self.rich.atomic:
            out.append(self.rich.atomic[key])
            self.span = -1                     # its (empty) text is the original's
        else:
            out.append(Run(key, ""))
            self.span = key

    def handle_endtag(self, tag):
        if tag == "a":
            self.stack.pop()
        else:
            self.span = None

    def handle_data(self, data):
        out, source = self.stack[-1]
        if self.span == -1:
            return
        if self.span is not None:
            out[-1].text += data
            return
        key = self.rich.base.get(id(source))
        if key is None:   # a container without plain text: the text joins the run before it (else after)
            key = next((it.key for it in reversed(out) if isinstance(it, Run) and it.key not in self.rich.atomic
                        and it.key not in self.rich.kept),
                       next((it.key for it in source if isinstance(it, Run) and it.style is not None
                             and it.key not in self.rich.kept), None))
        if key is None:     # no run of its own at all: the paragraph's first text run (not one kept as it is)
            key = next((k for k, _ in _runs(self.rich.items) if k not in self.rich.kept), None)
        if out and isinstance(out[-1], Run) and out[-1].key == key:
            out[-1].text += data
        else:
            out.append(Run(key, data))


def _runs(items: list[Item]):
    """(key, run) of every text (non-atomic) run, depth first."""
    for it in items:
        if isinstance(it, Group):
            yield from _runs(it.items)
        elif it.style is not None:
            yield it.key, it
