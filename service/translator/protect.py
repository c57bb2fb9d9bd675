"""Protected spans: what the model cannot translate comes back verbatim, where it belongs.

A sentence's control and format characters (zero-width space, direction marks, soft hyphen; at its
edges they stay in the glue, see ``text.is_glue``) are left out of the model's input and not put
back: they mark places in the source words (a hyphenation point, a word break) that the translation
does not have; inside a protected span they stay, verbatim with it (an emoji's joiners).
A sentence's spans the model cannot know (``find_spans``: URLs, e-mail addresses, numbers with
their separators and units, code-like tokens, HTML entities, runs of characters outside the model's
alphabet such as emoji, U+FFFD or private-use characters) are kept out of its input. A span at the
edge of the sentence (after its final punctuation, or symbols before its first word) is cut off and
put back at the same edge. Every other span is replaced by a placeholder of one vocabulary piece (``PLACEHOLDERS``: a number for spans that start
with a digit, a name for the rest), which the model copies through or leaves out; afterwards each
span goes back where its placeholder landed, found with the decoder's cross-attention
(``restore``). The sentence may also be recased for the model (``truecase.py``); the translation
then gets the input's case style back.

The model's "alphabet" is read from its tokenizer, not from a list: a character is known when it
encodes to ordinary vocabulary pieces, and unknown when it needs byte-fallback pieces (``<0xF0>``)
or ``<unk>``. Letters that NFKC-normalise to known ones (full-width letters, ligatures such as
"ﬁ") are known; other characters that NFKC changes ("™" -> "TM", "½") are not, so they stay verbatim.

Invariant: the text a sentence comes back as contains every protected span verbatim, once each, in
the translation's order of their placeholders; ``tokens``/``source_tokens``/``attention`` are what
the model saw and produced (the placeholder piece in place of each inner span; edge spans absent).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Optional

import torch

from .text import Split, is_glue
from .truecase import Truecaser, apply_style

# The placeholders, one vocabulary piece each: a number stands in for a span that starts with a
# digit (so "5 Kinder", "Nummer 5" stay grammatical and the model copies it), a city name spelled
# the same in German and English captions of the training text for every other span (the model
# treats it as a name: copies it or leaves it out, and translates the rest as it would without it).
# Chosen by measurement, see docs/api.md#real-world-text.
PLACEHOLDERS = {"number": "5", "other": "Seattle"}

# With a scheme or "www."; else a bare domain with a common top-level domain ("example.com/x").
_URL = (r"(?:(?:https?|ftp)://|www\.)[^\s<>\"'`]+"
        r"|(?<![\w@.-])[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.(?:com|org|net|de|at|ch|io|eu|info|edu|gov)"
        r"(?:/[^\s<>\"'`]*)?(?![\w@-]|\.\w)")
_EMAIL = r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"
# Digits with their separators ("3,50", "1.000", "12:30", "2024-01-05", "1/2"), a sign, a percent
# sign or a short unit glued on ("5km", "10%").
_NUMBER = r"(?<![\w.,])[+-]?\d+(?:[.,:/'-]\d+)*(?:%|[A-Za-z]{1,3}\b)?"
# snake_case, camelCase (a lowercase letter then a capital), paths, dotted calls.
_CODE = (r"\b(?:\w*[A-Za-z0-9]_\w+|[a-z]+[A-Z]\w*)\b(?:\(\))?|(?<!\w)(?:~|\.{1,2})?/[\w.-]+(?:/[\w.-]*)+"
         r"|\b[A-Za-z]:\\[\w\\.-]+|\b\w+(?:\.\w+)+\(\)")
_ENTITY = r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]{1,31});"    # "&nbsp;", "&#0;", "&unknown;"
# A unit glued to a number's symbol ("25°C", "30 °F", "5 €/kg"): letters after the symbol.
_UNIT = re.compile(r"/?[^\W\d_]{1,3}(?!\w)")
SPAN_PATTERNS = {"url": _URL, "email": _EMAIL, "code": _CODE, "entity": _ENTITY, "number": _NUMBER}
_TRAILING = ".,;:!?)]}\"'»”’"   # taken off the end of a URL unless the URL opened the bracket
_FINAL = ".!?…:;\"'»”’)]"       # what ends a sentence before a trailing span


@dataclass
class Span:
    start: int    # character offsets in the sentence
    end: int
    kind: str     # url, email, code, entity, number, symbol, word (with a letter the model lacks)

    def merge(self, other: "Span") -> "Span":
        return Span(self.start, other.end, self.kind if self.kind == other.kind else "mixed")


@dataclass
class Protected:
    """One sentence as prepared for the model."""
    source: str                  # the sentence as sent
    model_text: str              # what the model translates (placeholders, recased)
    spans: list[str] = field(default_factory=list)   # inner spans, source order; one placeholder each
    kinds: list[str] = field(default_factory=list)   # each span's placeholder: "number" or "other"
    prefix: str = ""             # edge spans (and the whitespace after them) before the translation
    suffix: str = ""             # edge spans (and the whitespace before them) after it
    style: Optional[str] = None  # case style of the source: "upper", "title" or None
    needs_model: bool = True     # whether a letter is left for the model besides the placeholders
    glued: list[tuple[bool, bool]] = field(default_factory=list)  # each span: a letter or digit right before, after


class Protector:
    """Finds spans, builds model inputs and restores translations for one tokenizer.

    ``protect`` / ``recase`` turn span protection and truecasing off (the translation is then the
    model's output for the sentence as sent, as before). Protection needs placeholders that are one
    vocabulary piece each; with a tokenizer that lacks them it is off.
    """

    def __init__(self, tok, truecaser: Optional[Truecaser] = None, protect: bool = True, recase: bool = True):
        self.tok = tok
        self.truecaser = truecaser if recase else None
        self.placeholders = dict(PLACEHOLDERS)
        self.placeholder_ids: dict[str, frozenset[int]] = {}   # kind -> its piece ids ("▁5", and "5" glued)
        for kind, w in self.placeholders.items():
            ids, glued, opener = tok.encode(w), tok.encode("(" + w), tok.encode("(")
            if len(ids) == 1:
                extra = glued[1:] if len(glued) == 2 and glued[0] == opener[0] else []
                self.placeholder_ids[kind] = frozenset(ids + extra)
        self.protect = protect and len(self.placeholder_ids) == len(self.placeholders)
        self._ph = frozenset().union(*self.placeholder_ids.values())
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

    def _model_text(self, text: str) -> str:
        """Text (no spans in it) as the model gets it: composed (NFC), without control and format
        characters (whitespace kept; a soft hyphen inside a word leaves the word whole, "Hu\u00adnd"
        -> "Hund") and without combining marks the vocabulary lacks even after composition ("u" + three
        U+0308 -> "ü"): the model cannot translate them (they would be byte pieces, and garble the sentence)."""
        return "".join(c for c in unicodedata.normalize("NFC", text)
                       if c.isspace() or not (is_glue(c) or (unicodedata.category(c) in ("Mn", "Me")
                                                             and not self.known(c))))

    def find_spans(self, text: str, merge: bool = True) -> list[Span]:
        """Protected spans of text, in order, non-overlapping; with ``merge`` spans separated only by
        whitespace are one (the whitespace between them is kept verbatim)."""
        found = []
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
            if spans and s.start < spans[-1].end:
                continue            # inside an earlier (longer) span
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

    def rejoin(self, split: Split) -> Split:
        """``split`` with the pieces that a URL, e-mail address or code token runs across joined into
        one (the sentence splitter cuts "https://example.com/path?x=1" at its "?")."""
        if not self.protect or len(split.pieces) < 2:
            return split
        spans = [s for s in self.find_spans(split.join(split.pieces), merge=False)
                 if s.kind in ("url", "email", "code")]
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

    def prepare(self, sentence: str) -> Protected:
        """The model's input for one sentence (see the module docstring). The sentence is composed
        first (NFC: "a" + U+0301 is "á", as the tokenizer would see it), so spans are found in the text
        the model gets, and come back composed."""
        if not unicodedata.is_normalized("NFC", sentence):
            sentence = unicodedata.normalize("NFC", sentence)
        spans = self.find_spans(sentence) if self.protect else []
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
        parts, pos = [], lo
        kinds = []
        for s in spans:
            kinds.append("number" if re.match(r"[+-]?\d", sentence[s.start:s.end]) else "other")
            before, glued = self._model_text(sentence[pos:s.start]), len(self.placeholder_ids[kinds[-1]]) > 1
            space = before and (before[-1].isalnum() or not (glued or before[-1].isspace()))
            parts.append(before + (" " if space else "") + self.placeholders[kinds[-1]])
            after = sentence[s.end:s.end + 1]
            if after and (after.isalnum() or after in "([{"):
                parts.append(" ")
            pos = s.end
        parts.append(self._model_text(sentence[pos:hi]))
        text = "".join(parts)
        style, bare = None, _without(text, {self.placeholders[k] for k in kinds})
        if self.truecaser is not None:
            style = self.truecaser.style(bare)
            text = self.truecaser.recase(text, style)
        glued = [(sentence[s.start - 1:s.start].isalnum(), sentence[s.end:s.end + 1].isalnum()) for s in spans]
        return Protected(sentence, text, [sentence[s.start:s.end] for s in spans], kinds, prefix, suffix, style,
                         any(c.isalpha() for c in bare), glued)

    def encode(self, p: Protected) -> list[int]:
        """Source ids of the model text, EOS included."""
        return self.tok.encode(p.model_text) + [self.tok.eos_id]

    def partial(self, p: Protected, tokens: list[int]) -> Optional[str]:
        """The text of a sentence still being decoded (its tokens so far), or None when it has inner
        spans (their places are known only from the finished hypothesis's attention)."""
        return None if p.spans else p.prefix + apply_style(p.style, self.tok.decode(tokens))

    def restore(self, p: Protected, src_ids: list[int], tokens: list[int], cross: Optional[torch.Tensor]) -> str:
        """The translation text of one hypothesis (``tokens``; ``cross`` its [L, H, T, S] cross-attention,
        or None) with the case style, edge spans and inner spans put back.

        Alignment: A = cross averaged over layers and heads, [T, S]. (1) Target positions holding a
        placeholder piece (the model copied it) are matched to the source placeholders of the same
        kind greedily by A (highest weight first); each copy takes one span and is replaced by it,
        and pieces glued to a copy ("▁5" "0" "8" for a "5") go with it. Extra copies (the model
        repeated it) are dropped, except as many as the source had the placeholder word itself
        ("Seattle" in the text besides a span): those are that word. A placeholder of a kind no span
        of the sentence has is an ordinary word. (2) A span whose placeholder the model
        left out goes next to the translation of its source neighbours (``_anchor``). (3) Without
        attention, or when the source does not hold one placeholder per span (the text itself had
        the placeholder word), copies are taken in order and the other spans go at the end, before
        the final punctuation. Spans never go inside a word or after the final punctuation.
        """
        if not p.spans:
            return p.prefix + apply_style(p.style, self.tok.decode(tokens)) + p.suffix
        allowed = [self.placeholder_ids[k] for k in p.kinds]
        used = frozenset().union(*allowed)   # a placeholder of a kind no span has is a word ("Seattle")
        src_pos = [i for i, t in enumerate(src_ids) if t in used]
        copies = [t for t, tid in enumerate(tokens) if tid in used]
        usable = cross is not None and cross.dim() == 4 and cross.shape[2] >= len(tokens) > 0 \
            and len(src_pos) == len(allowed) and all(src_ids[i] in a for i, a in zip(src_pos, allowed))
        att = cross.float().mean(dim=(0, 1))[:len(tokens)] if usable else None    # [T, S]
        at_copy: dict[int, int] = {}      # target position of a copy -> span index
        pairs = [(float(att[t, src_pos[j]]) if att is not None else -t - j, t, j)
                 for t in copies for j in range(len(p.spans)) if tokens[t] in allowed[j]]
        for _, t, j in sorted(pairs, reverse=True):     # without attention: in order
            if t not in at_copy and j not in at_copy.values():
                at_copy[t] = j
        # The source's own words spelled like a placeholder (src_pos beyond the spans): as many
        # unmatched copies, first first, are those words and stay; the others are repeats, dropped.
        spare = set([t for t in copies if t not in at_copy][:max(0, len(src_pos) - len(p.spans))])
        copies = [t for t in copies if t not in spare]
        final = len(tokens)               # the final punctuation's position, spans go before it
        if tokens and not any(c.isalnum() for c in self.tok.pieces(tokens[-1:])[0]):
            final -= 1
        before: dict[int, list[int]] = {}  # target position -> spans inserted before it
        for j in range(len(p.spans)):
            if j in at_copy.values():
                continue
            t = self._anchor(att, src_ids, src_pos[j], tokens, copies) if att is not None else None
            before.setdefault(final if t is None else min(t, final), []).append(j)
        return p.prefix + self._assemble(p, tokens, at_copy, before, copies) + p.suffix

    def _anchor(self, att: torch.Tensor, src_ids: list[int], pos: int, tokens: list[int],
                copies: list[int]) -> Optional[int]:
        """Where a dropped placeholder's span goes: the target position to insert before, or None.

        A placeholder the model left out draws attention from many target rows, so its own column
        is no guide; its source neighbours are: after the target word that attends most to the
        source piece before the placeholder, else before the one that attends most to the piece
        after it (other placeholders, punctuation and EOS are skipped as neighbours).
        """
        pieces, src = self.tok.pieces(tokens), self.tok.pieces(src_ids)
        word = [i for i, sp in enumerate(src) if any(c.isalnum() for c in sp) and src_ids[i] not in self._ph
                and i != len(src_ids) - 1]
        rows = [t for t in range(len(tokens)) if t not in copies]
        if not rows:
            return None
        left = [i for i in word if i < pos]
        if left:
            t = max(rows, key=lambda r: float(att[r, left[-1]])) + 1
            while t < len(tokens) and _continues(pieces[t]):    # to the end of that target word
                t += 1
            return t
        right = [i for i in word if i > pos]
        if right:
            t = max(rows, key=lambda r: float(att[r, right[0]]))
            while t > 0 and _continues(pieces[t]):              # to the start of that target word
                t -= 1
            return t
        return None

    def _assemble(self, p: Protected, tokens: list[int], at_copy: dict[int, int], before: dict[int, list[int]],
                  copies: list[int]) -> str:
        """Decode ``tokens`` in chunks between span positions; spans verbatim, chunks in the case style.
        A chunk or copied placeholder whose first piece starts a word ("▁") keeps the space before it,
        except next to a span that was glued to a word on that side in the source ("<schnell>")."""
        pieces = self.tok.pieces(tokens)
        out: list[str] = []
        chunk: list[int] = []
        glue = [False]                    # whether the last span was glued to the word after it

        def flush():
            if chunk:
                text = apply_style(p.style, self.tok.decode(chunk))
                text = text.lstrip() if glue[0] else text
                spaced = out and text and not text[0].isspace() and self.tok.pieces(chunk[:1])[0].startswith("▁")
                out.append((" " if spaced and not glue[0] else "") + text)
                chunk.clear()
                glue[0] = False

        def span(j: int, spaced: bool):
            flush()
            glued = p.glued[j] if j < len(p.glued) else (False, False)
            out.append((" " if out and spaced and not (glued[0] or glue[0]) else "") + p.spans[j])
            glue[0] = glued[1]

        after_copy = False                # inside the word a copied placeholder starts
        for t in range(len(tokens) + 1):
            for j in before.get(t, []):
                span(j, True)
            if t == len(tokens):
                break
            if t in at_copy:
                span(at_copy[t], pieces[t].startswith("▁"))
            elif not (t in copies or (after_copy and _continues(pieces[t]))):
                chunk.append(tokens[t])     # (extra copies of a placeholder, and the pieces glued to a
                after_copy = False          # copy, "▁5" "0" "8" after a "5", are dropped)
                continue
            after_copy = True
        flush()
        return "".join(out)


def _continues(piece: str) -> bool:
    """Whether a target piece continues the word before it (no word-boundary mark, letters or digits)."""
    return not piece.startswith("▁") and any(c.isalnum() for c in piece)


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


def _without(text: str, words: set[str]) -> str:
    for w in words:
        text = re.sub(rf"\b{re.escape(w)}\b", " ", text)
    return text
