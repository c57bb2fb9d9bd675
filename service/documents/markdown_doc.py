"""Markdown (.md): parsed with markdown-it-py (CommonMark, tables, YAML front matter via
mdit-py-plugins). Each paragraph, heading and table cell is one segment unit; its inline markup
(``**strong**``, ``*emphasis*``, ``~~strike~~``, ``[links](url "title")``) is carried to the translated
words by ``RichText``; inline code, images, autolinks, inline HTML and line breaks (hard: two spaces,
a backslash; soft: a plain line end, with the next line's ``> `` or indentation) stay verbatim at
their place, written as the source wrote them, as do a link's destination and title. Text that the
translation keeps is written as the source wrote it (its escapes and entities); new text is escaped.
Everything else - front matter, fenced and indented code, HTML blocks, list markers, block quotes,
table rules, blank lines - is left byte for byte: the translation replaces only the source span of
each block's inline text. The inline parser notes where each token came from (``_State``,
``_spanning``), so the source spans are exact. The file's lines, markdown-it's tokens (block and
inline) and each paragraph's HTML parts are counted as they are made (MAX_PARSED_NODES).
"""
from __future__ import annotations

import bisect
import re
from array import array
from typing import Optional

from markdown_it import MarkdownIt
from markdown_it.rules_inline import StateInline
from mdit_py_plugins.front_matter import front_matter_plugin

from .common import (
    Group,
    Item,
    Nodes,
    Run,
    Segments,
    check_size,
    count_lines,
    decode_text,
    lines,
)

_PAIRS = {"strong_open": "strong_close", "em_open": "em_close", "s_open": "s_close", "link_open": "link_close"}
_ESCAPE = re.compile(r"([\\`*_\[\]<|])")      # written as \x: literal in Markdown (| in table cells)
_LINE_START = re.compile(r"[#>+=-]|\d+(?=[.)])")    # new text that, starting a line, would start a block
_BROKEN = re.compile(r"\n[ \t>]*$")                 # a line break as written, the next line's prefix included
_BR = re.compile(r"<br\b", re.I)
TEXT = "text"


def _parser(nodes: Optional[Nodes] = None) -> MarkdownIt:
    """markdown-it with the plugins used here, its inline parser noting each token's source offsets
    (escapes and entities left as tokens of their own); with ``nodes``, its parsers count each token
    they make."""
    md = MarkdownIt("commonmark").use(front_matter_plugin).enable(["table", "strikethrough"])
    md.core.ruler.disable("text_join")              # escapes and entities stay text_special: their source form
    for name in md.inline.ruler.get_all_rules():
        md.inline.ruler.at(name, _spanning(md.inline.ruler.__rules__[md.inline.ruler.__find__(name)].fn))
    md.inline.parse = _positioned(md.inline)
    if nodes is not None:
        md.block.parse = _counting(md.block.parse, nodes, inline=False)
        md.inline.parse = _counting(md.inline.parse, nodes, inline=True)   # paragraphs' text, images' alt text
    return md


class _State(StateInline):
    """markdown-it's inline state, each token it pushes noting where parsing stood (``meta["pos"]``;
    a link's close: the end of its label)."""

    def push(self, ttype, tag, nesting):
        token = super().push(ttype, tag, nesting)
        token.meta["pos"] = self.pos
        return token


def _positioned(inline):
    """markdown-it's ``ParserInline.parse`` over a ``_State``."""
    def parse(src, md, env, tokens):
        state = _State(src, md, env, tokens)
        inline.tokenize(state)
        for rule in inline.ruler2.getRules(""):
            rule(state)
        return state.tokens
    return parse


def _spanning(rule):
    """An inline rule that notes on each token it pushes the content offsets it read (``meta["span"]``;
    an inner rule's tokens keep their own)."""
    def spanning(state, silent):
        start, n = state.pos, len(state.tokens)
        ok = rule(state, silent)
        if ok and not silent:
            for tok in state.tokens[n:]:
                if "pos" in tok.meta:           # not the pending text flushed by the rule's first push
                    tok.meta.setdefault("span", (start, state.pos))
        return ok
    return spanning


class _Counted(list):
    """A token list that counts each token markdown-it's states push onto it (they ``append``)."""

    def __init__(self, nodes: Nodes):
        super().__init__()
        self.nodes = nodes

    def append(self, token) -> None:
        self.nodes.add()
        super().append(token)


def _counting(parse, nodes: Nodes, inline: bool):
    """markdown-it's ``parse(src, md, env, tokens)`` (block or inline) pushing onto a counted list,
    whose tokens then go to ``tokens``. Inline text (a paragraph's) over MAX_DOCUMENT_CHARS is refused
    before it is parsed: its link labels cache a number per character."""
    def counted(src, md, env, tokens):
        if inline:
            check_size(0, len(src))
        out = _Counted(nodes)
        out.extend(tokens)
        parse(src, md, env, out)
        tokens[:] = out
        return tokens
    return counted


class _Source:
    """One inline token's content mapped onto the file: ``at(i)`` is the source offset of content
    offset ``i`` (the content drops each line's block prefix: ``> ``, indentation)."""

    def __init__(self, source: str, content: str, starts: list[int]):
        self.source, self.starts = source, starts          # source offset of each content line
        self.lines = [0] + [m.end() for m in re.finditer("\n", content)]    # content offset of each line

    def at(self, i: int) -> int:
        k = bisect.bisect_right(self.lines, i) - 1
        return self.starts[k] + i - self.lines[k]

    def text(self, a: int, b: int) -> str:
        """The source text of content ``a``..``b``, block prefixes included."""
        return self.source[self.at(a):self.at(b)] if b > a else ""


class MarkdownDocument:
    def __init__(self, data: bytes):
        self.source = decode_text(data, "Markdown")
        nodes = Nodes()
        nodes.add(count_lines(self.source))    # markdown-it keeps five numbers a line
        self._starts = array("q", [0])          # where each line starts, and the end
        self._starts.extend(end for _, end in lines(self.source))
        self._edits: list[tuple[int, int, str]] = []      # (start, end, new text), source offsets
        self._seg = Segments(nodes)
        cursor: dict[int, int] = {}                        # line -> column searched from next
        block_map = None
        for tok in _parser(nodes).parse(self.source):
            if tok.map is not None:
                block_map = tok.map
            if tok.type != "inline" or not tok.children or block_map is None:
                continue
            starts = self._locate(tok.content, block_map[0], cursor)
            if starts is None:
                continue
            self._add(tok, _Source(self.source, tok.content, starts))
        self.segments = self._seg.segments

    def _locate(self, content: str, first: int, cursor: dict[int, int]) -> Optional[list[int]]:
        """The source offset of each line of an inline token's content: its first line found in source
        line ``first`` (after that line's cursor), each next one in the next line; None if not found."""
        parts = content.split("\n")
        if first + len(parts) - 1 >= len(self._starts) - 1:
            return None
        out = []
        for k, part in enumerate(parts):
            line = first + k
            at = self._find(part, line, cursor.get(line, 0) if k == 0 or k == len(parts) - 1 else 0)
            if at < 0:
                return None
            out.append(self._starts[line] + at)
        cursor[first + len(parts) - 1] = out[-1] - self._starts[first + len(parts) - 1] + len(parts[-1])
        return out

    def _find(self, text: str, line: int, column: int) -> int:
        """``text``'s column in source line ``line`` from ``column`` on (-1: not there)."""
        start = self._starts[line]
        at = self.source.find(text, start + column, self._starts[line + 1])
        return at - start if at >= 0 else -1

    def _add(self, tok, src: _Source) -> None:
        keys: dict[int, object] = {}          # key -> how the item is written
        forms: list[tuple[str, str]] = []     # (text, source form) of the paragraph's text, in order
        span = (src.at(0), src.at(len(tok.content)))
        self._seg.add_runs(_items(tok.children, keys, src, forms), lambda rebuilt: self._edits.append(
            (span[0], span[1], _render(rebuilt, keys, _Forms(forms)))))

    def rebuild(self, translations: list[str]) -> bytes:
        self._edits.clear()
        self._seg.apply(translations)
        out, pos = [], 0
        for start, end, text in sorted(self._edits):
            out += [self.source[pos:start], text]
            pos = end
        out.append(self.source[pos:])
        return "".join(out).encode("utf-8")


def _items(tokens: list, keys: dict, src: _Source, forms: list) -> list[Item]:
    """An inline token's children as runs and groups; ``keys`` maps each key to how it is written
    (TEXT, a verbatim string, a group's ``(before, after)`` or delimiter); ``forms`` gets each text's
    source form."""
    out: list[Item] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        key = len(keys)
        if t.type in _PAIRS and t.markup != "autolink":
            depth, j = 0, i
            while True:     # the matching close at the same depth
                depth += tokens[j].type == t.type
                depth -= tokens[j].type == _PAIRS[t.type]
                if depth == 0:
                    break
                j += 1
            if t.type == "link_open":       # [ before the label, ](destination "title") after it, as written
                a, b = t.meta["span"]
                keys[key] = (src.text(a, t.meta["pos"]), src.text(tokens[j].meta["pos"], b))
            else:
                keys[key] = t.markup
            out.append(Group(key, _items(tokens[i + 1:j], keys, src, forms)))
            i = j + 1
            continue
        if t.type == "link_open":             # an autolink <http://...>: verbatim
            j = i
            while tokens[j].type != "link_close":
                j += 1
            keys[key] = src.text(*t.meta["span"])
            out.append(Run(key, "", None))
            i = j + 1
            continue
        if t.type in ("text", "text_special"):
            keys[key] = TEXT
            forms.append((t.content, src.text(*t.meta["span"]) if t.type == "text_special" else t.content))
            out.append(Run(key, t.content, TEXT))
        elif t.type in ("softbreak", "hardbreak"):     # the line end as written, its trailing spaces too
            a, b = t.meta["span"]
            while a > 0 and src.text(a - 1, a) == " ":
                a -= 1
            keys[key] = src.text(a, b)
            out.append(Run(key, "", None, space=True))
        elif t.type == "code_inline":         # in the sentence as a placeholder; written back verbatim
            keys[key] = src.text(*t.meta["span"])
            out.append(Run(key, t.content, ("code", key), kept=True))
        elif t.type == "html_inline" and _BR.match(t.content):     # a <br> between words, its spaces with it
            a, b = t.meta["span"]
            while a > 0 and src.text(a - 1, a) == " ":
                a -= 1
            while src.text(b, b + 1) == " ":
                b += 1
            keys[key] = src.text(a, b)
            out.append(Run(key, "", None, space=True))
        else:                                 # image, inline HTML: verbatim
            keys[key] = src.text(*t.meta["span"])
            out.append(Run(key, "", None))
        i += 1
    return out


class _Forms:
    """A paragraph's source text, character by character as written (an escape ``\\*`` or entity
    ``&amp;`` on its first character), for writing back text that a translation keeps."""

    def __init__(self, forms: list[tuple[str, str]]):
        self.text = "".join(text for text, _ in forms)
        self.chars: list[Optional[str]] = []       # per character: its source form ("" inside a form, None: no own)
        for text, form in forms:
            self.chars += [form] + [""] * (len(text) - 1) if form != text else list(text)
        self.pos = 0
        self.kept = False                           # whether the last text written was the source's

    def written(self, text: str) -> str:
        """``text`` escaped, each character that continues the source's text (from where the last one
        did) written as the source wrote it; ``kept``: whether its first one did."""
        out, i = [], 0
        self.kept = False
        while i < len(text):
            j = self.pos
            while self.text[j:j + 1] == " " and text[i] != " ":
                j += 1
            if j > self.pos and self.text.startswith(text[i], j):
                self.pos = j       # a space the line break next to it stands for
            k = 1           # the characters of the source form at pos (an entity may decode to more)
            while self.pos + k < len(self.chars) and self.chars[self.pos + k] == "":
                k += 1
            if (self.pos < len(self.chars) and self.chars[self.pos] != "" and len(text) - i >= k
                    and self.text.startswith(text[i:i + k], self.pos)):
                self.kept = self.kept or i == 0
                out.append(self.chars[self.pos])
                self.pos, i = self.pos + k, i + k
            else:
                out.append(_ESCAPE.sub(r"\\\1", text[i]))
                i += 1
        return "".join(out)


def _render(items: list[Item], keys: dict, forms: _Forms, used: Optional[set] = None) -> str:
    """Markdown of items: text as written or escaped, verbatim keys once each (a later piece of one:
    nothing)."""
    used = set() if used is None else used
    out: list[str] = []
    for it in items:
        if isinstance(it, Run):
            tok = keys[it.key]
            if tok == TEXT:
                text = forms.written(it.text)
                m = _LINE_START.match(text) if out and _BROKEN.search(out[-1]) else None
                if m and not forms.kept:        # new text after a line break: its first mark escaped
                    text = text[:m.end()] + "\\" + text[m.end():] if m.group()[0].isdigit() else "\\" + text
                out.append(text)
            elif it.key not in used:
                used.add(it.key)
                lead, _, trail = _around(it.text)
                out.append(lead + tok + trail)
            continue
        tok, inner = keys[it.key], _render(it.items, keys, forms, used)
        lead, core, trail = _around(inner)
        if not core:
            out.append(inner)
        elif isinstance(tok, tuple):
            out.append(f"{lead}{tok[0]}{core}{tok[1]}{trail}")
        else:
            out.append(f"{lead}{tok}{core}{tok}{trail}")
    return "".join(out)


def _around(text: str) -> tuple[str, str, str]:
    """(whitespace before, the rest, whitespace after) of text; all-blank text is all lead."""
    core = text.strip()
    if not core:
        return text, "", ""
    lead = text[:len(text) - len(text.lstrip())]
    return lead, core, text[len(lead) + len(core):]


def load(data: bytes) -> MarkdownDocument:
    return MarkdownDocument(data)
