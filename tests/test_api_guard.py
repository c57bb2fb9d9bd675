"""API keys and rate limits (service/api/middleware/guard.py), without Ray: the Guard itself with a fake clock,
and its middleware in front of a small FastAPI app with the service's error handlers and the
LibreTranslate route's body-key check."""
from __future__ import annotations

import gzip
import os
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from service.api.middleware import guard as guard_mod
from service.api.middleware.body import BodyMiddleware
from service.api.errors import LIBRE_PATHS, add_exception_handlers, libre_error_response
from service.api.middleware.guard import (
    Guard,
    GuardMiddleware,
    GuardSettings,
    RateLimit,
    parse_keys,
)
from service.api.libretranslate import read_admitted
from service.protocol import ServiceError

KEY, OTHER = "k-3f9a1c7e5d", "k-other-77b2"
CAP = 16 * 1024


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Recorder:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def record(self, key: str, decision: str) -> None:
        self.calls.append((key, decision))


def make_client(guard: Guard) -> TestClient:
    app = FastAPI()
    app.add_middleware(BodyMiddleware, max_body_bytes=CAP)    # as in the gateway: inside the guard
    app.add_middleware(GuardMiddleware, get_guard=lambda: guard, libre_paths=LIBRE_PATHS)
    add_exception_handlers(app)

    @app.post("/v1/translate")
    async def native():
        return {"ok": True}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return {"metrics": True}

    @app.post("/translate")
    async def libre(request: Request):
        try:
            fields, denied = await read_admitted(request)
        except ServiceError as e:
            return libre_error_response(e)
        return denied or {"translatedText": fields.get("q")}
    return TestClient(app)


def test_keys_401_without_or_with_a_wrong_key_200_with_a_right_one_on_both_routes():
    g = Guard(GuardSettings(), env=f" {KEY} ,{OTHER},")
    g.metrics = rec = Recorder()
    c, key_id = make_client(g), g.hasher.label
    r = c.post("/v1/translate", json={})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "unauthorized" and r.json()["error"]["field"] == "Authorization"
    r = c.post("/v1/translate", json={}, headers={"Authorization": "Bearer " + KEY[:-1] + "x"})
    assert r.status_code == 401 and KEY[:-1] not in r.text
    assert c.post("/v1/translate", json={}, headers={"Authorization": f"Bearer {KEY}"}).json() == {"ok": True}
    assert c.post("/v1/translate", json={}, headers={"Authorization": f"bearer  {OTHER} "}).status_code == 200
    # LibreTranslate: the api_key field (JSON or form) or the header; errors in its shape
    body = {"q": "Hallo", "source": "de", "target": "en"}
    r = c.post("/translate", json=body)
    assert r.status_code == 401 and set(r.json()) == {"error"} and "api_key" in r.json()["error"]
    assert c.post("/translate", json={**body, "api_key": "nope"}).status_code == 401
    assert c.post("/translate", json={**body, "api_key": KEY}).json() == {"translatedText": "Hallo"}
    assert c.post("/translate", data={**body, "api_key": OTHER}).json() == {"translatedText": "Hallo"}
    assert c.post("/translate", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert c.post("/translate", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    # health stays open; /metrics only when asked
    assert c.get("/healthz").status_code == 200 and c.get("/metrics").status_code == 200
    g.settings = GuardSettings(protect_metrics=True)
    assert c.get("/metrics").status_code == 401
    assert c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # metrics see key ids, never keys
    labels = {k for k, _ in rec.calls}
    assert key_id(KEY) in labels and key_id(OTHER) in labels and {"missing", "invalid"} <= labels
    assert not any(KEY in k or OTHER in k for k in labels)
    assert len(key_id(KEY)) == 8


def test_anonymous_libretranslate_bodies_get_401_before_any_body_error():
    g = Guard(GuardSettings(), env=KEY)
    c = make_client(g)
    body = {"q": "Hallo", "source": "de", "target": "en"}
    bomb = gzip.compress(b"{" + b" " * (4 * CAP) + b"}")
    anonymous = [dict(content=b"{not json", headers={"Content-Type": "application/json"}),       # 400
                 dict(content=b"<q>Hallo</q>", headers={"Content-Type": "text/xml"}),             # 415
                 dict(content=b"x" * (CAP + 1), headers={"Content-Type": "application/json"}),    # 413
                 dict(content=bomb, headers={"Content-Type": "application/json",                  # 413 inflated
                                             "Content-Encoding": "gzip"}),
                 dict(content=b"{}", headers={"Content-Type": "application/json; charset=idna"}),  # 415
                 dict(content=b"[1]", headers={"Content-Type": "application/json"})]              # 400
    for request in anonymous:
        r = c.post("/translate", **request)
        assert r.status_code == 401 and "api_key" in r.json()["error"], (request["headers"], r.text)
        assert r.headers["www-authenticate"] == "Bearer"
    # with a key, the body's own errors again
    auth = {"Authorization": f"Bearer {KEY}"}
    assert c.post("/translate", content=b"{not json", headers={**auth, "Content-Type": "application/json"}
                  ).status_code == 400
    assert c.post("/translate", content=b"<q/>", headers={**auth, "Content-Type": "text/xml"}).status_code == 415
    assert c.post("/translate", content=b"x" * (CAP + 1), headers=auth).status_code == 413
    # the body's api_key still admits, as JSON, urlencoded and multipart
    assert c.post("/translate", json={**body, "api_key": KEY}).json() == {"translatedText": "Hallo"}
    assert c.post("/translate", data={**body, "api_key": KEY}).json() == {"translatedText": "Hallo"}
    assert c.post("/translate", files={k: (None, v) for k, v in {**body, "api_key": KEY}.items()}
                  ).json() == {"translatedText": "Hallo"}
    # keys off: the body's errors as before
    g_off = make_client(Guard(GuardSettings(), env=""))
    assert g_off.post("/translate", content=b"{not json", headers={"Content-Type": "application/json"}
                      ).status_code == 400


def test_other_authorization_schemes_are_401_naming_bearer():
    g = Guard(GuardSettings(), env=KEY)
    c = make_client(g)
    body = {"q": "Hallo", "source": "de", "target": "en", "api_key": KEY}
    for path, kwargs in (("/translate", {"json": body}), ("/v1/translate", {"json": {}})):
        r = c.post(path, headers={"Authorization": "Basic abc"}, **kwargs)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        message = r.json()["error"] if path == "/translate" else r.json()["error"]["message"]
        assert "'Basic'" in message and "Bearer <key>" in message
    assert c.get("/healthz", headers={"Authorization": "Basic abc"}).status_code == 200   # open paths stay open
    # keys off: the header is not looked at
    assert make_client(Guard(GuardSettings(), env="")).post(
        "/translate", json=body, headers={"Authorization": "Basic abc"}).status_code == 200


def test_keys_off_by_default_let_everything_through():
    g = Guard(GuardSettings(), env="")
    c = make_client(g)
    assert not g.keys_on
    assert c.post("/v1/translate", json={}).status_code == 200
    r = c.post("/translate", json={"q": "x", "source": "de", "target": "en"})
    assert r.status_code == 200 and "ratelimit-limit" not in r.headers


def test_rate_limit_429_with_headers_and_recovery():
    clock = Clock()
    g = Guard(GuardSettings(rate_limit=RateLimit(rate_per_s=2, burst=3)), env="", clock=clock)
    g.metrics = rec = Recorder()
    c = make_client(g)
    statuses = []
    for _ in range(5):
        r = c.post("/v1/translate", json={})
        statuses.append(r.status_code)
    assert statuses == [200, 200, 200, 429, 429]
    assert r.headers["ratelimit-limit"] == "3" and r.headers["ratelimit-remaining"] == "0"
    assert r.headers["retry-after"] == "1" and int(r.headers["ratelimit-reset"]) == 2     # 3 tokens at 2/s
    assert r.json()["error"]["type"] == "rate_limited" and "2 requests/s" in r.json()["error"]["message"]
    assert c.get("/healthz").status_code == 200          # health never draws from the bucket
    clock.t += 0.5                                        # one token back
    r = c.post("/v1/translate", json={})
    assert r.status_code == 200 and r.headers["ratelimit-remaining"] == "0"
    assert c.post("/v1/translate", json={}).status_code == 429
    clock.t += 10                                         # refills to the burst, never beyond
    assert [c.post("/v1/translate", json={}).status_code for _ in range(4)] == [200, 200, 200, 429]
    assert rec.calls.count(("anonymous", "rate_limited")) == 4
    # the LibreTranslate route answers in its own shape
    r = c.post("/translate", json={"q": "x", "source": "de", "target": "en"})
    assert r.status_code == 429 and set(r.json()) == {"error"} and r.headers["retry-after"] == "1"


def test_rate_limits_per_key_per_key_overrides_and_replicas(tmp_path):
    clock = Clock()
    path = tmp_path / "keys.txt"
    path.write_text(f"# comment\n{KEY}\n{OTHER} rate=1 burst=1   # a small key\n")
    g = Guard(GuardSettings(api_keys_file=str(path), rate_limit=RateLimit(rate_per_s=10, burst=4)), env="",
              clock=clock)
    admit = [g.admit(KEY, "a").error is None for _ in range(5)]
    assert admit == [True] * 4 + [False]
    assert [g.admit(OTHER, "a").error is None for _ in range(2)] == [True, False]    # its own bucket and limit
    assert g.admit(OTHER, "a").error.status == 429
    # two gateway replicas: each enforces half
    g2 = Guard(GuardSettings(rate_limit=RateLimit(rate_per_s=10, burst=4), gateway_replicas=2), env="", clock=clock)
    assert [g2.admit(None, "1.2.3.4").error is None for _ in range(3)] == [True, True, False]
    assert g2.admit(None, "5.6.7.8").error is None                                   # per client address
    assert g2.admit(None, "1.2.3.4").headers["RateLimit-Limit"] == "2"


def test_keys_file_is_reread_when_it_changes(tmp_path):
    clock = Clock()
    path = tmp_path / "keys.txt"
    path.write_text(KEY + "\n")
    g = Guard(GuardSettings(api_keys_file=str(path)), env="", clock=clock)
    assert g.admit(KEY, "a").error is None and g.admit(OTHER, "a").error.status == 401
    path.write_text(OTHER + "\n")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))    # a distinct mtime on any file system
    clock.t += guard_mod.RELOAD_CHECK_S
    assert g.admit(OTHER, "a").error is None and g.admit(KEY, "a").error.status == 401
    path.write_text("")          # an empty file: keys stay on, nobody gets in
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    clock.t += guard_mod.RELOAD_CHECK_S
    assert g.keys_on and g.admit(OTHER, "a").error.status == 401


@pytest.mark.parametrize("line", ["k rate=1", "k burst=2", "k rate=0 burst=1", "k rate=1 burst=0", "k x=1 y=2",
                                  "k rate=a burst=1", "k extra"])
def test_bad_keys_file_lines_name_the_line_not_the_key(line):
    with pytest.raises(ValueError) as e:
        parse_keys("good\n" + line.replace("k", "s3cr3t", 1), "keys.txt")
    assert "keys.txt:2" in str(e.value) and "s3cr3t" not in str(e.value)


def test_constant_time_lookup_finds_only_exact_keys():
    g = Guard(GuardSettings(), env=f"{KEY},{OTHER}")
    assert g.lookup(KEY) == KEY and g.lookup(KEY + " ") is None and g.lookup(KEY.upper()) is None
    assert g.lookup("") is None and g.lookup(None) is None and g.lookup("\ud800") is None
    t0 = time.perf_counter()
    for _ in range(2000):
        g.lookup("x" * 64)
    assert time.perf_counter() - t0 < 1.0
