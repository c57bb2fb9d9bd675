"""Glossaries without a server: term matching (service/translator/glossary.py), the stored-glossary
store (service/api/glossaries.py), the request fields' validation, and a Translator (tiny random
model) whose outputs contain their terms."""
from __future__ import annotations

import asyncio
import re
import types

import pydantic
import pytest
from conftest import build_tiny_checkpoint
from local_services import local_services

from service.api.glossaries import (
    GlossaryClient,
    GlossaryCreate,
    GlossaryStore,
    read_file,
    resolve,
    scope_of,
)
from service.api.middleware.caller import Caller
from service.api.schemas import TranslateRequest
from service.protocol import (
    MAX_GLOSSARY_ENTRIES,
    MAX_GLOSSARY_TERM_CHARS,
    GenerationOptions,
    InvalidRequest,
    ServiceError,
    StreamToken,
    TranslateJob,
)
from service.replica import to_service_error
from service.translator import Translator, model_card
from service.translator.glossary import Glossary


class Tok:
    """A stand-in tokenizer: one id per character (enough for term ids and their lengths)."""
    def encode(self, text):
        return [ord(c) for c in text]


def gl(entries, lang="de", max_tokens=50, **kw):
    return Glossary(entries, lang, Tok(), max_tokens, **kw)


# ---- matching --------------------------------------------------------------------------------------
def test_case_and_inflection_match_by_snowball_stem():
    g = gl([("Vertrag", "agreement"), ("Hund", "dog")])
    s = "VERTRÄGE und Verträge des Vertrages; zwei Hunde, drei Hunden, ein Hundeleben."
    found = [(s[m.start:m.end], g.entries[m.entry][1]) for m in g.find(s)]
    assert found == [("VERTRÄGE", "agreement"), ("Verträge", "agreement"), ("Vertrages", "agreement"),
                     ("Hunde", "dog"), ("Hunden", "dog")]      # "Hundeleben" is another word
    assert g.constraints(s) == (tuple(map(ord, "agreement")), tuple(map(ord, "dog")))   # each target once
    assert g.constraints("Eine Katze.") == ()
    english = gl([("running shoe", "Laufschuh")], lang="en")
    assert [m.words for m in english.find("He buys Running Shoes.")] == [2]
    nostem = gl([("Vertrag", "agreement")], lang="xx")       # no stemmer: case-folded words must be equal
    assert len(nostem.find("VERTRAG")) == 1 and not nostem.find("Verträge")


def test_overlapping_terms_longest_then_first():
    g = gl([("Mann", "man"), ("alter Mann", "old man"), ("alter", "elderly"), ("Mann mit Hut", "man in a hat")])
    s = "Ein alter Mann mit Hut."
    assert [g.entries[m.entry][0] for m in g.find(s)] == ["alter", "Mann mit Hut"]
    assert [g.entries[m.entry][0] for m in g.find("ein alter Mann")] == ["alter Mann"]


def test_conflicts_and_bad_entries_are_422_naming_the_entry():
    with pytest.raises(InvalidRequest, match=r"glossary\[1\].source.*conflicts with glossary\[0\]") as e:
        gl([("Vertrag", "agreement"), ("Verträge", "contracts")])
    assert e.value.field == "glossary[1].source"
    assert len(gl([("Vertrag", "agreement"), (" vertrag ", "agreement")])) == 1     # a repeat is one entry
    for entries, field in (([("  ", "x")], "glossary[0].source"), ([("x", "")], "glossary[0].target"),
                           ([("...", "x")], "glossary[0].source"),
                           ([("a", "b" * (MAX_GLOSSARY_TERM_CHARS + 1))], "glossary[0].target"),
                           ([("a", "b" * 60)], "glossary[0].target")):          # over max_tokens (50)
        with pytest.raises(InvalidRequest) as e:
            gl(entries)
        assert e.value.field == field and to_service_error(e.value, "m").status == 422
    with pytest.raises(InvalidRequest, match="at most 3 entries"):
        gl([(str(i), "x") for i in range(4)], limit=3)


# ---- the request fields --------------------------------------------------------------------------------
@pytest.mark.parametrize("glossary, where", [
    ([{"source": " ", "target": "x"}], "glossary[0].source: must not be empty"),
    ([{"source": "a", "target": ""}], "glossary[0].target: must not be empty"),
    ([{"source": "a", "target": "b" * (MAX_GLOSSARY_TERM_CHARS + 1)}], f"at most {MAX_GLOSSARY_TERM_CHARS} characters"),
    ([{"source": str(i), "target": "x"} for i in range(MAX_GLOSSARY_ENTRIES + 1)], f"at most {MAX_GLOSSARY_ENTRIES} entries"),
    ([{"source": "a"}], "target"),
    ([{"source": "a", "target": "b", "note": 1}], "note"),
    ("Vertrag=agreement", "must be a list"),
])
def test_bad_glossary_fields_are_rejected(glossary, where):
    with pytest.raises(pydantic.ValidationError, match=re.escape(where)):
        TranslateRequest(text="x", glossary=glossary)


def test_glossary_with_glossary_id_is_valid_and_job_carries_entries():
    both = TranslateRequest(text="x", glossary=[{"source": "a", "target": "b"}], glossary_id="g")
    assert both.job().glossary == (("a", "b"),) and both.glossary_id == "g"     # the stored ones: the gateway's
    job = TranslateRequest(text="x", glossary=[{"source": "Vertrag", "target": "agreement"}]).job()
    assert job.glossary == (("Vertrag", "agreement"),) and not job.stored_glossary


# ---- the store -------------------------------------------------------------------------------------------
def test_store_loads_files_and_scopes_created_glossaries_by_key(tmp_path):
    (tmp_path / "cars.tsv").write_text("source\ttarget\n# comment\nWagen\tcar\n\nReifen\ttyre\n", encoding="utf-8")
    (tmp_path / "pets.csv").write_text('Hund,dog\n"Katze, klein",kitten\n', encoding="utf-8")
    (tmp_path / "notes.txt").write_text("ignored")
    assert read_file(tmp_path / "pets.csv") == [("Hund", "dog"), ("Katze, klein", "kitten")]
    store = GlossaryStore(str(tmp_path))
    assert [(g.name, len(g.entries), g.shared) for g in store.list("")] == [("cars", 2, True), ("pets", 2, True)]
    body = GlossaryCreate(name="legal", entries=[{"source": "Vertrag", "target": "agreement"}], source_lang="de")
    store.create("k:alice", body)
    assert [g.name for g in store.list("k:alice")] == ["legal", "cars", "pets"]
    assert [g.name for g in store.list("k:bob")] == ["cars", "pets"]            # another key does not see it
    assert resolve(store, "k:alice", "legal", "de", "en") == (("Vertrag", "agreement"),)
    assert resolve(store, "k:bob", "cars", "de", "en") == (("Wagen", "car"), ("Reifen", "tyre"))
    errors = [(lambda: resolve(store, "k:bob", "legal", "de", "en"), 404, "glossary_id"),
              (lambda: resolve(store, "k:alice", "legal", "en", "de"), 409, "glossary_id"),
              (lambda: store.create("k:alice", body), 409, "name"),
              (lambda: store.create("k:alice", GlossaryCreate(name="../x", entries=body.entries)), 422, "name"),
              (lambda: store.create("k:alice", GlossaryCreate(name="c", entries=[
                  {"source": "Vertrag", "target": "a"}, {"source": "Verträge", "target": "b"}], source_lang="de")),
               409, "entries[1].source"),
              (lambda: store.delete("k:alice", "cars"), 403, "name"),
              (lambda: store.delete("k:bob", "legal"), 404, "name")]
    for call, status, field in errors:
        with pytest.raises(ServiceError) as e:
            call()
        assert (e.value.status, e.value.field) == (status, field), e.value
    store.delete("k:alice", "legal")
    assert [g.name for g in store.list("k:alice")] == ["cars", "pets"]
    (tmp_path / "bad.tsv").write_text("a\tb\tc\n")
    with pytest.raises(ValueError, match="bad.tsv:1: expected 2 columns"):
        GlossaryStore(str(tmp_path))


def test_scope_is_the_key_id_or_shared():
    def req(who):
        return types.SimpleNamespace(scope={"state": {"caller": Caller(who if who.startswith("k:") else "", who, who)}})
    assert scope_of(req("k:1a2b3c4d")) == "k:1a2b3c4d"
    assert scope_of(req("c:127.0.0.1")) == "" and scope_of(types.SimpleNamespace(scope={})) == ""


# ---- through a Translator ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return model_card("tiny", build_tiny_checkpoint(tmp_path_factory.mktemp("gl"), "de", "en", max_len=64))


def test_translator_outputs_contain_terms_and_rejects_bad_glossaries(card):
    texts = ["Ein Hund läuft über die Wiese.", "Zwei Männer sitzen auf einer Bank."]

    def job(glossary=(), beam=2, stored=False):
        return TranslateJob(texts, GenerationOptions(beam_size=beam, max_new_tokens=20), glossary=glossary,
                            stored_glossary=stored)

    async def main():
        t = Translator(card, device="cpu")
        await t.reconfigure({"max_num_seqs": 16})
        plain = await t.translate(job())
        out = {}
        for beam in (1, 2):
            out[beam] = await t.translate(job((("Katze", "cat"), ("Hund", "dog")), beam))
        streamed = [x async for x in t.stream(job((("Wiese", "meadow"),), 1))]
        errors = []
        for bad, stored in (((("Bank", "x" * 100),), False), ((("Bank", "bench"), ("Banken", "banks")), False),
                            ((("Bank", "bench"), ("Banken", "banks")), True)):
            try:
                await t.translate(job(bad, stored=stored))
            except InvalidRequest as e:
                errors.append((e.field, e.message))
        await t.stop()
        return plain, out, streamed, errors
    plain, out, streamed, errors = asyncio.run(main())
    for beam, res in out.items():
        first, second = res.translations
        assert "dog" in first.text.lower() and "cat" not in first.text.lower()     # "Katze" is not in the text
        assert second.text == plain.translations[1].text and second.tokens == plain.translations[1].tokens
    final = streamed[-1].translations[0].text
    assert "meadow" in final.lower()
    assert "".join(x.text for x in streamed if isinstance(x, StreamToken) and x.index == 0) == final
    assert [field for field, _ in errors] == ["glossary[0].target", "glossary[1].source", "glossary_id[1].source"]
    assert errors[2][1] == ("glossary_id[1].source: 'Banken' conflicts with glossary_id[0] ('Bank' -> 'bench'): one "
                            "source term, two targets ('banks')")     # a stored glossary's entries: glossary_id


def test_gateway_routes_scope_glossaries_by_key_and_fill_the_job():
    from model.config import ModelConfig
    from service.api.glossaries import scope_of
    from service.api.routes import stores as G
    from service.translator import ModelCard

    def req(who):
        return types.SimpleNamespace(scope={"state": {"caller": Caller(who if who.startswith("k:") else "", who, who)}})
    card = ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
    me = local_services([card], None, glossaries=GlossaryClient(GlossaryStore("")))
    alice, bob = req("k:aaaa"), req("k:bbbb")
    body = GlossaryCreate(name="legal", entries=[{"source": "Vertrag", "target": "agreement"}])
    info = asyncio.run(G.create_glossary(body, alice, me))
    assert (info.name, info.entry_count, info.shared) == ("legal", 1, False)
    assert [g.name for g in asyncio.run(G.list_glossaries(alice, me)).data] == ["legal"]
    assert asyncio.run(G.list_glossaries(bob, me)).data == []
    job = asyncio.run(me.pipeline.with_glossary(TranslateJob(["x"], GenerationOptions()), "legal", scope_of(alice),
                                                "de", "en"))
    assert job.glossary == (("Vertrag", "agreement"),) and job.stored_glossary
    with pytest.raises(ServiceError) as e:
        asyncio.run(me.pipeline.with_glossary(TranslateJob(["x"], GenerationOptions()), "legal", scope_of(bob),
                                              "de", "en"))
    assert (e.value.status, e.value.field) == (404, "glossary_id")
    assert asyncio.run(G.get_glossary("legal", alice, me)).entries[0].target == "agreement"
    assert asyncio.run(G.delete_glossary("legal", alice, me)).status_code == 204
    assert asyncio.run(G.list_glossaries(alice, me)).data == []


def test_libretranslate_glossary_fields():
    from service.api.libretranslate import LibreRequest, read_glossary
    store = GlossaryClient(GlossaryStore(""))
    store.store.create("", GlossaryCreate(name="bikes", entries=[{"source": "Fahrrad", "target": "bike"}],
                                    source_lang="de"))
    request = types.SimpleNamespace(scope={})
    card = types.SimpleNamespace(source_lang="de", lang_tokens=False)
    for fields, want in (({"glossary": '[{"source": "Hund", "target": "dog"}]'}, (("Hund", "dog"),)),   # a form's string
                         ({"glossary": [{"source": "Hund", "target": "dog"}]}, (("Hund", "dog"),)),
                         ({"glossary_id": "bikes"}, (("Fahrrad", "bike"),))):
        r = LibreRequest(["x"], False, card, 0, False, False, "en")
        asyncio.run(read_glossary(r, fields, request, store))
        assert r.glossary == want and r.job(["x"]).glossary == want
    r = LibreRequest(["x"], False, card, 0, False, False, "en")       # both: the stored entries, then the request's
    asyncio.run(read_glossary(r, {"glossary": [{"source": "Hund", "target": "dog"}], "glossary_id": "bikes"}, request, store))
    assert r.glossary == (("Fahrrad", "bike"), ("Hund", "dog"))
    for fields, field in (({"glossary": "[{"}, "glossary"), ({"glossary": [{"source": "a"}]}, "glossary.0.target"),
                          ({"glossary": [{"source": " ", "target": "b"}]}, "glossary"),
                          ({"glossary_id": "nope"}, "glossary_id")):
        with pytest.raises(ServiceError) as e:
            asyncio.run(read_glossary(LibreRequest(["x"], False, card, 0, False, False, "en"), fields, request, store))
        assert e.value.field == field and e.value.status in (400, 404), e.value


def test_405_allow_names_every_route_of_the_path():
    from fastapi.testclient import TestClient

    from service.api.http import build_app
    client = TestClient(build_app(None))
    for method, path, allow in (("OPTIONS", "/v1/glossaries", "GET, POST, HEAD"),
                                ("PUT", "/v1/glossaries/x", "GET, DELETE, HEAD"), ("GET", "/v1/translate", "POST")):
        r = client.request(method, path)
        assert r.status_code == 405 and r.headers["allow"] == allow, (path, r.headers)


def test_stored_glossaries_and_a_requests_entries_apply_together_past_the_requests_limit(card):
    """A stored glossary (up to MAX_STORED_GLOSSARY_ENTRIES) with a request's own entries (up to
    MAX_GLOSSARY_ENTRIES) is one glossary of both; only past every source's limit together is it refused."""
    from service.protocol import MAX_GLOSSARY_ENTRIES, MAX_JOB_GLOSSARY_ENTRIES
    t = Translator(card, device="cpu")
    entries = tuple((f"Wort{i}", f"word{i}") for i in range(MAX_GLOSSARY_ENTRIES + 50))
    g = t.glossary(TranslateJob(["Wort3 und Wort120."], GenerationOptions(), glossary=entries))
    assert len(g.entries) == MAX_GLOSSARY_ENTRIES + 50 and [m.entry for m in g.find("Wort3 und Wort120.")] == [3, 120]
    too_many = tuple((f"Wort{i}", f"word{i}") for i in range(MAX_JOB_GLOSSARY_ENTRIES + 1))
    with pytest.raises(InvalidRequest, match=f"at most {MAX_JOB_GLOSSARY_ENTRIES} entries"):
        t.glossary(TranslateJob(["Wort3."], GenerationOptions(), glossary=too_many, stored_glossary=True))
