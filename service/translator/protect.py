"""Protecting a sentence: what the model cannot translate, or must not, is kept out of its input and
comes back verbatim, where it belongs.

    protect (spans.py finds them) -> case (truecase.py) -> encode
    ... engine ... -> place spans (placement.py) -> assemble (assemble.py)

A sentence's control and format characters (zero-width space, direction marks, soft hyphen; at its
edges they stay in the glue, see ``text.is_glue``) are left out of the model's input and not put
back: they mark places in the source words (a hyphenation point, a word break) that the translation
does not have; inside a protected span they stay, verbatim with it (an emoji's joiners).
A sentence's protected spans (``spans.SpanFinder``: what the model cannot know, and the occurrences
of do-not-translate terms) are kept out of its input. They are found on the sentence as sent,
before anything is recased. A span at the edge of the sentence (after its final punctuation, or
symbols before its first word) is cut off and put back at the same edge. Every other span is
replaced by a placeholder of one vocabulary piece (``PLACEHOLDERS``: a number for spans that start
with a digit, a name for the rest), chosen per sentence so that it cannot collide with the
sentence's own words: the first candidate of its kind that the text outside the spans does not
contain, ignoring case (not as a word, nor inside one). The model copies a placeholder through or
leaves it out; afterwards each span goes back where its placeholder landed, found with the
decoder's cross-attention (``restore``). The sentence may also be recased for the model
(``truecase.py``; the placeholders are left as they are); the translation then gets the input's
case style back.

Invariant: the text a sentence comes back as contains every protected span verbatim, once each;
``tokens``/``source_tokens``/``attention`` are what the model saw and produced (the placeholder piece
in place of each inner span; edge spans absent).
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from .assemble import assemble, partial
from .placement import Placement, place_spans
from .spans import Span, SpanFinder, Terms
from .text import Split, is_glue
from .truecase import Truecaser, recase_sentence

# The placeholder candidates of each kind, best first, one vocabulary piece each (a candidate that is
# not one piece in a model's vocabulary is skipped): a number stands in for a span that starts with
# a digit (so "5 Kinder", "Nummer 5" stay grammatical and the model copies it), a name spelled the
# same in German and English captions of the training text for every other span (the model treats
# it as a name: copies it or leaves it out, and translates the rest as it would without it). A
# sentence uses the first candidate of a kind that its text outside the spans does not contain
# (``Protector.placeholder``). The first ones were chosen by measurement, see docs/text.md.
PLACEHOLDERS = {"number": ("5", "3", "4", "6", "9", "2"),
                "other": ("Seattle", "Miami", "Atlanta", "Hawaii", "Vegas", "Texas", "London", "Berlin")}
# a zero-width space marks a word break (Unicode's ZWSP; Thai, Khmer and pasted text use it between
# words): the model reads a space there; other format and control characters are left out
SEPARATORS = re.compile("\u200b")
_FINAL = ".!?…:;\"'»”’)]"       # what ends a sentence before a trailing span


@dataclass
class Protected:
    """One sentence as prepared for the model."""
    source: str                  # the sentence as sent
    model_text: str              # what the model translates (placeholders; recased by ``case``)
    spans: list[str] = field(default_factory=list)   # inner spans as they go back, source order; one placeholder
                                                     # each (verbatim; glossary.Glossary.put_back: a term's target)
    kinds: list[str] = field(default_factory=list)   # each span's placeholder kind: "number" or "other"
    prefix: str = ""             # edge spans (and the whitespace after them) before the translation
    suffix: str = ""             # edge spans (and the whitespace before them) after it
    style: Optional[str] = None  # case style of the source: "upper", "title" or None (set by ``case``)
    needs_model: bool = True     # whether a letter is left for the model besides the placeholders
    glued: list[tuple[bool, bool]] = field(default_factory=list)  # each span: a letter or digit right before, after
    placeholders: list[str] = field(default_factory=list)   # each span's placeholder word ("5", "Seattle")
    fixed: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each placeholder in model_text
    bare: str = ""               # the text around the spans, as the model gets it (its case style is judged on it)
    covered: list[tuple[int, int]] = field(default_factory=list)  # (start, end) in source of every span, edge ones too
    at: list[tuple[int, int, str]] = field(default_factory=list)  # each inner span's (start, end) in source, its kind


class Protector:
    """A sentence's own stages for one tokenizer: ``prepare`` (protect, then case) before the model and
    ``restore`` (place spans, then assemble) after it.

    ``protect`` / ``recase`` turn span protection and truecasing off (the translation is then the
    model's output for the sentence as sent). Protection needs a placeholder of one vocabulary piece
    for each kind; with a tokenizer that has none for a kind it is off.
    """

    def __init__(self, tok, truecaser: Optional[Truecaser] = None, protect: bool = True, recase: bool = True):
        self.tok = tok
        self.finder = SpanFinder(tok)
        self.truecaser = truecaser if recase else None
        self.candidates: dict[str, list[str]] = {}    # kind -> its placeholder words of one piece, best first
        self.word_ids: dict[str, frozenset[int]] = {}   # placeholder word -> its piece ids ("▁5", and "5" glued)
        opener = tok.encode("(")
        for kind, words in PLACEHOLDERS.items():
            self.candidates[kind] = []
            for w in words:
                ids, glued = tok.encode(w), tok.encode("(" + w)
                if len(ids) == 1:
                    extra = glued[1:] if len(glued) == 2 and glued[0] == opener[0] else []
                    self.word_ids[w] = frozenset(ids + extra)
                    self.candidates[kind].append(w)
        self.enabled = protect and all(self.candidates.values())   # whether spans are protected

    # ---- finding (spans.py) ---------------------------------------------------------------------
    def known(self, c: str) -> bool:
        """Whether the model's alphabet has character c (``spans.SpanFinder.known``)."""
        return self.finder.known(c)

    def find_spans(self, text: str, merge: bool = True, keep: Optional[Terms] = None) -> list[Span]:
        """The protected spans of text (``spans.SpanFinder.find``)."""
        return self.finder.find(text, merge, keep)

    def rejoin(self, split: Split, keep: Optional[Terms] = None) -> Split:
        """``split`` with the pieces a protected URL, e-mail address, code token or do-not-translate
        term runs across joined into one (``spans.SpanFinder.rejoin``); as it is with protection off."""
        return self.finder.rejoin(split, keep) if self.enabled else split

    # ---- before the model: protect -> case -> encode --------------------------------------------
    def prepare(self, sentence: str, keep: Optional[Terms] = None) -> Protected:
        """The model's input for one sentence: ``protect``, then ``case``."""
        return self.case(self.protect(sentence, keep))

    def protect(self, sentence: str, keep: Optional[Terms] = None) -> Protected:
        """The sentence with its spans out and placeholders in (see the module docstring); ``keep``:
        do-not-translate terms. The sentence is composed first (NFC: "a" + U+0301 is "á", as the
        tokenizer would see it), so spans are found in the text the model gets, and come back composed."""
        if not unicodedata.is_normalized("NFC", sentence):
            sentence = unicodedata.normalize("NFC", sentence)
        spans = self.finder.find(sentence, keep=keep) if self.enabled else []
        covered = [(s.start, s.end) for s in spans]
        lo, hi = 0, len(sentence)
        prefix = suffix = ""
        if spans and spans[-1].end == len(sentence) and sentence[:spans[-1].start].rstrip()[-1:] in tuple(_FINAL):
            hi = spans.pop().start      # after the sentence's final punctuation
            suffix = sentence[len(sentence[:hi].rstrip()):]
            hi = len(sentence[:hi].rstrip())
        if spans and spans[0].start == 0 and spans[0].kind == "symbol":
            lo = spans.pop(0).end       # symbols before the first word
            lo += len(sentence[lo:]) - len(sentence[lo:].lstrip())
            prefix = sentence[:lo]
        between = [self._model_text(sentence[a:b])      # the text around the spans, as the model gets it
                   for a, b in zip([lo] + [s.end for s in spans], [s.start for s in spans] + [hi])]
        bare = " ".join(between)
        kinds = ["number" if re.match(r"[+-]?\d", sentence[s.start:s.end]) else "other" for s in spans]
        chosen = {k: self.placeholder(k, bare) for k in dict.fromkeys(kinds)}
        words = [chosen[k] for k in kinds]
        parts: list[str] = []
        fixed: list[tuple[int, int]] = []     # where the placeholders are in the model text
        length = 0
        for s, before, w in zip(spans, between, words):
            glued = len(self.word_ids[w]) > 1
            space = before and (before[-1].isalnum() or not (glued or before[-1].isspace()))
            after = sentence[s.end:s.end + 1]
            part = before + (" " if space else "")
            fixed.append((length + len(part), length + len(part) + len(w)))
            part += w + (" " if after and (after.isalnum() or after in "([{") else "")
            parts.append(part)
            length += len(part)
        parts.append(between[-1])
        glued = [(sentence[s.start - 1:s.start].isalnum(), sentence[s.end:s.end + 1].isalnum()) for s in spans]
        return Protected(sentence, "".join(parts), [sentence[s.start:s.end] for s in spans], kinds, prefix, suffix,
                         needs_model=any(c.isalpha() for c in bare), glued=glued, placeholders=words, fixed=fixed,
                         bare=bare, covered=covered, at=[(s.start, s.end, s.kind) for s in spans])

    def placeholder(self, kind: str, text: str) -> str:
        """The placeholder of ``kind`` for a sentence whose text outside its spans is ``text``: the
        first candidate that text does not contain, ignoring case (so it is neither one of the
        sentence's words nor a piece of one, whatever the recasing does); the first candidate when
        the text holds them all (``restore`` then tells them apart as well as it can)."""
        low = text.casefold()
        words = self.candidates[kind]
        return next((w for w in words if w.casefold() not in low), words[0])

    def _model_text(self, text: str) -> str:
        """Text (no spans in it) as the model gets it: composed (NFC), without control and format
        characters (whitespace kept; a soft hyphen inside a word leaves the word whole, "Hu\u00adnd"
        -> "Hund"; a separator, ``SEPARATORS``, is a space: "Ein\u200bHund" -> "Ein Hund") and without
        combining marks the vocabulary lacks even after composition ("u" + three U+0308 -> "ü"): the
        model cannot translate them (they would be byte pieces, and garble the sentence)."""
        text = SEPARATORS.sub(" ", unicodedata.normalize("NFC", text))
        return "".join(c for c in text if c.isspace() or not (is_glue(c) or (unicodedata.category(c) in ("Mn", "Me")
                                                                             and not self.known(c))))

    def case(self, p: Protected) -> Protected:
        """``p`` recased for the model (``truecase.recase_sentence``); as it is with truecasing off."""
        return recase_sentence(p, self.truecaser) if self.truecaser is not None else p

    def encode(self, p: Protected) -> list[int]:
        """Source ids of the model text, EOS included."""
        return self.tok.encode(p.model_text) + [self.tok.eos_id]

    # ---- after the model: place spans -> assemble -----------------------------------------------
    def restore(self, p: Protected, src_ids: list[int], tokens: list[int], cross: Optional[Tensor]) -> str:
        """The translation text of one hypothesis (``tokens``; ``cross`` its [L, H, T, S] cross-attention,
        or None; ``src_ids`` what the model read): ``place`` the spans, then ``assemble.assemble``."""
        return assemble(p, self.tok, tokens, self.place(p, src_ids, tokens, cross))

    def place(self, p: Protected, src_ids: list[int], tokens: list[int], cross: Optional[Tensor]
              ) -> Optional[Placement]:
        """Where p's inner spans go among ``tokens`` (``placement.place_spans``); None without any."""
        if not p.spans:
            return None
        return place_spans([self.word_ids[w] for w in p.placeholders], self.tok, src_ids, tokens, cross)

    def partial(self, p: Protected, tokens: list[int]) -> Optional[str]:
        """The text of a sentence still being decoded (``assemble.partial``)."""
        return partial(p, self.tok, tokens)
