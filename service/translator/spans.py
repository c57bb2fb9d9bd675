"""Finding protected spans: what the model cannot know, or must not translate, in a sentence.

A sentence's spans (``SpanFinder.find``) are URLs, e-mail addresses, numbers with their separators
and units, code-like tokens, HTML entities, terminal escape sequences, runs of characters outside the
model's alphabet such as emoji, U+FFFD or private-use characters, and the occurrences of
do-not-translate terms (``Terms``: a request's ``keep`` and the server's stored list). Spans are
found on the sentence as sent, in any case ("HTTPS://EXAMPLE.COM" is a URL). What becomes of them is
``protect.py``'s (placeholders), ``placement.py``'s and ``assemble.py``'s (putting them back).

The model's "alphabet" is read from its tokenizer, not from a list: a character is known when it
encodes to ordinary vocabulary pieces, and unknown when it needs byte-fallback pieces (``<0xF0>``)
or ``<unk>``. Letters that NFKC-normalise to known ones (full-width letters, ligatures such as
"ﬁ") are known; other characters that NFKC changes ("™" -> "TM", "½") are not, so they stay verbatim.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from service.protocol import MAX_KEEP_CHARS

from .text import ESCAPE, Split

# Do-not-translate terms: a request's ``keep`` (its limits: ``service/protocol.py``) and the stored
# list (``Terms.load``, one term a line; each term at most MAX_KEEP_CHARS characters too).
MAX_STORED_TERMS = 10_000      # terms in a stored list

# With a scheme or "www." (either in any case); else a bare domain with a common top-level domain,
# in lowercase or capitals ("example.com/x", "EXAMPLE.COM").
_TLD = "com|org|net|de|at|ch|io|eu|info|edu|gov"
_URL = (r"(?:(?i:https?|ftp)://|(?i:www)\.)[^\s<>\"'`]+"
        r"|(?<![\w@.-])[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.(?:" + _TLD + "|" + _TLD.upper() + ")"
        r"(?:/[^\s<>\"'`]*)?(?![\w@-]|\.\w)")
_EMAIL = r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"
# Digits with their separators ("3,50", "1.000", "12:30", "2024-01-05", "1/2"), a sign, a percent
# sign or a short unit glued on ("5km", "10%").
_NUMBER = r"(?<![\w.,])[+-]?\d+(?:[.,:/'-]\d+)*(?:%|[A-Za-z]{1,3}\b)?"
# snake_case, camelCase (a lowercase letter then a capital), paths, dotted calls.
_CODE = (r"\b(?:\w*[A-Za-z0-9]_\w+|[a-z]+[A-Z]\w*)\b(?:\(\))?|(?<!\w)(?:~|\.{1,2})?/[\w.-]+(?:/[\w.-]*)+"
         r"|\b[A-Za-z]:\\[\w\\.-]+|\b\w+(?:\.\w+)+\(\)")
_ENTITY = r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]{0,31});"    # "&nbsp;", "&#0;", "&unknown;", "&x;"

# A unit glued to a number's symbol ("25°C", "30 °F", "5 €/kg"): letters after the symbol.
_UNIT = re.compile(r"/?[^\W\d_]{1,3}(?!\w)")
SPAN_PATTERNS = {"escape": ESCAPE, "url": _URL, "email": _EMAIL, "code": _CODE, "entity": _ENTITY, "number": _NUMBER}
_TRAILING = ".,;:!?)]}\"'»”’"   # taken off the end of a URL unless the URL opened the bracket


@dataclass
class Span:
    start: int    # character offsets in the sentence
    end: int
    kind: str     # escape, url, email, code, entity, number, symbol, word (with a letter the model lacks), keep (a term)

    def merge(self, other: "Span") -> "Span":
        return Span(self.start, max(self.end, other.end), self.kind if self.kind == other.kind else "mixed")



class Terms:
    """Do-not-translate terms. Each occurrence of a term in a sentence is a protected span: matched
    case-sensitively as whole words (no letter, digit or "_" right before or after it, where the term
    itself starts or ends with one), any run of whitespace for a space; overlapping occurrences (of
    one term or of several) are one span. Terms are composed (NFC) as sentences are; empty ones and
    repeats are left out."""

    def __init__(self, terms: Iterable[str] = ()):
        terms = (unicodedata.normalize("NFC", t).strip() for t in terms)
        self.terms: tuple[str, ...] = tuple(dict.fromkeys(t for t in terms if t))
        # A term that starts with a word character is tried only in sentences that have its first
        # word (the run of word characters it starts with), so a long stored list stays cheap.
        by_word: dict[str, list[re.Pattern]] = {}
        always: list[re.Pattern] = []
        for t in self.terms:
            first = re.match(r"\w+", t)
            (by_word.setdefault(first.group(), []) if first else always).append(_term_pattern(t))
        self._groups = [(by_word, always)] if self.terms else []

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __len__(self) -> int:
        return len(self.terms)

    def __add__(self, other: "Terms") -> "Terms":
        """Both lists (each keeps its index: a request's terms added to a long stored list cost
        only their own)."""
        if not other or not self:
            return self if self else other
        both = Terms()
        both.terms, both._groups = self.terms + other.terms, self._groups + other._groups
        return both

    def find(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of every occurrence of every term in text, overlapping ones too."""
        if not self.terms:
            return []
        words = dict.fromkeys(re.findall(r"\w+", text))
        found = []
        for by_word, always in self._groups:
            for pat in always + [p for w in words for p in by_word.get(w, ())]:
                found += [m.span(1) for m in pat.finditer(text)]
        return found

    @classmethod
    def load(cls, path: str | Path) -> "Terms":
        """A stored list: one term a line (UTF-8); blank lines and lines starting with "#" are left out.
        Raises ValueError naming the file and line for a term over MAX_KEEP_CHARS characters or more
        than MAX_STORED_TERMS terms."""
        terms = []
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            term = line.strip()
            if not term or term.startswith("#"):
                continue
            if len(term) > MAX_KEEP_CHARS:
                raise ValueError(f"{path}:{n}: a term of {len(term)} characters; at most {MAX_KEEP_CHARS}")
            terms.append(term)
            if len(terms) > MAX_STORED_TERMS:
                raise ValueError(f"{path}:{n}: more than {MAX_STORED_TERMS} terms")
        return cls(terms)


@functools.lru_cache(maxsize=16384)
def _term_pattern(term: str) -> re.Pattern:
    """A lookahead that matches ``term`` at every position it occurs (overlapping ones too)."""
    body = r"\s+".join(re.escape(w) for w in term.split())
    head = r"(?<!\w)" if re.match(r"\w", term) else ""
    tail = r"(?!\w)" if re.match(r"\w", term[-1]) else ""
    return re.compile(f"(?=({head}{body}{tail}))")



class SpanFinder:
    """Finds the protected spans of sentences for one tokenizer (its vocabulary is the model's alphabet)."""

    def __init__(self, tok):
        self.tok = tok
        self._patterns = re.compile("|".join(f"(?P<{k}>{p})" for k, p in SPAN_PATTERNS.items()))

    @functools.lru_cache(maxsize=4096)
    def known(self, c: str) -> bool:
        """Whether the model's vocabulary covers character c: it encodes to ordinary pieces (no
        byte-fallback piece, no <unk>) that decode to something (the tokenizer drops U+FFFD)."""
        if c.isspace():
            return True
        if unicodedata.category(c) == "Cs" or (not c.isalpha() and unicodedata.normalize("NFKC", c) != c):
            return False    # a lone surrogate cannot be encoded; "™" -> "TM", "½" -> "1⁄2"
        ids = self.tok.encode(c)
        return bool(self.tok.decode(ids).strip()) and \
            all(i != self.tok.unk_id and not _is_byte(p) for i, p in zip(ids, self.tok.pieces(ids)))

    def find(self, text: str, merge: bool = True, keep: Optional[Terms] = None) -> list[Span]:
        """Protected spans of text, in order, non-overlapping (overlapping ones are one span, so a term
        inside a URL is that URL); with ``merge`` spans separated only by whitespace are one (the
        whitespace between them is kept verbatim). ``keep``: do-not-translate terms, each occurrence
        a span of kind "keep"."""
        found = [Span(a, b, "keep") for a, b in keep.find(text)] if keep else []
        for m in self._patterns.finditer(text):
            start, end = m.span()
            if m.lastgroup in ("url", "code"):
                while end > start and text[end - 1] in _TRAILING and not _opened(text[start:end], text[end - 1]):
                    end -= 1
            found.append(Span(start, end, m.lastgroup))
        i = 0
        while i < len(text):        # runs of unknown characters (and the joiners inside them)
            if self.known(text[i]) or any(s.start <= i < s.end for s in found):
                i += 1
                continue
            j = i + 1
            while j < len(text) and not text[j].isspace() and not self.known(text[j]):
                j += 1
            kind = "symbol"
            if any(c.isalpha() for c in text[i:j]):   # a letter the model lacks: its whole word ("Łódź")
                kind = "word"
                while i > 0 and _in_word(text[i - 1]):
                    i -= 1
                while j < len(text) and _in_word(text[j]):
                    j += 1
            if any(not _invisible(c) for c in text[i:j]):
                found.append(Span(i, j, kind))
            i = j
        found.sort(key=lambda s: (s.start, -s.end))
        spans: list[Span] = []
        for s in found:
            if spans and s.start < spans[-1].end:     # inside an earlier span, or overlapping it
                if s.end > spans[-1].end:
                    spans[-1] = spans[-1].merge(s)
                continue
            if merge and spans and not text[spans[-1].end:s.start].strip():
                spans[-1] = spans[-1].merge(s)
            else:
                spans.append(s)
        for k, s in enumerate(spans):     # a unit after a number's symbol: "25°" + "C"
            unit = _UNIT.match(text, s.end)
            if unit and not text[s.end - 1].isalnum() and any(c.isdigit() for c in text[s.start:s.end]) \
                    and (k + 1 == len(spans) or spans[k + 1].start >= unit.end()):
                s.end = unit.end()
        return spans

    def rejoin(self, split: Split, keep: Optional[Terms] = None) -> Split:
        """``split`` with the pieces that a URL, e-mail address, code token or do-not-translate term
        runs across joined into one (the sentence splitter cuts "https://example.com/path?x=1" at its "?")."""
        if len(split.pieces) < 2:
            return split
        spans = [s for s in self.find(split.join(split.pieces), merge=False, keep=keep)
                 if s.kind in ("url", "email", "code", "keep", "mixed")]
        pieces, glue, pos = [split.pieces[0]], [split.glue[0]], len(split.glue[0])
        for k in range(1, len(split.pieces)):
            end = pos + len(split.pieces[k - 1])            # end of piece k-1, start of piece k:
            start = end + len(split.glue[k])
            if any(s.start < end and s.end > start for s in spans):
                pieces[-1] += split.glue[k] + split.pieces[k]
            else:
                pieces.append(split.pieces[k])
                glue.append(split.glue[k])
            pos = start
        glue.append(split.glue[-1])
        return dataclasses.replace(split, pieces=pieces, glue=glue)


def _is_byte(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def _in_word(c: str) -> bool:
    """Whether c continues a word around a letter the model lacks: a letter, digit or combining mark."""
    return c.isalnum() or unicodedata.category(c) in ("Mn", "Mc")


def _invisible(c: str) -> bool:
    """Whether c alone is no span: a control or format character (left out of the model's input),
    a combining mark or a space. Private-use, unassigned and surrogate code points are spans."""
    return unicodedata.category(c) in ("Cc", "Cf", "Mn", "Me", "Zs")


def _opened(url: str, closer: str) -> bool:
    """Whether ``url`` (ending in ``closer``) opened that bracket itself (a Wikipedia link "(Band)")."""
    pairs = {")": "(", "]": "[", "}": "{"}
    return closer in pairs and url.count(pairs[closer]) >= url.count(closer)
