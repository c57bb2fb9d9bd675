"""Glossaries (terminology): which target terms a sentence's translation must contain.

A glossary is a list of entries (source term, target term). A source term occurs in a sentence when
its words, in order, match consecutive words of the sentence (words: runs of letters and digits,
``\\w+``; what lies between them is not compared), each word matching when both have the same
Snowball stem after case folding (``snowballstemmer``, the Snowball project's own Python port, for
the model's source language): "Vertrag" matches "Verträge", "vertrages", "VERTRAG"; "Hund" matches
"Hunde" and "Hunden". For a language without a Snowball stemmer the case-folded words must be
equal. Words inside the sentence's protected spans (URLs, e-mail addresses, numbers, code, do-not-
translate terms and the rest of ``spans.py``) are never matched: a span comes back verbatim, and
no term is forced in for it. One exception: a span that is a word the model cannot read (letters
outside its alphabet, "Männer" for an English-French model) and is exactly one occurrence of a term
goes back as that term's target instead (``put_back``; the text a pivot's first leg keeps).

Each occurrence's target term becomes a decoding constraint (its SentencePiece ids as the tokenizer
writes the term alone, so it starts a word), enforced by lexically constrained beam search
(``model/inference/constraints.py``): a term whose source occurs twice is written twice, before
the sentence's final punctuation (``sentence_ends``), and never forced more often than its source
occurs (an occurrence inside another term's counts: "two bikes" holds "two").

Overlapping occurrences: the one with more words wins, then the one that starts first, then the
entry listed first; the others are dropped.

Rejected (``InvalidRequest``, 422, naming ``<field>[i].source`` or ``.target``): an empty or
whitespace-only term, a source term without a letter or digit, a term over MAX_GLOSSARY_TERM_CHARS
characters, more entries than the limit, a target term longer than the model's max_len in tokens,
and conflicting entries: two entries whose source terms match the same words (equal stems) with
different target terms. Repeated identical entries are one.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from service.protocol import MAX_GLOSSARY_TERM_CHARS, InvalidRequest

if TYPE_CHECKING:
    from .protect import Protected

_WORD = re.compile(r"\w+")
# What ends a sentence: a target piece of these only (and closing quotes or brackets after them).
_ENDS, _CLOSERS = ".!?…。！？؟", "\"'»”’)]"
# The model's source language (ISO 639-1) -> its Snowball stemmer.
SNOWBALL = {"ar": "arabic", "ca": "catalan", "cs": "czech", "da": "danish", "de": "german", "el": "greek",
            "en": "english", "es": "spanish", "eu": "basque", "fi": "finnish", "fr": "french", "hi": "hindi",
            "hu": "hungarian", "hy": "armenian", "id": "indonesian", "it": "italian", "lt": "lithuanian",
            "nl": "dutch", "no": "norwegian", "nb": "norwegian", "ne": "nepali", "pl": "polish",
            "pt": "portuguese", "ro": "romanian", "ru": "russian", "sr": "serbian", "sv": "swedish",
            "ta": "tamil", "tr": "turkish", "yi": "yiddish"}


@functools.lru_cache(maxsize=None)
def _stemmer(lang: Optional[str]):
    import snowballstemmer
    name = SNOWBALL.get((lang or "").split("-")[0].lower())
    return snowballstemmer.stemmer(name) if name else None


def stems(text: str, lang: Optional[str]) -> list[tuple[str, int, int]]:
    """(stem, start, end) of each word of ``text`` (NFC, case-folded, Snowball-stemmed for ``lang``)."""
    stemmer = _stemmer(lang)
    text = unicodedata.normalize("NFC", text)
    out = []
    for m in _WORD.finditer(text):
        w = m.group().casefold()
        out.append((stemmer.stemWord(w) if stemmer else w, m.start(), m.end()))
    return out


def check_entries(entries: Sequence[tuple[str, str]], field: str, limit: int) -> None:
    """The language-independent rules on glossary entries (count, empty, length).
    Raises InvalidRequest naming ``field[i].source`` / ``.target`` and the limit."""
    if len(entries) > limit:
        raise InvalidRequest(f"{field}: at most {limit} entries, got {len(entries)}", field)
    for i, (src, tgt) in enumerate(entries):
        for side, term in (("source", src), ("target", tgt)):
            where = f"{field}[{i}].{side}"
            if not isinstance(term, str) or not term.strip():
                raise InvalidRequest(f"{where}: must be a non-empty term, got {term!r}", where)
            if len(term) > MAX_GLOSSARY_TERM_CHARS:
                raise InvalidRequest(f"{where}: at most {MAX_GLOSSARY_TERM_CHARS} characters, got {len(term)}",
                                     where)
        if not _WORD.search(src):
            raise InvalidRequest(f"{field}[{i}].source: needs a letter or digit to be matched, got {src!r}",
                                 f"{field}[{i}].source")


@dataclass(frozen=True)
class Match:
    entry: int        # index of the entry in the glossary
    start: int        # character offsets in the sentence
    end: int
    words: int        # words matched


class Glossary:
    """Entries compiled for one source language and tokenizer (see the module docstring).

    Args:
        entries: (source term, target term) pairs.
        lang: the source language (Snowball stemmer); tok: the target tokenizer (``encode``; None:
        check the entries only, without target ids);
        max_tokens: the longest target term in tokens (the model's max_len - 1); field: the request
        field named in errors; limit: the most entries allowed.
    Raises InvalidRequest as the module docstring says.
    """

    def __init__(self, entries: Iterable[tuple[str, str]], lang: Optional[str], tok, max_tokens: int,
                 field: str = "glossary", limit: int = 10_000):
        entries = self.normalized(entries)
        check_entries(entries, field, limit)
        self.lang, self.field, self.tok = lang, field, tok
        self.entries: list[tuple[str, str]] = []
        self.keys: list[tuple[str, ...]] = []            # each entry's source stems
        self.ids: list[tuple[int, ...]] = []             # each entry's target token ids
        seen: dict[tuple[str, ...], int] = {}            # stems -> the entry (index in the request)
        by_first: dict[str, list[int]] = {}              # first stem -> compiled entries starting with it
        for i, (src, tgt) in enumerate(entries):
            key = tuple(s for s, _, _ in stems(src, lang))
            if key in seen:
                j = seen[key]
                if entries[j][1] != tgt:
                    raise InvalidRequest(f"{field}[{i}].source: {src!r} conflicts with {field}[{j}] "
                                         f"({entries[j][0]!r} -> {entries[j][1]!r}): one source term, two targets "
                                         f"({tgt!r})", f"{field}[{i}].source")
                continue
            ids = tuple(tok.encode(tgt)) if tok is not None else (0,)
            if not ids or (tok is not None and len(ids) > max_tokens):
                raise InvalidRequest(f"{field}[{i}].target: at most {max_tokens} tokens (the model's max_len), "
                                     f"got {len(ids)}", f"{field}[{i}].target")
            seen[key] = i
            by_first.setdefault(key[0], []).append(len(self.entries))
            self.entries.append((src, tgt))
            self.keys.append(key)
            self.ids.append(ids)
        self._by_first = by_first

    @staticmethod
    def normalized(entries: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Entries as they are matched: composed (NFC), without surrounding whitespace."""
        return [(unicodedata.normalize("NFC", s).strip() if isinstance(s, str) else s,
                 unicodedata.normalize("NFC", t).strip() if isinstance(t, str) else t) for s, t in entries]

    def __len__(self) -> int:
        return len(self.entries)

    @functools.cached_property
    def ends(self) -> tuple[int, ...]:
        """The target ids that end a sentence (``sentence_ends``): terms go before them."""
        return sentence_ends(self.tok) if self.tok is not None else ()

    def find(self, sentence: str, skip: Sequence[tuple[int, int]] = ()) -> list[Match]:
        """The occurrences of the glossary's source terms in ``sentence``, overlaps resolved
        (module docstring), in sentence order; ``skip``: (start, end) of the sentence's protected
        spans, where nothing is matched."""
        words = stems(sentence, self.lang)
        found = []
        for p, (stem, _, _) in enumerate(words):
            for e in self._by_first.get(stem, ()):
                key = self.keys[e]
                if tuple(s for s, _, _ in words[p:p + len(key)]) == key:
                    start, end = words[p][1], words[p + len(key) - 1][2]
                    if not any(a < end and start < b for a, b in skip):
                        found.append(Match(e, start, end, len(key)))
        found.sort(key=lambda m: (-m.words, m.start, m.entry))
        kept: list[Match] = []
        for m in found:
            if all(m.end <= k.start or m.start >= k.end for k in kept):
                kept.append(m)
        return sorted(kept, key=lambda m: m.start)

    def terms(self, sentence: str, skip: Sequence[tuple[int, int]] = ()) -> tuple[tuple[int, ...], ...]:
        """The decoding constraints of ``sentence``: the target ids of every occurrence (``find``), in
        sentence order; a term that occurs twice is there twice."""
        return tuple(self.ids[m.entry] for m in self.find(sentence, skip))

    def put_back(self, p: "Protected") -> "Protected":
        """``p`` with each inner span that is a word the model cannot read (kind "word", ``spans.py``)
        and exactly one occurrence of a term put back as that term's target instead of verbatim."""
        if not any(kind == "word" for _, _, kind in p.at):
            return p
        targets = {(m.start, m.end): self.entries[m.entry][1] for m in self.find(p.source)}
        spans = [targets.get((a, b), span) if kind == "word" else span for span, (a, b, kind) in zip(p.spans, p.at)]
        return p if spans == p.spans else dataclasses.replace(p, spans=spans)

    def constraints(self, sentence: str, skip: Sequence[tuple[int, int]] = ()) -> tuple[tuple[int, ...], ...]:
        """The target terms that occur in ``sentence`` (as ids), each once, in sentence order."""
        return tuple(dict.fromkeys(self.terms(sentence, skip)))


@functools.lru_cache(maxsize=8)
def sentence_ends(tok) -> tuple[int, ...]:
    """The ids of ``tok``'s pieces that end a sentence: final punctuation (".", "?!", "…", "。"), with
    or without a word boundary before it and closing quotes or brackets after it (".\"")."""
    pieces = tok.pieces(range(tok.vocab_size))
    return tuple(i for i, p in enumerate(pieces)
                 if (t := p.lstrip("\u2581")) and t[0] in _ENDS and not t.strip(_ENDS + _CLOSERS))
