"""Fuzzy matches from the translation memory: a sentence the memory does not hold word for word
takes the stored translation of its most similar stored source when that one scores at least the
job's ``memory_threshold`` (0-100; DeepL's ``translation_memory_threshold``).

The score is rapidfuzz's ``fuzz.ratio`` (https://rapidfuzz.github.io/RapidFuzz/Usage/fuzz.html):
100 x (1 - Indel distance / (len(a) + len(b))) on the memory's normalized texts (``memory.normalize``),
case-sensitive; 100 only for equal texts.

``FuzzyIndex`` answers a lookup over one memory (a model and scope of the store) without scoring every
stored source:

    candidates   the sources sharing with the query a word (lower-cased ``\\w+`` run) that at most
                 COMMON of them hold (no such word: those sharing any word), whose length allows the
                 threshold (fuzz.ratio <= 200 min(la, lb) / (la + lb))
    ranking      the ratio the shared words promise, 2 x (their characters + 1 each) / (la + lb):
                 the best CANDIDATES go on
    scoring      ``rapidfuzz.process.extractOne`` over those, score_cutoff = the threshold

Invariant: a match is a stored source with its exact fuzz.ratio, at or above the threshold. The best
source is missed only when it shares no word with the query or ranks below CANDIDATES others on
shared words; ``python -m service.bench.fuzzy_memory`` counts how often against a full scan. A
memory of at most FULL_SCAN sources is scored whole (exact).

``FuzzyMemory`` keeps the indexes of one ``MemoryStore`` (the MAX_INDEXES last used), each rebuilt
when the store's generation of its model and scope changed (any write, by any process).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from rapidfuzz import fuzz, process

from service.protocol import Translation, Unavailable

from .memory import MemoryStore, Recalled, normalize
from .text import Piece

DEEPL_DEFAULT_THRESHOLD = 75    # DeepL's translation_memory_threshold when absent ("matches at least 75%")
FULL_SCAN = 1_000               # memories of at most this many sources are scored whole
CANDIDATES = 128                # sources scored per lookup in a larger memory
COMMON = 0.05                   # a word held by more than this share of the sources only ranks candidates
MAX_INDEXES = 8                 # indexes kept per store (least recently used dropped)
_TOKENS = re.compile(r"\w+|\n")     # words; "\n" separates sources (normalized sources have none)
_WORDS = re.compile(r"\w+")
logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Match:
    source: str         # the stored (normalized) source
    target: str         # its stored translation
    score: float        # fuzz.ratio of the query and source, 0-100


class FuzzyIndex:
    """An inverted index of one memory's sources by word, for ``best``."""

    def __init__(self, sources: Sequence[str], targets: Sequence[str]):
        self.sources, self.targets = list(sources), list(targets)
        n = len(self.sources)
        self.lengths = np.fromiter(map(len, self.sources), np.int64, n)
        self.vocab: dict[str, int] = {}
        if n <= FULL_SCAN:
            return
        tokens = _TOKENS.findall("\n".join(self.sources).lower())
        self.vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
        ids = np.fromiter(map(self.vocab.__getitem__, tokens), np.int64, len(tokens))
        size = len(self.vocab)                          # word ids are below it (the separator's too)
        newline = self.vocab.pop("\n", -1)
        breaks = ids == newline
        doc = np.cumsum(breaks) - breaks                # the source each token is in
        keys = ids[~breaks] * n + doc[~breaks]
        keys.sort()
        keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]   # (word, source) once each, by word then source
        words, self.postings = keys // n, (keys % n).astype(np.int32)
        self.indptr = np.searchsorted(words, np.arange(size + 1))   # word w: postings[indptr[w]:indptr[w+1]]
        self.df = np.diff(self.indptr)
        self.chars = np.zeros(size, np.float64)     # a word's characters and its space
        for w, i in self.vocab.items():
            self.chars[i] = len(w) + 1
        self.common = max(1, int(COMMON * n))
        # [n] per common word: whether each source holds it (at most 1 / COMMON x words per source rows)
        self.holds = {int(w): np.zeros(n, bool) for w in np.flatnonzero(self.df > self.common)}
        for w, row in self.holds.items():
            row[self.postings[self.indptr[w]:self.indptr[w + 1]]] = True

    def __len__(self) -> int:
        return len(self.sources)

    def best(self, query: str, threshold: float) -> Optional[Match]:
        """The stored source most similar to ``query`` (normalized) scoring at least ``threshold``, or None."""
        if not self.sources:
            return None
        idx = self.candidates(query, threshold) if self.vocab else None
        choices = self.sources if idx is None else [self.sources[i] for i in idx]
        hit = process.extractOne(query, choices, scorer=fuzz.ratio, score_cutoff=threshold)
        if hit is None:
            return None
        i = hit[2] if idx is None else int(idx[hit[2]])
        return Match(self.sources[i], self.targets[i], float(hit[1]))

    def candidates(self, query: str, threshold: float) -> np.ndarray:
        """The sources worth scoring for ``query`` (module docstring), ascending."""
        words = np.fromiter({self.vocab[w] for w in _WORDS.findall(query.lower()) if w in self.vocab}, np.int64)
        if not len(words):
            return words
        rare = self.df[words] <= self.common
        first = words[rare] if rare.any() else words        # the words that make a source a candidate
        shared = np.bincount(np.concatenate([self.postings[self.indptr[w]:self.indptr[w + 1]] for w in first]),
                             weights=np.repeat(self.chars[first], self.df[first]), minlength=len(self.sources))
        idx = np.nonzero(shared > 0)[0]     # [n] shared: characters of those words each source holds
        lq, lens, t = len(query), self.lengths[idx], threshold - 1e-6
        idx = idx[(lens * (200 - t) >= lq * t) & (lq * (200 - t) >= lens * t)]
        if len(idx) <= CANDIDATES:
            return idx
        promise = shared[idx]
        if rare.any():                      # the common words' characters, for the candidates only
            for w in words[~rare]:
                promise = promise + self.chars[w] * self.holds[int(w)][idx]
        promise = promise / (lq + self.lengths[idx])
        return np.sort(idx[np.argpartition(promise, -CANDIDATES)[-CANDIDATES:]])


class FuzzyMemory:
    """The fuzzy indexes of one store's memories, built on first use and after every change."""

    def __init__(self, store: MemoryStore, max_indexes: int = MAX_INDEXES):
        self.store, self.max_indexes = store, max_indexes
        self._indexes: collections.OrderedDict[tuple[str, str], tuple[int, FuzzyIndex]] = collections.OrderedDict()
        self._build = threading.Lock()      # one build at a time
        self._warned = False                # an unusable file is logged once

    def index(self, model: str, scope: str) -> FuzzyIndex:
        """The index of ``model`` and ``scope``, built first when missing or older than the store's entries."""
        key, generation = (model, scope), self.store.generation(model, scope)
        held = self._indexes.get(key)
        if held is None or held[0] != generation:
            with self._build:
                held = self._indexes.get(key)
                if held is None or held[0] != generation:     # read after the generation: never older than it
                    pairs = self.store.export(model, scope)
                    held = (generation, FuzzyIndex([s for s, _ in pairs], [t for _, t in pairs]))
                    self._indexes[key] = held
                    while len(self._indexes) > self.max_indexes:
                        self._indexes.popitem(last=False)
        with contextlib.suppress(KeyError):     # another thread may have dropped it meanwhile
            self._indexes.move_to_end(key)
        return held[1]

    async def refresh(self, model: str, scope: str) -> None:
        """``index`` in a worker thread, so that a build (about a second per 100,000 sources) does
        not hold up the event loop; the lookups of the request that follows find it built."""
        try:
            held = self._indexes.get((model, scope))
            if held is None or held[0] != self.store.generation(model, scope):
                await asyncio.to_thread(self.index, model, scope)
        except Unavailable:     # the file cannot be read: complete finds nothing (logged there)
            pass

    def complete(self, recalled: Recalled, model: str, scope: str, sentences: Sequence[str],
                 threshold: float) -> Recalled:
        """``recalled`` with the best fuzzy match at or above ``threshold`` of each sentence it has no
        exact entry for (stored, with its score); unchanged when the whole text was found or
        ``threshold`` is 100 (only equal texts score 100)."""
        if recalled.whole is not None or threshold >= 100:
            return recalled
        todo = {normalize(s) for s in sentences} - recalled.stored.keys() - {""}
        if not todo:
            return recalled
        try:
            index = self.index(model, scope)
        except Unavailable as e:        # as MemoryStore.lookup: translation goes on without the memory
            if not self._warned:
                self._warned = True
                logger.warning("%s; no fuzzy matches", e)
            return recalled
        for source in todo:
            match = index.best(source, threshold)
            if match is not None:
                recalled.stored[source], recalled.scores[source] = match.target, match.score
        return recalled


def report(translations: list[Translation], pieces: Sequence[Piece]) -> None:
    """Mark each translation with where it came from (``origin``: memory when the memory answered
    every sentence, engine when none, mixed otherwise) and ``memory_score``, the lowest match score
    of the sentences the memory answered; a text with nothing to translate gets neither."""
    by_text: dict[int, list[Piece]] = collections.defaultdict(list)
    for p in pieces:
        by_text[p.text_index].append(p)
    for i, tr in enumerate(translations):
        ps = by_text.get(i)
        if not ps:
            continue
        scores = [100.0 if p.match is None else p.match for p in ps if p.stored is not None]
        tr.origin = "memory" if len(scores) == len(ps) else "mixed" if scores else "engine"
        tr.memory_score = round(min(scores), 2) if scores else None
