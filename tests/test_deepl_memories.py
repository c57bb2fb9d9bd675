"""DeepL's translation memories with the official client, unchanged (``deepl`` 1.32: import, list,
get, segments, export, delete, jobs, ``translate_text(translation_memory=..., _threshold=...)``)
against the service's app (``build_app(local_services(...))`` over a tiny in-process Translator
reading the memory file) served by uvicorn in a thread on a free 127.0.0.1 port; with API keys on,
each key's memories its own. Also raw HTTP for what the client refuses to send (bad thresholds)."""
from __future__ import annotations

import asyncio
import threading
import time
import types
import xml.etree.ElementTree as ET

import deepl
import httpx
import pytest
import uvicorn
from rapidfuzz import fuzz

from conftest import build_tiny_checkpoint
from local_services import local_services
from service.api.http import build_app
from service.api.middleware.guard import Guard, GuardSettings
from service.loadtest.serve_app import free_port
from service.translator import Translator, TranslatorSettings, model_card

A, B = "key-alpha", "key-bravo"
STORED = "Ein Hund läuft über die grüne Wiese."
STORED_EN = "A dog runs across the green meadow (stored)."
AT_75 = "Ein Hund sitzt auf der grünen Wiese."       # fuzz.ratio with STORED: exactly 75
PAIRS = [(STORED, STORED_EN), ("Zwei Männer spielen Fußball.", "Two men play football (stored)."),
         ('Er sagt "ja" & <nein>.', 'He says "yes" & <no>.')]
XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"


def tmx(pairs, source="de-DE", target="en-GB") -> bytes:
    units = "".join(f'<tu><tuv xml:lang="{source}"><seg>{_esc(s)}</seg></tuv>'
                    f'<tuv xml:lang="{target}"><seg>{_esc(t)}</seg></tuv></tu>' for s, t in pairs)
    return (f'<?xml version="1.0" encoding="UTF-8"?><tmx version="1.4"><header srclang="{source}" '
            f'datatype="plaintext" segtype="sentence" adminlang="en" o-tmf="x" creationtool="t" '
            f'creationtoolversion="1"/><body>{units}</body></tmx>').encode("utf-8")


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def tmx_pairs(data: bytes) -> list[tuple[str, str]]:
    out = []
    for tu in ET.fromstring(data).find("body").findall("tu"):
        segs = {tuv.get(XML_LANG): tuv.find("seg").text for tuv in tu.findall("tuv")}
        out.append((segs["de"], segs["en"]))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tm")
    card = model_card("tiny", build_tiny_checkpoint(tmp, "de", "en", max_len=64))
    memory_file = str(tmp / "state" / "memory.sqlite3")
    state, jobs = {}, []

    async def run(model, job):      # the translator starts in the server's event loop, on first use
        jobs.append(job)
        if "translator" not in state:
            t = Translator(card, settings=TranslatorSettings(memory_file=memory_file))
            await t.reconfigure({"max_num_seqs": 4, "cpu_kernels": False})
            state.update(translator=t, loop=asyncio.get_running_loop())
        return await state["translator"].translate(job)
    guard = Guard(GuardSettings(failed_key_limit=None), env=f"{A},{B}")
    svc = local_services([card], run, guard=guard, memory_file=memory_file)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(svc), host="127.0.0.1", port=port, log_level="warning",
                                        lifespan="off"))
    thread = threading.Thread(target=srv.run, name="uvicorn-tm", daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < end, "uvicorn did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    timeout = deepl.http_client.min_connection_timeout
    deepl.http_client.min_connection_timeout = 300.0      # the client's setting: a busy CPU translates slowly
    warm = httpx.post(f"{url}/v1/translate", json={"text": "Hallo."}, headers={"Authorization": f"Bearer {A}"},
                      timeout=120)      # the translator starts: later calls fit the client's timeouts
    assert warm.status_code == 200, warm.text
    yield types.SimpleNamespace(url=url, svc=svc, jobs=jobs, tmp=tmp,
                                client={k: deepl.DeepLClient(k, server_url=url) for k in (A, B)})
    if "translator" in state:
        asyncio.run_coroutine_threadsafe(state["translator"].stop(), state["loop"]).result(30)
    deepl.http_client.min_connection_timeout = timeout
    srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive()


def imported(s, key, pairs, name="pets.tmx", **kw):
    path = s.tmp / name
    path.write_bytes(tmx(pairs, **kw))
    job = s.client[key].import_translation_memory_from_filepath(path, display_name=name.split(".")[0],
                                                                timeout_s=20)
    assert job.ok and job.status == "completed", job
    return job.result.translation_memory_id


def engine_text(s, key, text) -> str:
    return s.client[key].translate_text(text, source_lang="DE", target_lang="EN-US").text


def test_import_list_segments_export_delete_round_trip_exactly(server):
    s, c = server, server.client[A]
    tm_id = imported(s, A, PAIRS)
    info = c.get_translation_memory(tm_id)
    assert (info.name, info.source_language, info.target_languages, info.segment_count) == \
        ("pets", "de", ["en"], 3)
    assert info.creation_time is not None
    assert tm_id in [m.translation_memory_id for m in c.list_translation_memories()]
    seen, cursor = [], None
    while True:         # one segment per page: the cursor walks all of them
        page = c.list_translation_memory_segments(tm_id, page_size=1, page_cursor=cursor)
        assert page.segment_count == 3 and len(page) == 1
        seen += [(x.source_text, x.targets[0].target_text, x.targets[0].target_language) for x in page]
        cursor = page.next_page_cursor
        if cursor is None:
            break
    assert sorted(seen) == sorted((src, tgt, "en") for src, tgt in PAIRS)
    hits = c.list_translation_memory_segments(tm_id, filter_text="MÄNNER")      # case-insensitive by default
    assert [x.source_text for x in hits] == ["Zwei Männer spielen Fußball."] and hits.segment_count == 3
    assert len(c.list_translation_memory_segments(tm_id, filter_text="MÄNNER", filter_case_sensitive=True)) == 0
    out = s.tmp / "export.tmx"
    job = c.export_translation_memory_to_filepath(tm_id, out, timeout_s=20)
    assert job.ok and job.operation == "export"
    assert sorted(tmx_pairs(out.read_bytes())) == sorted(PAIRS)
    again = imported(s, A, tmx_pairs(out.read_bytes()), name="again.tmx", source="de", target="en")
    assert sorted((x.source_text, x.targets[0].target_text) for x in c.list_translation_memory_segments(again)) \
        == sorted(PAIRS)
    for t in (tm_id, again):
        c.delete_translation_memory(t)
        with pytest.raises(deepl.DeepLException, match="Not found") as e:
            c.get_translation_memory(t)
        assert e.value.http_status_code == 404
    assert not {tm_id, again} & {m.translation_memory_id for m in c.list_translation_memories()}


def test_the_memory_answers_at_and_above_the_threshold_and_the_engine_below(server):
    s, c = server, server.client[A]
    assert fuzz.ratio(STORED, AT_75) == 75.0
    tm_id = imported(s, A, PAIRS, name="threshold.tmx")
    engine = engine_text(s, A, AT_75)
    assert engine != STORED_EN

    def translated(text, **kw):
        return c.translate_text(text, source_lang="DE", target_lang="EN-US", translation_memory=tm_id, **kw).text
    assert translated(AT_75) == STORED_EN                                       # DeepL's default, 75: at it
    assert translated(AT_75, translation_memory_threshold=75) == STORED_EN      # at the threshold
    assert translated(AT_75, translation_memory_threshold=60) == STORED_EN      # above it
    assert translated(AT_75, translation_memory_threshold=76) == engine         # below it: the engine's
    assert translated(STORED, translation_memory_threshold=100) == STORED_EN    # exact
    two = translated(f"{AT_75} Zwei Männer spielen Fussball.", translation_memory_threshold=75)
    assert two == f"{STORED_EN} Two men play football (stored)."               # each sentence on its own
    assert s.jobs[-1].memory_threshold == 75.0 and s.jobs[-1].memory_scope.endswith(f"/tm/{tm_id}")
    assert engine_text(s, A, AT_75) == engine           # without translation_memory: not this memory
    c.delete_translation_memory(tm_id)


def test_a_keys_own_memory_is_listed_and_used_fuzzily(server):
    s = server
    r = httpx.put(f"{s.url}/v1/memory", params={"model": "tiny"}, content=f"{STORED}\t{STORED_EN}\n".encode(),
                  headers={"Authorization": f"Bearer {A}", "Content-Type": "text/tab-separated-values"})
    assert r.status_code == 200, r.text
    own = [m for m in s.client[A].list_translation_memories() if m.name == "memory de->en"]
    assert len(own) == 1 and own[0].segment_count == 1
    text = s.client[A].translate_text(AT_75, source_lang="DE", target_lang="EN-GB",
                                      translation_memory=own[0].translation_memory_id).text
    assert text == STORED_EN
    r = httpx.post(f"{s.url}/v1/translate", headers={"Authorization": f"Bearer {A}"}, timeout=300,
                   json={"text": [AT_75, "Drei Katzen."], "memory_threshold": 75})
    assert r.status_code == 200, r.text
    first, second = r.json()["translations"]
    assert (first["text"], first["origin"], first["memory_score"]) == (STORED_EN, "memory", 75.0)
    assert second["origin"] == "engine" and "memory_score" not in second
    r = httpx.post(f"{s.url}/v1/translate", headers={"Authorization": f"Bearer {A}"}, timeout=300,
                   json={"text": AT_75, "memory_threshold": 75.5})
    assert r.json()["translations"][0]["origin"] == "engine"
    s.client[A].delete_translation_memory(own[0].translation_memory_id)
    assert s.svc.memory.count("tiny", s.svc.guard.hasher.scope(A)) == 0


def test_each_key_sees_and_uses_its_own_memories_only(server):
    s = server
    tm_id = imported(s, A, PAIRS, name="alpha.tmx")
    b = s.client[B]
    assert tm_id not in [m.translation_memory_id for m in b.list_translation_memories()]
    for call in (lambda: b.get_translation_memory(tm_id), lambda: b.list_translation_memory_segments(tm_id),
                 lambda: b.delete_translation_memory(tm_id), lambda: b.create_translation_memory_export(tm_id)):
        with pytest.raises(deepl.DeepLException) as e:
            call()
        assert e.value.http_status_code == 404
    with pytest.raises(deepl.DeepLException, match="translation_memory_id") as e:
        b.translate_text(STORED, source_lang="DE", target_lang="EN-US", translation_memory=tm_id)
    assert e.value.http_status_code == 404         # as an unknown id
    job = s.client[A].create_translation_memory_export(tm_id)
    with pytest.raises(deepl.DeepLException) as e:
        b.get_translation_memory_job(job.job_id)
    assert e.value.http_status_code == 404
    assert s.client[A].get_translation_memory(tm_id).segment_count == 3     # B's calls changed nothing
    s.client[A].delete_translation_memory(tm_id)


def stored_rows(s) -> int:
    with s.svc.memory.transaction() as db:
        return db.execute("SELECT COUNT(*) FROM memory").fetchone()[0]


@pytest.mark.parametrize("body, words", [
    (b"<tmx version='1.4'><body><tu>", "not well-formed"),
    (b'<?xml version="1.0"?><!DOCTYPE tmx [<!ENTITY a "aa">]><tmx version="1.4"><body/></tmx>', "DTD"),
    (tmx([(STORED, "x" * 5001)]), "at most 5000 characters"),
    (tmx([(STORED, STORED_EN)], target="fr"), "no model here translates de into fr"),
    (tmx([(STORED, STORED_EN)], source="fr", target="en"), "no model here translates fr into en"),
])
def test_a_broken_file_fails_the_job_naming_why_and_stores_nothing(server, body, words):
    s, c = server, server.client[A]
    before, rows = {m.translation_memory_id for m in c.list_translation_memories()}, stored_rows(s)
    created = c.create_translation_memory_import("bad.tmx", len(body))
    c.upload_translation_memory_file(created, body)
    job = c.get_translation_memory_job(created.job_id)
    assert job.status == "failed" and not job.ok and words in job.result.error_message, job.result.error_message
    assert {m.translation_memory_id for m in c.list_translation_memories()} == before and stored_rows(s) == rows
    path = s.tmp / "bad.tmx"
    path.write_bytes(body)
    with pytest.raises(deepl.DeepLException) as e:          # the client's one call says why too
        c.import_translation_memory_from_filepath(path, timeout_s=20)
    assert words in str(e.value)


def test_a_half_good_file_stores_nothing(server):
    s, c = server, server.client[A]
    rows = stored_rows(s)
    body = tmx([(STORED, STORED_EN), (PAIRS[1][0], PAIRS[1][1]), ("Zu lang.", "y" * 5001)])
    created = c.create_translation_memory_import("half.tmx", len(body))
    c.upload_translation_memory_file(created, body)
    job = c.get_translation_memory_job(created.job_id)
    assert job.status == "failed" and "entry 3" in job.result.error_message, job.result.error_message
    assert stored_rows(s) == rows and "half.tmx" not in [m.name for m in c.list_translation_memories()]


def test_a_tsv_import_with_its_languages(server):
    s = server
    hdr = {"Authorization": f"DeepL-Auth-Key {A}"}
    tsv = "".join(f"{a}\t{b}\n" for a, b in PAIRS[:2]).encode()
    declared = {"file_name": "pets.tsv", "content_length": len(tsv), "content_type": "text/tab-separated-values"}
    r = httpx.post(f"{s.url}/v3/translation_memories/import", headers=hdr, json={"source_file": declared})
    assert r.status_code == 400 and "parameters.source_lang" in r.json()["message"], r.text
    r = httpx.post(f"{s.url}/v3/translation_memories/import", headers=hdr, json={
        "source_file": declared, "parameters": {"source_lang": "DE", "target_lang": "FR"}})
    assert r.status_code == 400 and "no model here translates de into fr" in r.json()["message"], r.text
    langs = {"source_lang": "DE", "target_lang": "EN-GB"}
    for bad in (len(tsv) + 0.5, str(len(tsv)), True, 0, 2.0 ** 80):
        r = httpx.post(f"{s.url}/v3/translation_memories/import", headers=hdr, json={
            "source_file": {**declared, "content_length": bad}, "parameters": langs})
        assert r.status_code == 400 and "'source_file.content_length'" in r.json()["message"], (bad, r.text)
    # an integral float is an integer (JSON Schema 2020-12, as the OpenAPI 3.1 document says)
    r = httpx.post(f"{s.url}/v3/translation_memories/import", headers=hdr, json={
        "source_file": {**declared, "content_length": float(len(tsv))}, "parameters": langs})
    assert r.status_code == 200, r.text
    up = httpx.put(r.json()["upload_url"], content=tsv, headers={"Content-Type": "text/tab-separated-values"})
    assert up.status_code == 200, up.text
    job = s.client[A].get_translation_memory_job(r.json()["job_id"])
    assert job.status == "completed", job.result.error_message
    segs = s.client[A].list_translation_memory_segments(job.result.translation_memory_id)
    assert sorted((x.source_text, x.targets[0].target_text) for x in segs) == sorted(PAIRS[:2])
    s.client[A].delete_translation_memory(job.result.translation_memory_id)


@pytest.mark.parametrize("fields, field", [
    ({"translation_memory_threshold": 101}, "translation_memory_threshold"),
    ({"translation_memory_threshold": -1}, "translation_memory_threshold"),
    ({"translation_memory_threshold": "x"}, "translation_memory_threshold"),
    ({"translation_memory_id": "no-such-memory"}, "translation_memory_id"),
    ({"translation_memory_id": None, "translation_memory_threshold": 80}, "translation_memory_threshold"),
])
def test_bad_memory_fields_on_translate_are_4xx_naming_the_field(server, fields, field):
    """400 naming the field; an unknown memory 404 (as an unknown glossary_id)."""
    s = server
    tm_id = imported(s, A, PAIRS[:1], name="fields.tmx")
    body = {"text": [STORED], "source_lang": "DE", "target_lang": "EN-US", "translation_memory_id": tm_id, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    status = 404 if fields.get("translation_memory_id") == "no-such-memory" else 400
    r = httpx.post(f"{s.url}/v2/translate", headers={"Authorization": f"DeepL-Auth-Key {A}"}, json=body, timeout=300)
    assert r.status_code == status and set(r.json()) == {"message"} and field in r.json()["message"], r.text
    r = httpx.post(f"{s.url}/v1/translate", headers={"Authorization": f"Bearer {A}"},
                   json={"text": STORED, "memory_threshold": 100.5})
    assert r.status_code == 422 and r.json()["error"]["field"] == "memory_threshold", r.text
    s.client[A].delete_translation_memory(tm_id)


def test_v3_routes_answer_in_deepls_shape(server):
    s = server
    hdr = {"Authorization": f"DeepL-Auth-Key {A}"}
    unknown = "0b6a4c3e-5d1f-4e2a-9c8b-7a6f5e4d3c2b"
    for method, path, params, status, words in [
            ("GET", f"/v3/translation_memories/{unknown}", None, 404, "not found"),
            ("GET", "/v3/translation_memories/nope", None, 404, "Not Found"),       # no memory id: no such path
            ("GET", "/v3/translation_memories/jobs/nope", None, 404, "not found"),
            ("GET", "/v3/translation_memories", {"page_size": 26}, 400, "page_size"),
            ("GET", f"/v3/translation_memories/{unknown}/segments", {"filter_text": "a"}, 400, "filter_text"),
            ("GET", f"/v3/translation_memories/{unknown}/segments", {"page_cursor": "garbage"}, 400, "page_cursor"),
            ("PUT", "/v3/translation_memories/files/nope", {"token": "t"}, 404, "not found")]:
        r = httpx.request(method, s.url + path, params=params, headers=hdr)
        assert r.status_code == status and set(r.json()) == {"message"} and words in r.json()["message"], \
            (path, r.status_code, r.text)
    for method in ("GET", "DELETE", "OPTIONS"):    # "import" is no memory id: the path takes POST only
        r = httpx.request(method, f"{s.url}/v3/translation_memories/import", headers=hdr)
        assert (r.status_code, r.headers["allow"]) == (405, "POST"), (method, r.text)
    r = httpx.get(f"{s.url}/v3/translation_memories")
    assert r.status_code == 403 and set(r.json()) == {"message"}          # keys on: none sent
    created = s.client[A].create_translation_memory_import("t.tmx", 10)
    assert httpx.put(created.upload_url.replace("token=", "token=x"), content=b"0123456789").status_code == 404
    assert httpx.put(created.upload_url, content=b"012345678").status_code == 400      # not the declared size
    assert s.client[A].get_translation_memory_job(created.job_id).status == "awaiting_input"


def test_a_key_imports_at_most_max_memories(server, monkeypatch):
    from service.api import deepl_memories
    s, c = server, server.client[A]
    tm_id = imported(s, A, PAIRS[:1], name="one.tmx")
    n = sum(1 for m in c.list_translation_memories(page_size=25) if m.name != "memory de->en")
    monkeypatch.setattr(deepl_memories, "MAX_MEMORIES", n)
    with pytest.raises(deepl.DeepLException) as e:
        c.create_translation_memory_import("two.tmx", 10)
    assert e.value.http_status_code == 413 and f"at most {n} imported" in str(e.value)
    assert s.client[B].create_translation_memory_import("b.tmx", 10).job_id     # another key's room is its own
    c.delete_translation_memory(tm_id)


def test_a_document_takes_the_memory_at_and_above_the_threshold(server):
    """translate_document(translation_memory=..., translation_memory_threshold=...) as translate_text:
    each segment from the memory at and above the threshold, the engine's below; bad fields 4xx."""
    s, c = server, server.client[A]
    tm_id = imported(s, A, PAIRS, name="doc.tmx")
    src = s.tmp / "memory-doc.txt"
    src.write_text(f"{AT_75}\n\nZwei Männer spielen Fußball.\n", encoding="utf-8")

    def document(**kw) -> list[str]:
        out = s.tmp / "memory-doc.out.txt"
        out.unlink(missing_ok=True)
        c.translate_document_from_filepath(src, out, source_lang="DE", target_lang="EN-GB", **kw)
        return out.read_text(encoding="utf-8").split("\n")
    assert document(translation_memory=tm_id) == [STORED_EN, "", "Two men play football (stored).", ""]
    assert s.jobs[-1].memory_threshold == 75.0 and s.jobs[-1].memory_scope.endswith(f"/tm/{tm_id}")
    below = document(translation_memory=tm_id, translation_memory_threshold=76)
    assert below[0] == engine_text(s, A, AT_75) != STORED_EN and below[2] == "Two men play football (stored)."
    assert document()[2] != "Two men play football (stored)."        # without it: the engine's
    with pytest.raises(deepl.DeepLException) as e:                    # another key's: as unknown
        s.client[B].translate_document_from_filepath(src, s.tmp / "b.txt", source_lang="DE", target_lang="EN-GB",
                                                     translation_memory=tm_id)
    assert e.value.http_status_code == 404 and "translation_memory_id" in str(e.value)
    for fields, status, field in [({"translation_memory_id": tm_id, "translation_memory_threshold": "101"}, 400,
                                   "translation_memory_threshold"),
                                  ({"translation_memory_id": "no-such-memory"}, 404, "translation_memory_id")]:
        r = httpx.post(f"{s.url}/v2/document", headers={"Authorization": f"DeepL-Auth-Key {A}"},
                       data={"target_lang": "EN-GB", "source_lang": "DE", **fields},
                       files={"file": ("d.txt", b"Hallo.")})
        assert r.status_code == status and field in r.json()["message"], (fields, r.text)
    r = httpx.post(f"{s.url}/v2/document", headers={"Authorization": f"DeepL-Auth-Key {A}"},   # no memory to apply
                   data={"target_lang": "EN-GB", "source_lang": "DE", "translation_memory_threshold": "80"},
                   files={"file": ("d.txt", AT_75.encode())})
    assert r.status_code == 200 and r.headers["x-unsupported"] == "translation_memory_threshold", r.text
    handle = deepl.DocumentHandle(r.json()["document_id"], r.json()["document_key"])
    c.translate_document_wait_until_done(handle)
    assert c.translate_document_download(handle).content.decode() == engine_text(s, A, AT_75)
    c.delete_translation_memory(tm_id)
