"""Where an element goes in a sentence's translation (``markup.HtmlText.rebuild``): an element
around words at those words' translation, else at the same place of the sentence; an element
without text before the word it preceded in the source, else at the word bound nearest to its place."""
from __future__ import annotations

import bisect
import re
import unicodedata
from typing import Optional

_OPEN = "\"'([{" + "".join(chr(c) for c in range(0xA0, 0x3100) if unicodedata.category(chr(c)) in ("Ps", "Pi"))
_CLOSE = "\"')]}" + "".join(chr(c) for c in range(0xA0, 0x3100) if unicodedata.category(chr(c)) in ("Pe", "Pf"))
_WRAP = re.compile(f"^[{re.escape(_OPEN)}]+|[{re.escape(_CLOSE)}]+$")     # quotes and brackets around a text


class WordBounds:
    """Where the words of a text start and end (character offsets, ascending), for ``empty_at``."""

    def __init__(self, text: str):
        n = len(text)
        self.starts = [i for i in range(n) if text[i].isalnum() and (i == 0 or not text[i - 1].isalnum())]
        self.ends = [i for i in range(1, n + 1) if text[i - 1].isalnum() and (i == n or not text[i].isalnum())]


def nearest(points: list[int], lo: int, target: float, default: int) -> int:
    """The point of ``points`` (ascending) at or after ``lo`` nearest to ``target``, the first on a tie."""
    first = bisect.bisect_left(points, lo)
    k = max(first, bisect.bisect_left(points, target))
    near = [points[j] for j in (k - 1, k) if first <= j < len(points)]
    return min(near, key=lambda i: abs(i - target), default=default)


def empty_at(whole: str, pos: int, after: str, frac: float, words: WordBounds, sentence_end: bool = False) -> int:
    """Where an element without text goes in ``whole`` (at or after ``pos``): before the word that
    follows it in the source (``after``, the start of its text) where that word is there (of its
    occurrences, the nearest to ``frac`` of whole's length; with space between them in the source,
    before that space), else, when it follows the end of a
    sentence in the source (``sentence_end``), after the sentence end nearest to that place, else at
    the word start (glued to the next word) or word end (else) nearest to it (``words``: whole's word
    bounds). A word it was glued into ("Para<x/>graph") is looked for inside a word too."""
    target = frac * len(whole)
    word = re.match(r"\s*(\w+|\S)", after)          # its next word, or a mark (punctuation, a placeholder)
    if word:
        anchor = rf"\b{re.escape(word.group(1))}\b" if re.match(r"\w", word.group(1)) else re.escape(word.group(1))
        marked = re.match(r"\s*([^\w\s]+\w+)", after)      # a mark and its word ('"MAY"'): the pair, first
        hits = [m.start() for m in re.finditer(rf"{re.escape(marked.group(1))}\b", whole[pos:], re.I)] if marked else []
        hits = hits or [m.start() for m in re.finditer(anchor, whole[pos:], re.I)]
        if not hits and not word.start(1) and re.match(r"\w", word.group(1)):    # inside a word ("Para|graph")
            hits = [m.start() for m in re.finditer(rf"(?<=\w){re.escape(word.group(1))}\b", whole[pos:], re.I)]
        if hits:
            at = pos + min(hits, key=lambda i: abs(pos + i - target))
            while word.start(1) and at > pos and whole[at - 1].isspace():     # space between: after the word before
                at -= 1
            return at
    if sentence_end:
        ends = [m.end() for m in re.finditer(r"[.!?\u2026:;]+(?=\s|$)", whole) if m.end() >= pos]
        if ends:
            return min(ends, key=lambda i: abs(i - target))
    glued = bool(after[:1].strip())
    return nearest(words.starts if glued else words.ends, pos if glued else max(pos, 1), target, pos)


def find(low: str, tr: str, pos: int, target: Optional[float] = None) -> Optional[tuple[int, int]]:
    """Where an element's own translation ``tr`` is in ``low`` (its parent's translation, lower case)
    at or after ``pos``: the whole of it (without final punctuation: "Dog." -> "Dog", or without the
    marks around its words: '"Dog"' -> "Dog"), else from the
    first to the last of its words (3+ letters) found there within 40 characters; None if neither.
    Of several places, the one nearest to ``target`` (the offset where the element's text would be
    in proportion; None: the first)."""
    def nearest_at(pattern: str) -> Optional[tuple[int, int]]:
        best = None
        for m in re.finditer(f"(?=({pattern}))", low[pos:]):      # overlapping: "xx" in "xxxxx" at 0, 1, 2, 3
            if target is None:
                return m.span(1)
            if best is not None and abs(pos + m.start() - target) >= abs(pos + best[0] - target):
                break           # offsets only grow from here
            best = m.span(1)
        return best
    bare = _WRAP.sub("", tr)                          # without quotes or brackets around it ('"."' -> ".")
    core = re.sub(r"^[\W_]+|[\W_]+$", "", tr)       # without any marks around its words ("[markdown-it]")
    for cand in dict.fromkeys([tr, tr.rstrip(".!?"), bare, core]):
        m = nearest_at(re.escape(cand.lower())) if cand else None
        if m:
            return _edges(low, tr.lower(), tr.lower().find(cand.lower()), pos + m[0], pos + m[1], pos)
    hits = [m for w in dict.fromkeys(re.findall(r"\w{3,}", tr.lower()))
            for m in [nearest_at(rf"\b{re.escape(w)}\b")] if m]
    if not hits:
        return None
    first = min(m[0] for m in hits)
    last = max(m[1] for m in hits if m[0] - first <= 40)
    return _widened(low, tr.lower(), pos + first, pos + last, pos)


def _edges(low: str, tr: str, at: int, start: int, end: int, pos: int) -> tuple[int, int]:
    """``start``..``end`` (found as ``tr[at:]``'s core) widened over as much of what ``tr`` has before
    and after the core as ``low`` has there too ("See also" + ":" of "See also:")."""
    head, tail = tr[:at], tr[at + end - start:]
    while tail and not low.startswith(tail, end):
        tail = tail[:-1]
    while head and not low.endswith(head, pos, start):
        head = head[1:]
    return start - len(head), end + len(tail)


def _widened(low: str, tr: str, start: int, end: int, pos: int) -> tuple[int, int]:
    """``start``..``end`` (found by ``tr``'s long words) widened over the words of ``tr`` before and
    after them that stand right there (short words: "im Garten"), and over the punctuation ``tr`` ends
    with that follows."""
    words = re.findall(r"\w+", tr)
    inside = re.findall(r"\w+", low[start:end])
    if inside and inside[0] in words:
        for w in reversed(words[:words.index(inside[0])]):
            m = re.search(rf"\b{re.escape(w)}\s+$", low[pos:start])
            if not m:
                break
            start = pos + m.start()
    if inside and inside[-1] in words:
        for w in words[len(words) - words[::-1].index(inside[-1]):]:
            m = re.match(rf"\s+{re.escape(w)}\b", low[end:])
            if not m:
                break
            end += m.end()
    tail = re.search(r"[.!?,;:]+(?=\W*$)", tr)
    if tail and low.startswith(tail.group(), end):
        end += len(tail.group())
    return start, end


def words_at(whole: str, pos: int, a: float, b: float) -> Optional[tuple[int, int]]:
    """The whole words of ``whole`` (at or after ``pos``) at the same place, as fractions ``a``..``b``
    of its length, as an element's text has in its parent's source text; None if there are none."""
    start = max(pos, int(a * len(whole)))
    while start > pos and whole[start - 1].isalnum():
        start -= 1
    end = max(start, round(b * len(whole)))
    while end < len(whole) and whole[end - 1: end + 1].isalnum():
        end += 1
    while start < end and not whole[start].isalnum():
        start += 1
    while end > start and not whole[end - 1].isalnum():
        end -= 1
    return (start, end) if start < end else None
