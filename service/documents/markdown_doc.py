"""Markdown (.md): parsed with markdown-it-py (CommonMark, tables, YAML front matter via
mdit-py-plugins). Each paragraph, heading and table cell is one segment unit; its inline markup
(``**strong**``, ``*emphasis*``, ``~~strike~~``, ``[links](url)``) is carried to the translated words
by ``RichText`` and written back as Markdown; inline code, images, autolinks and inline HTML stay
verbatim at their place (never translated). Everything else - front matter, fenced and indented code,
HTML blocks, list markers, block quotes, table rules, blank lines - is left byte for byte: the
translation replaces only the source span of each block's inline text (a paragraph over several
lines becomes one line). The file's lines, markdown-it's tokens (block and inline) and each
paragraph's HTML parts are counted as they are made (MAX_PARSED_NODES).
"""
from __future__ import annotations

import re
from array import array
from typing import Optional

from markdown_it import MarkdownIt
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
TEXT = "text"


def _parser(nodes: Optional[Nodes] = None) -> MarkdownIt:
    """markdown-it with the plugins used here; with ``nodes``, its parsers count each token they make."""
    md = MarkdownIt("commonmark").use(front_matter_plugin).enable(["table", "strikethrough"])
    if nodes is not None:
        md.block.parse = _counting(md.block.parse, nodes, inline=False)
        md.inline.parse = _counting(md.inline.parse, nodes, inline=True)   # paragraphs' text, images' alt text
    return md


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
            span = self._locate(tok.content, block_map[0], cursor)
            if span is None:
                continue
            self._add(tok, span)
        self.segments = self._seg.segments

    def _locate(self, content: str, first: int, cursor: dict[int, int]):
        """The source offsets of an inline token's content: its first line found in source line
        ``first`` (after that line's cursor), its last in the line it ends on; None if not found."""
        n = content.count("\n")
        head, tail = content[:content.find("\n")] if n else content, content[content.rfind("\n") + 1:]
        last = first + n
        if last >= len(self._starts) - 1:
            return None
        a = self._find(head, first, cursor.get(first, 0))
        b = self._find(tail, last, cursor.get(last, 0) if last != first else max(a, 0))
        if a < 0 or b < 0:
            return None
        cursor[last] = b + len(tail)
        return self._starts[first] + a, self._starts[last] + b + len(tail)

    def _find(self, text: str, line: int, column: int) -> int:
        """``text``'s column in source line ``line`` from ``column`` on (-1: not there)."""
        start = self._starts[line]
        at = self.source.find(text, start + column, self._starts[line + 1])
        return at - start if at >= 0 else -1

    def _add(self, tok, span: tuple[int, int]) -> None:
        keys: dict[int, object] = {}          # key -> the token (or tokens) it renders
        self._seg.add_runs(_items(tok.children, keys), lambda rebuilt: self._edits.append(
            (span[0], span[1], _render(rebuilt, keys))))

    def rebuild(self, translations: list[str]) -> bytes:
        self._edits.clear()
        self._seg.apply(translations)
        out, pos = [], 0
        for start, end, text in sorted(self._edits):
            out += [self.source[pos:start], text]
            pos = end
        out.append(self.source[pos:])
        return "".join(out).encode("utf-8")


def _items(tokens: list, keys: dict) -> list[Item]:
    """An inline token's children as runs and groups; ``keys`` maps each key to its token(s)."""
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
            keys[key] = t
            out.append(Group(key, _items(tokens[i + 1:j], keys)))
            i = j + 1
            continue
        if t.type == "link_open":             # an autolink <http://...>: verbatim
            j = i
            while tokens[j].type != "link_close":
                j += 1
            keys[key] = "<" + "".join(x.content for x in tokens[i + 1:j]) + ">"
            out.append(Run(key, "", None))
            i = j + 1
            continue
        if t.type == "text":
            keys[key] = TEXT
            out.append(Run(key, t.content, TEXT))
        elif t.type == "softbreak":
            keys[key] = TEXT
            out.append(Run(key, " ", TEXT))
        elif t.type == "code_inline":         # in the sentence for context; written back verbatim
            keys[key] = _verbatim(t)
            out.append(Run(key, t.content, ("code", key)))
        else:                                 # code, image, inline HTML, hard break: verbatim
            keys[key] = _verbatim(t)
            out.append(Run(key, "", None))
        i += 1
    return out


def _verbatim(t) -> str:
    """The Markdown of a token kept as it is."""
    if t.type == "code_inline":
        fence = "`" * (max((len(m) for m in re.findall("`+", t.content)), default=0) + 1)
        pad = " " if t.content.startswith("`") or t.content.endswith("`") else ""
        return f"{fence}{pad}{t.content}{pad}{fence}"
    if t.type == "image":
        title = f' "{t.attrs["title"]}"' if t.attrs.get("title") else ""
        return f"![{t.content}]({t.attrs.get('src', '')}{title})"
    if t.type == "hardbreak":
        return "\\\n"
    return t.content       # html_inline and anything else: its source


def _render(items: list[Item], keys: dict, used: set = None) -> str:
    """Markdown of items: text escaped, verbatim keys once each (a later piece of one: nothing)."""
    used = set() if used is None else used
    out = []
    for it in items:
        if isinstance(it, Run):
            tok = keys[it.key]
            if tok == TEXT:
                out.append(_ESCAPE.sub(r"\\\1", it.text))
            elif it.key not in used:
                used.add(it.key)
                lead, _, trail = _around(it.text)
                out.append(lead + tok + trail)
            continue
        tok, inner = keys[it.key], _render(it.items, keys, used)
        lead, core, trail = _around(inner)
        if not core:
            out.append(inner)
        elif tok.type == "link_open":
            href = tok.attrs.get("href", "")
            href = f"<{href}>" if re.search(r"[\s()<>]", href) else href
            title = f' "{tok.attrs["title"]}"' if tok.attrs.get("title") else ""
            out.append(f"{lead}[{core}]({href}{title}){trail}")
        else:
            out.append(f"{lead}{tok.markup}{core}{tok.markup}{trail}")
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
