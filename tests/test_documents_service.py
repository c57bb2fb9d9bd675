"""Document translation against the running service (the shared Ray + Serve app of conftest.py): each
format's text comes back as the model translates it through /v1/translate, with its structure; the
LibreTranslate file routes; the official ``deepl`` client; a short request passing a long document;
refusals as 4xx. Files are built at test time (tests/test_documents.py)."""
from __future__ import annotations

import io
import json
import threading
import time

import docx
import httpx
import pptx
import pytest

from conftest import DATA, sse_events, translate
from model.tokenizer import read_lines
from test_documents import SRT, VTT, make_docx, make_odt, with_member

pytestmark = pytest.mark.slow
LANGS = {"source_lang": "de", "target_lang": "en"}


def post_document(url: str, data: bytes, name: str, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/documents", files={"file": (name, data)}, data={**LANGS, **fields}, timeout=300)


def mt(url: str, texts: list[str]) -> list[str]:
    return [t["text"] for t in translate(url, texts, **LANGS)["translations"]]


def test_every_format_comes_back_translated_with_its_structure(service_url):
    import srt
    text = "Ein Hund läuft über die Wiese.\n\nZwei Männer spielen Fußball.\n"
    want = mt(service_url, ["Ein Hund läuft über die Wiese.", "Zwei Männer spielen Fußball.", "Ein Kind",
                            "Eine Frau", "Zwei Männer."])
    r = post_document(service_url, text.encode(), "a.txt")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    assert r.text == f"{want[0]}\n\n{want[1]}\n" and 'filename="a.txt"' in r.headers["content-disposition"]
    r = post_document(service_url, SRT.encode(), "a.srt")
    cues = list(srt.parse(r.text))
    assert [(c.start, c.end) for c in cues] == [(c.start, c.end) for c in srt.parse(SRT)]
    assert cues[1].content == want[4]
    r = post_document(service_url, make_docx(), "a.docx")
    d = docx.Document(io.BytesIO(r.content))
    assert [p.style.name for p in d.paragraphs] == ["Heading 1", "Normal", "List Bullet"]
    assert [c.text for c in d.tables[0].rows[0].cells] == want[2:4] and len(d.inline_shapes) == 1
    runs = [r for r in d.paragraphs[1].runs if r.text]
    assert [r.bold for r in runs].count(True) == 1 and all(r.text.strip() for r in runs if r.bold)
    assert d.paragraphs[1].text == mt(service_url, ["Ein Mann mit rotem Hut steht auf der Straße."])[0]
    r = post_document(service_url, make_odt(), "a.odt")
    assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.oasis.opendocument.text"
    r = post_document(service_url, "<p>Ein Hund läuft über die Wiese.</p>".encode(), "a.html")
    assert r.text == f"<p>{want[0]}</p>" and r.headers["content-type"].startswith("text/html")
    r = post_document(service_url, VTT.encode(), "a.vtt")
    assert r.text.startswith("WEBVTT") and "00:00:01.000 --> 00:00:02.500 align:start position:10%" in r.text
    assert r.text.rstrip("\n").endswith("00:00:03.000 --> 00:00:04.000\n" + want[4])
    prs = pptx.Presentation()
    tbl = prs.slides.add_slide(prs.slide_layouts[6]).shapes.add_table(1, 2, 0, 0, 100, 100).table
    tbl.cell(0, 0).text, tbl.cell(0, 1).text = "Ein Kind", "Eine Frau"
    buf = io.BytesIO()
    prs.save(buf)
    r = post_document(service_url, buf.getvalue(), "a.pptx")
    cells = pptx.Presentation(io.BytesIO(r.content)).slides[0].shapes[0].table.rows[0].cells
    assert [c.text for c in cells] == want[2:4]
    md = "# Ein Titel\n\n```\nCode bleibt\n```\n"
    r = post_document(service_url, md.encode(), "a.md")
    assert r.text == f"# {mt(service_url, ['Ein Titel'])[0]}\n\n```\nCode bleibt\n```\n"


def test_untrusted_files_get_a_4xx_naming_the_limit(service_url):
    bomb = with_member(make_docx(), "word/media/bomb.bin", b"\0" * (20 * 1024 * 1024))
    for data, name, status, words in ((bomb, "a.docx", 413, "MAX_COMPRESSION_RATIO"),
                                      (with_member(make_docx(), "../x.xml", b"<x/>"), "a.docx", 422, "outside"),
                                      (b"%PDF-1.4 x", "a.pdf", 415, "supported"),
                                      (make_docx(), "a.txt", 415, "binary")):
        r = post_document(service_url, data, name)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["field"] == "file"
    r = httpx.post(service_url + "/v1/documents", data=LANGS, files={"other": ("a.txt", b"x")}, timeout=30)
    assert r.status_code == 400 and "file" in r.text
    r = httpx.post(service_url + "/translate_file", files={"file": ("a.pdf", b"%PDF")},
                   data={"source": "de", "target": "en"}, timeout=30)
    assert r.status_code == 415 and "supported" in r.json()["error"]


def test_libretranslate_translate_file_then_download(service_url):
    """LibreTranslate's file route as its web page calls it (libretranslatepy has no file call)."""
    text = "Ein Hund läuft über die Wiese.\n"
    r = httpx.post(service_url + "/translate_file", files={"file": ("brief.txt", text.encode())},
                   data={"source": "auto", "target": "en"}, timeout=120)
    assert r.status_code == 200, r.text
    url = r.json()["translatedFileUrl"]
    assert "/download_file/" in url and url.endswith(".txt")
    got = httpx.get(url, timeout=30)
    assert got.status_code == 200 and got.text == mt(service_url, [text.strip()])[0] + "\n"
    assert 'filename="brief.txt"' in got.headers["content-disposition"]
    assert httpx.get(service_url + "/download_file/" + "A" * 24 + ".txt", timeout=30).status_code == 404


def test_the_deepl_client_translates_a_docx(service_url, tmp_path):
    import deepl
    translator = deepl.Translator("any-key", server_url=service_url)
    src, out = tmp_path / "a.docx", tmp_path / "a.en.docx"
    src.write_bytes(make_docx())
    status = translator.translate_document_from_filepath(src, out, target_lang="EN-GB")
    assert status.done and status.billed_characters > 0
    d = docx.Document(str(out))
    assert [p.style.name for p in d.paragraphs] == ["Heading 1", "Normal", "List Bullet"]
    assert d.paragraphs[2].text == mt(service_url, ["Zwei Hunde spielen."])[0]
    r = httpx.post(service_url + "/v2/document/" + "0" * 32, data={"document_key": "x"}, timeout=30)
    assert r.status_code == 404 and "Document not found" in r.json()["message"]


def test_a_short_request_sent_during_a_long_document_is_answered_first(service_url):
    """The document's jobs take turns with other clients' requests in the engine: a one-sentence
    request sent while a 160-sentence document is being translated is answered before it ends."""
    lines = read_lines(DATA / "val.de.gz")[:160]
    events, done = [], {}

    def document():
        with httpx.stream("POST", service_url + "/v1/documents", files={"file": ("long.txt", "\n\n".join(lines).encode())},
                          data={**LANGS, "stream": "true"}, timeout=600) as r:
            text = ""
            for chunk in r.iter_text():
                text += chunk
                if "event: progress" in chunk and "first" not in done:
                    done["first"] = time.time()
            done["doc"] = time.time()
            events.extend(sse_events(text))
    alone = time.time()
    translate(service_url, "Ein Hund.", **LANGS)
    alone = time.time() - alone
    t = threading.Thread(target=document)
    started = time.time()
    t.start()
    deadline = time.time() + 300
    while "first" not in done and time.time() < deadline:
        time.sleep(0.05)
    assert "first" in done and "doc" not in done
    sent = time.time()
    short = translate(service_url, "Ein Hund.", **LANGS)["translations"][0]["text"]
    answered = time.time()
    t.join(600)
    assert short and answered < done["doc"], (answered - sent, done["doc"] - sent)
    progress = [d for e, d in events if e == "progress"]
    assert [p["total"] for p in progress] == [160] * len(progress) and progress[-1]["done"] == 160
    assert [p["done"] for p in progress] == sorted(p["done"] for p in progress) and len(progress) >= 10
    (final,) = [d for e, d in events if e == "document"]
    got = httpx.get(final["url"], timeout=30).text.split("\n\n")
    assert len(got) == 160 and got[:3] == mt(service_url, lines[:3])
    print(json.dumps({"document_s": round(done["doc"] - started, 2), "short_alone_s": round(alone, 2),
                      "short_s": round(answered - sent, 2),
                      "document_left_s": round(done["doc"] - answered, 2)}))


def test_a_deepl_document_keeps_a_stored_glossarys_terms(service_url):
    """/v2/document with glossary_id: every segment keeps the glossary's terms, as /v2/translate does
    with the same glossary; an unknown glossary is a 404 at the upload, and without source_lang the
    glossary applies to the model of the document's detected language (409 for another pair)."""
    text = "Ein Mann fährt mit dem Fahrrad die Straße entlang."
    glossary = {"name": "doc-bike", "source_lang": "de", "target_lang": "en",
                "entries": [{"source": "Fahrrad", "target": "unicycle"}]}
    assert httpx.post(service_url + "/v1/glossaries", json=glossary, timeout=30).status_code == 201
    try:
        fields = {"target_lang": "EN-GB", "source_lang": "DE", "glossary_id": "doc-bike"}
        up = httpx.post(service_url + "/v2/document", files={"file": ("bike.txt", text.encode())}, data=fields,
                        timeout=60)
        assert up.status_code == 200, up.text
        job, key = up.json()["document_id"], up.json()["document_key"]
        deadline = time.time() + 60
        while (status := httpx.post(f"{service_url}/v2/document/{job}", data={"document_key": key},
                                    timeout=30).json())["status"] != "done":
            assert status["status"] in ("queued", "translating") and time.time() < deadline, status
            time.sleep(0.5)
        got = httpx.post(f"{service_url}/v2/document/{job}/result", data={"document_key": key}, timeout=30).text
        want = httpx.post(service_url + "/v2/translate", data={"text": text, **fields}, timeout=60).json()
        assert "unicycle" in got and got.strip() == want["translations"][0]["text"], (got, want)
        for extra, status_code, words in (({"glossary_id": "nope"}, 404, "glossary"),
                                          ({"source_lang": ""}, 200, "document_id"),
                                          ({"source_lang": "", "target_lang": "DE"}, 409, "glossary")):
            name, data = ("bike.txt", text.encode()) if "target_lang" not in extra else ("bike.txt", b"A man rides a bike.")
            r = httpx.post(service_url + "/v2/document", files={"file": (name, data)}, data={**fields, **extra},
                           timeout=60)
            assert r.status_code == status_code and words in r.text, r.text
    finally:
        httpx.delete(service_url + "/v1/glossaries/doc-bike", timeout=30)
