"""Translated files and document jobs, kept in one directory that every ingress replica reads
(``DocumentSettings.store_dir``; on several nodes, a shared mount), for a bounded time and size.

    {store_dir}/files/{name}        a translated file (name: a random token + the file's extension)
    {store_dir}/files/{name}.json   its record: file name, media type, owner, expiry, size
    {store_dir}/jobs/{id}.json      a DeepL-style document job: status, progress, its file's name, its
                                    holder (removed with its file when its owner cancels it)
    {store_dir}/jobs/.admit.lock    held (flock) while a job is admitted: counted and written at once

Files are written to a temporary name and renamed (``os.replace``), so a replica never reads half a
file. On every write, expired files are removed, then the oldest until the files fit in
``max_store_bytes``. The owner is the SHA-256 of the API key that uploaded the file (None when keys
are off): with keys on, only a request with the same key reads it (else 404, as for a name that
does not exist: the answer says nothing about other keys' files).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from service.protocol import ServiceError
from service.state import private_dir, private_file, state_dir

_NAME = re.compile(r"[A-Za-z0-9_-]{16,64}(\.[a-z0-9]{1,10})?")      # what a stored name looks like


class DocumentSettings(BaseModel):
    """AppArgs.documents: where translated files are kept and for how long."""
    model_config = ConfigDict(extra="forbid")
    store_dir: Optional[str] = None       # None: {state dir}/documents (service/state.py); env MT_DOCUMENTS_DIR
    ttl_s: float = Field(3600.0, gt=0, allow_inf_nan=False)          # seconds a translated file is kept
    max_store_bytes: int = Field(1024 ** 3, ge=1)                    # all kept files together; oldest evicted
    chunk_segments: int = Field(16, ge=1, le=64)                     # segments per engine job (one turn)
    parallel_chunks: int = Field(2, ge=1, le=16)                     # a document's jobs in flight at once
    # the service's public base URL ("https://mt.example.com"): download URLs start with it; None: built
    # from the request (its Host header, and the scheme a proxy trusted by the ASGI server forwarded)
    public_url: Optional[str] = Field(None, pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
    # unfinished DeepL document jobs of one key (keys off: client address), counted in the store: over
    # every ingress replica that shares it
    max_jobs_per_key: int = Field(4, ge=1)

    def directory(self) -> Path:
        return Path(self.store_dir or state_dir() / "documents")


@dataclass
class StoredFile:
    name: str                  # the download name
    filename: str              # the uploaded file's name (Content-Disposition)
    media_type: str
    owner: Optional[str]       # the uploader's scope (caller.Caller.owner), None when keys are off
    created: float             # time.time()
    expires: float
    size: int                  # bytes


class DocumentStore:
    def __init__(self, settings: DocumentSettings):
        self.settings = settings
        self.root = settings.directory()
        self.files, self.jobs = self.root / "files", self.root / "jobs"

    def _ready(self) -> None:
        for d in (self.root, self.files, self.jobs):
            private_dir(d)

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        """``data`` as ``path``, whole or not at all, readable by the service's user only."""
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        with open(private_file(tmp), "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    # ---- files ----------------------------------------------------------------------------------
    def put(self, data: bytes, filename: str, media_type: str, owner: Optional[str]) -> StoredFile:
        """Keep ``data`` for ttl_s seconds; returns its record (``name`` is the download name)."""
        self._ready()
        ext = filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
        name = secrets.token_urlsafe(18) + (f".{ext}" if re.fullmatch(r"[a-z0-9]{1,10}", ext) else "")
        now = time.time()
        rec = StoredFile(name, filename, media_type, owner, now, now + self.settings.ttl_s, len(data))
        self._write(self.files / name, data)
        self._write(self.files / f"{name}.json", json.dumps(asdict(rec)).encode())
        self.evict(keep=name)
        return rec

    def get(self, name: str, owner: Optional[str], keys_on: bool) -> tuple[StoredFile, bytes]:
        """The record and bytes of a kept file. Raises ServiceError 404 for a name that is not kept
        (never was, expired, evicted) or, with keys on, belongs to another key."""
        missing = ServiceError(404, f"file {name[:80]!r} is not kept here: unknown, expired (files are kept "
                                    f"{self.settings.ttl_s:g} s) or uploaded with another API key", "name")
        if not _NAME.fullmatch(name):
            raise missing
        try:
            rec = StoredFile(**json.loads((self.files / f"{name}.json").read_bytes()))
            data = (self.files / name).read_bytes()
        except (OSError, ValueError, TypeError):
            raise missing from None
        if rec.expires < time.time() or (keys_on and rec.owner != owner):
            raise missing
        return rec, data

    def evict(self, keep: str = "") -> None:
        """Remove expired files, then the oldest until the rest fit in max_store_bytes."""
        now, records = time.time(), []
        for meta in self.files.glob("*.json"):
            try:
                rec = StoredFile(**json.loads(meta.read_bytes()))
            except (OSError, ValueError, TypeError):
                continue
            if rec.expires < now:
                self._remove(rec.name)
            else:
                records.append(rec)
        total = sum(r.size for r in records)
        for rec in sorted(records, key=lambda r: r.created):
            if total <= self.settings.max_store_bytes:
                break
            if rec.name != keep:
                self._remove(rec.name)
                total -= rec.size
        for job in self.jobs.glob("*.json"):     # job records live as long as files do
            try:
                if now - job.stat().st_mtime > self.settings.ttl_s:
                    job.unlink()
            except OSError:
                pass

    def _remove(self, name: str) -> None:
        for p in (self.files / name, self.files / f"{name}.json"):
            try:
                p.unlink()
            except OSError:
                pass

    # ---- jobs (the DeepL-style asynchronous document API) ----------------------------------------
    def put_job(self, job_id: str, record: dict) -> None:
        self._ready()
        self._write(self.jobs / f"{job_id}.json", json.dumps({**record, "updated": time.time()}).encode())

    def admit_job(self, job_id: str, record: dict, limit: int, stale_s: float) -> int:
        """Write ``record`` as job ``job_id``'s unless its holder (``record["holder"]``) has ``limit``
        unfinished jobs in the store; returns how many it had (``limit`` or more: nothing written).
        Unfinished: queued or translating, and updated within ``stale_s`` seconds (a job not updated
        for longer lost its replica). Counting and writing hold an exclusive lock on
        ``jobs/.admit.lock``, so replicas sharing the directory that admit at once count each other's
        jobs (flock: on several nodes, a shared mount that passes locks on, as NFSv4 does)."""
        self._ready()
        with open(private_file(self.jobs / ".admit.lock"), "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file is closed
            held = self._unfinished(record["holder"], stale_s)
            if held < limit:
                self.put_job(job_id, record)
            return held

    def _unfinished(self, holder: str, stale_s: float) -> int:
        now, held = time.time(), 0
        for path in self.jobs.glob("*.json"):
            try:
                if now - path.stat().st_mtime > stale_s:     # written at its last update: stale, or finished long ago
                    continue
                job = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue                                     # removed meanwhile
            held += (isinstance(job, dict) and job.get("holder") == holder
                     and job.get("status") in ("queued", "translating") and now - job.get("updated", 0) <= stale_s)
        return held

    def remove_job(self, job_id: str) -> None:
        """Forget a job: its record and its translated file (if any)."""
        if not _NAME.fullmatch(job_id):
            return
        job = self.get_job(job_id)
        if job is not None and job.get("result"):
            self._remove(job["result"])
        try:
            (self.jobs / f"{job_id}.json").unlink()
        except OSError:
            pass

    def get_job(self, job_id: str) -> Optional[dict]:
        if not _NAME.fullmatch(job_id):
            return None
        try:
            return json.loads((self.jobs / f"{job_id}.json").read_bytes())
        except (OSError, ValueError):
            return None
