"""A document's memory and a key's document jobs, bounded (issue #51): archives checked as they
inflate (caps on unpacked bytes, XML bytes and elements, whatever the headers say), text formats'
parse nodes counted as they are built (MAX_PARSED_NODES), a document's memory handed back once it is
done, DeepL document jobs capped per key and cancelled by their owner (DELETE /v2/document/{id}).
No model: "translations" upper-case each text."""
from __future__ import annotations

import asyncio
import io
import json
import os
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from service import documents
from service.api import deepl_documents
from service.api.document_store import DocumentSettings, DocumentStore
from service.api.middleware.guard import Guard, GuardSettings
from service.bench.documents_memory import TEXT_CASES, declaring, docx_of, kib, paragraphs
from service.documents import DocumentError, common, safety
from service.protocol import MAX_DOCUMENT_BYTES, MAX_XML_BYTES, ServiceError

from local_services import local_services


def refused(data: bytes) -> DocumentError:
    with pytest.raises(DocumentError) as e:
        documents.load(data, "a.docx")
    return e.value


@pytest.fixture(scope="module")
def body() -> bytes:
    """Word paragraphs of plain text, 1 MiB past MAX_XML_BYTES, compressing ~11 times (under the ratio
    cap): 2 MiB of them, 17 times (deflate looks back 32 KiB only)."""
    return paragraphs(2 << 20, 4, 40, False) * 17


@pytest.fixture(scope="module")
def honest(body) -> bytes:
    return docx_of(body)


def test_a_zip_bomb_is_refused_as_it_inflates_whatever_its_headers_say(body, honest):
    bomb = declaring(honest, "word/document.xml", 1000)     # its headers say 1,000 bytes
    assert len(bomb) < MAX_DOCUMENT_BYTES and len(body) > MAX_XML_BYTES
    assert zipfile.ZipFile(io.BytesIO(bomb)).getinfo("word/document.xml").file_size == 1000
    for data in (bomb, honest):
        e = refused(data)
        assert e.status == 413 and e.field == "file", e.message
        assert f"more than {MAX_XML_BYTES} bytes (MAX_XML_BYTES)" in e.message
    under = body[:body.rfind(b"</w:p>", 0, MAX_XML_BYTES - (1 << 20)) + 6]     # the template's other parts: 0.8 MiB
    _, unpacked = safety.open_archive(docx_of(under), "Word", "word/document.xml")
    assert MAX_XML_BYTES - (256 << 10) < unpacked < MAX_XML_BYTES + (64 << 10)     # a thumbnail too


def test_a_member_that_unpacks_to_other_than_its_header_says_is_damaged():
    good = docx_of(paragraphs(2_000, 2, 3, True))
    e = refused(declaring(good, "word/document.xml", 100_000))      # more declared than there is
    assert e.status == 422 and "its header says 100000" in e.message
    info = zipfile.ZipFile(io.BytesIO(good)).getinfo("word/document.xml")
    at = info.header_offset + 30 + len(info.filename) + 100
    bad = good[:at] + bytes(b ^ 0x5A for b in good[at:at + 200]) + good[at + 200:]     # damaged deflate data
    e = refused(bad)
    assert e.status == 422 and "'word/document.xml' cannot be read" in e.message


def test_elements_past_the_cap_and_packing_methods_office_files_do_not_use_are_refused(monkeypatch):
    data = docx_of(paragraphs(50_000, 4, 2, True))
    monkeypatch.setattr(safety, "MAX_XML_ELEMENTS", 1_000)
    e = refused(data)
    assert e.status == 413 and "more than 1000 elements (MAX_XML_ELEMENTS)" in e.message
    monkeypatch.undo()
    assert documents.load(data, "a.docx").segments
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_BZIP2)
    e = refused(out.getvalue())
    assert e.status == 422 and "stored or deflated" in e.message


def _status_kib(field: str):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return kib(field)
    except OSError:
        pytest.skip("needs Linux's /proc/self (VmRSS, VmHWM)")


def test_a_large_documents_memory_is_handed_back_once_released(honest):
    """Not timed: resident sizes around one document; after ``release`` the process is back near its
    level (glibc's malloc_trim), and refusing a bomb never builds a tree (its peak stays small)."""
    if documents._malloc_trim is None:
        pytest.skip("no glibc malloc_trim")
    data = docx_of(paragraphs(4 << 20, 10, 1, True))        # ~4 MiB of formatted paragraphs
    bomb = declaring(honest, "word/document.xml", 1000)
    documents.release(documents.load(docx_of(paragraphs(1 << 20, 10, 1, True)), "warm.docx"))   # caches first
    documents.release_memory()
    _status_kib("VmHWM")
    before = kib("VmRSS")
    refused(bomb)
    assert kib("VmHWM") - before < 64 * 1024, "refusing the bomb should hold chunks, not a tree"
    doc = documents.load(data, "a.docx")
    held = kib("VmRSS") - before
    doc.rebuild([s.upper() for s in doc.segments])
    documents.release(doc)
    left = kib("VmRSS") - before
    print(f"VmRSS: parsed +{held // 1024} MiB, released +{left // 1024} MiB")
    assert held > 48 * 1024 and left < held / 3, (held, left)


# ---- text formats: what their parsers build, counted as it is built ----------------------------------
def _upper_client(tmp_path) -> TestClient:
    """The app (keys off) with a de->en model whose translations upper-case each text."""
    from model.config import ModelConfig
    from service.api.http import build_app
    from service.protocol import TranslateResponse, Translation, Usage
    from service.translator import ModelCard

    async def upper(model, job):
        return TranslateResponse(model=model, usage=Usage(source_tokens=0, generated_tokens=0), translations=[
            Translation(text=t.upper(), tokens=[], source_tokens=[], score=0.0, finish_reason="eos") for t in job.texts])
    card = ModelCard("m", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
    return TestClient(build_app(local_services([card], upper, store_dir=str(tmp_path))))


# name -> (file head, a unit and its translation ({i}: its number from 1), the nodes a unit parses into)
UNITS = {
    "a.html": ("", "<p>Ein <b>Hund</b>.</p>\n", "<p>EIN <b>HUND</b>.</p>\n", 8),   # 4 tags, 4 texts
    "a.md": ("", "- Ein *Hund* läuft.\n", "- EIN *HUND* LÄUFT.\n", 16),   # a line, 10 tokens, 5 HTML parts
    "a.srt": ("", "{i}\n00:00:01,000 --> 00:00:02,000\nEin <i>Hund</i>\n\n",
              "{i}\n00:00:01,000 --> 00:00:02,000\nEIN <i>HUND</i>\n\n", 5),   # a cue, 4 HTML parts
    "a.vtt": ("WEBVTT\n\n", "00:00:01.000 --> 00:00:02.000\nEin <i>Hund</i>\n\n",
              "00:00:01.000 --> 00:00:02.000\nEIN <i>HUND</i>\n\n", 5),
}


@pytest.mark.parametrize("name", list(UNITS))
def test_a_text_format_past_max_parsed_nodes_is_a_413_naming_it_and_one_under_it_is_translated(name, tmp_path,
                                                                                                monkeypatch):
    monkeypatch.setattr(common, "MAX_PARSED_NODES", 1_000)
    head, unit, upper, nodes = UNITS[name]

    def post(n: int):
        data = (head + "".join(unit.format(i=i + 1) for i in range(n))).encode()
        return client.post("/v1/documents", files={"file": (name, data)}, data={"target_lang": "en"})
    with _upper_client(tmp_path) as client:
        over = post(1_000 * 5 // 4 // nodes)
        assert over.status_code == 413, over.text
        error = over.json()["error"]
        assert error["field"] == "file" and error["message"].startswith("file: the file parses into more than 1000 "
                                                                        "nodes") and "(MAX_PARSED_NODES)" in error["message"]
        n = 1_000 * 4 // 5 // nodes
        ok = post(n)
        assert ok.status_code == 200, ok.text
        assert ok.text.rstrip("\n") == (head + "".join(upper.format(i=i + 1) for i in range(n))).rstrip("\n")
        if name == "a.md":      # its lines count before markdown-it makes five numbers of each
            lines = client.post("/v1/documents", files={"file": (name, b"\n" * 1_000 + b"Ein Hund.")},
                                data={"target_lang": "en"})
            assert lines.status_code == 413 and "(MAX_PARSED_NODES)" in lines.json()["error"]["message"]


def test_plain_text_is_read_block_by_block_and_refused_at_the_segment_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "MAX_DOCUMENT_SEGMENTS", 50)
    with _upper_client(tmp_path) as client:
        over = client.post("/v1/documents", files={"file": ("a.txt", b"Ein Hund.\n\n" * 51)}, data={"target_lang": "en"})
        assert over.status_code == 413 and over.json()["error"]["message"] == \
            "file: more than 50 pieces of text to translate (MAX_DOCUMENT_SEGMENTS)", over.text
        ok = client.post("/v1/documents", files={"file": ("a.txt", b" Ein Hund.\r\n\n" * 50)}, data={"target_lang": "en"})
        assert ok.status_code == 200 and ok.content == b" EIN HUND.\r\n\n" * 50, ok.text


def test_text_formats_at_the_upload_limit_peak_within_their_budget():
    """Not timed: resident sizes around the densest text files at MAX_DOCUMENT_BYTES (before the caps:
    +2.2 GiB for the Markdown list, +691 MiB for the HTML, +307 MiB for the lines of text). Markdown's
    lines are counted before it is parsed; HTML's tags as they are read, the file refused at the cap;
    plain text is read line by line, refused at its characters' cap."""
    if documents._malloc_trim is None:
        pytest.skip("no glibc malloc_trim")
    for case, cap, budget_mib in (("md-items", "MAX_PARSED_NODES", 32), ("html-inline", "MAX_PARSED_NODES", 128),
                                  ("txt-lines", "MAX_DOCUMENT_CHARS", 32)):
        filename, make = TEXT_CASES[case]
        data = make()
        assert len(data) > MAX_DOCUMENT_BYTES - 64
        documents.release(documents.load(b"<p>Ein <b>Hund</b>\n\n", "warm" + filename[1:]))
        documents.release_memory()
        _status_kib("VmHWM")
        before = kib("VmRSS")
        e = refused_as(data, filename)
        peak = kib("VmHWM") - before
        assert e.status == 413 and f"({cap})" in e.message, e.message
        assert peak < budget_mib * 1024, (case, peak // 1024)
        assert kib("VmRSS") - before < 16 * 1024, case


def refused_as(data: bytes, filename: str) -> DocumentError:
    with pytest.raises(DocumentError) as e:
        documents.load(data, filename)
    return e.value


# ---- DeepL document jobs: a cap per key, cancel by the owner ----------------------------------------
def deepl_client(tmp_path, gate: threading.Event, max_jobs: int) -> TestClient:
    """The app with keys key-a and key-b whose translations wait for ``gate`` (at most 30 s)."""
    from model.config import ModelConfig
    from service.api.http import build_app
    from service.protocol import TranslateResponse, Translation, Usage
    from service.translator import ModelCard

    async def held(model, job):
        deadline = time.monotonic() + 30
        while not gate.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return TranslateResponse(model=model, usage=Usage(source_tokens=0, generated_tokens=0), translations=[
            Translation(text=t.upper(), tokens=[], source_tokens=[], score=0.0, finish_reason="eos") for t in job.texts])
    card = ModelCard("m", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
    svc = local_services([card], held, guard=Guard(GuardSettings(), env="key-a,key-b"), store_dir=str(tmp_path))
    svc.doc_settings.max_jobs_per_key = max_jobs
    return TestClient(build_app(svc))


def test_deepl_jobs_are_capped_per_key_and_cancelled_by_their_owner_only(tmp_path):
    gate = threading.Event()
    a, b = {"Authorization": "DeepL-Auth-Key key-a"}, {"Authorization": "DeepL-Auth-Key key-b"}

    def upload(headers):
        return client.post("/v2/document", files={"file": ("a.txt", b"Ein Hund.\n")},
                           data={"target_lang": "EN-GB", "source_lang": "DE"}, headers=headers)

    def call(method, job, key, headers, tail=""):
        return client.request(method, f"/v2/document/{job}{tail}", json={"document_key": key}, headers=headers)
    with deepl_client(tmp_path, gate, max_jobs=2) as client:
        first, second = upload(a), upload(a)
        assert first.status_code == second.status_code == 200, first.text
        over = upload(a)                                   # a third unfinished job of key-a
        assert over.status_code == 429 and int(over.headers["Retry-After"]) >= 1, over.text
        assert "at most 2 unfinished" in over.json()["message"] and "max_jobs_per_key" in over.json()["message"]
        other = upload(b)                                  # key-b still gets its job
        assert other.status_code == 200, other.text
        job, key = first.json()["document_id"], first.json()["document_key"]
        assert call("DELETE", job, key, b).status_code == 404              # another key
        assert call("DELETE", job, "0" * 64, a).status_code == 404         # a wrong document_key
        big = client.request("DELETE", f"/v2/document/{job}", content=b"x" * 20_000, headers=a)
        assert big.status_code == 413 and "at most 16384 bytes" in big.json()["message"]
        assert call("POST", job, key, a).json()["status"] in ("queued", "translating")
        assert call("DELETE", job, key, a).status_code == 204              # the owner
        assert call("POST", job, key, a).status_code == 404
        assert call("POST", job, key, a, "/result").status_code == 404
        third = upload(a)                                  # its place is free again
        assert third.status_code == 200, third.text
        # cancelled on another replica (the record removed there): the job ends without writing it back
        second_id, second_key = second.json()["document_id"], second.json()["document_key"]
        DocumentStore(DocumentSettings(store_dir=str(tmp_path))).remove_job(second_id)
        gate.set()
        for handle, headers in ((third.json(), a), (other.json(), b)):
            for _ in range(200):
                status = call("POST", handle["document_id"], handle["document_key"], headers).json()
                if status["status"] == "done":
                    break
                time.sleep(0.05)
            assert status["status"] == "done", status
        for _ in range(200):
            if not deepl_documents._jobs.running:
                break
            time.sleep(0.05)
        assert call("POST", second_id, second_key, a).status_code == 404
        files = sorted(p.name for p in (tmp_path / "files").iterdir())
        assert len(files) == 4                              # two results and their records, none of the cancelled
        done = other.json()                                 # a finished job: cancelling removes its file
        assert call("DELETE", done["document_id"], done["document_key"], b).status_code == 204
        assert call("POST", done["document_id"], done["document_key"], b, "/result").status_code == 404
        assert len(list((tmp_path / "files").iterdir())) == 2
        assert call("POST", third.json()["document_id"], third.json()["document_key"], a, "/result").content == \
            b"EIN HUND.\n"
    assert not deepl_documents._jobs.running


def test_the_job_cap_is_shared_by_the_replicas_of_one_store(tmp_path):
    """Two ingress replicas (each its own DocumentStore over one directory) admitting at once, from
    threads that start together: one key gets max_jobs_per_key places among them, another key its own;
    a job that finishes, fails or is cancelled gives its place back, as does one left without progress."""
    limit = 3

    def replicas_of(directory) -> list[DocumentStore]:
        return [DocumentStore(DocumentSettings(store_dir=str(directory))) for _ in range(2)]

    def at_once(i: int) -> bool:      # the store's admission, as deepl_documents.admit runs it
        together.wait()
        record = {"status": "queued", "holder": "h"}
        return replicas[i % 2].admit_job(f"JOB{i:016d}", record, limit, deepl_documents.JOB_STALE_S) < limit
    for attempt in range(5):          # (without the store's lock, most rounds admitted 4 to 8)
        replicas, together = replicas_of(tmp_path / str(attempt)), threading.Barrier(8)
        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(at_once, range(8))) == limit

    def admit(i: int, who: str = "k:aaaa") -> str | None:
        if who == "k:aaaa" and i < 8:
            together.wait()
        job_id = f"JOB{who[0]}{i:016d}"
        try:
            asyncio.run(deepl_documents.admit(replicas[i % 2], who, job_id, {"status": "queued"}, limit))
        except ServiceError as e:
            assert e.status == 429 and e.retry_after and e.field == "file", e
            assert f"at most {limit} unfinished" in e.message and f"; {limit} are queued or translating" in e.message
            return None
        return job_id
    replicas, together = replicas_of(tmp_path / "store"), threading.Barrier(8)
    with ThreadPoolExecutor(8) as pool:     # through the route's admission
        admitted = [j for j in pool.map(admit, range(8)) if j]
    assert len(admitted) == limit, admitted
    assert [bool(admit(i, "c:10.0.0.7")) for i in range(limit + 1)] == [True] * limit + [False]   # another holder
    assert admit(10) is None and admit(11) is None                # full, seen from either replica
    one, two, three = admitted
    replicas[0].put_job(one, {**replicas[0].get_job(one), "status": "done"})      # finished
    assert admit(100) and admit(101) is None
    replicas[1].remove_job(two)                                                   # cancelled
    assert admit(102) and admit(103) is None
    replicas[1].put_job(three, {**replicas[1].get_job(three), "status": "error"})  # failed
    assert admit(104) and admit(105) is None
    stale = replicas[0].jobs / f"JOBk{104:016d}.json"      # its replica stopped JOB_STALE_S ago
    old = time.time() - deepl_documents.JOB_STALE_S - 1
    stale.write_text(json.dumps({**json.loads(stale.read_text()), "updated": old}))
    os.utime(stale, (old, old))
    assert admit(106) and admit(107) is None
    assert [bool(admit(i, "c:10.0.0.7")) for i in range(20, 22)] == [False, False]    # the other holder: still full
