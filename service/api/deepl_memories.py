"""DeepL's translation memories (``/v3/translation_memories``, DeepL API v3; routes/deepl_memories.py)
over the service's one translation memory (service/translator/memory.py), per API key.

A translation memory here is one source language, one or more target languages, each with the
store's model key of the model that serves the pair, and a scope of the store:

    the key's own memory of a model   what /suggest and PUT /v1/memory fill and every translation of
                                      the key reads; listed while it has entries, its id derived from
                                      the key and the model (name "memory de->en")
    an imported one                   each import job creates one (TMX, or TSV with the languages
                                      given), entries under a scope of its own ("<key scope>/tm/<id>")

    translation_memory_id on /v2/translate   the job reads that memory only: exact entries, then fuzzy
                                             matches scoring at least translation_memory_threshold
                                             (0-100, default 75 as DeepL's) take its translation
                                             (service/translator/fuzzy.py)

Imports and exports are jobs (in the memory's SQLite file, so every ingress replica sees them), as
DeepL's: POST .../import declares the file and answers an ``upload_url``; a PUT of the file to it
imports it before answering, so the first poll of GET .../jobs/{id} sees the job ``completed`` (with
the new memory's id) or ``failed`` with a message naming the cause (nothing is stored then: the
memory and its entries are written in one transaction). POST .../{id}/export answers a job whose
``download_url`` gives the TMX file, written when downloaded. Upload and download URLs carry a
random token (DeepL's pre-signed URLs: the client sends them no key) and expire after URL_TTL_S.
"""
from __future__ import annotations

import datetime
import hmac
import secrets
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from service.protocol import ServiceError, shown
from service.translator.fuzzy import DEEPL_DEFAULT_THRESHOLD
from service.translator.memory import MemoryStore, insert, memory_model

from . import memory as formats

if TYPE_CHECKING:
    from service.pipeline import LanguageGraph

URL_TTL_S = 3600                  # seconds an upload or download URL stays valid
JOB_TTL_S = 24 * 3600             # seconds a job is kept
MAX_MEMORIES = 100                # imported translation memories per API key (all of them, keys off)
MAX_LIST_PAGE = 25                # translation memories per page of GET /v3/translation_memories (DeepL's)
MAX_SEGMENT_PAGE = 100            # segments per page (DeepL's 1-100, default 50)
NOT_FOUND = "translation_memory_not_found"      # the error type that stays a 404 (errors.deepl_error_response)
NAMESPACE = uuid.UUID("5b0f5c9e-6f1e-4a8b-9d41-2f6c1d7e3a10")   # ids of the keys' own memories (uuid5)
TMX_TYPES = ("application/xml", "text/xml", formats.TMX)
UPLOAD_TYPES = (*TMX_TYPES, formats.TSV)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS tm (id TEXT PRIMARY KEY, owner TEXT NOT NULL, name TEXT NOT NULL,
       source_lang TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS tm_target (id TEXT NOT NULL, target_lang TEXT NOT NULL, model TEXT NOT NULL,
       PRIMARY KEY (id, target_lang))""",
    """CREATE TABLE IF NOT EXISTS tm_job (id TEXT PRIMARY KEY, owner TEXT NOT NULL, token TEXT NOT NULL,
       operation TEXT NOT NULL, status TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL,
       expires REAL NOT NULL, tm_id TEXT, display_name TEXT, content_type TEXT, content_length INTEGER,
       source_lang TEXT, target_lang TEXT, error TEXT, skipped INTEGER)""",
)



def not_found(what: str, value: str, field: Optional[str] = None) -> ServiceError:
    return ServiceError(404, f"{what} {shown(value)} not found", field, type=NOT_FOUND)


def timestamp(t: Optional[float]) -> Optional[str]:
    """ISO 8601 in UTC with milliseconds, as DeepL writes times."""
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


# ---- the memories -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Memory:
    """One translation memory: where its entries are in the store."""
    id: str
    name: str
    source_lang: str
    targets: tuple[tuple[str, str], ...]    # (target language, the store's model key), by language
    scope: str                              # the store's scope of its entries
    own: bool = False                       # the key's own memory of a model (else imported)
    created: Optional[float] = None
    updated: Optional[float] = None

    def model_of(self, target_lang: str) -> Optional[str]:
        return dict(self.targets).get(target_lang)


def served_pairs(graph: "LanguageGraph") -> list[tuple[str, str, str]]:
    """(source, target, the store's model key) of every pair a model here translates directly."""
    return [(c.source_lang, t, memory_model(c.id, t if c.target_languages else None))
            for c in graph.cards.values() for t in c.targets]


def served_key(graph: "LanguageGraph", source: str, target: str) -> str:
    """The store's model key of the model that translates ``source`` into ``target`` (the one
    ``LanguageGraph.resolve`` picks, as for a request). Raises ServiceError 422 naming the pair when
    no model here translates it directly (a pivot route's legs have memories of their own)."""
    try:
        card = graph.resolve(None, source, target)
    except ServiceError:
        card = None
    if card is None or card.id not in graph.cards:
        raise ServiceError(422, f"no model here translates {short(source)} into {short(target)} (pairs: "
                                f"{', '.join(f'{s}->{t}' for s, t, _ in served_pairs(graph))})", "target_lang")
    return memory_model(card.id, target if card.target_languages else None)


def short(lang: str) -> str:
    return shown(lang)[1:-1]


class Registry:
    """The memories and jobs of one store (tables beside its entries, made on first use)."""

    def __init__(self, store: MemoryStore):
        self.store = store
        self._ready = False

    def _db(self):
        """A write transaction on the store, the tables made first."""
        if not self._ready:
            with self.store.transaction() as db:
                for statement in _SCHEMA:
                    db.execute(statement)
            self._ready = True
        return self.store.transaction()

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._db() as db:
            return db.execute(sql, args).fetchall()

    # ---- memories ----
    def own(self, owner: str, graph: "LanguageGraph") -> list[Memory]:
        """The key's own memories of the models here that hold entries."""
        out = []
        for source, target, key in served_pairs(graph):
            if self.store.count(key, owner):
                out.append(Memory(str(uuid.uuid5(NAMESPACE, f"{owner}\n{key}")), f"memory {source}->{target}",
                                  source, ((target, key),), owner, own=True))
        return out

    def all(self, owner: str, graph: "LanguageGraph") -> list[Memory]:
        """The key's memories: its own, then the imported ones, oldest first."""
        rows = self._rows("SELECT id, name, source_lang, created, updated FROM tm WHERE owner=? ORDER BY created, id",
                          (owner,))
        return self.own(owner, graph) + [self._imported(owner, *row) for row in rows]

    def _imported(self, owner: str, tm_id: str, name: str, source: str, created: float, updated: float) -> Memory:
        targets = self._rows("SELECT target_lang, model FROM tm_target WHERE id=? ORDER BY target_lang", (tm_id,))
        return Memory(tm_id, name, source, tuple(targets), f"{owner}/tm/{tm_id}", False, created, updated)

    def get(self, owner: str, tm_id: str, graph: "LanguageGraph", field: Optional[str] = None) -> Memory:
        """The key's memory of that id. Raises ServiceError 404 (another key's is not found either)."""
        rows = self._rows("SELECT id, name, source_lang, created, updated FROM tm WHERE owner=? AND id=?",
                          (owner, tm_id))
        if rows:
            return self._imported(owner, *rows[0])
        for m in self.own(owner, graph):
            if m.id == tm_id:
                return m
        raise not_found("translation memory", tm_id, field)

    def count(self, m: Memory) -> int:
        """Its segments: the distinct sources of all its targets."""
        if len(m.targets) == 1:
            return self.store.count(m.targets[0][1], m.scope)
        keys = [k for _, k in m.targets]
        return self._rows(f"SELECT COUNT(DISTINCT source) FROM memory WHERE scope=? AND model IN "
                          f"({','.join('?' * len(keys))})", (m.scope, *keys))[0][0]

    def segments(self, m: Memory, after: Optional[str], limit: int, text: Optional[str], case: bool
                 ) -> tuple[list[tuple[str, dict[str, tuple[str, float]]]], Optional[str]]:
        """Up to ``limit`` segments after source ``after`` in source order: (source, {target language:
        (target, updated)}), those with ``text`` in a source or target (ignoring case unless ``case``)
        only; and the last source returned when more follow."""
        needle = text if case or text is None else text.casefold()

        def matches(*values: str) -> bool:
            return needle is None or any(needle in (v if case else v.casefold()) for v in values)
        out: list[tuple[str, dict[str, tuple[str, float]]]] = []
        batch, cursor = max(limit + 1, 500), after or ""
        while True:     # in batches per target, filtered here (SQLite's lower() knows ASCII only)
            by_source: dict[str, dict[str, tuple[str, float]]] = {}
            ends = []       # the last source of each target's full batch: later ones may lack that target
            for lang, key in m.targets:
                rows = self._rows("SELECT source, target, updated FROM memory WHERE model=? AND scope=? AND "
                                  "source > ? ORDER BY source LIMIT ?", (key, m.scope, cursor, batch))
                for source, target, updated in rows:
                    by_source.setdefault(source, {})[lang] = (target, updated)
                if len(rows) == batch:
                    ends.append(rows[-1][0])
            end = min(ends) if ends else None
            for source in sorted(s for s in by_source if end is None or s <= end):
                seg = by_source[source]
                if matches(source, *(t for t, _ in seg.values())):
                    out.append((source, seg))
                    if len(out) > limit:
                        return out[:limit], out[limit - 1][0]
            if end is None:
                return out, None
            cursor = end

    def delete(self, m: Memory) -> None:
        """The memory and its entries, in one transaction (the key's own: its entries of that model)."""
        with self._db() as db:
            for _, key in m.targets:
                db.execute("DELETE FROM memory WHERE model=? AND scope=?", (key, m.scope))
            if not m.own:
                db.execute("DELETE FROM tm_target WHERE id=?", (m.id,))
                db.execute("DELETE FROM tm WHERE id=?", (m.id,))

    def create(self, owner: str, name: str, source: str, targets: list[tuple[str, str, list[tuple[str, str]]]]
               ) -> Memory:
        """A new memory with its entries ((target language, model key, pairs) per target), written in
        one transaction: all of it or, when anything fails, nothing."""
        tm_id, now = str(uuid.uuid4()), time.time()
        scope = f"{owner}/tm/{tm_id}"
        with self._db() as db:
            self.check_room(owner, db)
            db.execute("INSERT INTO tm VALUES (?, ?, ?, ?, ?, ?)", (tm_id, owner, name, source, now, now))
            for lang, key, pairs in targets:
                db.execute("INSERT INTO tm_target VALUES (?, ?, ?)", (tm_id, lang, key))
                insert(db, key, scope, pairs, origin="import")
        return Memory(tm_id, name, source, tuple(sorted((lang, key) for lang, key, _ in targets)), scope, False,
                      now, now)

    def check_room(self, owner: str, db=None) -> None:
        """Raises ServiceError 413 when the key has MAX_MEMORIES imported memories already."""
        sql, args = "SELECT COUNT(*) FROM tm WHERE owner=?", (owner,)
        n = db.execute(sql, args).fetchone()[0] if db is not None else self._rows(sql, args)[0][0]
        if n >= MAX_MEMORIES:
            raise ServiceError(413, f"at most {MAX_MEMORIES} imported translation memories per key; delete one first")

    # ---- jobs ----
    def new_job(self, owner: str, operation: str, status: str, **fields) -> dict:
        """A new job (its token for the upload or download URL included); jobs past JOB_TTL_S are dropped."""
        now = time.time()
        job = {"id": str(uuid.uuid4()), "owner": owner, "token": secrets.token_urlsafe(24), "operation": operation,
               "status": status, "created": now, "updated": now, "expires": now + URL_TTL_S, "tm_id": None,
               "display_name": None, "content_type": None, "content_length": None, "source_lang": None,
               "target_lang": None, "error": None, "skipped": None, **fields}
        with self._db() as db:
            db.execute("DELETE FROM tm_job WHERE created < ?", (now - JOB_TTL_S,))
            db.execute(f"INSERT INTO tm_job ({', '.join(job)}) VALUES ({', '.join('?' * len(job))})",
                       tuple(job.values()))
        return job

    def job(self, job_id: str) -> Optional[dict]:
        with self._db() as db:
            cur = db.execute("SELECT * FROM tm_job WHERE id=?", (job_id,))
            row = cur.fetchone()
            return dict(zip([d[0] for d in cur.description], row)) if row else None

    def update_job(self, job_id: str, when: Optional[str] = None, **fields) -> bool:
        """Set ``fields`` of the job (only while its status is ``when``, if given); whether it was."""
        fields["updated"] = time.time()
        sql = f"UPDATE tm_job SET {', '.join(f'{k}=?' for k in fields)} WHERE id=?"
        args = (*fields.values(), job_id)
        if when is not None:
            sql, args = sql + " AND status=?", (*args, when)
        with self._db() as db:
            return db.execute(sql, args).rowcount == 1


_registries: "weakref.WeakKeyDictionary[MemoryStore, Registry]" = weakref.WeakKeyDictionary()


def registry(store: Optional[MemoryStore]) -> Registry:
    """The store's Registry. Raises ServiceError 400 when the memory is off (no store)."""
    if store is None:
        raise ServiceError(400, "translation memories are off on this server (it keeps no translation memory)")
    if store not in _registries:
        _registries[store] = Registry(store)
    return _registries[store]


# ---- DeepL's shapes -------------------------------------------------------------------------------
def info(m: Memory, segment_count: int) -> dict:
    """A TranslationMemoryInfo as DeepL's JSON."""
    out = {"translation_memory_id": m.id, "name": m.name, "source_language": m.source_lang,
           "target_languages": [lang for lang, _ in m.targets], "segment_count": segment_count}
    if m.created is not None:
        out.update(creation_time=timestamp(m.created), updated_time=timestamp(m.updated))
    return out


def segment(m: Memory, source: str, targets: dict[str, tuple[str, float]]) -> dict:
    """A TranslationMemorySegment as DeepL's JSON (ids derived from the memory and the texts)."""
    return {"source_segment_id": str(uuid.uuid5(uuid.UUID(_uuid_of(m.id)), source)), "source_text": source,
            "targets": [{"target_segment_id": str(uuid.uuid5(uuid.UUID(_uuid_of(m.id)), f"{lang}\n{source}")),
                         "target_language": lang, "target_text": text, "updated_time": timestamp(updated)}
                        for lang, (text, updated) in sorted(targets.items())],
            "updated_time": timestamp(max(u for _, u in targets.values()))}


def _uuid_of(tm_id: str) -> str:
    return tm_id if len(tm_id) == 36 else str(uuid.uuid5(NAMESPACE, tm_id))


def job_json(job: dict, base_url: str) -> dict:
    """A translation memory job as DeepL's JSON (GET /v3/translation_memories/jobs/{id})."""
    status = job["status"]
    if status in ("awaiting_input", "completed") and time.time() > job["expires"]:
        status = "expired"
    result: dict = {"status": status}
    if status == "awaiting_input":
        result["status_metadata"] = {"required_action": "upload the file to upload_url"}
    if status == "failed":
        result["error"] = {"message": job["error"]}
    if job["operation"] == "import" and status == "completed":
        result.update(translation_memory_id=job["tm_id"], skipped_segment_count=job["skipped"])
    if job["operation"] == "export" and status == "completed":
        result.update(download_url=file_url(base_url, job), expires_at=timestamp(job["expires"]))
    out = {"job_id": job["id"], "product": "translation_memory", "operation": job["operation"],
           "creation_time": timestamp(job["created"]), "updated_time": timestamp(job["updated"]),
           "results": [result]}
    if job["operation"] == "import":
        out["parameters"] = {"display_name": job["display_name"]}
        out["source_file"] = {"content_type": job["content_type"], "content_length": job["content_length"]}
    else:
        out["parameters"] = {"translation_memory_id": job["tm_id"]}
    return out


def file_url(base_url: str, job: dict) -> str:
    """The job's upload (import) or download (export) URL: it carries the job's token."""
    return f"{base_url.rstrip('/')}/v3/translation_memories/files/{job['id']}?token={job['token']}"


def check_token(job: Optional[dict], token: Optional[str], job_id: str) -> dict:
    """The job a file URL names, its token checked. Raises ServiceError 404 (unknown job or token:
    the same answer), 410 past its expiry."""
    if job is None or not token or not hmac.compare_digest(job["token"].encode(), token.encode()):
        raise not_found("translation memory job", job_id)
    if time.time() > job["expires"]:
        raise ServiceError(410, f"the URL of translation memory job {job_id} expired")
    return job


# ---- import -------------------------------------------------------------------------------------------


def int_param(value: Optional[str], name: str, default: int, low: int, high: int) -> int:
    """A query parameter's integer in [low, high]. Raises ServiceError 400 naming it."""
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or not low <= n <= high:
        raise ServiceError(400, f"Value for '{name}' not supported: an integer {low}-{high}, got {shown(value)}", name)
    return n


def bool_param(value: Optional[str], name: str) -> bool:
    if value is None or value.lower() in ("false", "0"):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise ServiceError(400, f"Value for '{name}' not supported: true or false, got {shown(value)}", name)


# ---- translate_text(translation_memory=...) ---------------------------------------------------------
def job_fields(store: Optional[MemoryStore], owner: Optional[str], graph: "LanguageGraph",
               tm_id: Optional[str], threshold: Optional[int], source: Optional[str], target: str) -> dict:
    """The TranslateJob fields of /v2/translate's translation_memory_id and _threshold: the memory's
    scope and the threshold (DeepL's default 75). Raises ServiceError naming the field: 404 an unknown
    id (another key's too); 400 a threshold without a memory, memories off, a memory of other
    languages than the request's (``source`` None: detected, not checked)."""
    if tm_id is None:
        if threshold is not None:
            raise ServiceError(400, "Value for 'translation_memory_threshold' not supported: it applies with "
                                    "translation_memory_id only", "translation_memory_threshold")
        return {}
    if store is None or owner is None:
        raise ServiceError(400, "Value for 'translation_memory_id' not supported: translation memories are off on "
                                "this server", "translation_memory_id")
    try:
        m = registry(store).get(owner, tm_id, graph, "translation_memory_id")
    except ServiceError as e:       # unknown (another key's too): 404, as an unknown glossary_id
        raise ServiceError(e.status, f"Value for 'translation_memory_id' not supported: {e.message}",
                           "translation_memory_id", type=e.type) from None
    if (source is not None and source != m.source_lang) or m.model_of(target) is None:
        raise ServiceError(400, f"Value for 'translation_memory_id' not supported: translation memory {m.id} is "
                                f"{m.source_lang}->{'|'.join(t for t, _ in m.targets)}, the request "
                                f"{source or '(detected)'}->{target}", "translation_memory_id")
    return {"memory_scope": m.scope, "memory_threshold": float(DEEPL_DEFAULT_THRESHOLD if threshold is None
                                                               else threshold)}

