"""Access control and rate limits of the ingress: API keys and a token bucket per key (or per client
address when keys are off). Both are off by default (``GuardSettings()``).

    request -> GuardMiddleware (pure ASGI, in front of the routes)
        open path (/healthz, /readyz, /frontend/settings) -> passed on
        /metrics, /docs (+ /openapi.json)         -> a key is needed only with protect_metrics / protect_docs
        / and /explorer/* (explorer.py)           -> a key (header or the page's cookie) only with protect_explorer
        any other path                            -> Guard.admit(key, client): 401, 429, or passed on with
                                                     RateLimit-* headers added to the answer
    POST /translate without an Authorization header while keys are on: the route checks
    LibreTranslate's ``api_key`` body field itself (``Guard.admit`` again, see libretranslate.py); a
    body that cannot be read (415, 413, unparsable) is a 401 there, before any other error.
    An Authorization header of another scheme than Bearer or DeepL-Auth-Key (Basic, ...) is a 401 on
    every keyed path; DeepL's paths (/v2/*, /v3/*, deepl.py) answer it, and a missing or wrong key, as 403
    ``{"message": ...}``. The admitted request's ``Caller`` (caller.py: who is asking, the scope of
    everything kept for it) is stored as ``scope["state"]["caller"]``.
    Failed key checks draw from a bucket per client address (``failed_key_limit``): past it, 429 with
    Retry-After instead of 401, so keys cannot be guessed at speed. /metrics, when it needs no key,
    draws from a bucket per client address (``metrics_rate_limit``).

Keys come from ``MT_API_KEYS`` (comma-separated) and ``api_keys_file`` (one per line, ``#`` comments,
optional per-key limits ``KEY rate=2 burst=5``); the file is re-read when its mtime changes (checked at
most every ``RELOAD_CHECK_S``) and on ``Guard.reload()``. Keys are compared with
``hmac.compare_digest`` and never logged, counted or echoed: metrics and logs see a label, stores a
scope, both keyed hashes of the key under the installation's secret (``caller.KeyHasher``).
"""
from __future__ import annotations

import collections
import hmac
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from service.protocol import ServiceError

from ..docs_pages import is_docs_path
from ..errors import DEEPL_PREFIX, deepl_error_response, error_response, libre_error_response, route_path
from ..explorer import cookie_key, is_explorer_path, key_page
from .caller import ANONYMOUS, Caller, KeyHasher, anonymous, load_secret

ENV_KEYS = "MT_API_KEYS"
DEEPL_AUTH_SCHEME = "deepl-auth-key"   # Authorization: DeepL-Auth-Key KEY (compared ignoring case)
RELOAD_CHECK_S = 1.0               # at most one stat() of the keys file per this many seconds
MAX_BUCKETS = 65_536               # token buckets kept (least recently used evicted): bounded memory
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/frontend/settings"})   # the last: a page reads it to learn keyRequired
BODY_KEY_PATHS = ("/translate", "/detect", "/translate_file", "/suggest")   # LibreTranslate routes whose body may hold the api_key
QUERY_KEY_PREFIXES = ("/download_file/",    # routes that check the key themselves (Bearer or ?api_key=)
                      "/v3/translation_memories/files/")   # or a job's token (DeepL's upload and download URLs)
METRICS_PATHS = frozenset({"/metrics"})


class RateLimit(BaseModel):
    """A token bucket: ``rate_per_s`` requests per second sustained, bursts of up to ``burst``."""
    model_config = ConfigDict(extra="forbid")
    rate_per_s: float = Field(..., gt=0, allow_inf_nan=False)
    burst: int = Field(..., ge=1)


class GuardSettings(BaseModel):
    """AppArgs.guard: access control and rate limits of the ingress (all off by default)."""
    model_config = ConfigDict(extra="forbid")
    api_keys_file: Optional[str] = None       # one key per line (see module docstring); MT_API_KEYS adds keys
    protect_metrics: bool = False             # /metrics needs a key too (when keys are on)
    protect_docs: bool = False                # /docs and /openapi.json need a key too (when keys are on)
    protect_explorer: bool = False            # the explorer page / and its files need a key too (when keys are on)
    rate_limit: Optional[RateLimit] = None    # per key (or client address); None = no limit
    max_streams_per_key: Optional[int] = Field(None, ge=1)   # open SSE streams per key (or client); None = no limit
    # failed key checks per client address: past the bucket, 429 instead of 401; None = no limit
    failed_key_limit: Optional[RateLimit] = RateLimit(rate_per_s=0.5, burst=20)
    # GET /metrics per client address when it needs no key (a scrape every few seconds fits); None = no limit
    metrics_rate_limit: Optional[RateLimit] = RateLimit(rate_per_s=5.0, burst=60)
    key_secret_file: Optional[str] = None     # the secret of the keyed hashes (caller.load_secret); None: this process's
    gateway_replicas: int = Field(1, ge=1)    # set by build_app: each replica enforces 1/n of the limits


def parse_keys(text: str, source: str) -> dict[str, Optional[RateLimit]]:
    """key -> its own limit (or None) from a keys file's text. Raises ValueError naming the line, not the key."""
    keys: dict[str, Optional[RateLimit]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        opts = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        if len(opts) != len(parts) - 1 or not set(opts) <= {"rate", "burst"} or len(opts) == 1:
            raise ValueError(f"{source}:{n}: expected 'KEY' or 'KEY rate=R burst=B'")
        try:
            keys[parts[0]] = RateLimit(rate_per_s=float(opts["rate"]), burst=int(opts["burst"])) if opts else None
        except ValueError:
            raise ValueError(f"{source}:{n}: rate must be > 0 and burst an integer >= 1") from None
    return keys


@dataclass
class Bucket:
    tokens: float       # requests that may start now (fractional while refilling)
    t: float            # time.monotonic() of the last update


@dataclass
class Decision:
    """What the guard says about one request."""
    error: Optional[ServiceError]             # 401 / 429, or None: let it through
    headers: dict[str, str]                   # RateLimit-* (and Retry-After, WWW-Authenticate) to send
    key: str                                  # the metrics label: a key's label, ANONYMOUS, or missing/invalid
    caller: Optional[Caller] = None           # who is asking, once admitted

    @property
    def who(self) -> str:
        """Whose streams it counts: "k:<label>" or "c:<client address>"."""
        return self.caller.who if self.caller is not None else ""


class Guard:
    """API keys and token buckets of one ingress replica (see the module docstring)."""

    def __init__(self, settings: Optional[GuardSettings] = None, env: Optional[str] = None,
                 clock: Callable[[], float] = time.monotonic, metrics=None):
        self.settings = settings or GuardSettings()
        self.env = os.environ.get(ENV_KEYS, "") if env is None else env
        self.clock = clock
        self.keys: dict[str, Optional[RateLimit]] = {}
        self._mtime: Optional[float] = None
        self._checked = -math.inf
        self._buckets: collections.OrderedDict[str, Bucket] = collections.OrderedDict()
        self.streams: collections.Counter[str] = collections.Counter()   # open streams by Decision.who
        self.metrics = metrics     # service.metrics.GuardMetrics inside a replica; None: not counted
        secret = self.settings.key_secret_file
        self.hasher = KeyHasher(load_secret(Path(secret) if secret else None))
        self.reload()

    # ---- keys ------------------------------------------------------------------------------------
    def reload(self) -> None:
        """Read MT_API_KEYS and the keys file again. Raises ValueError for a malformed file."""
        keys: dict[str, Optional[RateLimit]] = {k.strip(): None for k in self.env.split(",") if k.strip()}
        path = self.settings.api_keys_file
        if path:
            self._mtime = os.stat(path).st_mtime_ns
            with open(path, encoding="utf-8") as f:
                keys.update(parse_keys(f.read(), path))
        self.keys = keys
        self._checked = self.clock()

    def _maybe_reload(self) -> None:
        path = self.settings.api_keys_file
        if not path or self.clock() - self._checked < RELOAD_CHECK_S:
            return
        self._checked = self.clock()
        try:
            if os.stat(path).st_mtime_ns != self._mtime:
                self.reload()
        except (OSError, ValueError):   # a file being rewritten or broken: keep the keys we have
            pass

    @property
    def keys_on(self) -> bool:
        self._maybe_reload()
        return bool(self.keys) or bool(self.settings.api_keys_file)

    def lookup(self, key: Optional[str]) -> Optional[str]:
        """The stored key equal to ``key`` (constant-time per candidate), or None."""
        if not key:
            return None
        found = None
        given = key.encode("utf-8", "surrogatepass")
        for k in self.keys:
            if hmac.compare_digest(given, k.encode("utf-8")):
                found = k
        return found

    # ---- the decision ------------------------------------------------------------------------------
    def needs_key(self, path: str) -> bool:
        """Whether ``path`` (without the route prefix) is behind the keys, when they are on."""
        if path in OPEN_PATHS:
            return False
        if is_docs_path(path):
            return self.settings.protect_docs
        if path in METRICS_PATHS:
            return self.settings.protect_metrics
        if is_explorer_path(path):
            return self.settings.protect_explorer
        return True

    @staticmethod
    def limited(path: str) -> bool:
        """Whether requests to ``path`` draw from the rate limit (everything but health, docs, metrics, explorer)."""
        return path not in OPEN_PATHS | METRICS_PATHS and not is_explorer_path(path) and not is_docs_path(path)

    def admit(self, key: Optional[str], client: str, field: str = "Authorization") -> Decision:
        """Check the key (when keys are on) and take one token. ``field`` is named in a 401's message;
        a client past ``failed_key_limit`` failed checks gets 429 instead."""
        if self.keys_on:
            stored = self.lookup(key)
            if stored is None:
                throttled = self._failed_check(client)
                if throttled is not None:
                    return throttled
                what = "no API key" if not key else "the API key is not valid"
                return self.unauthorized(f"{field}: {what}; send 'Authorization: Bearer <key>'" +
                                         (" or the api_key field" if field == "api_key" else ""),
                                         field, "missing" if not key else "invalid")
            caller = self.hasher.caller(stored)
            bucket_id, limit = "k:" + caller.scope, self.keys[stored] or self.settings.rate_limit
        else:
            caller = anonymous(client)
            bucket_id, limit = caller.who, self.settings.rate_limit
        if limit is None:
            return self._count(Decision(None, {}, caller.label, caller), "allowed")
        d = self._take(bucket_id, limit, caller.label, "key" if caller.scope else "client")
        d.caller = caller
        return d

    def _failed_check(self, client: str) -> Optional[Decision]:
        """One failed key check of ``client``; a counted 429 once its ``failed_key_limit`` is spent."""
        limit = self.settings.failed_key_limit
        if limit is None:
            return None
        d = self._take("f:" + client, limit, "invalid", "failed key checks")
        if d.error is None:
            return None
        d.error = ServiceError(429, f"API key: too many failed key checks from this address (at most "
                                    f"{limit.burst}, then {limit.rate_per_s:g}/s); retry after "
                                    f"{math.ceil(d.error.retry_after)} s", "Authorization",
                               retry_after=d.error.retry_after, type="rate_limited")
        return d

    def metrics_scrape(self, client: str) -> Optional[Decision]:
        """GET /metrics without a key: a counted 429 past ``metrics_rate_limit`` for ``client``, else None."""
        limit = self.settings.metrics_rate_limit
        if limit is None:
            return None
        d = self._take("m:" + client, limit, ANONYMOUS, "/metrics scrapes")
        return d if d.error is not None else None

    # ---- concurrent streams ------------------------------------------------------------------------
    def open_stream(self, who: str, label: str = ANONYMOUS) -> Callable[[], None]:
        """Count one more open stream of ``who`` (``Decision.who``; ``label``: its metrics label,
        ``Decision.key``); returns its release (idempotent: call it when the stream ends, fails or its
        client goes away). Raises ServiceError 429 when ``who`` already has ``max_streams_per_key``
        open (ceil(1/n) of it on each of n gateway replicas)."""
        limit = self.settings.max_streams_per_key
        if limit is not None:
            here = math.ceil(limit / self.settings.gateway_replicas)
            if self.streams[who] >= here:
                self._count(Decision(None, {}, label), "too_many_streams")
                what = "key" if who.startswith("k:") else "client"
                raise ServiceError(429, f"stream: at most {limit} concurrent streams per {what}"
                                        f"{f' ({here} on this gateway replica)' if here != limit else ''}; "
                                        f"{self.streams[who]} are open: retry when one ends",
                                   "stream", retry_after=1, type="too_many_streams")
        self.streams[who] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.streams[who] -= 1
                if self.streams[who] <= 0:
                    del self.streams[who]
        return release

    def unauthorized(self, message: str, field: str, label: str) -> Decision:
        """A counted 401 (``WWW-Authenticate: Bearer``) naming ``field``; ``label``: missing or invalid."""
        return self._count(Decision(ServiceError(401, message, field, type="unauthorized"),
                                    {"WWW-Authenticate": "Bearer"}, label), "unauthorized")

    def _take(self, bucket_id: str, limit: RateLimit, label: str, what: str) -> Decision:
        """One token from ``bucket_id``'s bucket; a 429 naming ``what`` is limited when it is empty."""
        n = self.settings.gateway_replicas
        rate, burst = limit.rate_per_s / n, max(1.0, limit.burst / n)
        now = self.clock()
        b = self._buckets.pop(bucket_id, None) or Bucket(burst, now)
        b.tokens = min(burst, b.tokens + (now - b.t) * rate)
        b.t = now
        self._buckets[bucket_id] = b              # most recently used last
        while len(self._buckets) > MAX_BUCKETS:
            self._buckets.popitem(last=False)
        ok = b.tokens >= 1
        if ok:
            b.tokens -= 1
        headers = {"RateLimit-Limit": str(int(burst)), "RateLimit-Remaining": str(int(b.tokens)),
                   "RateLimit-Reset": str(math.ceil((burst - b.tokens) / rate))}
        if ok:
            return self._count(Decision(None, headers, label), "allowed")
        wait = (1 - b.tokens) / rate
        return self._count(Decision(ServiceError(
            429, f"rate limit: at most {limit.rate_per_s:g} requests/s (bursts of {limit.burst}) for this {what}; "
                 f"retry after {math.ceil(wait)} s", retry_after=wait, type="rate_limited"), headers, label),
            "rate_limited")

    def _count(self, d: Decision, decision: str) -> Decision:
        if self.metrics is not None:
            self.metrics.record(d.key, decision)
        return d


def deepl_auth_key(authorization: str) -> Optional[str]:
    """The key of an ``Authorization: DeepL-Auth-Key KEY`` header value, else None."""
    scheme, _, value = authorization.strip().partition(" ")
    return (value.strip() or None) if scheme.lower() == DEEPL_AUTH_SCHEME else None


def bearer(headers: dict[str, str]) -> Optional[str]:
    """The key of an ``Authorization: Bearer <key>`` (or DeepL's ``DeepL-Auth-Key <key>``) header, else None."""
    scheme, _, value = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == DEEPL_AUTH_SCHEME:
        return deepl_auth_key(headers["authorization"])
    return value.strip() or None if scheme.lower() == "bearer" else None


class GuardMiddleware:
    """Applies ``get_guard()`` (None: nothing to do) to every HTTP request; see the module docstring.

    Rejections are answered here, in the error shape of the route (LibreTranslate's on ``libre_paths``);
    the rate-limit headers of a request the guard let through are added to its answer, and a route may
    set more in ``scope["state"]["guard_headers"]``.
    """

    def __init__(self, app, get_guard: Callable[[], Optional[Guard]], libre_paths: tuple[str, ...] = ()):
        self.app, self.get_guard, self.libre_paths = app, get_guard, libre_paths

    async def __call__(self, scope, receive, send):
        guard = self.get_guard() if scope["type"] == "http" else None
        if guard is None:
            return await self.app(scope, receive, send)
        path = route_path(scope)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        state = scope.setdefault("state", {})
        key, auth = bearer(headers), headers.get("authorization", "").strip()
        if key is None and not auth and is_explorer_path(path):
            key = cookie_key(headers)      # a browser opening the page sends its key as a cookie
        client = (scope.get("client") or ("unknown",))[0]
        state["guard"], state["guard_client"] = guard, client
        if not guard.keys_on:
            state["caller"] = anonymous(client)
        scrape = path in METRICS_PATHS and not (guard.keys_on and guard.needs_key(path))
        d = guard.metrics_scrape(client) if scrape else None
        if d is not None:
            return await error_response(d.error, headers=d.headers)(scope, receive, send)
        if not auth and (path in BODY_KEY_PATHS or path.startswith(QUERY_KEY_PREFIXES)) and guard.keys_on:
            pass        # LibreTranslate's api_key body field: the route checks it first (check_body_key)
        elif (guard.needs_key(path) and guard.keys_on) or guard.limited(path):
            scheme = auth.split()[0] if auth else ""
            if guard.keys_on and guard.needs_key(path) and scheme and scheme.lower() not in ("bearer",
                                                                                              DEEPL_AUTH_SCHEME):
                d = guard.unauthorized(f"Authorization: the {scheme[:20]!r} scheme is not accepted; send "
                                       "'Authorization: Bearer <key>'", "Authorization", "invalid")
            else:
                d = guard.admit(key, client)
            if d.error is not None:
                render = (libre_error_response if path in self.libre_paths else
                          deepl_error_response if path.startswith(DEEPL_PREFIX) else
                          key_page if is_explorer_path(path) else error_response)
                resp: JSONResponse = render(d.error, headers=d.headers)
                return await resp(scope, receive, send)
            state["guard_headers"], state["guard_decision"], state["caller"] = d.headers, d, d.caller

        async def send_with_headers(message):
            if message["type"] == "http.response.start" and state.get("guard_headers"):
                message = {**message, "headers": list(message.get("headers", [])) + [
                    (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in state["guard_headers"].items()]}
            await send(message)
        await self.app(scope, receive, send_with_headers)


def check_body_key(state: dict, api_key: object) -> Optional[Decision]:
    """For a route that reads its key from the body or the query (LibreTranslate's ``api_key``)
    without an Authorization header while keys are on: admit by that key, deciding the request's
    Caller. Returns the rejection, or None (headers stored for the middleware)."""
    guard: Optional[Guard] = state.get("guard")
    if guard is None or "guard_headers" in state or not guard.keys_on:
        return None
    d = guard.admit(api_key if isinstance(api_key, str) else None, state.get("guard_client", "unknown"), "api_key")
    if d.error is not None:
        return d
    state["guard_headers"], state["guard_decision"], state["caller"] = d.headers, d, d.caller
    return None
