"""Stored glossaries: named lists of (source term, target term) entries that a request references by
``glossary_id`` instead of sending them (``/v1/translate``, LibreTranslate's ``/translate``).

    GET    /v1/glossaries            the caller's glossaries and the shared ones (names, sizes)
    POST   /v1/glossaries            create one: {"name", "entries": [{"source", "target"}], "source_lang"?, "target_lang"?}
    GET    /v1/glossaries/{name}     one, with its entries
    DELETE /v1/glossaries/{name}     delete one the caller created (204)

Shared glossaries come from files at start: every ``*.tsv`` and ``*.csv`` file of the directory
``AppArgs.glossary_dir`` (or ``MT_GLOSSARY_DIR``), named by the file name without its suffix; one
entry a row, source term then target term (TSV: tab-separated; CSV: comma-separated with CSV quoting;
Python's ``csv`` module reads both); blank rows, rows starting with "#" and a first row
``source, target`` are left out. They are read-only through the API. Glossaries created through the
API belong to the API key that created them (when keys are on; to everyone when they are off) and
live in the memory of one detached Ray actor that every gateway replica shares
(``GlossaryClient.cluster``): they outlive gateway restarts and redeploys, not the Ray cluster.

A request's ``glossary_id`` is looked up among the caller's glossaries first, then the shared ones.

DeepL's glossaries (``/v2/glossaries``, ``/v3/glossaries``; deepl_glossaries.py) live in this store
too: a DeepL glossary is the group of the caller's glossaries whose ``group`` (else whose name) is
its glossary_id, one stored glossary per dictionary (language pair), named ``<glossary_id>.<source>-<target>``
(``dictionary_name``). A ``glossary_id`` on any route names a glossary or a group; of a group, the
dictionary of the request's pair is used (``GlossaryStore.pick``).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from service.protocol import (
    MAX_GLOSSARIES,
    MAX_GLOSSARY_ENTRIES,
    MAX_GLOSSARY_TERM_CHARS,
    MAX_STORED_GLOSSARY_ENTRIES,
    NOT_BLANK,
    InvalidRequest,
    ServiceError,
    shown,
)
from service.translator.glossary import Glossary, check_entries, stems

from .middleware.caller import caller_of

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# what the document states of a term (GlossaryEntry's own validators give the messages)
TERM_SCHEMA = {"minLength": 1, "maxLength": MAX_GLOSSARY_TERM_CHARS, "pattern": NOT_BLANK}
SOURCE_TERM_SCHEMA = {**TERM_SCHEMA, "pattern": r"\w"}     # a letter or digit, to be matched (translator/glossary.py)
SHARED = ""          # the scope of file glossaries (and of every glossary when keys are off)
STORE_ACTOR = "glossary-store"   # the Ray actor every gateway replica shares (GlossaryClient.cluster)


class GlossaryEntry(BaseModel):
    """One glossary entry."""
    model_config = ConfigDict(strict=True, extra="forbid")
    source: str = Field(..., description=f"source term (1..{MAX_GLOSSARY_TERM_CHARS} characters, a letter or digit "
                                         "among them)", json_schema_extra=SOURCE_TERM_SCHEMA)
    target: str = Field(..., description=f"target term (1..{MAX_GLOSSARY_TERM_CHARS} characters, not blank)",
                        json_schema_extra=TERM_SCHEMA)


class GlossaryCreate(BaseModel):
    """POST /v1/glossaries body."""
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(..., description="1-64 characters: letters, digits, '.', '_', '-', starting with a letter or digit",
                      json_schema_extra={"pattern": f"^{NAME.pattern}$"})
    entries: list[GlossaryEntry] = Field(..., min_length=1, max_length=MAX_STORED_GLOSSARY_ENTRIES)
    source_lang: Optional[str] = Field(None, min_length=1, pattern=NOT_BLANK,
                                       description="source language; when set, only models reading it may use it "
                                                         "(and its stemmer checks conflicting entries now)")
    target_lang: Optional[str] = Field(None, min_length=1, pattern=NOT_BLANK,
                                       description="target language; when set, only models writing it may use it")


def check_served(body: GlossaryCreate, pairs: list[tuple[str, str]]) -> None:
    """A glossary's languages must be ones a served model (or pivot route) translates, as a pair when
    both are given: one no request could ever use is refused. Raises ServiceError 422 naming the
    field and the served codes or pairs."""
    sources, targets = sorted({s for s, _ in pairs}), sorted({t for _, t in pairs})
    for field, code, served in (("source_lang", body.source_lang, sources), ("target_lang", body.target_lang, targets)):
        if code is not None and code not in served:
            raise ServiceError(422, f"{field}: {shown(code)} is not a language served here; served: "
                                    f"{', '.join(served)}", field)
    if body.source_lang is not None and body.target_lang is not None and (body.source_lang, body.target_lang) not in pairs:
        raise ServiceError(422, f"target_lang: no model here translates {body.source_lang}->{body.target_lang}; "
                                f"served pairs: {', '.join(f'{s}->{t}' for s, t in pairs)}", "target_lang")


class GlossaryInfo(BaseModel):
    name: str
    entry_count: int
    source_lang: Optional[str] = None
    target_lang: Optional[str] = None
    shared: bool = Field(..., description="loaded from the server's glossary directory (read-only)")
    entries: Optional[list[GlossaryEntry]] = Field(None, description="GET /v1/glossaries/{name} only")


class GlossaryList(BaseModel):
    object: str = "list"
    data: list[GlossaryInfo]


@dataclass(frozen=True)
class StoredGlossary:
    name: str
    entries: tuple[tuple[str, str], ...]
    source_lang: Optional[str] = None
    target_lang: Optional[str] = None
    shared: bool = False
    group: Optional[str] = None       # the DeepL glossary_id of the group it is a dictionary of (None: its name)
    label: Optional[str] = None       # the DeepL glossary's name (free text; None: the stored name)
    created: float = 0.0              # when it was stored (Unix time)

    @property
    def key(self) -> str:
        """The DeepL glossary_id it belongs to."""
        return self.group or self.name

    def info(self, with_entries: bool = False) -> GlossaryInfo:
        return GlossaryInfo(name=self.name, entry_count=len(self.entries), source_lang=self.source_lang,
                            target_lang=self.target_lang, shared=self.shared,
                            entries=[GlossaryEntry(source=s, target=t) for s, t in self.entries]
                            if with_entries else None)


def read_file(path: Path) -> list[tuple[str, str]]:
    """The entries of a TSV or CSV glossary file (module docstring). Raises ValueError naming the
    file and row for a row without two columns."""
    text = path.read_text(encoding="utf-8-sig")
    dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
    entries = []
    for n, row in enumerate(csv.reader(io.StringIO(text), dialect=dialect), 1):
        if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
            continue
        if n == 1 and [c.strip().lower() for c in row] == ["source", "target"]:
            continue
        if len(row) != 2:
            raise ValueError(f"{path}:{n}: expected 2 columns (source term, target term), got {len(row)}")
        entries.append((row[0].strip(), row[1].strip()))
    return entries


class GlossaryStore:
    """Glossaries by scope (an API key's id, or SHARED) and name; thread-safe."""

    def __init__(self, directory: Optional[str] = None):
        self._lock = threading.Lock()
        self._by_scope: dict[str, dict[str, StoredGlossary]] = {SHARED: {}}
        if directory:
            self.load_directory(Path(directory))

    def load_directory(self, directory: Path) -> None:
        """Load every *.tsv / *.csv file as a shared glossary. Raises ValueError for a bad file."""
        for path in sorted(directory.iterdir()):
            if path.suffix.lower() not in (".tsv", ".csv") or not path.is_file():
                continue
            name = path.stem
            if not NAME.fullmatch(name):
                raise ValueError(f"{path}: a glossary name must match {NAME.pattern}")
            entries = read_file(path)
            try:
                check_entries(entries, f"{path.name}: entries", MAX_STORED_GLOSSARY_ENTRIES)
                Glossary(entries, None, None, 0, f"{path.name}: entries", MAX_STORED_GLOSSARY_ENTRIES)
            except InvalidRequest as e:
                raise ValueError(str(e)) from None
            self._by_scope[SHARED][name] = StoredGlossary(name, tuple(entries), shared=True)

    def list(self, scope: str) -> list[StoredGlossary]:
        with self._lock:
            own = self._by_scope.get(scope, {}) if scope != SHARED else {}
            return sorted([*own.values(), *self._by_scope[SHARED].values()], key=lambda g: (g.shared, g.name))

    def get(self, scope: str, name: str, field: str = "glossary_id") -> StoredGlossary:
        """The caller's glossary ``name``, else the shared one. Raises ServiceError 404 naming ``field``."""
        with self._lock:
            g = self._by_scope.get(scope, {}).get(name) or self._by_scope[SHARED].get(name)
        if g is None:
            raise ServiceError(404, f"{field}: no glossary named {shown(name)}; GET /v1/glossaries lists yours",
                               field)
        return g

    def create(self, scope: str, body: GlossaryCreate) -> StoredGlossary:
        """Store a new glossary. Raises ServiceError 422 (bad name or entries), 409 (the name is
        taken), 413 (more than MAX_GLOSSARIES)."""
        if not NAME.fullmatch(body.name):
            raise ServiceError(422, f"name: must be 1-64 characters (letters, digits, '.', '_', '-', starting with a "
                                    f"letter or digit), got {shown(body.name)}", "name")
        entries = [(e.source, e.target) for e in body.entries]
        try:
            Glossary(entries, body.source_lang, None, 0, "entries", MAX_STORED_GLOSSARY_ENTRIES)
        except InvalidRequest as e:     # two of its entries conflict (one source, two targets): 409, as a taken name
            raise ServiceError(409 if " conflicts with " in e.message else 422, e.message, e.field) from None
        g = StoredGlossary(body.name, tuple(Glossary.normalized(entries)), body.source_lang, body.target_lang,
                           created=time.time())
        with self._lock:
            own = self._by_scope.setdefault(scope, {})
            if body.name in own or body.name in self._by_scope[SHARED]:
                raise ServiceError(409, f"name: a glossary named {shown(body.name)} exists; delete it first", "name")
            if sum(not g.shared for g in own.values()) >= MAX_GLOSSARIES:
                raise ServiceError(413, f"name: at most {MAX_GLOSSARIES} glossaries per API key; delete one first",
                                   "name")
            own[body.name] = g
        return g

    def members(self, scope: str, key: Optional[str] = None) -> list[StoredGlossary]:
        """The caller's own glossaries (not the shared ones) of DeepL glossary ``key`` (its
        dictionaries; None: of every key), in the order they were stored."""
        with self._lock:
            own = self._by_scope.get(scope, {})
            return [g for g in own.values() if not g.shared and key in (None, g.key)]

    def pick(self, scope: str, glossary_id: str, source_lang: Optional[str], target_lang: Optional[str],
             field: str = "glossary_id") -> tuple[tuple[str, str], ...]:
        """The entries ``glossary_id`` gives a model source_lang -> target_lang: a group's dictionary of
        that pair, else the glossary of that name (``resolve``). Raises ServiceError 404 (unknown),
        409 (no dictionary or glossary of that pair)."""
        group = self.members(scope, glossary_id)
        if not any(g.group for g in group):
            return check_languages(self.get(scope, glossary_id, field), source_lang, target_lang, field)
        for g in group:
            if all(w is None or h is None or same_language(w, h)
                   for w, h in ((g.source_lang, source_lang), (g.target_lang, target_lang))):
                return g.entries
        raise ServiceError(409, f"{field}: glossary {shown(glossary_id)} has no dictionary for {source_lang}->"
                                f"{target_lang}; its dictionaries: "
                                f"{', '.join(f'{g.source_lang}->{g.target_lang}' for g in group)}", field)

    def edit_group(self, scope: str, key: str, put: list[StoredGlossary], merge: bool = False,
                   drop: tuple[tuple[str, str], ...] = (), label: Optional[str] = None,
                   create: bool = False) -> list[StoredGlossary]:
        """Change DeepL glossary ``key`` at once (nothing changes when it raises): ``put`` dictionaries
        (each replaces, or with ``merge`` is merged into, the one of its pair; a new pair is added as
        ``dictionary_name``), ``drop`` the dictionaries of these pairs, rename it to ``label``;
        ``create``: the glossary is new. Answers its dictionaries. Raises ServiceError 404 (unknown
        glossary or dictionary), 400 (its last dictionary dropped; merged entries that conflict),
        409 (a name taken), 413 (over MAX_GLOSSARIES)."""
        with self._lock:
            own = self._by_scope.setdefault(scope, {})
            old = {(base(g.source_lang), base(g.target_lang)): g for g in own.values()
                   if not g.shared and g.key == key}
            if bool(old) == create:
                raise (ServiceError(409, f"glossary_id: {shown(key)} exists", "glossary_id") if create else
                       ServiceError(404, f"glossary_id: no glossary {shown(key)}", "glossary_id",
                                    type="glossary_not_found"))
            new = dict(old)
            for pair in drop:
                if new.pop(pair, None) is None:
                    raise ServiceError(404, f"glossary_id: glossary {shown(key)} has no dictionary {pair[0]}->"
                                            f"{pair[1]}", "glossary_id", type="glossary_not_found")
            for g in put:
                pair = (g.source_lang, g.target_lang)
                was = new.get(pair)
                if was is not None and merge:
                    merged = dict(was.entries)
                    merged.update(g.entries)
                    entries = list(merged.items())
                    try:
                        Glossary(entries, g.source_lang, None, 0, "entries", MAX_STORED_GLOSSARY_ENTRIES)
                    except InvalidRequest as e:
                        raise ServiceError(400, f"dictionaries: merged into {pair[0]}->{pair[1]}: {e.message}",
                                           "dictionaries") from None
                    g = dataclasses.replace(g, entries=tuple(entries))
                new[pair] = dataclasses.replace(g, name=was.name if was else dictionary_name(key, *pair),
                                                group=was.group if was else key, label=was.label if was else g.label,
                                                created=was.created if was else g.created)
            if not new:
                raise ServiceError(400, f"source_lang: that is the last dictionary of glossary {shown(key)}; delete "
                                        "the glossary instead", "source_lang")
            if label is not None:
                new = {p: dataclasses.replace(g, label=label) for p, g in new.items()}
            taken = next((g.name for p, g in new.items() if p not in old and g.name in own), None)
            if taken is not None:
                raise ServiceError(409, f"glossary_id: the name {shown(taken)} is taken", "glossary_id")
            count = sum(not g.shared for g in own.values()) - len(old) + len(new)
            if count > MAX_GLOSSARIES:
                raise ServiceError(413, f"dictionaries: at most {MAX_GLOSSARIES} glossaries (dictionaries) per API "
                                        "key; delete one first", "dictionaries")
            for g in old.values():
                del own[g.name]
            own.update((g.name, g) for g in new.values())
            return sorted(new.values(), key=lambda g: g.created)

    def delete_group(self, scope: str, key: str) -> None:
        """Delete DeepL glossary ``key`` (every dictionary). Raises ServiceError 404."""
        with self._lock:
            own = self._by_scope.get(scope, {})
            names = [g.name for g in own.values() if not g.shared and g.key == key]
            if not names:
                raise ServiceError(404, f"glossary_id: no glossary {shown(key)}", "glossary_id",
                                   type="glossary_not_found")
            for name in names:
                del own[name]

    def call(self, method: str, *args):
        """("ok", what ``method`` returns) or ("error", (status, message, field)): the Ray actor's
        entry point (a ServiceError does not cross processes as itself)."""
        try:
            return "ok", getattr(self, method)(*args)
        except ServiceError as e:
            return "error", (e.status, e.message, e.field, None, e.type)

    def delete(self, scope: str, name: str) -> None:
        """Raises ServiceError 404 (unknown), 403 (a shared glossary from the directory)."""
        with self._lock:
            own = self._by_scope.get(scope, {})
            if name in own and not own[name].shared:
                del own[name]
                return
            if name in self._by_scope[SHARED]:
                raise ServiceError(403, f"name: glossary {shown(name)} is loaded from the server's glossary "
                                        "directory and cannot be deleted through the API", "name")
        raise ServiceError(404, f"name: no glossary named {shown(name)}", "name")


def scope_of(request) -> str:
    """The caller's glossaries: its scope (``caller.Caller``) when keys are on, else SHARED."""
    return caller_of(request).scope


class GlossaryClient:
    """The async face of a store that the routes use: a ``GlossaryStore`` in this process, or the
    cluster's one store, a detached Ray actor named STORE_ACTOR (``cluster``) that every gateway
    replica shares (so a glossary created through one replica is seen by the others). The actor
    answers ServiceErrors as data (``_call``), raised again here."""

    def __init__(self, store):
        self.store = store
        self.remote = not isinstance(store, GlossaryStore)

    @classmethod
    def cluster(cls, directory: Optional[str] = None) -> "GlossaryClient":
        """The store of the Ray cluster this process runs in (created by the first caller, loading
        ``directory``: AppArgs.glossary_dir), or a store in this process when Ray is not initialised.
        Raises ValueError for a bad glossary file."""
        import ray
        if not ray.is_initialized():
            return cls(GlossaryStore(directory))
        GlossaryStore(directory)      # a bad file fails here, in the replica's constructor, with its message
        actor = ray.remote(num_cpus=0, max_concurrency=16)(GlossaryStore).options(
            name=STORE_ACTOR, namespace="serve", lifetime="detached", get_if_exists=True).remote(directory)
        return cls(actor)

    async def _call(self, method: str, *args):
        if not self.remote:
            return getattr(self.store, method)(*args)
        status, value = await self.store.call.remote(method, *args)
        if status == "error":
            raise ServiceError(*value)
        return value

    async def list(self, scope: str) -> list[StoredGlossary]:
        return await self._call("list", scope)

    async def get(self, scope: str, name: str, field: str = "glossary_id") -> StoredGlossary:
        return await self._call("get", scope, name, field)

    async def create(self, scope: str, body: GlossaryCreate) -> StoredGlossary:
        return await self._call("create", scope, body)

    async def delete(self, scope: str, name: str) -> None:
        return await self._call("delete", scope, name)

    async def members(self, scope: str, key: Optional[str] = None) -> list[StoredGlossary]:
        return await self._call("members", scope, key)

    async def edit_group(self, scope: str, key: str, put: list[StoredGlossary], merge: bool = False,
                         drop: tuple = (), label: Optional[str] = None, create: bool = False) -> list[StoredGlossary]:
        return await self._call("edit_group", scope, key, put, merge, drop, label, create)

    async def delete_group(self, scope: str, key: str) -> None:
        return await self._call("delete_group", scope, key)

    async def resolve(self, scope: str, glossary_id: str, source_lang: Optional[str], target_lang: Optional[str],
                      field: str = "glossary_id") -> tuple[tuple[str, str], ...]:
        """``resolve`` on this store (the function every route calls)."""
        return await self._call("pick", scope, glossary_id, source_lang, target_lang, field)

    async def resolve_all(self, scope: str, ids: list[str], source_lang: Optional[str], target_lang: Optional[str],
                          skip_missing: bool = False, field: str = "glossary_ids"
                          ) -> Optional[tuple[tuple[str, str], ...]]:
        """``resolve`` of several glossaries, in order: a source term an earlier one has (one stem,
        translator/glossary.py) keeps its target (DeepL's glossary_ids). ``skip_missing``: one without
        that pair adds nothing (None when none has it). Raises ServiceError 404, 409."""
        out, found = [], False
        for glossary_id in ids:
            try:
                out.extend(await self.resolve(scope, glossary_id, source_lang, target_lang, field))
                found = True
            except ServiceError as e:
                if e.status != 409 or not skip_missing:
                    raise
        kept: dict[tuple[str, ...], tuple[str, str]] = {}      # source stems -> the first entry of them
        for entry in out:
            kept.setdefault(tuple(w for w, _, _ in stems(entry[0], source_lang)), entry)
        return tuple(kept.values()) if found else None


def resolve(store: GlossaryStore, scope: str, glossary_id: str, source_lang: Optional[str],
            target_lang: Optional[str], field: str = "glossary_id") -> tuple[tuple[str, str], ...]:
    """The entries of stored glossary ``glossary_id`` for a model source_lang -> target_lang: what a
    route (this API's, LibreTranslate's, DeepL's) puts in ``TranslateJob.glossary``. Raises
    ServiceError 404 for an unknown name, 409 when the glossary's languages are not the model's (of a
    DeepL glossary: the dictionary of the model's pair, ``GlossaryStore.pick``)."""
    return store.pick(scope, glossary_id, source_lang, target_lang, field)


def check_languages(g: StoredGlossary, source_lang: Optional[str], target_lang: Optional[str],
                    field: str = "glossary_id") -> tuple[tuple[str, str], ...]:
    """``g``'s entries, once its languages (when set) are the model's. Raises ServiceError 409 (the
    stored glossary's languages conflict with the model's: state no request schema can state)."""
    glossary_id = g.name
    for side, want, have in (("source_lang", g.source_lang, source_lang), ("target_lang", g.target_lang, target_lang)):
        if want is not None and have is not None and not same_language(want, have):
            raise ServiceError(409, f"{field}: glossary {shown(glossary_id)} is for {side} {want}; the model "
                                    f"translates {source_lang}->{target_lang}", field)
    return g.entries


def base(code: Optional[str]) -> Optional[str]:
    """A language code without its region, lower case ("EN-GB" -> "en")."""
    return code.split("-")[0].lower() if code else code


def same_language(a: str, b: str) -> bool:
    """Whether two codes name one language ("en-GB" and "EN" do)."""
    return base(a) == base(b)


def dictionary_name(key: str, source_lang: str, target_lang: str) -> str:
    """The stored name of DeepL glossary ``key``'s dictionary source_lang -> target_lang."""
    return f"{key}.{source_lang}-{target_lang}"


__all__ = ["GlossaryClient", "GlossaryCreate", "GlossaryEntry", "GlossaryInfo", "GlossaryList", "GlossaryStore",
           "MAX_GLOSSARY_ENTRIES", "resolve", "scope_of"]
