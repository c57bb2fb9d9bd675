"""Case, the one place of it: a sentence in capitals or in title case is recased to its usual form
before translation (``recase_sentence``, after ``protect.py``), and the translation gets the input's
style back (``apply_style``, in ``assemble.py``).

The model has seen caption German in its usual casing: German capitalizes nouns, so neither
lowercasing nor sentence case turns "EIN HUND LÄUFT." into what it knows ("Ein Hund läuft.").
A truecaser (Lita et al., 2003, "tRuEcasIng") recases each word to its most frequent form in the
training text. The table ships with the checkpoint (``truecase.<lang>.txt.gz``: one word a line,
the form it takes most often when not sentence-initial; built by ``python -m
service.translator.truecase``). Without a table the model's vocabulary decides: a word whose
lowercase form is a whole vocabulary piece is lowercase, else it is capitalized.

Styles (``Truecaser.style``), judged on the letters of a sentence (protected spans left out):
    "upper"  every cased letter is a capital and some known word of 2+ letters is not a capital word
             in its usual form (so "USA." or an unknown "NASA" alone is not a style; capitals spell ß
             as SS, and "STRASSE" finds "Straße"): each word is recased to its
             usual form (unknown words capitalized, as German nouns are); the translation is
             uppercased.
    "title"  3+ words, every word starts with a capital, not all capitals, and 2+ words after the
             first are lowercase in their usual form (a German sentence does not capitalize such
             words, a headline does; one alone may be a nominalized verb, "Das Laufen", or the formal
             "Sie"): such words are recased; every word of the translation is capitalized.
    None     anything else; a word of 3+ capitals inside such a sentence ("Ein HUND läuft.") is recased
             to its usual form when the table knows it, and the translation is left as the model
             writes it.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from .protect import Protected

WORD = re.compile(r"[^\W\d_]+(?:-[^\W\d_]+)*")   # letters, hyphenated compounds ("T-Shirt") as one word


def table_path(checkpoint: str | Path, lang: str) -> Path:
    """Where a checkpoint's truecasing table for source language ``lang`` lives."""
    return Path(checkpoint) / f"truecase.{lang}.txt.gz"


def build_table(lines: Iterable[str]) -> list[str]:
    """Per word (by its lowercase form) its most frequent casing outside sentence-initial position;
    a word seen only sentence-initially keeps that form. Sorted case-insensitively."""
    inner: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    first: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        for i, m in enumerate(WORD.finditer(line)):
            (first if i == 0 else inner)[m.group().lower()][m.group()] += 1
    forms = [(inner.get(k) or first[k]).most_common(1)[0][0] for k in set(inner) | set(first)]
    return sorted(forms, key=lambda w: (w.lower(), w))


class Truecaser:
    """Usual forms of words (``forms``: lowercase -> usual form); ``vocab`` (lowercase pieces without
    the word-boundary mark) decides words that ``forms`` lacks."""

    def __init__(self, forms: Optional[dict[str, str]] = None, vocab: Optional[set[str]] = None):
        self.forms = forms or {}
        self.vocab = vocab or set()

    @classmethod
    def load(cls, checkpoint: str | Path, lang: str, tok=None) -> "Truecaser":
        """The checkpoint's table when it has one; the tokenizer's vocabulary as fallback."""
        path = table_path(checkpoint, lang)
        forms = {}
        if path.exists():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                forms = {w.lower(): w for w in f.read().split("\n") if w}
            for low, w in list(forms.items()):       # "STRASSE": capitals spell ß as SS
                forms.setdefault(low.replace("ß", "ss"), w)
        vocab = set()
        if tok is not None and hasattr(tok, "vocab_size"):
            for p in tok.pieces(range(tok.vocab_size)):
                if p.startswith("▁") and len(p) > 2 and p[1:].islower():
                    vocab.add(p[1:])
        return cls(forms, vocab)

    def usual(self, word: str) -> Optional[str]:
        """The usual form of word, or None when neither the table nor the vocabulary knows it."""
        low = word.lower()
        if low in self.forms:
            return self.forms[low]
        if "-" in low:
            parts = [self.usual(p) for p in word.split("-")]
            if all(parts):
                return "-".join(parts)
        if low in self.vocab:
            return low
        return None

    def style(self, text: str) -> Optional[str]:
        """"upper", "title" or None (see the module docstring)."""
        words = WORD.findall(text)
        letters = [c for w in words for c in w if c.isupper() or c.islower()]
        if not letters:
            return None
        if all(c.isupper() for c in letters):
            for w in words:
                u = self.usual(w)
                if len(w) >= 2 and u is not None and not u.isupper():
                    return "upper"
            return None
        if len(words) >= 3 and all(w[0].isupper() for w in words):
            if sum((u := self.usual(w)) is not None and u[0].islower() for w in words[1:]) >= 2:
                return "title"
        return None

    def recase(self, text: str, style: Optional[str], fixed: Sequence[tuple[int, int]] = ()) -> str:
        """text with words recased for the model (see the module docstring); other characters kept, and
        so are the words that overlap a ``fixed`` (start, end) range (protected spans' placeholders)."""
        out, pos = [], 0
        for m in WORD.finditer(text):
            if any(a < m.end() and m.start() < b for a, b in fixed):
                continue
            w, u = m.group(), self.usual(m.group())
            if style == "upper":
                new = u if u is not None else w[:1] + w[1:].lower()
            elif style == "title":
                new = u if u is not None and u[0].islower() else w
            else:
                new = u if u is not None and len(w) >= 3 and w.isupper() and not u.isupper() else w
            if style and not any(c.isalnum() for c in text[:m.start()]):    # the sentence's first word
                new = new[:1].upper() + new[1:]
            out += [text[pos:m.start()], new]
            pos = m.end()
        out.append(text[pos:])
        return "".join(out)


def recase_sentence(p: Protected, truecaser: Truecaser) -> Protected:
    """A protected sentence as the model gets it: its case style (judged on the text around its spans)
    noted for the translation, its words recased, its placeholders left as they are."""
    style = truecaser.style(p.bare)
    return dataclasses.replace(p, model_text=truecaser.recase(p.model_text, style, p.fixed), style=style)


def apply_style(style: Optional[str], text: str) -> str:
    """The translation in the input's style: all capitals, every word capitalized, or unchanged."""
    if style == "upper":
        return text.upper()
    if style == "title":
        return WORD.sub(lambda m: m.group()[:1].upper() + m.group()[1:], text)
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Build a truecasing table from training text (one sentence a line).")
    ap.add_argument("--train", required=True,
                    help="training text, plain or .gz (e.g. ../shared/data/multi30k/train.de.gz)")
    ap.add_argument("--out", required=True, help="output, e.g. model/checkpoints/de-en/truecase.de.txt.gz")
    args = ap.parse_args(argv)
    opener = gzip.open if args.train.endswith(".gz") else open
    with opener(args.train, "rt", encoding="utf-8") as f:
        forms = build_table(f)
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:   # mtime=0: the same input gives the same bytes
        f.write(("\n".join(forms) + "\n").encode("utf-8"))
    print(f"{args.out}: {len(forms)} words")


if __name__ == "__main__":
    main()
