"""The translation memory: stored translations that replace the model's for identical source
sentences, and a bounded cache of the translations the model made.

    MemoryStore (SQLite file)   suggestions (LibreTranslate's /suggest) and imported pairs (PUT
                                /v1/memory), per model and scope (an API key's id; "" with keys off);
                                one file shared by every process of the node: a write is committed
                                before its route answers, and every translator reads the file on
                                each request, so the next request sees it whichever replica answers
    ResultCache (per process)   the engine's results by (source ids, options), least recently used
                                evicted past ``max_entries``; 0 = off (the default)

Lookup order per sentence (``Translator.prepare``, ``MemoryStore.recall``): the memory for the whole
text, then for each of its sentences; a hit is never sent to the model. Then the cache; then the engine. A key is the text
after ``normalize`` (the normalisation SentencePiece applies before the model: NFKC, whitespace runs
as one space, trimmed), so "Hallo  Welt. " and "Hallo Welt." are one entry.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import sqlite3
import threading
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Iterable, Optional, Sequence

from model.inference.search import Hypothesis
from service.engine import GenerationOptions, RequestStats, TranslationResult
from service.protocol import RETRY_AFTER_S, Unavailable
from service.state import private_dir, private_file

from .text import Piece, trim

logger = logging.getLogger("ray.serve")

MAX_MEMORY_CHARS = 5_000      # characters of one stored source or target (= MAX_TEXT_CHARS)
SQLITE_TIMEOUT_S = 5.0        # how long a reader or writer waits for the file's lock

_SCHEMA = """
CREATE TABLE IF NOT EXISTS memory (
    model TEXT NOT NULL, scope TEXT NOT NULL, source TEXT NOT NULL, target TEXT NOT NULL,
    origin TEXT NOT NULL, updated REAL NOT NULL, PRIMARY KEY (model, scope, source));
CREATE TABLE IF NOT EXISTS usage (scope TEXT PRIMARY KEY, characters INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS generation (
    model TEXT NOT NULL, scope TEXT NOT NULL, value INTEGER NOT NULL, PRIMARY KEY (model, scope));
CREATE TRIGGER IF NOT EXISTS memory_inserted AFTER INSERT ON memory BEGIN
    INSERT INTO generation VALUES (NEW.model, NEW.scope, 1)
    ON CONFLICT(model, scope) DO UPDATE SET value = value + 1; END;
CREATE TRIGGER IF NOT EXISTS memory_updated AFTER UPDATE ON memory BEGIN
    INSERT INTO generation VALUES (NEW.model, NEW.scope, 1)
    ON CONFLICT(model, scope) DO UPDATE SET value = value + 1; END;
CREATE TRIGGER IF NOT EXISTS memory_deleted AFTER DELETE ON memory BEGIN
    INSERT INTO generation VALUES (OLD.model, OLD.scope, 1)
    ON CONFLICT(model, scope) DO UPDATE SET value = value + 1; END;
"""


def normalize(text: str) -> str:
    """The memory's key of a text: NFKC, whitespace runs as one space, trimmed (``text.trim``)."""
    return " ".join(trim(unicodedata.normalize("NFKC", text)).split())


def memory_model(model: str, target_lang: Optional[str] = None) -> str:
    """The store's model key: the model id, with the target language for a multilingual model
    (``target_lang`` None for a model of one target)."""
    return model if not target_lang else f"{model}>>{target_lang}"


@dataclass
class Recalled:
    """What the translation memory holds for one text (``MemoryStore.recall``, fuzzy matches added by
    ``fuzzy.FuzzyMemory.complete``)."""
    whole: Optional[str] = None     # the whole text's stored translation, when its sentences are not just it
    stored: dict[str, str] = field(default_factory=dict)    # normalized source -> stored translation
    scores: dict[str, float] = field(default_factory=dict)  # normalized source -> fuzzy match score (absent: exact, 100)

    def of(self, sentence: str) -> Optional[str]:
        """The stored translation of one sentence of the text, or None."""
        return self.stored.get(normalize(sentence))

    def score_of(self, sentence: str) -> float:
        """The match score (0-100) of a sentence ``of`` answers: 100 for an exact match."""
        return self.scores.get(normalize(sentence), 100.0)


class MemoryStore:
    """The stored translations in one SQLite file (WAL mode: readers never wait for a writer).

    Each process opens its own connection on first use; every method is safe to call from several
    threads (one lock per store). A file that cannot be opened or read makes ``lookup`` find nothing
    (logged once: translation goes on without the memory); the other methods raise Unavailable (503)
    naming the file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._conn: Optional[sqlite3.Connection] = None
        self._lock = threading.Lock()
        self._warned = False

    @contextlib.contextmanager
    def _file(self):
        """The lock and the connection; sqlite3.Error as Unavailable naming the file."""
        with self._lock:
            try:
                yield self._db()
            except (sqlite3.Error, OSError) as e:
                raise Unavailable(f"memory: the translation memory's file {self.path} cannot be used: {e}",
                                  retry_after=RETRY_AFTER_S) from None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            private_file(private_dir(self.path.parent) / self.path.name)   # SQLite's -wal and -shm take its mode
            conn = sqlite3.connect(self.path, timeout=SQLITE_TIMEOUT_S, check_same_thread=False,
                                   isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            self._conn = conn
        return self._conn

    def lookup(self, model: str, scope: str, sources: Iterable[str]) -> dict[str, str]:
        """normalized source -> stored target for those of ``sources`` (already normalized) stored."""
        keys = list(dict.fromkeys(sources))
        out: dict[str, str] = {}
        try:
            with self._file() as db:
                for i in range(0, len(keys), 500):      # SQLite's variable limit
                    chunk = keys[i:i + 500]
                    rows = db.execute(f"SELECT source, target FROM memory WHERE model=? AND scope=? AND source IN "
                                      f"({','.join('?' * len(chunk))})", (model, scope, *chunk))
                    out.update(rows.fetchall())
        except Unavailable as e:
            if not self._warned:
                self._warned = True
                logger.warning("%s; translating without it", e)
            return {}
        return out

    def recall(self, model: str, scope: str, text: str, sentences: Sequence[str]) -> Recalled:
        """What is stored for ``text`` and its ``sentences``, in one query. The whole text's
        translation answers it only when the text is more than its one sentence (that one is a
        sentence's)."""
        whole = normalize(text)
        stored = self.lookup(model, scope, [whole, *(normalize(s) for s in sentences)])
        if whole in stored and sentences and [normalize(s) for s in sentences] != [whole]:
            return Recalled(stored[whole], stored)
        return Recalled(None, stored)

    def put(self, model: str, scope: str, pairs: Iterable[tuple[str, str]], origin: str = "suggestion") -> int:
        """Store (source, target) pairs (sources normalized here; a stored source is replaced); returns
        how many. ``origin``: suggestion or import."""
        with self.transaction() as db:
            return insert(db, model, scope, pairs, origin)

    @contextlib.contextmanager
    def transaction(self):
        """The connection inside one write transaction (BEGIN IMMEDIATE): committed when the block
        ends, rolled back when it raises, so that several writes land together or not at all."""
        with self._file() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def generation(self, model: str, scope: str) -> int:
        """A number that changes with every write to the entries of ``model`` and ``scope`` (any
        process's: triggers keep it), for caches of them (``fuzzy.FuzzyMemory``); 0 before the first."""
        with self._file() as db:
            row = db.execute("SELECT value FROM generation WHERE model=? AND scope=?", (model, scope)).fetchone()
        return row[0] if row else 0

    def count(self, model: str, scope: str) -> int:
        with self._file() as db:
            return db.execute("SELECT COUNT(*) FROM memory WHERE model=? AND scope=?",
                                      (model, scope)).fetchone()[0]

    def export(self, model: str, scope: str) -> list[tuple[str, str]]:
        """Every stored (source, target) of the model and scope, sources in order."""
        with self._file() as db:
            return db.execute("SELECT source, target FROM memory WHERE model=? AND scope=? ORDER BY source",
                                      (model, scope)).fetchall()

    def delete(self, model: str, scope: str, sources: Optional[Iterable[str]] = None) -> int:
        """Delete the given sources (normalized here), or all of the model and scope; returns how many."""
        with self._file() as db:
            if sources is None:
                return db.execute("DELETE FROM memory WHERE model=? AND scope=?", (model, scope)).rowcount
            return sum(db.execute("DELETE FROM memory WHERE model=? AND scope=? AND source=?",
                                  (model, scope, normalize(s))).rowcount for s in sources)

    def add_usage(self, scope: str, characters: int) -> None:
        with self._file() as db:
            db.execute("INSERT INTO usage VALUES (?, ?) ON CONFLICT(scope) DO UPDATE SET "
                               "characters = characters + excluded.characters", (scope, characters))

    def usage(self, scope: str) -> int:
        with self._file() as db:
            row = db.execute("SELECT characters FROM usage WHERE scope=?", (scope,)).fetchone()
        return row[0] if row else 0


def insert(db: sqlite3.Connection, model: str, scope: str, pairs: Iterable[tuple[str, str]],
           origin: str = "suggestion") -> int:
    """``MemoryStore.put``'s write on an open transaction (``MemoryStore.transaction``)."""
    now = time.time()
    rows = [(model, scope, normalize(s), t, origin, now) for s, t in pairs]
    db.executemany("INSERT OR REPLACE INTO memory VALUES (?, ?, ?, ?, ?, ?)", rows)
    return len(rows)


class ResultCache:
    """Least-recently-used cache of engine results by key (``max_entries`` 0: off, stores nothing)."""

    def __init__(self, max_entries: int = 0):
        self.max_entries = max_entries
        self._items: collections.OrderedDict[Hashable, object] = collections.OrderedDict()

    def get(self, key: Hashable):
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key: Hashable, value) -> None:
        if self.max_entries <= 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def memory_hit() -> TranslationResult:
    """The result of a sentence the translation memory answered: one hypothesis without tokens
    (the model generated none), score 0 (log-probability 0: certain); its text is the stored one."""
    return TranslationResult([Hypothesis(tokens=[], log_prob=0.0, score=0.0, finish_reason="eos")],
                             RequestStats(request_id=-1, status="ok", finish_reason="eos", src_tokens=0, beam_size=0))


def cache_key(piece: Piece, options: GenerationOptions) -> tuple:
    """The result cache's key of a sentence: its source ids (target-language token included) and
    every decoding option (``GenerationOptions`` fields), so a hit is the result the engine would give."""
    return tuple(piece.src_ids), dataclasses.astuple(options)
