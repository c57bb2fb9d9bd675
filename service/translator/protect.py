"""Protected spans: what the model cannot translate, or must not, comes back verbatim, where it belongs.

A sentence's control and format characters (zero-width space, direction marks, soft hyphen; at its
edges they stay in the glue, see ``text.is_glue``) are left out of the model's input and not put
back: they mark places in the source words (a hyphenation point, a word break) that the translation
does not have; inside a protected span they stay, verbatim with it (an emoji's joiners).
A sentence's spans the model cannot know (``find_spans``: URLs, e-mail addresses, numbers with
their separators and units, code-like tokens, HTML entities, terminal escape sequences, runs of characters outside the model's
alphabet such as emoji, U+FFFD or private-use characters), and the occurrences of do-not-translate
terms (``Terms``: a request's ``keep`` and the server's stored list), are kept out of its input.
Spans are found on the sentence as sent, in any case ("HTTPS://EXAMPLE.COM" is a URL), before
anything is recased. A span at the edge of the sentence (after its final punctuation, or symbols
before its first word) is cut off and put back at the same edge. Every other span is replaced by a
placeholder of one vocabulary piece (``PLACEHOLDERS``: a number for spans that start with a digit, a
name for the rest), chosen per sentence so that it cannot collide with the sentence's own words: the
first candidate of its kind that the text outside the spans does not contain, ignoring case (not as
a word, nor inside one). The model copies a placeholder through or leaves it out; afterwards each
span goes back where its placeholder landed, found with the decoder's cross-attention
(``restore``). The sentence may also be recased for the model (``truecase.py``; the placeholders are
left as they are); the translation then gets the input's case style back.

The model's "alphabet" is read from its tokenizer, not from a list: a character is known when it
encodes to ordinary vocabulary pieces, and unknown when it needs byte-fallback pieces (``<0xF0>``)
or ``<unk>``. Letters that NFKC-normalise to known ones (full-width letters, ligatures such as
"ﬁ") are known; other characters that NFKC changes ("™" -> "TM", "½") are not, so they stay verbatim.

Invariant: the text a sentence comes back as contains every protected span verbatim, once each;
``tokens``/``source_tokens``/``attention`` are what the model saw and produced (the placeholder piece
in place of each inner span; edge spans absent).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import torch

from service.protocol import MAX_KEEP_CHARS

from .align import mean_attention, word_attention, words
from .text import ESCAPE, Split, is_glue
from .truecase import Truecaser, apply_style

# The placeholder candidates of each kind, best first, one vocabulary piece each (a candidate that is
# not one piece in a model's vocabulary is skipped): a number stands in for a span that starts with
# a digit (so "5 Kinder", "Nummer 5" stay grammatical and the model copies it), a name spelled the
# same in German and English captions of the training text for every other span (the model treats
# it as a name: copies it or leaves it out, and translates the rest as it would without it). A
# sentence uses the first candidate of a kind that its text outside the spans does not contain
# (``Protector.placeholder``). The first ones were chosen by measurement, see docs/text.md.
PLACEHOLDERS = {"number": ("5", "3", "4", "6", "9", "2"),
                "other": ("Seattle", "Miami", "Atlanta", "Hawaii", "Vegas", "Texas", "London", "Berlin")}

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
_ENTITY = r"&(?:#[0-9]+|#[xX][0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]{1,31});"    # "&nbsp;", "&#0;", "&unknown;"

# A unit glued to a number's symbol ("25°C", "30 °F", "5 €/kg"): letters after the symbol.
_UNIT = re.compile(r"/?[^\W\d_]{1,3}(?!\w)")
SPAN_PATTERNS = {"escape": ESCAPE, "url": _URL, "email": _EMAIL, "code": _CODE, "entity": _ENTITY, "number": _NUMBER}
_TRAILING = ".,;:!?)]}\"'»”’"   # taken off the end of a URL unless the URL opened the bracket
_FINAL = ".!?…:;\"'»”’)]"       # what ends a sentence before a trailing span


@dataclass
class Span:
    start: int    # character offsets in the sentence
    end: int
    kind: str     # escape, url, email, code, entity, number, symbol, word (with a letter the model lacks), keep (a term)

    def merge(self, other: "Span") -> "Span":
        return Span(self.start, max(self.end, other.end), self.kind if self.kind == other.kind else "mixed")


@dataclass
class Protected:
    """One sentence as prepared for the model."""
    source: str                  # the sentence as sent
    model_text: str              # what the model translates (placeholders, recased)
    spans: list[str] = field(default_factory=list)   # inner spans, source order; one placeholder each
    kinds: list[str] = field(default_factory=list)   # each span's placeholder kind: "number" or "other"
    prefix: str = ""             # edge spans (and the whitespace after them) before the translation
    suffix: str = ""             # edge spans (and the whitespace before them) after it
    style: Optional[str] = None  # case style of the source: "upper", "title" or None
    needs_model: bool = True     # whether a letter is left for the model besides the placeholders
    glued: list[tuple[bool, bool]] = field(default_factory=list)  # each span: a letter or digit right before, after
    placeholders: list[str] = field(default_factory=list)   # each span's placeholder word ("5", "Seattle")


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


class Protector:
    """Finds spans, builds model inputs and restores translations for one tokenizer.

    ``protect`` / ``recase`` turn span protection and truecasing off (the translation is then the
    model's output for the sentence as sent, as before). Protection needs a placeholder of one
    vocabulary piece for each kind; with a tokenizer that has none for a kind it is off.
    """

    def __init__(self, tok, truecaser: Optional[Truecaser] = None, protect: bool = True, recase: bool = True):
        self.tok = tok
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
        self.protect = protect and all(self.candidates.values())
        # The first choice of each kind (what a sentence without those words gets).
        self.placeholders = {k: ws[0] for k, ws in self.candidates.items() if ws}
        self.placeholder_ids = {k: self.word_ids[w] for k, w in self.placeholders.items()}
        self._ph = frozenset().union(*self.word_ids.values())
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

    def find_spans(self, text: str, merge: bool = True, keep: Optional[Terms] = None) -> list[Span]:
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
        if not self.protect or len(split.pieces) < 2:
            return split
        spans = [s for s in self.find_spans(split.join(split.pieces), merge=False, keep=keep)
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

    def placeholder(self, kind: str, text: str) -> str:
        """The placeholder of ``kind`` for a sentence whose text outside its spans is ``text``: the
        first candidate that text does not contain, ignoring case (so it is neither one of the
        sentence's words nor a piece of one, whatever the recasing does); the first candidate when
        the text holds them all (``restore`` then tells them apart as well as it can)."""
        low = text.casefold()
        words = self.candidates[kind]
        return next((w for w in words if w.casefold() not in low), words[0])

    def prepare(self, sentence: str, keep: Optional[Terms] = None) -> Protected:
        """The model's input for one sentence (see the module docstring); ``keep``: do-not-translate
        terms. The sentence is composed first (NFC: "a" + U+0301 is "á", as the tokenizer would see
        it), so spans are found in the text the model gets, and come back composed. Spans are found
        on the sentence as sent; recasing (``truecase.py``) changes only the text between them."""
        if not unicodedata.is_normalized("NFC", sentence):
            sentence = unicodedata.normalize("NFC", sentence)
        spans = self.find_spans(sentence, keep=keep) if self.protect else []
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
        text = "".join(parts)
        style = None
        if self.truecaser is not None:
            style = self.truecaser.style(bare)
            text = self.truecaser.recase(text, style, fixed)
        glued = [(sentence[s.start - 1:s.start].isalnum(), sentence[s.end:s.end + 1].isalnum()) for s in spans]
        return Protected(sentence, text, [sentence[s.start:s.end] for s in spans], kinds, prefix, suffix, style,
                         any(c.isalpha() for c in bare), glued, words)

    def encode(self, p: Protected) -> list[int]:
        """Source ids of the model text, EOS included."""
        return self.tok.encode(p.model_text) + [self.tok.eos_id]

    def partial(self, p: Protected, tokens: list[int]) -> Optional[str]:
        """The text of a sentence still being decoded (its tokens so far), or None when it has inner
        spans (their places are known only from the finished hypothesis's attention)."""
        return None if p.spans else p.prefix + apply_style(p.style, self.tok.decode(tokens))

    def restore(self, p: Protected, src_ids: list[int], tokens: list[int], cross: Optional[torch.Tensor]) -> str:
        """The translation text of one hypothesis (``tokens``; ``cross`` its [L, H, T, S] cross-attention,
        or None) with the case style, edge spans and inner spans put back: every span once.

        Alignment (``align.py``): A = cross averaged over layers and heads, [T, S]. (1) Target positions holding a
        sentence's placeholder piece (the model copied it) are copies: each goes to the span whose
        source placeholder it attends to most (among the spans with its word), the copies with the
        highest weight first; a copy takes one span and is replaced by it, and pieces glued to a
        copy ("▁5" "0" "8" for a "5") go with it. A copy whose span another copy took is a repeat
        and is dropped. A placeholder word the sentence does not use as one ("Seattle" in a
        sentence whose placeholder is "Miami") is an ordinary word. (2) A span no copy took (the
        model left its placeholder out) goes where the alignment puts its source position
        (``_place``). (3) Without attention, or when the source does not hold exactly one
        placeholder per span (the text had every candidate word itself), copies are taken in
        order, as many unmatched copies as the source had extra placeholder words stay as words,
        and the other spans go at the end, before the final punctuation. Spans never go inside a
        word or after the final punctuation.
        """
        if not p.spans:
            return p.prefix + apply_style(p.style, self.tok.decode(tokens)) + p.suffix
        words = p.placeholders or [self.placeholders[k] for k in p.kinds]
        allowed = [self.word_ids[w] for w in words]
        used = frozenset().union(*allowed)   # a placeholder word the sentence does not use is a word
        src_pos = [i for i, t in enumerate(src_ids) if t in used]
        copies = [t for t, tid in enumerate(tokens) if tid in used]
        usable = cross is not None and cross.dim() == 4 and cross.shape[2] >= len(tokens) > 0 \
            and cross.shape[3] >= len(src_ids) and len(src_pos) == len(allowed) \
            and all(src_ids[i] in a for i, a in zip(src_pos, allowed))
        att = mean_attention(cross, len(tokens)) if usable else None    # [T, S] (align.py)
        at_copy: dict[int, int] = {}      # target position of a copy -> span index
        if att is not None:               # each copy bids for the span it attends to most
            bids = []
            for t in copies:
                j = max((j for j in range(len(p.spans)) if tokens[t] in allowed[j]),
                        key=lambda j: float(att[t, src_pos[j]]))
                bids.append((float(att[t, src_pos[j]]), -t, j))
            for _, t, j in sorted(bids, reverse=True):
                if j not in at_copy.values():
                    at_copy[-t] = j
        else:                             # in order
            for t in copies:
                j = next((j for j in range(len(p.spans)) if tokens[t] in allowed[j] and j not in at_copy.values()),
                         None)
                if j is not None:
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
            t = self._place(att, src_ids, src_pos, src_pos[j], tokens, copies) if att is not None else None
            before.setdefault(final if t is None else min(t, final), []).append(j)
        return p.prefix + self._assemble(p, tokens, at_copy, before, copies) + p.suffix

    def _place(self, att: torch.Tensor, src_ids: list[int], placeholders: list[int], pos: int, tokens: list[int],
               copies: list[int]) -> Optional[int]:
        """Where the span of a placeholder the model left out (at source position ``pos``) goes: the
        target position to insert it before (a word's start, or the end), or None when nothing aligns.

        Words, not pieces, are aligned: a source word is a piece starting with "▁" and the pieces
        after it (placeholders, EOS, a ``>>xx<<`` token and words without a letter or digit left out);
        a target word likewise (copies, the pieces glued to them and punctuation left out). W[t, s] =
        A summed over the pieces of source word s, averaged over those of target word t. A source
        word is anchored to a target word when each is the other's best match in W (an article that
        attends to its noun is not an anchor; the noun is). The span goes after the translation of
        the nearest anchored source word before the placeholder, or before that of the nearest one
        after it, whichever is nearer in the source: "eine weiße 5 Kappe" -> "a white [5] cap". At
        the same distance, the one before wins, unless the two cross (the one before is translated
        after the one after: one of them is wrong); then the side with fewer target words on the
        wrong side of it (a word whose best source word follows the placeholder written before the
        span, or one whose best source word precedes it written after). The placeholder's own column
        is not used: a placeholder the model left out draws attention from many target words.
        """
        src, tgt = self.tok.pieces(src_ids), self.tok.pieces(tokens)
        ph = set(placeholders)
        skip_src = {i for i, piece in enumerate(src) if i in ph or i == len(src) - 1 or not _wordlike(piece)
                    or (piece.startswith(">>") and piece.endswith("<<"))}
        skip_tgt = set()
        for c in copies:                  # a copy and the pieces glued to it
            skip_tgt.add(c)
            k = c + 1
            while k < len(tokens) and _continues(tgt[k]):
                skip_tgt.add(k)
                k += 1
        skip_tgt |= {t for t, piece in enumerate(tgt) if not _wordlike(piece)}
        src_words, tgt_words = words(src), words(tgt)
        s_keep = [w for w in src_words if any(i not in skip_src for i in w)]
        t_keep = [w for w in tgt_words if any(t not in skip_tgt for t in w) and not any(t in copies for t in w)]
        if not s_keep or not t_keep:
            return None
        W = word_attention(att, s_keep, t_keep, skip_src, skip_tgt)   # [Tw, Sw] (align.py)
        best_src, best_tgt = W.argmax(1).tolist(), W.argmax(0).tolist()
        here = next(k for k, w in enumerate(src_words) if pos in w)      # the placeholder's word
        index = {w[0]: k for k, w in enumerate(src_words)}
        left = right = None               # (distance in source words, target word)
        for k, w in enumerate(s_keep):
            t = best_tgt[k]
            if best_src[t] != k:
                continue
            d = index[w[0]] - here
            if d < 0 and (left is None or -d < left[0]):
                left = (-d, t)
            elif d > 0 and (right is None or d < right[0]):
                right = (d, t)
        after = before = None
        if left is not None:              # after the last piece of that word that has a letter or digit
            after = max(t for t in t_keep[left[1]] if _wordlike(tgt[t])) + 1
        if right is not None:
            before = t_keep[right[1]][0]
        if after is not None and before is not None and after > before and left[0] == right[0]:
            follows = [index[s_keep[k][0]] > here for k in best_src]     # each target word's best source word
            starts = [w[0] for w in t_keep]
            return min((before, after), key=lambda g: sum((a < g) == f for a, f in zip(starts, follows)))
        if after is not None and (before is None or left[0] <= right[0]):
            return after
        return before

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
            spaced = spaced and out and not (glued[0] or glue[0] or out[-1][-1:].isspace())   # one space, not two
            out.append((" " if spaced else "") + p.spans[j])
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


def _wordlike(piece: str) -> bool:
    """Whether a piece has a letter or digit."""
    return any(c.isalnum() for c in piece)


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
