"""Split texts into sentences for translation and rejoin the translations with the original whitespace.

A text (a paragraph, several lines, a whole document) is split first into lines, then each line into
sentences with pysbd (Sadvilkar and Neumann, 2020, "PySBD: Pragmatic Sentence Boundary
Disambiguation"), a rule-based segmenter with per-language rules (German's for German: "am 3. Mai",
"ca. 5 Euro", "z.B." stay inside their sentence) that keeps abbreviations inside sentences.
Splitting never fails: where pysbd raises on a line (it does on some brackets and abbreviations) or
the text has used up ``SEGMENTER_BUDGET_S`` of segmenter time, that line is cut by ``simple_split``
instead (``Split.fallbacks`` says why; the translator counts it in ``mt_sentence_split_fallbacks_total``).
Pieces without a letter (``needs_model`` is false: "1.", "12345", "-", "...", emoji) are not
translated: ``Split.translatable`` moves them into the glue, so they come back verbatim; so does a
list marker that starts a sentence ("1. ", "2) ", "(a) ", "- ", "• ": ``_LIST_MARKER``).
Invariant: ``Split.join(split.pieces) == text`` — the whitespace between and around pieces (line
breaks, double spaces, indentation), and the control and format characters at their edges
(``is_glue``: zero-width space, direction marks, soft hyphen), are kept verbatim in ``glue`` and
reused when the translated pieces are joined, so the output has the input's layout. A ``Piece``
is one sentence of one text, encoded.
"""
from __future__ import annotations

import functools
import re
import time
import unicodedata
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import pysbd

# Characters that close a quotation or bracket; pysbd sometimes starts the next sentence with them
# ('sagt: "Hallo.' + '" Das ...'), so they are moved back to the sentence they close.
_CLOSERS = "\"'”’»«)]}›"
_LINE_BREAK = re.compile(r"(\r\n|\n|\r|\u2028|\u2029)")
# The fallback's boundary candidates: sentence-final punctuation, closing quotes or brackets, whitespace.
# Control and format characters (``is_glue``) may sit between the punctuation and the whitespace.
_FORMAT = "\x00-\x08\x0e-\x1b\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff"
_BOUNDARY = re.compile(r"[.!?…]+[" + re.escape(_CLOSERS + "“‘") + r"]*[" + _FORMAT + r"]*(\s+)")  # “‘: German
_OPENERS = "\"'„“‘«»‹(["
# A terminal escape sequence (ECMA-48): a control sequence ("\x1b[31m"), an operating-system command
# ("\x1b]0;title\x07") or a two-character escape. At a sentence's edges it is glue as a whole, inside
# one a protected span (protect.py): its final letter never joins a word.
ESCAPE = r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]{0,256}(?:\x07|\x1b\\)|[@-Z\\-_])"
_ESCAPE = re.compile(ESCAPE)
# A line of words, commas and dashes with at most one final ".", "!" or "?" (a short sentence as
# clients mostly send them): pysbd would return it whole (checked on every Multi30k val/test line
# and 60k random lines in de, en, fr) and never reaches it: 15 µs against pysbd's 1,539 µs per short
# sentence (timeit, 2026-11-30).
_ONE_SENTENCE = re.compile(r"\s*[^\W_][\w\s,'’\-–/&%€$+]*[.!?]?\s*")
SEGMENTER_BUDGET_S = 0.5   # seconds of pysbd time per text; the lines after it use simple_split
# A list marker at the start of a sentence, then whitespace: "1.", "2)", "(3)", "a)", "(b)", a dash or
# a bullet. It is kept verbatim in the glue, so it stays where it was; given to the model with the
# sentence, it came back inside it ("1. Ein Hund rennt." -> "A 1 dog runs.") or not at all ("- ").
_LIST_MARKER = re.compile(r"(?:\(?\d{1,3}[.)]|\(\d{1,3}\)|\(?[^\W\d_]\)|[-\u2013\u2014\u2022\u00b7\u25aa\u25e6"
                          r"\u2023\u2043*])[ \t\u00a0]+(?=\S)")


@dataclass
class Split:
    """A text cut into translatable pieces: text == glue[0] + pieces[0] + glue[1] + ... + glue[n]."""
    pieces: list[str]   # sentences without surrounding whitespace, never without visible text
    glue: list[str]     # len(pieces) + 1 runs of whitespace (or other invisible characters: control,
                        # format, e.g. zero-width space) kept as sent; after ``translatable()`` also the
                        # pieces without letters
    fallbacks: list[str] = field(default_factory=list)   # per line cut by simple_split, why:
                                                         # "error" (pysbd raised) or "timeout" (budget spent)

    def join(self, translations: Sequence[str]) -> str:
        """Interleave translations (one per piece) with the original whitespace."""
        if len(translations) != len(self.pieces):
            raise ValueError(f"expected {len(self.pieces)} translations, got {len(translations)}")
        out = [self.glue[0]]
        for t, g in zip(translations, self.glue[1:]):
            out.append(t)
            out.append(g)
        return "".join(out)

    def translatable(self, needs: Optional[Callable[[str], bool]] = None) -> "Split":
        """The same text with only the pieces that need the model (``needs``, default ``needs_model``):
        every other piece joins the glue around it, so it comes back verbatim and ``join`` still
        rebuilds the text."""
        needs = needs or needs_model
        pieces: list[str] = []
        glue = [self.glue[0]]
        for piece, after in zip(self.pieces, self.glue[1:]):
            if needs(piece):
                pieces.append(piece)
                glue.append(after)
            else:
                glue[-1] += piece + after
        return Split(pieces, glue, self.fallbacks)


@dataclass
class Piece:
    """One sentence of one text of a request, as sent to the engine (or answered by the translation memory)."""
    text_index: int     # which text of the request
    piece_index: int    # which sentence of that text's Split
    src_ids: list[int]  # its token ids, EOS included ([] for a memory hit)
    stored: Optional[str] = None    # the translation memory's text for it: not sent to the engine
    match: Optional[float] = None   # a memory hit's match score, 0-100 (100: exact; fuzzy.py)


@functools.lru_cache(maxsize=None)
def _segmenter(language: str) -> pysbd.Segmenter:
    try:
        return pysbd.Segmenter(language=language, clean=False)
    except ValueError:  # a language pysbd has no rules for: English rules are the usual default
        return pysbd.Segmenter(language="en", clean=False)


def has_text(s: str) -> bool:
    """Whether s has a visible character: not only whitespace, control or format characters (such
    as U+200B zero-width space) and terminal escape sequences, which the model would see as an empty
    sentence. Private-use, unassigned and surrogate code points count as visible (they come back verbatim)."""
    return bool(trim(s))


def is_glue(c: str) -> bool:
    """Whether c is kept as glue at a sentence's edges: whitespace, or a control or format character
    (categories Cc, Cf: U+200B zero-width space, U+200E left-to-right mark, U+202E, U+00AD soft
    hyphen, ...), which the model cannot translate; it comes back verbatim where it was."""
    return c.isspace() or unicodedata.category(c) in ("Cc", "Cf")


def trim(s: str) -> str:
    """s without glue at either end: glue characters (``is_glue``) and whole terminal escape sequences."""
    i, j = 0, len(s)
    while i < j and is_glue(s[i]):
        m = _ESCAPE.match(s, i, j) if s[i] == "\x1b" else None
        i = m.end() if m else i + 1
    while j > i:
        if is_glue(s[j - 1]):
            j -= 1
            continue
        k = s.rfind("\x1b", max(i, j - 300), j)     # a sequence ending at j (at most ~260 characters)
        if k < 0 or not _ESCAPE.fullmatch(s, k, j):
            break
        j = k
    return s[i:j]


def needs_model(piece: str) -> bool:
    """Whether a piece has a letter (Unicode category L*) for the model to translate; pieces of
    digits, punctuation, symbols or emoji only ("1.", "12345", "-", "...", "€ 5,00") pass through."""
    return any(c.isalpha() for c in piece)


def simple_split(line: str) -> list[str]:
    """The fallback segmenter: a boundary is sentence-final punctuation (``.!?…``, closing quotes or
    brackets after it) followed by whitespace and an uppercase letter (an opening quote or bracket
    may come first), except after a "." that ends a number ("am 3. Mai"), a single letter (initials)
    or a word with another "." inside ("z.B.", "B.A."). Returns the sentences, trimmed of glue (``trim``), that have
    visible text, in order; they are substrings of ``line``, so ``split_text``'s invariant holds."""
    out, start = [], 0
    for m in _BOUNDARY.finditer(line):
        k = m.end()
        while k < len(line) and line[k] in _OPENERS:
            k += 1
        w = m.start()       # the word before the punctuation: line[w:m.start()]
        while w > 0 and not line[w - 1].isspace():
            w -= 1
        word = line[w:m.start()]
        if not line[k:k + 1].isupper() or (line[m.start()] == "." and (
                word.isdigit() or (len(word) == 1 and word.isalpha()) or "." in word)):
            continue
        out.append(line[start:m.start(1)])
        start = m.end(1)
    out.append(line[start:])
    return [trim(s) for s in out if has_text(s)]


def split_sentences(line: str, language: str = "en") -> list[str]:
    """The sentences of one line (no line breaks inside) by pysbd, each trimmed of surrounding glue
    (``trim``: whitespace, control and format characters); segments without visible text are left
    out (they stay in the glue, see ``split_text``).
    Raises what pysbd raises (``split_text`` falls back to ``simple_split``)."""
    if _ONE_SENTENCE.fullmatch(line):
        return [trim(line)]
    raw = [s for s in _segmenter(language).segment(line) if has_text(s)]
    out: list[str] = []
    for s in raw:
        # pysbd may put a closing quote at the start of the next sentence; give it back.
        if out and s[0] in _CLOSERS:
            n = len(s) - len(s.lstrip(_CLOSERS))
            out[-1], s = out[-1] + s[:n], s[n:]
            if not has_text(s):
                continue
        out.append(s)
    return [trim(s) for s in out]   # every one has visible text (filtered above)


def _line_sentences(line: str, language: str, started: float, fallbacks: list[str]) -> list[str]:
    """pysbd's sentences of a line, or simple_split's (reason appended to ``fallbacks``) when pysbd
    raises or the text's segmenter time (since ``started``, ``time.perf_counter``) is spent."""
    if time.perf_counter() - started > SEGMENTER_BUDGET_S:
        fallbacks.append("timeout")
        return simple_split(line)
    try:
        return split_sentences(line, language)
    except Exception:  # noqa: BLE001 - any segmenter failure (re.error, IndexError, ...) has a fallback
        fallbacks.append("error")
        return simple_split(line)


def split_text(text: str, language: str = "en") -> Split:
    """Cut text into lines and sentences (see module docstring). Whitespace-only text has no pieces.
    Never raises for any text: lines pysbd cannot cut are cut by ``simple_split``."""
    pieces: list[str] = []
    glue: list[str] = []
    fallbacks: list[str] = []
    started = time.perf_counter()
    pending = ""            # whitespace seen since the last piece
    for part in _LINE_BREAK.split(text):
        if not part:
            continue
        if _LINE_BREAK.fullmatch(part):
            pending += part
            continue
        pos = 0
        for sentence in _line_sentences(part, language, started, fallbacks):
            at = part.find(sentence, pos)
            if at < 0:  # the segmenter changed characters: fall back to the rest of the line as one piece
                sentence = trim(part[pos:])
                at = part.find(sentence, pos)
            marker = _LIST_MARKER.match(sentence)
            if marker is not None and needs_model(sentence[marker.end():]):
                at, sentence = at + marker.end(), sentence[marker.end():]   # the marker joins the glue
            pending += part[pos:at]
            glue.append(pending)
            pieces.append(sentence)
            pending = ""
            pos = at + len(sentence)
            if not has_text(part[pos:]):     # the rest of the line is glue
                break
        pending += part[pos:]
    glue.append(pending)
    split = Split(pieces, glue, fallbacks)
    assert split.join(pieces) == text, "split_text lost characters"
    return split


def split_sentences_of(text: str, language: str = "en", mode: str = "1") -> Split:
    """``split_text`` as DeepL's ``split_sentences`` asks: "1" (the default) at punctuation and line
    breaks; "nonewlines" at punctuation only (a line break inside a sentence goes to the model as a
    space; the text between sentences keeps its line breaks); "0" the whole text as one sentence."""
    if mode == "1":
        return split_text(text, language)
    if mode == "0":
        whole = one_piece(text)
        return Split([" ".join(whole.pieces[0].split())], whole.glue)
    flat = _LINE_BREAK.sub(lambda m: " " * len(m.group()), text)     # same length: positions map back
    split = split_text(flat, language)
    glue, pos = [], 0
    for piece, g in zip(split.pieces, split.glue):
        glue.append(text[pos:pos + len(g)])
        pos += len(g) + len(piece)
    glue.append(text[pos:])
    return Split([" ".join(p.split()) for p in split.pieces], glue, split.fallbacks)


def one_piece(text: str) -> Split:
    """The whole text as one piece, the glue at its ends (``trim``) around it."""
    core = trim(text)
    at = text.find(core)
    return Split([core], [text[:at], text[at + len(core):]])


# Where an over-long sentence is cut, best first: after clause punctuation, at whitespace.
_CLAUSE_CUT = re.compile(r"(?<=[,;:\u2013\u2014)\]])\s+")
_WORD_CUT = re.compile(r"\s+")


def cut_long(split: Split, fits: Callable[[str], bool], spans: Callable[[str], list[tuple[int, int]]] = lambda s: [],
             ) -> Split:
    """``split`` with each piece that does not ``fit`` (the model reads at most its source window of
    tokens per sentence) cut into chunks that do, each translated as a sentence of its own.

    Each chunk is the longest that fits, cut after clause punctuation (``, ; : – — ) ]`` and
    whitespace) when that keeps at least half of what a cut at the last fitting whitespace would,
    else at that whitespace, else (a run without whitespace: CJK text, a very long word) between two
    characters, never before a combining mark or inside a range of ``spans(piece)`` (protected
    spans: a URL or a do-not-translate term stays whole). The whitespace at a cut becomes glue, so
    ``join`` still rebuilds the text, and nothing of the piece is dropped. A chunk is found by
    binary search over the cut positions (a text's token count grows with its length), so a piece
    costs O(log n) ``fits`` calls per chunk. Each cut piece adds "too_long" to ``fallbacks``.
    """
    if all(fits(p) for p in split.pieces):
        return split
    pieces, glue, fallbacks = [], [split.glue[0]], list(split.fallbacks)
    for piece, after in zip(split.pieces, split.glue[1:]):
        if fits(piece):
            pieces.append(piece)
            glue.append(after)
            continue
        fallbacks.append("too_long")
        chunks, gaps = _cut(piece, fits, spans(piece))
        pieces += chunks
        glue += gaps + [after]
    return Split(pieces, glue, fallbacks)


def _cut(piece: str, fits: Callable[[str], bool], spans: list[tuple[int, int]]) -> tuple[list[str], list[str]]:
    """``cut_long`` of one piece: its chunks and the len(chunks) - 1 runs of whitespace between them."""
    def free(i: int) -> bool:   # a cut between characters i - 1 and i
        return i >= len(piece) or not unicodedata.combining(piece[i]) and not any(a < i < b for a, b in spans)

    clause = [(m.start(), m.end()) for m in _CLAUSE_CUT.finditer(piece) if free(m.start()) and free(m.end())]
    words = [(m.start(), m.end()) for m in _WORD_CUT.finditer(piece) if free(m.start()) and free(m.end())]
    chars = [(i, i) for i in range(1, len(piece)) if free(i)]
    chunks, gaps, start = [], [], 0
    while not fits(piece[start:]):
        def last_fitting(cuts):     # the last cut (a, b) after start with piece[start:a] fitting, or None
            cuts = [c for c in cuts if c[0] > start]
            lo, hi, best = 0, len(cuts) - 1, None
            while lo <= hi:
                mid = (lo + hi) // 2
                if fits(piece[start:cuts[mid][0]]):
                    best, lo = cuts[mid], mid + 1
                else:
                    hi = mid - 1
            return best
        cut = last_fitting(words)
        if cut is not None:
            at_clause = last_fitting([c for c in clause if c[0] <= cut[0]])
            if at_clause is not None and 2 * (at_clause[0] - start) >= cut[0] - start:
                cut = at_clause
        else:
            cut = last_fitting(chars) or next((c for c in chars if c[0] > start), None)
            if cut is None:          # nothing to cut at: the rest goes as it is (the caller's limit check)
                break
        chunks.append(piece[start:cut[0]])
        gaps.append(piece[cut[0]:cut[1]])
        start = cut[1]
    chunks.append(piece[start:])
    return chunks, gaps
