"""The routes beyond /v1/translate on models of every pair of their languages (issues 47 and 52): a
tiny NLLB-200 import and a tiny T5 (MADLAD-400) import (tests/tiny_multilingual.py, tests/tiny_t5.py),
each served alone by translators in this process. Stored glossaries on LibreTranslate's /translate
and DeepL's /v2/translate (the glossary's pair checked against the request's, not against ``mul``);
the OpenAPI rule of a stored glossary's pair; txt, HTML and docx documents on /v1/documents,
/translate_file and /v2/document (their text equals the same segments through /v1/translate); the
translation memory's import and export (keyed by model and target language); a URL and a ``keep``
term verbatim from a model whose vocabulary has placeholder words."""
from __future__ import annotations

import asyncio
import io
import time

import docx
import httpx
import pytest

pytest.importorskip("transformers")
from local_services import local_services  # noqa: E402
from tiny_model import one_thread  # noqa: F401,E402 (autouse fixture)
from tiny_multilingual import make_dir  # noqa: E402
from tiny_t5 import make_t5_dir  # noqa: E402

from model.convert import main as convert  # noqa: E402
from service import documents  # noqa: E402
from service.api.http import build_app  # noqa: E402
from service.replica import mapped_errors  # noqa: E402
from service.translator import Translator, model_card  # noqa: E402
from service.translator.config import TextConfig, TranslatorSettings  # noqa: E402

MODELS = ("nllb", "madlad")
SENTENCES = ["Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch im Park.", "Danke."]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """model id -> an httpx client of an app serving that model alone (documents kept under the
    module's folder; one translation memory file for both), and the event loop they run on."""
    root = tmp_path_factory.mktemp("mlroutes")
    hf = {"nllb": make_dir(root / "nllb-hf", "nllb"), "madlad": make_t5_dir(root / "t5-hf", "t5")}
    memory_file = str(root / "memory.sqlite")
    settings = TranslatorSettings(text=TextConfig(protect_spans=False, truecase=False), memory_file=memory_file)
    loop, translators, clients = asyncio.new_event_loop(), {}, {}
    for name in MODELS:
        assert convert(["--from-transformers", str(hf[name]), "--out", str(root / name)]) == 0
        t = translators[name] = Translator(model_card(name, root / name), device="cpu", settings=settings)
        loop.run_until_complete(t.reconfigure({"linear_dtype": "float32", "max_num_seqs": 64}))

        async def run(model, job, t=t):
            with mapped_errors(model):
                return await t.translate(job)
        svc = local_services([t.card], run, store_dir=str(root / f"docs-{name}"), memory_file=memory_file)
        clients[name] = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(svc)), base_url="http://t")
    yield loop, clients
    for name in MODELS:
        loop.run_until_complete(clients[name].aclose())
        loop.run_until_complete(translators[name].stop())
    loop.close()


def call(served, model: str, method: str, path: str, **kw) -> httpx.Response:
    loop, clients = served
    return loop.run_until_complete(clients[model].request(method, path, **kw))


def mt(served, model: str, texts: list[str], target: str = "fr", **kw) -> list[str]:
    """/v1/translate's text of each text de -> target (its default options, as the document routes')."""
    r = call(served, model, "POST", "/v1/translate", json={"text": texts, "source_lang": "de", "target_lang": target,
                                                         **kw})
    assert r.status_code == 200, r.text
    return [t["text"] for t in r.json()["translations"]]


@pytest.mark.parametrize("model", MODELS)
def test_stored_glossaries_on_the_libretranslate_and_deepl_routes(served, model):
    """A /v1 glossary de->fr by glossary_id, and a DeepL v2 glossary DE->FR, on /translate and
    /v2/translate: the target term is in the text, as on /v1/translate; a glossary of another pair is
    a 4xx naming glossary_id."""
    text = SENTENCES[0]
    assert "chiens" not in mt(served, model, [text])[0]
    body = {"name": "hunde", "source_lang": "de", "target_lang": "fr", "entries": [{"source": "Hunde", "target": "chiens"}]}
    assert call(served, model, "POST", "/v1/glossaries", json=body).status_code == 201
    assert call(served, model, "POST", "/v1/glossaries", json={**body, "name": "en", "target_lang": "en"}).status_code == 201
    native = mt(served, model, [text], glossary_id="hunde")[0]
    assert "chiens" in native
    r = call(served, model, "POST", "/translate", json={"q": text, "source": "de", "target": "fr", "glossary_id": "hunde"})
    assert r.status_code == 200, r.text
    assert r.json()["translatedText"] == native        # the same options: beam 4, length penalty 1
    r = call(served, model, "POST", "/v2/translate", json={"text": [text], "source_lang": "DE", "target_lang": "FR",
                                                         "glossary_id": "hunde"})
    assert r.status_code == 200 and "chiens" in r.json()["translations"][0]["text"], r.text
    r = call(served, model, "POST", "/v2/glossaries", json={"name": "d", "source_lang": "de", "target_lang": "fr",
                                                          "entries": "Hunde\tchiens", "entries_format": "tsv"})
    assert r.status_code == 201, r.text
    r = call(served, model, "POST", "/v2/translate", json={"text": [text], "source_lang": "DE", "target_lang": "FR",
                                                         "glossary_id": r.json()["glossary_id"]})
    assert r.status_code == 200 and "chiens" in r.json()["translations"][0]["text"], r.text
    r = call(served, model, "POST", "/translate", json={"q": text, "source": "de", "target": "fr", "glossary_id": "en"})
    assert 400 <= r.status_code < 500 and "glossary" in r.json()["error"], r.text
    r = call(served, model, "POST", "/v2/translate", json={"text": [text], "source_lang": "DE", "target_lang": "FR",
                                                         "glossary_id": "en"})
    assert 400 <= r.status_code < 500 and "glossary_id" in r.json()["message"], r.text


def test_the_openapi_glossary_schema_refuses_a_language_into_itself(served):
    """GlossaryCreate's schema (as /openapi.json states it) refuses de -> de, as POST /v1/glossaries
    does, and allows de -> fr and a target alone."""
    import jsonschema
    spec = call(served, "nllb", "GET", "/openapi.json").json()
    schema = {**spec["components"]["schemas"]["GlossaryCreate"], "components": spec["components"]}
    entry = {"name": "g", "entries": [{"source": "Hund", "target": "chien"}]}
    jsonschema.validate({**entry, "source_lang": "de", "target_lang": "fr"}, schema)
    jsonschema.validate({**entry, "target_lang": "de"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**entry, "source_lang": "de", "target_lang": "de"}, schema)
    r = call(served, "nllb", "POST", "/v1/glossaries", json={**entry, "source_lang": "de", "target_lang": "de"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "target_lang", r.text


def make_docx() -> bytes:
    d = docx.Document()
    d.add_paragraph(SENTENCES[0])
    d.add_paragraph(SENTENCES[1])
    d.add_table(rows=1, cols=1).cell(0, 0).text = SENTENCES[2]
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


FILES = {"a.txt": f"{SENTENCES[0]}\n\n{SENTENCES[1]}\n".encode(),
         "a.html": f"<p>{SENTENCES[0]}</p><p>{SENTENCES[2]}</p>".encode()}


def want_file(served, model: str, data: bytes, name: str) -> bytes:
    """The file rebuilt with /v1/translate's translations of its segments."""
    doc = documents.load(data, name)
    segments = list(doc.segments)
    todo = [i for i, s in enumerate(segments) if s.strip()]
    for i, t in zip(todo, mt(served, model, [segments[i] for i in todo])):
        segments[i] = t
    return doc.rebuild(segments)


def docx_texts(data: bytes) -> list[str]:
    d = docx.Document(io.BytesIO(data))
    return [p.text for p in d.paragraphs] + [d.tables[0].cell(0, 0).text]


def deepl_document(served, model: str, name: str, data: bytes) -> httpx.Response:
    r = call(served, model, "POST", "/v2/document", files={"file": (name, data)},
             data={"source_lang": "DE", "target_lang": "FR"})
    assert r.status_code == 200, r.text
    job = r.json()
    deadline = time.monotonic() + 60
    while True:
        status = call(served, model, "POST", f"/v2/document/{job['document_id']}",
                      data={"document_key": job["document_key"]}).json()
        assert status["status"] not in ("error",) and time.monotonic() < deadline, status
        if status["status"] == "done":
            break
        served[0].run_until_complete(asyncio.sleep(0.05))
    return call(served, model, "POST", f"/v2/document/{job['document_id']}/result",
                data={"document_key": job["document_key"]})


@pytest.mark.parametrize("model", MODELS)
def test_documents_translate_as_their_segments_do(served, model):
    """txt, HTML and docx on /v1/documents (the family's codes too), a txt on /translate_file and on
    /v2/document: the file's text is /v1/translate's of its segments."""
    for name, data in FILES.items():
        r = call(served, model, "POST", "/v1/documents", files={"file": (name, data)},
                 data={"source_lang": "de", "target_lang": "fr"})
        assert r.status_code == 200, r.text
        assert r.content == want_file(served, model, data, name), (name, r.text)
    want = mt(served, model, SENTENCES)
    langs = {"source_lang": "deu_Latn", "target_lang": "fra_Latn"} if model == "nllb" else \
        {"source_lang": "DE", "target_lang": "fr-FR"}
    r = call(served, model, "POST", "/v1/documents", files={"file": ("a.docx", make_docx())}, data=langs)
    assert r.status_code == 200, r.text
    assert docx_texts(r.content) == want
    r = call(served, model, "POST", "/translate_file", files={"file": ("a.txt", FILES["a.txt"])},
             data={"source": "de", "target": "fr"})
    assert r.status_code == 200, r.text
    path = r.json()["translatedFileUrl"].split("http://t")[1]
    assert call(served, model, "GET", path).content == want_file(served, model, FILES["a.txt"], "a.txt")
    r = deepl_document(served, model, "a.txt", FILES["a.txt"])
    assert r.status_code == 200 and r.content == f"{want[0]}\n\n{want[1]}\n".encode(), r.text
    r = call(served, model, "POST", "/v1/documents", files={"file": ("a.txt", FILES["a.txt"])},
             data={"source_lang": "de", "target_lang": "xx"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "target_lang", r.text


TMX = """<?xml version="1.0" encoding="UTF-8"?>
<tmx version="1.4"><header srclang="de" datatype="plaintext" segtype="sentence" adminlang="en" o-tmf="x"
 creationtool="x" creationtoolversion="1"/><body>
<tu><tuv xml:lang="de"><seg>Der Zug hat Verspätung.</seg></tuv><tuv xml:lang="en"><seg>The train is late.</seg></tuv>
<tuv xml:lang="fr"><seg>Le train est en retard.</seg></tuv></tu></body></tmx>"""


@pytest.mark.parametrize("model", MODELS)
def test_memory_import_and_export_per_target_language(served, model):
    """PUT /v1/memory (JSON, TMX) for de -> fr and de -> en of one model: each target's entry is
    what /v1/translate answers into that target, not into the other; GET exports them (json, tsv,
    TMX with the pair's languages); DELETE empties one target's memory."""
    q = {"model": model, "source_lang": "de", "target_lang": "fr"}
    bird = "Ein Vogel singt im Baum."
    r = call(served, model, "PUT", "/v1/memory", params=q, json={"entries": [{"source": bird, "target": "Un oiseau."}]})
    assert r.status_code == 200 and r.json() == {"model": model, "stored": 1}, r.text
    r = call(served, model, "PUT", "/v1/memory", params=q, content=TMX.encode(), headers={"Content-Type": "application/x-tmx+xml"})
    assert r.status_code == 200 and r.json()["stored"] == 1, r.text
    en = {**q, "target_lang": "en"}
    r = call(served, model, "PUT", "/v1/memory", params=en, content=TMX.encode(), headers={"Content-Type": "application/x-tmx+xml"})
    assert r.status_code == 200 and r.json()["stored"] == 1, r.text
    assert mt(served, model, [bird, "Der Zug hat Verspätung."]) == ["Un oiseau.", "Le train est en retard."]
    assert mt(served, model, ["Der Zug hat Verspätung."], target="en") == ["The train is late."]
    assert mt(served, model, [bird], target="en") != ["Un oiseau."]
    codes = {"source_lang": "deu_Latn", "target_lang": "fra_Latn"} if model == "nllb" else {"target_lang": "FR"}
    r = call(served, model, "GET", "/v1/memory", params={**q, **codes})
    assert r.status_code == 200, r.text
    assert {(e["source"], e["target"]) for e in r.json()["entries"]} == {
        (bird, "Un oiseau."), ("Der Zug hat Verspätung.", "Le train est en retard.")}
    tmx = call(served, model, "GET", "/v1/memory", params={**q, "format": "tmx"}).text
    assert 'srclang="de"' in tmx and 'xml:lang="fr"' in tmx and "Un oiseau." in tmx
    tsv = call(served, model, "GET", "/v1/memory", params={**en, "format": "tsv"}).text
    assert tsv.strip() == "Der Zug hat Verspätung.\tThe train is late."
    r = call(served, model, "DELETE", "/v1/memory", params=q)
    assert r.status_code == 200 and r.json()["deleted"] == 2, r.text
    assert call(served, model, "DELETE", "/v1/memory", params=en).json()["deleted"] == 1
    r = call(served, model, "GET", "/v1/memory", params={**q, "target_lang": "xx"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "target_lang", r.text


def test_protected_spans_and_keep_terms_come_back_verbatim(tmp_path):
    """An NLLB model whose vocabulary has placeholder words (one piece each: "Berlin", "5", from
    ``extra_lines``; the default tiny vocabularies have no name of one piece, so protection is off on
    them): a URL and a ``keep`` term are kept out of its input (the placeholder among
    ``source_tokens``) and come back verbatim, on /v1/translate and on LibreTranslate's /translate."""
    d = make_dir(tmp_path / "hf", "nllb", extra_lines=("Berlin 5",) * 40)
    assert convert(["--from-transformers", str(d), "--out", str(tmp_path / "nllb")]) == 0
    loop = asyncio.new_event_loop()
    t = Translator(model_card("nllb", tmp_path / "nllb"), device="cpu", settings=TranslatorSettings(
        text=TextConfig(truecase=False)))
    loop.run_until_complete(t.reconfigure({"linear_dtype": "float32"}))

    async def run(model, job):
        with mapped_errors(model):
            return await t.translate(job)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(local_services([t.card], run))),
                               base_url="http://t")
    try:
        url = "https://example.com/a?b=1"
        text = f"Zwei Hunde spielen bei {url} im Schnee."
        body = {"text": text, "source_lang": "de", "target_lang": "fr", "keep": ["Hunde"]}
        r = loop.run_until_complete(client.post("/v1/translate", json=body))
        assert r.status_code == 200, r.text
        tr = r.json()["translations"][0]
        assert tr["text"].count(url) == 1 and tr["text"].count("Hunde") == 1, tr["text"]
        assert "▁Berlin" in tr["source_tokens"] and "▁H" not in tr["source_tokens"], tr["source_tokens"]
        r = loop.run_until_complete(client.post("/v1/translate", json={**body, "keep": []}))
        assert "▁H" in r.json()["translations"][0]["source_tokens"]          # without keep, the model reads Hunde
        r = loop.run_until_complete(client.post("/translate", json={"q": text, "source": "de", "target": "fr",
                                                                    "keep": ["Hunde"]}))
        assert r.status_code == 200 and url in r.json()["translatedText"] and "Hunde" in r.json()["translatedText"]
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(t.stop())
        loop.close()
