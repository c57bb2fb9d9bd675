"""Who is asking: one ``Caller`` per request, decided once, before anything scoped is read or written.

    header key (Authorization: Bearer, DeepL-Auth-Key)   GuardMiddleware decides it before the route
    body or query key (LibreTranslate's ``api_key``)      the route's first step, ``guard.check_body_key``
    keys off                                               the anonymous caller: one shared scope

Every store (translation memory, glossaries, documents, DeepL jobs, usage) keys what it keeps by
``caller_of(request).scope``; a route that reads it before the key is checked raises (a 500, never a
silently shared scope). Keys are never stored or shown: ``KeyHasher`` turns a key into HMAC-SHA256
ids (RFC 2104) under a per-installation secret (``load_secret``), so a scope or metrics label cannot
be turned back into a short key offline without the secret.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ANONYMOUS = "anonymous"     # the metrics label of every request when keys are off
SECRET_ENV = "MT_KEY_SECRET"      # the secret itself (any text), instead of the secret file
SCOPE_HEX = 32                    # hex digits of a scope (128 bits: keys never collide)
LABEL_HEX = 8                     # hex digits of a metrics label (enough to tell keys apart on a dashboard)


@dataclass(frozen=True)
class Caller:
    """Who is asking."""
    scope: str      # what every store keys the caller's data by: a keyed hash of its API key; "" keys off
    label: str      # metrics and log label: a short keyed hash of the key, or ANONYMOUS
    who: str        # whose streams count: "k:<label>", or "c:<client address>" with keys off

    @property
    def owner(self) -> Optional[str]:
        """The owner of the files and jobs kept for the caller: its scope, None with keys off."""
        return self.scope or None


def anonymous(client: str) -> Caller:
    """The caller when keys are off: the shared scope, counted by client address."""
    return Caller("", ANONYMOUS, "c:" + client)


def caller_of(request_or_scope) -> Caller:
    """The request's Caller (a Starlette Request or an ASGI scope). Without a guard in front (an app
    built without GuardMiddleware) everyone is anonymous. Raises RuntimeError when the guard has not
    decided yet: the route reads scoped data before checking a key sent in its body."""
    scope = getattr(request_or_scope, "scope", request_or_scope)
    state = scope.get("state", {})
    caller = state.get("caller")
    if caller is not None:
        return caller
    if state.get("guard") is None:
        return anonymous((scope.get("client") or ("unknown",))[0])
    raise RuntimeError("the caller was read before its API key was checked (guard.check_body_key first)")


class KeyHasher:
    """HMAC-SHA256 ids of API keys under one secret; ``purpose`` keeps the scope and the label of one
    key unrelated."""

    def __init__(self, secret: bytes):
        self._secret = secret

    def _mac(self, purpose: str, key: str) -> str:
        return hmac.new(self._secret, f"{purpose}:".encode() + key.encode("utf-8", "surrogatepass"),
                        hashlib.sha256).hexdigest()

    def scope(self, key: str) -> str:
        return self._mac("scope", key)[:SCOPE_HEX]

    def label(self, key: str) -> str:
        return self._mac("label", key)[:LABEL_HEX]

    def caller(self, key: str) -> Caller:
        label = self.label(key)
        return Caller(self.scope(key), label, "k:" + label)


def load_secret(path: Optional[Path], env: Optional[str] = None) -> bytes:
    """The installation's secret: ``MT_KEY_SECRET`` when set, else the file at ``path``, created on
    first use with 32 random bytes, readable by this user only (0600; written whole under another name
    and linked into place, so replicas starting together all read the first one's). ``path`` None (and no variable): a secret of this process only."""
    env = os.environ.get(SECRET_ENV) if env is None else env
    if env:
        return env.encode("utf-8")
    if path is None:
        return secrets.token_bytes(32)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        try:
            os.link(tmp, path)      # whole or not at all; the first replica's secret wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_bytes()
