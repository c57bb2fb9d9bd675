"""Split texts into sentences for translation and rejoin the translations with the original whitespace.

A text (a paragraph, several lines, a whole document) is split first into lines, then each line into
sentences with pysbd (Sadvilkar and Neumann, 2020, "PySBD: Pragmatic Sentence Boundary
Disambiguation"), a rule-based segmenter that keeps abbreviations ("z.B.", "Dr.") inside sentences.
Invariant: ``Split.join(split.pieces) == text`` — the whitespace between and around pieces (line
breaks, double spaces, indentation) is kept verbatim in ``glue`` and reused when the translated pieces
are joined, so the output has the input's layout. A ``Piece`` is one sentence of one text, encoded.
"""
from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import pysbd

# Characters that close a quotation or bracket; pysbd sometimes starts the next sentence with them
# ('sagt: "Hallo.' + '" Das ...'), so they are moved back to the sentence they close.
_CLOSERS = "\"'”’»«)]}›"
_LINE_BREAK = re.compile(r"(\r\n|\n|\r|\u2028|\u2029)")


@dataclass
class Split:
    """A text cut into translatable pieces: text == glue[0] + pieces[0] + glue[1] + ... + glue[n]."""
    pieces: list[str]   # sentences without surrounding whitespace, never without visible text
    glue: list[str]     # len(pieces) + 1 runs of whitespace (or other invisible characters: control,
                        # format, e.g. zero-width space) kept as sent

    def join(self, translations: Sequence[str]) -> str:
        """Interleave translations (one per piece) with the original whitespace."""
        if len(translations) != len(self.pieces):
            raise ValueError(f"expected {len(self.pieces)} translations, got {len(translations)}")
        out = [self.glue[0]]
        for t, g in zip(translations, self.glue[1:]):
            out.append(t)
            out.append(g)
        return "".join(out)


@dataclass
class Piece:
    """One sentence of one text of a request, as sent to the engine."""
    text_index: int     # which text of the request
    piece_index: int    # which sentence of that text's Split
    src_ids: list[int]  # its token ids, EOS included


@functools.lru_cache(maxsize=None)
def _segmenter(language: str) -> pysbd.Segmenter:
    try:
        return pysbd.Segmenter(language=language, clean=False)
    except ValueError:  # a language pysbd has no rules for: English rules are the usual default
        return pysbd.Segmenter(language="en", clean=False)


def has_text(s: str) -> bool:
    """Whether s has a visible character: not only whitespace, control or format characters (such
    as U+200B zero-width space), which the model would see as an empty sentence."""
    return any(not c.isspace() and unicodedata.category(c) not in ("Cc", "Cf", "Cs", "Co", "Cn") for c in s)


def split_sentences(line: str, language: str = "en") -> list[str]:
    """The sentences of one line (no line breaks inside), each stripped of surrounding whitespace;
    segments without visible text are left out (they stay in the glue, see ``split_text``)."""
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
    return [s.strip() for s in out]   # every one has visible text (filtered above)


def split_text(text: str, language: str = "en") -> Split:
    """Cut text into lines and sentences (see module docstring). Whitespace-only text has no pieces."""
    pieces: list[str] = []
    glue: list[str] = []
    pending = ""            # whitespace seen since the last piece
    cursor = 0
    for part in _LINE_BREAK.split(text):
        if not part:
            continue
        if _LINE_BREAK.fullmatch(part):
            pending += part
            cursor += len(part)
            continue
        line_start = cursor
        pos = 0
        for sentence in split_sentences(part, language):
            at = part.find(sentence, pos)
            if at < 0:  # the segmenter changed characters: fall back to the rest of the line as one piece
                sentence = part[pos:].strip()
                at = part.find(sentence, pos)
            pending += part[pos:at]
            glue.append(pending)
            pieces.append(sentence)
            pending = ""
            pos = at + len(sentence)
            if pos >= len(part.rstrip()):
                break
        pending += part[pos:]
        cursor = line_start + len(part)
    glue.append(pending)
    split = Split(pieces, glue)
    assert split.join(pieces) == text, "split_text lost characters"
    return split
