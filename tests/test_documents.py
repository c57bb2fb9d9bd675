"""Document formats (service/documents), their safety checks, the store of translated files and the
way a document's segments go to the engine; no model (the "translations" here are upper-cased
segments, as in test_api_html.py). Files are built at test time with the formats' own libraries."""
from __future__ import annotations

import asyncio
import base64
import io
import time
import zipfile

import docx
import pptx
import pytest
from fastapi.testclient import TestClient
from odf import teletype
from odf.opendocument import OpenDocumentText
from odf.opendocument import load as odf_load
from odf.style import Style, TextProperties
from odf.table import Table, TableCell, TableColumn, TableRow
from odf.text import A, H, List, ListItem, P, Span

from service import documents
from service.api import documents as routes
from service.api.document_store import DocumentSettings, DocumentStore
from service.api.middleware.caller import KeyHasher
from service.api.middleware.guard import Guard, GuardSettings
from service.documents import DocumentError, safety
from service.protocol import ServiceError

from local_services import local_services

PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")

owner_of = KeyHasher(b"a test secret").scope     # an uploader's owner id, as the guard derives it


def upper(data: bytes, name: str) -> tuple[list[str], bytes]:
    doc = documents.load(data, name)
    return doc.segments, doc.rebuild([s.upper() for s in doc.segments])


def refused(data: bytes, name: str) -> DocumentError:
    with pytest.raises(DocumentError) as e:
        documents.load(data, name)
    return e.value


# ---- formats ---------------------------------------------------------------------------------------
def test_plain_text_blocks_are_segments_and_whitespace_stays():
    src = "  Ein Hund läuft.\nEr springt.\n\n\nZwei Katzen.  \n"
    segments, out = upper(src.encode(), "a.txt")
    assert segments == ["Ein Hund läuft.\nEr springt.", "Zwei Katzen."]
    assert out.decode() == "  EIN HUND LÄUFT.\nER SPRINGT.\n\n\nZWEI KATZEN.  \n"
    assert refused("Ein Hund".encode("utf-16"), "a.txt").status == 422      # text, not UTF-8 (its BOM names it)
    assert refused(b"Ein\x00Hund", "a.txt").status == 415                  # NUL bytes without a BOM: binary
    assert refused(b"caf\xe9", "a.txt").status == 422


def test_html_page_keeps_markup_and_inline_elements():
    src = '<html><head><style>p{}</style></head><body><h1>Ein Titel</h1><p>Ein <b>roter</b> Hut.</p></body></html>'
    segments, out = upper(src.encode(), "a.html")
    assert segments == ["Ein Titel", "Ein roter Hut.", "roter"]
    assert out.decode() == src.replace("Ein Titel", "EIN TITEL").replace("Ein <b>roter</b> Hut.", "EIN <b>ROTER</b> HUT.")


def test_markdown_keeps_front_matter_code_and_inline_markup():
    src = ('---\ntitle: Ein Titel\n---\n# Ein **großer** Titel\n\nEin Hund läuft [über](http://x.de "t") die '
           "`Wiese` und\nspringt.\n\n- Eins\n- Zwei *drei*\n\n> Zitat\n\n| A | B |\n|---|---|\n| Hund | Katze |\n\n"
           "```\nCode bleibt\n```\n\n    eingerückt bleibt\n")
    segments, out = upper(src.encode(), "a.md")
    assert "Code bleibt" not in " ".join(segments) and "Ein Titel" not in segments
    assert out.decode() == ('---\ntitle: Ein Titel\n---\n# EIN **GROSSER** TITEL\n\nEIN HUND LÄUFT [ÜBER](http://x.de "t") '
                            "DIE `Wiese` UND\nSPRINGT.\n\n- EINS\n- ZWEI *DREI*\n\n> ZITAT\n\n| A | B |\n|---|---|\n"
                            "| HUND | KATZE |\n\n```\nCode bleibt\n```\n\n    eingerückt bleibt\n")


SRT = ("1\n00:00:01,000 --> 00:00:02,500\nEin <i>Hund</i> läuft\nüber die Wiese.\n\n"
       "2\n00:01:03,040 --> 00:01:04,999\nZwei Männer.\n\n")
VTT = ("WEBVTT\n\nSTYLE\n::cue { color: red }\n\nintro\n00:00:01.000 --> 00:00:02.500 align:start position:10%\n"
       "Ein <b>Hund</b> läuft\nüber die Wiese.\n\nNOTE eine Notiz\n\n00:00:03.000 --> 00:00:04.000\nZwei Männer.\n")


def test_subtitle_timings_settings_and_notes_are_identical():
    import srt
    import webvtt
    segments, out = upper(SRT.encode(), "a.srt")
    assert segments == ["Ein Hund läuft über die Wiese.", "Hund", "Zwei Männer."]
    before, after = list(srt.parse(SRT)), list(srt.parse(out.decode()))
    assert [(c.index, c.start, c.end) for c in after] == [(c.index, c.start, c.end) for c in before]
    assert [c.content for c in after] == ["EIN <i>HUND</i> LÄUFT\nÜBER DIE WIESE.", "ZWEI MÄNNER."]
    segments, out = upper(VTT.encode(), "a.vtt")
    before, after = webvtt.from_buffer(io.StringIO(VTT)), webvtt.from_buffer(io.StringIO(out.decode()))
    assert [(c.identifier, c.start, c.end, c.settings if hasattr(c, "settings") else None) for c in after.captions] == \
           [(c.identifier, c.start, c.end, c.settings if hasattr(c, "settings") else None) for c in before.captions]
    assert [c.raw_text for c in after.captions] == ["EIN <b>HUND</b> LÄUFT\nÜBER DIE WIESE.", "ZWEI MÄNNER."]
    assert "STYLE\n::cue { color: red }" in out.decode() and "NOTE eine Notiz" in out.decode()
    assert refused(b"1\n00:00:01,000 --> kaputt\nText\n", "a.srt").status == 422


def make_docx() -> bytes:
    d = docx.Document()
    d.add_heading("Ein Titel", level=1)
    p = d.add_paragraph("Ein Mann mit ")
    p.add_run("rotem Hut").bold = True
    p.add_run(" steht auf der Straße.")
    p.add_run().add_picture(io.BytesIO(PNG))
    d.add_paragraph("Zwei Hunde spielen.", style="List Bullet")
    t = d.add_table(rows=1, cols=2)
    t.cell(0, 0).text, t.cell(0, 1).text = "Ein Kind", "Eine Frau"
    d.sections[0].header.paragraphs[0].text = "Eine Kopfzeile"
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def test_docx_keeps_styles_runs_tables_headers_and_images():
    segments, out = upper(make_docx(), "a.docx")
    assert segments == ["Ein Titel", "Ein Mann mit rotem Hut steht auf der Straße.", "rotem Hut",
                        "Zwei Hunde spielen.", "Ein Kind", "Eine Frau", "Eine Kopfzeile"]
    d = docx.Document(io.BytesIO(out))
    assert [(p.style.name, [(r.text, r.bold) for r in p.runs if r.text]) for p in d.paragraphs] == [
        ("Heading 1", [("EIN TITEL", None)]),
        ("Normal", [("EIN MANN MIT ", None), ("ROTEM HUT", True), (" STEHT AUF DER STRASSE.", None)]),
        ("List Bullet", [("ZWEI HUNDE SPIELEN.", None)])]
    assert len(d.inline_shapes) == 1                                   # the image run stays, once
    assert [c.text for c in d.tables[0].rows[0].cells] == ["EIN KIND", "EINE FRAU"]
    assert d.sections[0].header.paragraphs[0].text == "EINE KOPFZEILE"


def test_pptx_keeps_levels_runs_and_tables():
    prs = pptx.Presentation()
    s = prs.slides.add_slide(prs.slide_layouts[1])
    s.shapes.title.text = "Ein Titel"
    tf = s.placeholders[1].text_frame
    tf.text = "Ein Mann mit "
    r = tf.paragraphs[0].add_run()
    r.text, r.font.bold = "rotem Hut", True
    r = tf.paragraphs[0].add_run()
    r.text = " steht."
    r.hyperlink.address = "http://example.com/"
    p = tf.add_paragraph()
    p.text, p.level = "Zwei Hunde spielen.", 1
    tbl = s.shapes.add_table(1, 2, 0, 0, 100, 100).table
    tbl.cell(0, 0).text, tbl.cell(0, 1).text = "Ein Kind", "Eine Frau"
    buf = io.BytesIO()
    prs.save(buf)
    segments, out = upper(buf.getvalue(), "a.pptx")
    shapes = pptx.Presentation(io.BytesIO(out)).slides[0].shapes
    assert [(p.level, [(r.text, r.font.bold, r.hyperlink.address) for r in p.runs])
            for p in shapes[1].text_frame.paragraphs] == [
        (0, [("EIN MANN MIT ", None, None), ("ROTEM HUT", True, None), (" ", None, None),    # edge space: plain
             ("STEHT.", None, "http://example.com/")]),
        (1, [("ZWEI HUNDE SPIELEN.", None, None)])]
    assert shapes[0].text_frame.text == "EIN TITEL"
    assert [c.text for c in shapes[2].table.rows[0].cells] == ["EIN KIND", "EINE FRAU"]


def make_odt() -> bytes:
    doc = OpenDocumentText()
    bold = Style(name="Bold", family="text")
    bold.addElement(TextProperties(fontweight="bold"))
    doc.automaticstyles.addElement(bold)
    doc.text.addElement(H(outlinelevel=1, text="Ein Titel"))
    p = P(text="Ein Mann mit ")
    p.addElement(Span(stylename=bold, text="rotem Hut"))
    p.addText(" steht auf der Straße.")
    doc.text.addElement(p)
    p = P(text="Siehe ")
    p.addElement(A(href="http://example.com/", text="die Seite"))
    p.addText(" hier.")
    doc.text.addElement(p)
    lst, item = List(), ListItem()
    item.addElement(P(text="Zwei Hunde spielen."))
    lst.addElement(item)
    doc.text.addElement(lst)
    t, row = Table(name="T"), TableRow()
    t.addElement(TableColumn(numbercolumnsrepeated=2))
    t.addElement(row)
    for s in ("Ein Kind", "Eine Frau"):
        c = TableCell()
        c.addElement(P(text=s))
        row.addElement(c)
    doc.text.addElement(t)
    out = io.BytesIO()
    doc.write(out)
    return out.getvalue()


def test_odt_keeps_headings_spans_links_lists_and_tables():
    segments, out = upper(make_odt(), "a.odt")
    doc = odf_load(io.BytesIO(out))
    paras = [(p.qname[1], teletype.extractText(p), [(c.qname[1], str(c), sorted(c.attributes.values()))
                                                   for c in p.childNodes if c.nodeType == 1])
             for p in doc.text.getElementsByType(H) + doc.text.getElementsByType(P)]
    assert paras == [
        ("h", "EIN TITEL", []),
        ("p", "EIN MANN MIT ROTEM HUT STEHT AUF DER STRASSE.", [("span", "ROTEM HUT", ["Bold"])]),
        ("p", "SIEHE DIE SEITE HIER.", [("a", "DIE SEITE", ["http://example.com/", "simple"])]),
        ("p", "ZWEI HUNDE SPIELEN.", []), ("p", "EIN KIND", []), ("p", "EINE FRAU", [])]
    assert len(doc.text.getElementsByType(ListItem)) == 1 and len(doc.text.getElementsByType(TableCell)) == 2


# ---- untrusted files -------------------------------------------------------------------------------
def zip_of(members: dict[str, bytes], method=zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, data in members.items():
            z.writestr(zipfile.ZipInfo(name), data, compress_type=method)
    return buf.getvalue()


def with_member(base: bytes, name: str, data: bytes) -> bytes:
    """A copy of the archive ``base`` with member ``name`` replaced (or added)."""
    src = zipfile.ZipFile(io.BytesIO(base))
    members = {i.filename: src.read(i) for i in src.infolist()}
    members[name] = data
    return zip_of(members)


def test_archive_attacks_are_refused_with_the_limit_named(monkeypatch):
    good = make_docx()
    e = refused(with_member(good, "word/media/bomb.bin", b"\0" * (20 * 1024 * 1024)), "a.docx")     # zip bomb
    assert e.status == 413 and "MAX_COMPRESSION_RATIO" in e.message and len(good) < 100_000
    monkeypatch.setattr(safety, "MAX_UNCOMPRESSED_BYTES", 30_000)
    e = refused(good, "a.docx")
    assert e.status == 413 and "MAX_UNCOMPRESSED_BYTES" in e.message
    monkeypatch.undo()
    for name in ("../evil.xml", "/etc/passwd", "word\\..\\..\\x.xml", "C:/x.xml", "a/../../b.xml"):
        e = refused(with_member(good, name, b"<x/>"), "a.docx")
        assert e.status == 422 and "outside the archive" in e.message, name
    xxe = b'<?xml version="1.0"?><!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/passwd">]><d>&x;</d>'
    laughs = b'<!DOCTYPE d [<!ENTITY a "aaaa"><!ENTITY b "&a;&a;&a;&a;">]><d>&b;</d>'
    for xml in (xxe, laughs):
        e = refused(with_member(good, "word/document.xml", xml), "a.docx")
        assert e.status == 422 and "DTD or entities" in e.message
    deep = b"<a>" * 300 + b"</a>" * 300
    e = refused(with_member(good, "word/document.xml", deep), "a.docx")
    assert e.status == 413 and "MAX_XML_DEPTH" in e.message
    odt = make_odt()
    content = zipfile.ZipFile(io.BytesIO(odt)).read("content.xml")
    nested = b'<text:span text:style-name="Bold">' * 150 + b"tief" + b"</text:span>" * 150
    e = refused(with_member(odt, "content.xml", content.replace(b"Ein Titel", nested, 1)), "a.odt")
    assert e.status == 413 and "MAX_INLINE_DEPTH" in e.message and e.field == "file"
    e = refused(zip_of({f"m{i}.txt": b"" for i in range(documents.common.MAX_ARCHIVE_MEMBERS + 1)}), "a.docx")
    assert e.status == 413 and "MAX_ARCHIVE_MEMBERS" in e.message
    assert refused(b"x" * (documents.MAX_DOCUMENT_BYTES + 1), "a.txt").status == 413
    assert refused(good, "a.txt").status == 415                   # a zip named .txt
    assert refused(b"Ein Hund.", "a.docx").status == 415           # text named .docx
    assert refused(good, "a.pptx").status == 415                   # a docx named .pptx
    assert refused(make_odt(), "a.docx").status == 415
    e = refused(b"%PDF-1.4", "a.pdf")
    assert e.status == 415 and ".docx" in e.message
    e = refused(good[:len(good) // 2], "a.docx")
    assert e.status in (415, 422)


# ---- the store ------------------------------------------------------------------------------------
def test_store_keeps_files_per_key_and_evicts_expired_and_oldest(tmp_path, monkeypatch):
    store = DocumentStore(DocumentSettings(store_dir=str(tmp_path), ttl_s=60, max_store_bytes=25))
    a = store.put(b"0123456789", "a.txt", "text/plain", owner_of("key-a"))
    assert store.get(a.name, owner_of("key-a"), True)[1] == b"0123456789"
    for other in (owner_of("key-b"), None):
        with pytest.raises(ServiceError) as e:
            store.get(a.name, other, True)
        assert e.value.status == 404
    assert store.get(a.name, None, False)[1] == b"0123456789"         # keys off: no owner check
    for bad in ("../../etc/passwd", "x", a.name + "/.."):
        with pytest.raises(ServiceError):
            store.get(bad, None, False)
    b = store.put(b"0123456789", "b.txt", "text/plain", None)
    c = store.put(b"0123456789", "c.txt", "text/plain", None)         # 30 bytes > 25: the oldest goes
    with pytest.raises(ServiceError):
        store.get(a.name, owner_of("key-a"), True)
    assert store.get(b.name, None, False)[0].filename == "b.txt"
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 61)
    with pytest.raises(ServiceError):
        store.get(c.name, None, False)
    store.evict()
    assert not list((tmp_path / "files").iterdir())


# ---- how a document's segments reach the engine ----------------------------------------------------
async def test_segments_go_in_small_jobs_with_few_in_flight_and_big_ones_split():
    settings = DocumentSettings(chunk_segments=4, parallel_chunks=2)
    jobs, in_flight, peak = [], 0, 0

    async def run(model, job):
        nonlocal in_flight, peak
        if any(len(t) > 50 for t in job.texts):
            raise ServiceError(413, "text: too long", "text")
        in_flight += 1
        peak = max(peak, in_flight)
        jobs.append(list(job.texts))
        await asyncio.sleep(0.01)
        in_flight -= 1
        from service.protocol import TranslateResponse, Translation, Usage
        return TranslateResponse(model=model, usage=Usage(source_tokens=0, generated_tokens=0), translations=[
            Translation(text=t.upper(), tokens=[], source_tokens=[], score=0.0, finish_reason="eos") for t in job.texts])
    segments = [f"satz {i}" for i in range(17)] + ["", "wort " * 20]
    seen = []
    out, chars = await routes.translate_segments(segments, "m", None, run, settings, lambda d, t: seen.append((d, t)))
    assert out == [s.upper() for s in segments]
    assert peak == 2 and max(len(j) for j in jobs) <= 4 and seen[-1] == (18, 18)
    assert chars == sum(len(s) for s in segments)


# ---- the routes with API keys on (in process: the service's app, translations upper-casing each text) --
async def _upper(model, job):
    from service.protocol import TranslateResponse, Translation, Usage
    return TranslateResponse(model=model, usage=Usage(source_tokens=0, generated_tokens=0), translations=[
        Translation(text=t.upper(), tokens=[], source_tokens=[], score=0.0, finish_reason="eos") for t in job.texts])


def keyed_client(tmp_path) -> TestClient:
    from model.config import ModelConfig
    from service.api.http import build_app
    from service.translator import ModelCard
    card = ModelCard("m", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
    svc = local_services([card], _upper, guard=Guard(GuardSettings(), env="key-a,key-b"), store_dir=str(tmp_path))
    return TestClient(build_app(svc))


def test_files_are_downloadable_only_with_the_key_that_uploaded_them(tmp_path):
    client = keyed_client(tmp_path)
    txt = {"file": ("brief.txt", "Ein Hund.\n".encode())}
    assert client.post("/translate_file", files=txt, data={"source": "de", "target": "en"}).status_code == 401
    r = client.post("/translate_file", files=txt, data={"source": "de", "target": "en", "api_key": "key-a"})
    assert r.status_code == 200, r.text
    path = r.json()["translatedFileUrl"].split("testserver")[1]
    assert client.get(path).status_code == 401                                    # no key
    assert client.get(path, headers={"Authorization": "Bearer key-b"}).status_code == 404
    assert client.get(path + "?api_key=key-b").status_code == 404
    for ok in (client.get(path + "?api_key=key-a"), client.get(path, headers={"Authorization": "Bearer key-a"})):
        assert ok.status_code == 200 and ok.content == "EIN HUND.\n".encode()
    r = client.post("/translate_file", files={"file": ("a.pdf", b"%PDF")},
                    data={"source": "de", "target": "en", "api_key": "key-a"})
    assert r.status_code == 415 and "supported" in r.json()["error"]
    # the native route: the file itself; a streamed one: progress, then a URL for the same key only
    a = {"Authorization": "Bearer key-a"}
    r = client.post("/v1/documents", files=txt, data={"target_lang": "en"}, headers=a)
    assert r.status_code == 200 and r.content == "EIN HUND.\n".encode()
    r = client.post("/v1/documents", files=txt, data={"target_lang": "xx"}, headers=a)
    assert r.status_code == 404 and r.json()["error"]["field"] == "target_lang"
    for name in ("", "brief.mar\u212adown"):   # an empty filename field is no name; the Kelvin sign is no k
        r = client.post("/v1/documents", files=txt, data={"target_lang": "en", "filename": name}, headers=a)
        assert r.status_code == 415 and "supported" in r.json()["error"]["message"], r.text
    r = client.post("/v1/documents", files=txt, data={"target_lang": "en", "filename": "brief.TXT"}, headers=a)
    assert r.status_code == 200 and r.content == "EIN HUND.\n".encode()
    r = client.post("/v1/documents", files=txt, data={"target_lang": "en", "stream": "true"}, headers=a)
    from conftest import sse_events
    events = sse_events(r.text)
    assert [e for e, _ in events] == ["progress", "document"] and events[0][1] == {"done": 1, "total": 1}
    path = events[1][1]["url"].split("testserver")[1]
    assert client.get(path, headers={"Authorization": "Bearer key-b"}).status_code == 404
    assert client.get(path, headers=a).content == "EIN HUND.\n".encode()


def test_deepl_document_jobs_need_their_document_key_and_the_same_api_key(tmp_path):
    with keyed_client(tmp_path) as client:      # one event loop for the requests and the background job
        deepl_job_checks(client)


def deepl_job_checks(client: TestClient) -> None:
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    r = client.post("/v2/document", files={"file": ("a.docx", make_docx())}, data={"target_lang": "EN-GB",
                                                                                     "source_lang": "DE"}, headers=a)
    assert r.status_code == 200, r.text
    job, key = r.json()["document_id"], r.json()["document_key"]
    for _ in range(100):
        status = client.post(f"/v2/document/{job}", json={"document_key": key}, headers=a).json()
        if status["status"] == "done":
            break
        time.sleep(0.05)
    assert status["status"] == "done" and status["billed_characters"] == sum(
        len(s) for s in documents.load(make_docx(), "a.docx").segments if s.strip())
    assert client.post(f"/v2/document/{job}", json={"document_key": key}, headers=b).status_code == 404
    assert client.post(f"/v2/document/{job}", json={"document_key": "0" * 64}, headers=a).status_code == 404
    r = client.post(f"/v2/document/{job}/result", data={"document_key": key}, headers=a)
    assert r.status_code == 200 and docx.Document(io.BytesIO(r.content)).paragraphs[0].text == "EIN TITEL"
    r = client.post("/v2/document", files={"file": ("a.docx", make_docx())}, data={"target_lang": "DE",
                                                                                     "output_format": "pdf"}, headers=a)
    assert r.status_code == 400 and "output_format" in r.json()["message"]


def test_docx_tabs_stay_between_words_and_text_boxes_are_translated_in_place():
    from docx.oxml import parse_xml
    from docx.oxml.ns import nsdecls
    d = docx.Document()
    p = d.add_paragraph("Ein Hund")
    p.runs[0]._r.append(parse_xml(f'<w:tab {nsdecls("w")}/>'))
    p.runs[0]._r.append(parse_xml(f'<w:t {nsdecls("w")}>läuft vor dem Haus.</w:t>'))
    p._p.append(parse_xml(f'<w:r {nsdecls("w")} xmlns:v="urn:schemas-microsoft-com:vml"><w:pict><v:shape><v:textbox>'
                          '<w:txbxContent><w:p><w:r><w:t>Im Kasten</w:t></w:r></w:p></w:txbxContent></v:textbox>'
                          '</v:shape></w:pict></w:r>'))
    buf = io.BytesIO()
    d.save(buf)
    segments, out = upper(buf.getvalue(), "a.docx")
    assert segments == ["Ein Hund läuft vor dem Haus.", "Im Kasten"]
    p = docx.Document(io.BytesIO(out)).paragraphs[0]
    assert [r.text for r in p.runs] == ["EIN HUND", "\t", "LÄUFT VOR DEM HAUS.", ""]
    assert p._p.xml.count("IM KASTEN") == 1 and "Im Kasten" not in p._p.xml


def test_a_truncated_multipart_upload_is_named_malformed_on_every_document_route(tmp_path):
    """A body cut before its closing ``--boundary--`` (or without a boundary) is a 400 naming the
    malformed body on the three upload routes, never read as a form without its file ('file: missing')."""
    client = keyed_client(tmp_path)
    part = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n\r\nEin Hund.\r\n'
            b'--b\r\nContent-Disposition: form-data; name="target_lang"\r\n\r\nen\r\n')
    a = {"Authorization": "Bearer key-a"}
    for content_type, body in (("multipart/form-data; boundary=b", part),
                               ("multipart/form-data", part + b"--b--\r\n")):
        headers = {**a, "Content-Type": content_type}
        native = client.post("/v1/documents", content=body, headers=headers)
        assert native.status_code == 400 and native.json()["error"]["field"] == "body", native.text
        assert "malformed" in native.json()["error"]["message"]
        libre = client.post("/translate_file", content=body, headers=headers)
        assert libre.status_code == 400 and "malformed" in libre.json()["error"], libre.text
        deepl = client.post("/v2/document", content=body, headers=headers)
        assert deepl.status_code == 400 and "malformed" in deepl.json()["message"], deepl.text
    whole = client.post("/v1/documents", content=part + b"--b--\r\n",
                        headers={**a, "Content-Type": "multipart/form-data; boundary=b"})
    assert whole.status_code == 200 and whole.content == "EIN HUND.".encode()


@pytest.mark.parametrize("sent, named", [("../../etc/passwd.txt", "passwd.txt"), ("..\\..\\boot.docx", "boot.docx"),
                                         ("a/b/c.srt", "c.srt"), ("...", "document"), ("Brief.TXT", "Brief.TXT")])
def test_a_download_is_named_by_the_uploads_base_name_only(sent, named):
    from service.api.documents import file_response
    disposition = file_response(b"x", sent, "text/plain").headers["content-disposition"]
    assert disposition == f"attachment; filename=\"{named}\"; filename*=UTF-8''{named}"


def test_html_nested_too_deep_is_a_413_naming_the_file_once():
    from service.documents import load
    from service.documents.common import DocumentError
    with pytest.raises(DocumentError) as e:
        load(("<b>" * 150 + "Ein Hund." + "</b>" * 150).encode(), "page.html")
    assert e.value.status == 413 and e.value.message.startswith("file: inline HTML elements nested more than 100")
