"""DeepL's official Python client (``deepl`` 1.32, unchanged) against the app served by uvicorn on
127.0.0.1 in a thread of this process (no Ray): every glossary method, v2 and v3 (multilingual), the
entries round-tripped exactly, translate_text and translate_document with a glossary or glossary_ids (the fake
translator shows the entries each job carried), another key seeing none of it; and the shipped
model (model/checkpoints/de-en) writing the glossary's term."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
import types
from pathlib import Path

import deepl
import httpx
import pytest
import uvicorn
from deepl.api_data import MultilingualGlossaryDictionaryEntries as Entries

from local_services import local_services
from model.config import ModelConfig
from service.api.glossaries import GlossaryClient, GlossaryStore
from service.api.http import build_app
from service.api.middleware.guard import Guard, GuardSettings
from service.protocol import TranslateResponse, Translation, Usage
from service.translator import ModelCard

A, B = "key-alpha", "key-bravo"
CONFIG = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
CARDS = [ModelCard("de-en", "", "de", "en", CONFIG), ModelCard("en-de", "", "en", "de", CONFIG)]
SHIPPED = Path(__file__).resolve().parents[1] / "model" / "checkpoints" / "de-en"
# DeepL's own round-trip entries (deepl-python's tests), less the emoji pair: a source term here needs
# a letter or digit to be matched (service/translator/glossary.py)
ENTRIES = {"Apfel": "apple", "Banane": "banana", "A%=&": "B&=%", "\u0394\u3041": "\u6df1", "Haus, groß": 'big "house"'}


def serve(app):
    """The app on 127.0.0.1 and a free port, in a thread: (url, stop)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"

    def stop():
        server.should_exit = True
        thread.join(30)
        sock.close()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


@pytest.fixture(scope="module")
def service():
    jobs = []

    async def run(model, job):
        jobs.append(job)
        return TranslateResponse(model=model, usage=Usage(source_tokens=1, generated_tokens=1), translations=[
            Translation(text=x.upper(), tokens=[], source_tokens=[], score=0.0, finish_reason="eos")
            for x in job.texts])
    guard = Guard(GuardSettings(failed_key_limit=None), env=f"{A},{B}")
    svc = local_services(CARDS, run, guard=guard, glossaries=GlossaryClient(GlossaryStore("")))
    url, stop = serve(build_app(svc))
    yield types.SimpleNamespace(url=url, jobs=jobs, a=deepl.DeepLClient(A, server_url=url),
                                b=deepl.DeepLClient(B, server_url=url))
    stop()


def test_v2_glossaries_with_the_official_client(service):
    a = service.a
    assert {(p.source_lang, p.target_lang) for p in a.get_glossary_languages()} == {("de", "en"), ("en", "de")}
    g = a.create_glossary("fruit", "DE", "EN", ENTRIES)
    assert (g.name, g.source_lang, g.target_lang, g.entry_count, g.ready) == ("fruit", "DE", "EN", len(ENTRIES), True)
    got = a.get_glossary(g.glossary_id)
    assert (got.name, got.creation_time, got.entry_count) == (g.name, g.creation_time, g.entry_count)
    assert a.get_glossary_entries(g) == ENTRIES and a.get_glossary_entries(g.glossary_id) == ENTRIES
    assert g.glossary_id in [x.glossary_id for x in a.list_glossaries()]
    c = a.create_glossary_from_csv("csv", "EN", "DE", csv_data='apple,Apfel\n"big, red",groß\n')
    assert c.entry_count == 2 and a.get_glossary_entries(c) == {"apple": "Apfel", "big, red": "groß"}
    large = {f"Source{i}": f"Target{i}" for i in range(10_000)}       # DeepL's client tests' "large" glossary
    big = a.create_glossary("large", "DE", "EN", large)
    assert big.entry_count == 10_000 and a.get_glossary_entries(big) == large
    for x in (g, c, big):
        a.delete_glossary(x)
        with pytest.raises(deepl.GlossaryNotFoundException):
            a.get_glossary(x.glossary_id)
    with pytest.raises(deepl.GlossaryNotFoundException):
        a.delete_glossary(g.glossary_id)
    with pytest.raises(deepl.DeepLException, match="JA"):
        a.create_glossary("x", "DE", "JA", {"Hund": "inu"})
    with pytest.raises(deepl.DeepLException, match="line 2, source: 'Hund' duplicates line 1"):
        a.create_glossary_from_csv("x", "DE", "EN", csv_data="Hund,dog\nHund,hound\n")
    assert a.list_glossaries() == []


def test_v3_multilingual_glossaries_with_the_official_client(service):
    a = service.a
    g = a.create_multilingual_glossary("multi", [Entries("DE", "EN", ENTRIES), Entries("EN", "DE", {"apple": "Apfel"})])
    assert [(d.source_lang, d.target_lang, d.entry_count) for d in g.dictionaries] == [("DE", "EN", 5), ("EN", "DE", 1)]
    got = a.get_multilingual_glossary(g.glossary_id)
    assert (got.name, got.creation_time, len(got.dictionaries)) == ("multi", g.creation_time, 2)
    assert g.glossary_id in [x.glossary_id for x in a.list_multilingual_glossaries()]
    entries = a.get_multilingual_glossary_entries(g, "DE", "EN").dictionaries
    assert len(entries) == 1 and deepl.convert_tsv_to_dict(entries[0].entries) == ENTRIES
    assert a.update_multilingual_glossary_name(g, "renamed").name == "renamed"
    assert a.get_multilingual_glossary(g.glossary_id).name == "renamed"
    up = a.update_multilingual_glossary_dictionary(g, Entries("EN", "DE", {"apple": "Apfelbaum", "pear": "Birne"}))
    assert [d.entry_count for d in up.dictionaries] == [5, 2]
    assert deepl.convert_tsv_to_dict(a.get_multilingual_glossary_entries(g, "EN", "DE").dictionaries[0].entries) == \
        {"apple": "Apfelbaum", "pear": "Birne"}
    up = a.update_multilingual_glossary_dictionary_from_csv(g, "EN", "DE", "plum,Pflaume\n")
    assert [d.entry_count for d in up.dictionaries] == [5, 3]
    d = a.replace_multilingual_glossary_dictionary(g, Entries("EN", "DE", {"cherry": "Kirsche"}))
    assert (d.source_lang, d.target_lang, d.entry_count) == ("EN", "DE", 1)
    assert a.get_multilingual_glossary_entries(g, "EN", "DE").dictionaries[0].entries == "cherry\tKirsche"
    d = a.replace_multilingual_glossary_dictionary_from_csv(g, "EN", "DE", "grape,Traube\nfig,Feige\n")
    assert d.entry_count == 2
    a.delete_multilingual_glossary_dictionary(g, source_lang="EN", target_lang="DE")
    assert [(x.source_lang, x.target_lang) for x in a.get_multilingual_glossary(g.glossary_id).dictionaries] == \
        [("DE", "EN")]
    with pytest.raises(deepl.GlossaryNotFoundException):
        a.delete_multilingual_glossary_dictionary(g, source_lang="EN", target_lang="DE")
    c = a.create_multilingual_glossary_from_csv("csv", "EN", "DE", "apple,Apfel\n")
    assert [x.entry_count for x in c.dictionaries] == [1]
    for x in (g, c):
        a.delete_multilingual_glossary(x)
        with pytest.raises(deepl.GlossaryNotFoundException):
            a.get_multilingual_glossary(x.glossary_id)
    with pytest.raises(deepl.DeepLException, match=r"dictionaries\[1\]\.entries: line 2, source: 'Hunde' conflicts "
                                                   r"with line 1"):      # one stem, two targets: nothing stored
        a.create_multilingual_glossary("bad", [Entries("EN", "DE", {"dog": "Hund"}),
                                               Entries("DE", "EN", {"Hund": "dog", "Hunde": "dogs"})])
    assert a.list_multilingual_glossaries() == []


def test_translate_text_and_document_carry_the_pairs_dictionary(service, tmp_path):
    a = service.a
    g = a.create_multilingual_glossary("t", [Entries("DE", "EN", {"Hund": "hound"}),
                                             Entries("EN", "DE", {"dog": "Köter"})])
    v2 = a.create_glossary("v2", "DE", "EN", {"Katze": "kitty"})
    for glossary, want in ((g, (("Hund", "hound"),)), (g.glossary_id, (("Hund", "hound"),)),
                           (v2, (("Katze", "kitty"),)), (v2.glossary_id, (("Katze", "kitty"),))):
        out = a.translate_text(["Ein Hund.", "Eine Katze."], source_lang="DE", target_lang="EN-GB", glossary=glossary)
        assert [o.text for o in out] == ["EIN HUND.", "EINE KATZE."]
        assert service.jobs[-1].glossary == want and service.jobs[-1].stored_glossary is True
    a.translate_text("A dog.", source_lang="EN", target_lang="DE", glossary=g)
    assert service.jobs[-1].glossary == (("dog", "Köter"),)
    a.translate_text("Ein Hund.", source_lang="DE", target_lang="EN-GB", glossary_ids=[v2, g])
    assert service.jobs[-1].glossary == (("Katze", "kitty"), ("Hund", "hound"))
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("Ein Hund.\n", encoding="utf-8")
    a.translate_document_from_filepath(src, out, source_lang="DE", target_lang="EN-GB", glossary=g)
    assert out.read_text(encoding="utf-8") == "EIN HUND.\n" and service.jobs[-1].glossary == (("Hund", "hound"),)
    a.translate_document_from_filepath(src, out, source_lang="DE", target_lang="EN-GB", glossary_ids=[g, v2])
    assert service.jobs[-1].glossary == (("Hund", "hound"), ("Katze", "kitty"))
    # another key: sees none of them, cannot use, change or delete them
    b = service.b
    assert b.list_multilingual_glossaries() == [] and b.list_glossaries() == []
    for call in (lambda: b.get_multilingual_glossary(g.glossary_id), lambda: b.get_glossary(v2.glossary_id),
                 lambda: b.get_glossary_entries(v2.glossary_id),
                 lambda: b.get_multilingual_glossary_entries(g.glossary_id, "DE", "EN"),
                 lambda: b.update_multilingual_glossary_name(g.glossary_id, "mine"),
                 lambda: b.replace_multilingual_glossary_dictionary(g.glossary_id, Entries("DE", "EN", {"a": "b"})),
                 lambda: b.delete_multilingual_glossary(g.glossary_id), lambda: b.delete_glossary(v2.glossary_id),
                 lambda: b.translate_text("Ein Hund.", source_lang="DE", target_lang="EN-GB", glossary=g.glossary_id)):
        with pytest.raises(deepl.DeepLException):
            call()
    assert {x.name for x in a.list_multilingual_glossaries()} == {"t", "v2"}
    a.delete_multilingual_glossary(g)
    a.delete_glossary(v2)


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="the shipped model is not in this checkout")
def test_the_shipped_model_writes_the_glossarys_term():
    from service.translator import Translator, model_card
    card = model_card("de-en", SHIPPED)
    held = {}

    async def start():
        t = Translator(card)
        await t.reconfigure({"max_num_seqs": 8})
        return t

    async def run(model, job):       # the translator starts on the server's event loop, at the first job
        if "t" not in held:
            held["loop"], held["t"] = asyncio.get_running_loop(), asyncio.ensure_future(start())
        return await (await asyncio.shield(held["t"])).translate(job)
    url, stop = serve(build_app(local_services([card], run, glossaries=GlossaryClient(GlossaryStore("")))))
    try:
        text = "Ein Mann fährt mit dem Fahrrad die Straße entlang."
        warm = httpx.post(url + "/v2/translate", json={"text": text, "source_lang": "DE", "target_lang": "EN-GB"},
                          timeout=600)       # the first job loads the model (and builds its CPU kernels once)
        assert warm.status_code == 200, warm.text
        client = deepl.DeepLClient("any", server_url=url)      # keys off: any key
        plain = client.translate_text(text, source_lang="DE", target_lang="EN-GB").text
        assert "bike" not in plain                               # the model's own choice: "bicycle"
        g = client.create_multilingual_glossary("bikes", [Entries("DE", "EN", {"Fahrrad": "bike"})])
        got = client.translate_text(text, source_lang="DE", target_lang="EN-GB", glossary=g).text
        assert "bike" in got and got != plain, (plain, got)
        client.delete_multilingual_glossary(g)
    finally:
        if "t" in held:
            asyncio.run_coroutine_threadsafe(held["t"].result().stop(), held["loop"]).result(30)
        stop()
