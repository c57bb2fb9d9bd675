"""Tenancy (service/api/middleware/caller.py): with keys on, every stateful route, whichever way the
key is sent (header, DeepL-Auth-Key, JSON body, form, query), reads and writes the data of that
key's scope only; no key or a wrong one changes nothing. The service's own app, in process."""
from __future__ import annotations

import stat
import time
import types

import pytest
from fastapi.testclient import TestClient

from local_services import local_services, upper_cased
from model.config import ModelConfig
from service.api.glossaries import GlossaryClient, GlossaryStore
from service.api.http import build_app
from service.api.middleware.caller import KeyHasher, load_secret
from service.api.middleware.guard import Guard, GuardSettings, RateLimit
from service.protocol import TranslateResponse, Translation, Usage
from service.translator import ModelCard

A, B = "key-alpha", "key-bravo"
CARD = ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
# the ways a route may take a key; each route lists those it reads
WAYS = ("bearer", "deepl", "json", "form", "query")


def keyed(way: str, key, body: dict) -> dict:
    """httpx keyword arguments sending ``body`` with ``key`` the ``way`` given (None: no key)."""
    if key is None:
        return {"json": body}
    if way in ("bearer", "deepl"):
        scheme = "Bearer" if way == "bearer" else "DeepL-Auth-Key"
        return {"json": body, "headers": {"Authorization": f"{scheme} {key}"}}
    if way == "json":
        return {"json": {**body, "api_key": key}}
    if way == "form":
        return {"data": {**body, "api_key": key}}
    return {"json": body, "params": {"api_key": key}}


@pytest.fixture
def tenants(tmp_path):
    jobs = []
    run = upper_cased(jobs)
    guard = Guard(GuardSettings(failed_key_limit=None), env=f"{A},{B}")
    svc = local_services([CARD], run, guard=guard, store_dir=str(tmp_path / "docs"),
                         memory_file=str(tmp_path / "state" / "memory.sqlite3"),
                         glossaries=GlossaryClient(GlossaryStore("")))
    with TestClient(build_app(svc)) as client:      # one event loop: DeepL document jobs run in it
        yield types.SimpleNamespace(client=client, svc=svc, jobs=jobs, scope=guard.hasher.scope, tmp=tmp_path)


def memory_of(t, key) -> list:
    r = t.client.get("/v1/memory", params={"model": "de-en"}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return [e["source"] for e in r.json()["entries"]]


@pytest.mark.parametrize("way", ["bearer", "json", "form", "query"])
def test_a_suggestion_lands_in_the_senders_memory_only(tenants, way):
    t, q = tenants, f"Ein Hund läuft ({way})."
    body = {"q": q, "s": "A dog runs.", "source": "de", "target": "en"}
    for key, status in ((None, 401), ("wrong", 401)):
        assert t.client.post("/suggest", **keyed(way, key, body)).status_code == status
    r = t.client.post("/suggest", **keyed(way, A, body))
    assert r.status_code == 200 and r.json() == {"success": True}, r.text
    assert memory_of(t, A) == [q] and memory_of(t, B) == []
    assert t.svc.memory.export("de-en", "") == []              # never the shared (keys-off) scope
    r = t.client.post("/suggest", **keyed(way, B, {**body, "s": "Bravo's."}))
    assert r.status_code == 200 and memory_of(t, B) == [q]
    assert dict(t.svc.memory.export("de-en", t.scope(A)))[q] == "A dog runs."     # A's own correction stands


@pytest.mark.parametrize("route, ways", [("/translate", ("bearer", "json", "form", "query")),
                                         ("/v1/translate", ("bearer",)),
                                         ("/v2/translate", ("bearer", "deepl"))])
def test_a_translation_reads_the_senders_memory_and_glossaries_only(tenants, route, ways):
    t = tenants
    for key, entry in ((A, "canine"), (B, "hound")):
        r = t.client.post("/v1/glossaries", headers={"Authorization": f"Bearer {key}"}, json={
            "name": "pets", "source_lang": "de", "target_lang": "en", "entries": [{"source": "Hund", "target": entry}]})
        assert r.status_code == 201, r.text
    body = {"/translate": {"q": "Ein Hund.", "source": "de", "target": "en", "glossary_id": "pets"},
            "/v1/translate": {"text": "Ein Hund.", "source_lang": "de", "target_lang": "en", "glossary_id": "pets"},
            "/v2/translate": {"text": ["Ein Hund."], "source_lang": "DE", "target_lang": "EN-GB",
                              "glossary_id": "pets"}}[route]
    for way in ways:
        for key, entry in ((A, "canine"), (B, "hound")):
            del t.jobs[:]
            r = t.client.post(route, **keyed(way, key, body))
            assert r.status_code == 200, (way, r.text)
            assert [j.memory_scope for j in t.jobs] == [t.scope(key)], way
            assert [j.glossary for j in t.jobs] == [(("Hund", entry),)], way
        for key in (None, "wrong"):
            del t.jobs[:]
            r = t.client.post(route, **keyed(way, key, body))
            assert r.status_code in (401, 403) and t.jobs == [], (way, key, r.status_code)


def test_glossaries_and_memory_routes_are_each_keys_own(tenants):
    t = tenants
    a, b = ({"Authorization": f"Bearer {k}"} for k in (A, B))
    g = {"name": "legal", "entries": [{"source": "Vertrag", "target": "agreement"}]}
    assert t.client.post("/v1/glossaries", headers=a, json=g).status_code == 201
    assert [x["name"] for x in t.client.get("/v1/glossaries", headers=b).json()["data"]] == []
    assert t.client.get("/v1/glossaries/legal", headers=b).status_code == 404
    assert t.client.delete("/v1/glossaries/legal", headers=b).status_code == 404
    assert t.client.get("/v1/glossaries/legal", headers=a).status_code == 200
    tsv = {"Content-Type": "text/tab-separated-values"}
    r = t.client.put("/v1/memory", params={"model": "de-en"}, content="Hallo\tHello\n", headers={**a, **tsv})
    assert r.status_code == 200 and memory_of(t, A) == ["Hallo"] and memory_of(t, B) == []
    assert t.client.delete("/v1/memory", params={"model": "de-en"}, headers=b).json()["deleted"] == 0
    assert memory_of(t, A) == ["Hallo"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for method, path in (("GET", "/v1/glossaries"), ("DELETE", "/v1/glossaries/legal"), ("GET", "/v1/memory"),
                             ("DELETE", "/v1/memory")):
            assert t.client.request(method, path, headers=headers).status_code == 401, (method, path)
    assert memory_of(t, A) == ["Hallo"] and t.client.get("/v1/glossaries/legal", headers=a).status_code == 200


def test_usage_counts_each_keys_characters(tenants):
    t = tenants
    for key, text in ((A, "Ein Hund."), (B, "Ein Hund läuft heute.")):
        r = t.client.post("/v2/translate", json={"text": [text], "target_lang": "EN-GB", "source_lang": "DE"},
                          headers={"Authorization": f"DeepL-Auth-Key {key}"})
        assert r.status_code == 200, r.text
    for key, n in ((A, len("Ein Hund.")), (B, len("Ein Hund läuft heute."))):
        r = t.client.get("/v2/usage", headers={"Authorization": f"DeepL-Auth-Key {key}"})
        assert r.json()["character_count"] == n
    assert t.client.get("/v2/usage").status_code == 403


@pytest.mark.parametrize("way", ["bearer", "form"])
def test_files_are_each_uploaders_own_however_the_key_is_sent(tenants, way):
    t = tenants
    files = {"file": ("brief.txt", "Ein Hund.\n".encode())}
    fields = {"source": "de", "target": "en"}
    kw = ({"headers": {"Authorization": f"Bearer {A}"}, "data": fields} if way == "bearer"
          else {"data": {**fields, "api_key": A}})
    r = t.client.post("/translate_file", files=files, **kw)
    assert r.status_code == 200, r.text
    path = r.json()["translatedFileUrl"].split("testserver")[1]
    for own in (t.client.get(path, params={"api_key": A}), t.client.get(path, headers={"Authorization": f"Bearer {A}"})):
        assert own.status_code == 200 and own.content == b"EIN HUND.\n"
    for other in (t.client.get(path, params={"api_key": B}), t.client.get(path, headers={"Authorization": f"Bearer {B}"})):
        assert other.status_code == 404
    assert t.client.get(path).status_code == 401 and t.client.get(path, params={"api_key": "wrong"}).status_code == 401
    r = t.client.post("/v2/document", files=files, data={"target_lang": "EN-GB", "source_lang": "DE"},
                      headers={"Authorization": f"DeepL-Auth-Key {A}"})
    assert r.status_code == 200, r.text
    doc = r.json()
    status = f"/v2/document/{doc['document_id']}"
    assert t.client.post(status, data={"document_key": doc["document_key"]},
                         headers={"Authorization": f"DeepL-Auth-Key {B}"}).status_code == 404
    assert t.client.post(status, data={"document_key": doc["document_key"]},
                         headers={"Authorization": f"DeepL-Auth-Key {A}"}).status_code == 200
    for key, code in ((B, 404), (None, 403), ("wrong", 403), (A, 204)):     # cancel: the owner's only
        headers = {"Authorization": f"DeepL-Auth-Key {key}"} if key else {}
        r = t.client.request("DELETE", status, data={"document_key": doc["document_key"]}, headers=headers)
        assert r.status_code == code, (key, r.text)


def test_stored_files_are_readable_by_the_service_user_only(tenants):
    t = tenants
    assert t.client.post("/translate_file", files={"file": ("a.txt", b"Hallo.\n")},
                         data={"source": "de", "target": "en", "api_key": A}).status_code == 200
    memory_of(t, A)     # opens the memory file
    paths = [p for p in t.tmp.rglob("*")]
    assert any(p.suffix == ".txt" for p in paths) and any(p.name == "memory.sqlite3" for p in paths)
    for p in paths:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o077 == 0, (p, oct(mode))


def test_wrong_keys_are_throttled_per_client_address(tmp_path):
    guard = Guard(GuardSettings(failed_key_limit=RateLimit(rate_per_s=0.01, burst=5)), env=A)
    client = TestClient(build_app(local_services([CARD], None, guard=guard)))
    codes = [client.get("/v1/glossaries", headers={"Authorization": f"Bearer guess-{i}"}).status_code
             for i in range(8)]
    assert codes == [401] * 5 + [429] * 3
    r = client.get("/v1/glossaries", headers={"Authorization": "Bearer guess-9"})
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and "failed key checks" in r.text
    assert client.get("/v1/glossaries", headers={"Authorization": f"Bearer {A}"}).status_code == 200


def test_metrics_without_a_key_are_rate_limited_per_client(monkeypatch):
    from service.api.routes import native

    async def no_cluster():
        return "# no cluster here\n"
    monkeypatch.setattr(native, "scrape_metrics", no_cluster)
    guard = Guard(GuardSettings(metrics_rate_limit=RateLimit(rate_per_s=0.01, burst=3)), env="")
    client = TestClient(build_app(local_services([CARD], None, guard=guard)))
    assert [client.get("/metrics").status_code for _ in range(5)] == [200, 200, 200, 429, 429]


def test_keyed_ids_need_the_installations_secret(tmp_path):
    path = tmp_path / "state" / "key-secret"
    secret = load_secret(path, env="")
    assert load_secret(path, env="") == secret and stat.S_IMODE(path.stat().st_mode) == 0o600
    mine, other = KeyHasher(secret), KeyHasher(load_secret(tmp_path / "elsewhere", env=""))
    assert mine.scope(A) == KeyHasher(secret).scope(A) != other.scope(A)       # stable here, unrelated elsewhere
    assert mine.scope(A) != mine.scope(B) and len(mine.scope(A)) == 32 and len(mine.label(A)) == 8
    assert A not in mine.scope(A) and mine.label(A) not in mine.scope(A)


def test_download_urls_start_with_the_configured_public_url_whatever_the_headers_say(tmp_path):
    async def run(model, job):
        return TranslateResponse(model=model, usage=Usage(source_tokens=1, generated_tokens=1), translations=[
            Translation(text=t, tokens=[], source_tokens=[], score=0.0, finish_reason="eos") for t in job.texts])
    svc = local_services([CARD], run, store_dir=str(tmp_path))
    svc.doc_settings = svc.doc_settings.model_copy(update={"public_url": "https://mt.example.com/api"})
    client = TestClient(build_app(svc))
    forged = {"Host": "evil.example", "X-Forwarded-Proto": "http", "X-Forwarded-Host": "evil.example"}
    r = client.post("/translate_file", files={"file": ("a.txt", b"Hallo.\n")}, data={"source": "de", "target": "en"},
                    headers=forged)
    assert r.status_code == 200 and r.json()["translatedFileUrl"].startswith("https://mt.example.com/api/download_file/")
    plain = TestClient(build_app(local_services([CARD], run, store_dir=str(tmp_path))))
    r = plain.post("/translate_file", files={"file": ("a.txt", b"Hallo.\n")}, data={"source": "de", "target": "en"})
    assert r.json()["translatedFileUrl"].startswith("http://testserver/download_file/")     # the request's own


def wait_done(client: TestClient, status: str, key: dict, headers: dict) -> dict:
    """A DeepL document job's status once it has ended (the client's event loop runs the job)."""
    for _ in range(400):
        s = client.post(status, data=key, headers=headers).json()
        if s["status"] in ("done", "error"):
            return s
        time.sleep(0.05)
    return s


@pytest.mark.parametrize("scheme", ["Bearer", "DeepL-Auth-Key"])
def test_every_scoped_route_by_either_header_scheme(tenants, scheme):
    """The matrix for the header ways (every route takes both schemes): what A writes, B neither sees
    nor changes; no key and a wrong key are refused and change nothing; A still has it all after."""
    t = tenants
    a, b = ({"Authorization": f"{scheme} {k}"} for k in (A, B))
    g = {"name": "legal", "source_lang": "de", "target_lang": "en", "entries": [{"source": "Vertrag", "target": "deal"}]}
    assert t.client.post("/v1/glossaries", headers=a, json=g).status_code == 201
    tsv = {"Content-Type": "text/tab-separated-values"}
    assert t.client.put("/v1/memory", params={"model": "de-en"}, content="Hallo\tHello\n",
                        headers={**a, **tsv}).status_code == 200
    upload = t.client.post("/v2/document", files={"file": ("b.txt", b"Ein Vertrag.\n")},
                           data={"target_lang": "EN-GB", "source_lang": "DE"}, headers=a)
    assert upload.status_code == 200, upload.text
    doc = upload.json()
    status, key = f"/v2/document/{doc['document_id']}", {"document_key": doc["document_key"]}
    done = wait_done(t.client, status, key, a)
    assert done["status"] == "done" and done["billed_characters"] == len("Ein Vertrag.")
    probes = [("GET", "/v1/glossaries", {}), ("GET", "/v1/glossaries/legal", {}),
              ("GET", "/v1/memory", {"params": {"model": "de-en"}}), ("POST", status, {"data": key}),
              ("POST", status + "/result", {"data": key}), ("GET", "/v2/usage", {})]
    other = [t.client.request(m, p, headers=b, **kw) for m, p, kw in probes]
    assert [r.status_code for r in other] == [200, 404, 200, 404, 404, 200]
    assert other[0].json()["data"] == [] and other[2].json()["entries"] == []
    assert other[5].json()["character_count"] == 0
    writes = [("DELETE", "/v1/glossaries/legal", {}), ("DELETE", "/v1/memory", {"params": {"model": "de-en"}}),
              ("DELETE", status, {"data": key})]
    assert [t.client.request(m, p, headers=b, **kw).status_code for m, p, kw in writes] == [404, 200, 404]
    for headers in ({}, {"Authorization": f"{scheme} wrong"}):
        codes = [t.client.request(m, p, headers=headers, **kw).status_code for m, p, kw in probes + writes]
        assert all(c in (401, 403) for c in codes), (headers, codes)
    own = [t.client.request(m, p, headers=a, **kw) for m, p, kw in probes]     # A still has it all
    assert [r.status_code for r in own] == [200] * 6, [(r.status_code, r.text[:80]) for r in own]
    assert [x["name"] for x in own[0].json()["data"]] == ["legal"] and own[4].content == b"EIN VERTRAG.\n"
    assert [e["source"] for e in own[2].json()["entries"]] == ["Hallo"]
    assert t.client.post("/v2/translate", json={"text": ["Ein Hund."], "target_lang": "EN-GB"},
                         headers=a).status_code == 200
    usage = t.client.get("/v2/usage", headers=a).json()["character_count"]
    assert usage == len("Ein Vertrag.") + len("Ein Hund.")          # documents are billed too, as DeepL's
    again = [t.client.request(m, p, headers=a, **kw) for m, p, kw in probes[:4]]     # the result: handed over once
    assert [r.status_code for r in again] == [200, 200, 200, 404] and [e["source"] for e in again[2].json()["entries"]] == ["Hallo"]
