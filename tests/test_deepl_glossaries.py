"""DeepL's glossary routes in process (service/api/deepl_glossaries.py): v2 and v3 over the one
glossary store, the /v1 view of the same glossaries, ``glossary_id`` on /v2/translate and /v1/translate
(the pair's dictionary, after detection too), the bad inputs of issue 49 (400 naming line and field,
nothing stored), DeepL's error shape and statuses, per-key scoping. A fake translator shows what
each job carried."""
from __future__ import annotations

import types

import pytest
from fastapi.testclient import TestClient

from local_services import local_services
from model.config import ModelConfig
from service.api.glossaries import GlossaryClient, GlossaryStore
from service.api.http import build_app
from service.api.middleware.guard import Guard, GuardSettings
from service.protocol import MAX_GLOSSARY_TERM_CHARS, MAX_STORED_GLOSSARY_ENTRIES, TranslateResponse, Translation, Usage
from service.translator import ModelCard

A, B = "key-alpha", "key-bravo"
CONFIG = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
CARDS = [ModelCard("de-en", "", "de", "en", CONFIG), ModelCard("fr-en", "", "fr", "en", CONFIG),
         ModelCard("en-de", "", "en", "de", CONFIG)]


class Detector:
    """French when a text starts with "Le", else German."""
    requested = ("de", "fr", "en")

    def detect(self, text, top=None):
        return [("fr", 99.0)] if text.startswith("Le") else [("de", 99.0)]


@pytest.fixture
def t():
    jobs = []

    async def run(model, job):
        jobs.append((model, job))
        return TranslateResponse(model=model, usage=Usage(source_tokens=1, generated_tokens=1), translations=[
            Translation(text=x.upper(), tokens=[], source_tokens=[], score=0.0, finish_reason="eos")
            for x in job.texts])
    guard = Guard(GuardSettings(failed_key_limit=None), env=f"{A},{B}")
    svc = local_services(CARDS, run, guard=guard, detector=Detector(), glossaries=GlossaryClient(GlossaryStore("")))
    with TestClient(build_app(svc)) as client:
        yield types.SimpleNamespace(client=client, jobs=jobs, svc=svc)


def call(t, method, path, key=A, **kw):
    return t.client.request(method, path, headers={"Authorization": f"DeepL-Auth-Key {key}", **kw.pop("headers", {})},
                            **kw)


def v2(t, entries="Hund\tdog\nKatze\tcat", fmt="tsv", src="de", tgt="en", key=A, name="pets", form=False):
    body = {"name": name, "source_lang": src, "target_lang": tgt, "entries": entries, "entries_format": fmt}
    return call(t, "POST", "/v2/glossaries", key, **({"data": body} if form else {"json": body}))


def dictionary(src, tgt, entries, fmt="tsv"):
    return {"source_lang": src, "target_lang": tgt, "entries": entries, "entries_format": fmt}


def v3(t, *dicts, key=A, name="multi"):
    return call(t, "POST", "/v3/glossaries", key, json={"name": name, "dictionaries": list(dicts)})


def stored(t, key=A) -> list:
    return call(t, "GET", "/v1/glossaries", key, headers={"Authorization": f"Bearer {key}"}).json()["data"]


# ---- v2 ----------------------------------------------------------------------------------------------
def test_v2_create_list_get_entries_delete_and_the_v1_view(t):
    r = v2(t, entries="Hund\tdog\n\nKatze \t cat\n")
    assert r.status_code == 201, r.text
    g = r.json()
    assert set(g) == {"glossary_id", "name", "ready", "source_lang", "target_lang", "creation_time", "entry_count"}
    assert (g["name"], g["source_lang"], g["target_lang"], g["entry_count"], g["ready"]) == \
        ("pets", "de", "en", 2, True)
    gid = g["glossary_id"]
    assert call(t, "GET", "/v2/glossaries").json() == {"glossaries": [g]}
    assert call(t, "GET", f"/v2/glossaries/{gid}").json() == g
    e = call(t, "GET", f"/v2/glossaries/{gid}/entries", headers={"Accept": "text/tab-separated-values"})
    assert e.status_code == 200 and e.headers["content-type"].startswith("text/tab-separated-values")
    assert e.text == "Hund\tdog\nKatze\tcat"
    bad = call(t, "GET", f"/v2/glossaries/{gid}/entries", headers={"Accept": "application/json"})
    assert bad.status_code == 415 and set(bad.json()) == {"message"}
    # the /v1 view: one stored glossary per dictionary, named <id>.<source>-<target>
    assert [(x["name"], x["entry_count"], x["source_lang"]) for x in stored(t)] == [(f"{gid}.de-en", 2, "de")]
    r = call(t, "POST", "/v2/glossaries", data={"name": "csv", "source_lang": "DE", "target_lang": "EN-GB",
                                                 "entries": '"Haus, groß",mansion\nBaum,tree,de,en\n',
                                                 "entries_format": "csv"})
    assert r.status_code == 201 and r.json()["entry_count"] == 2, r.text
    csv_id = r.json()["glossary_id"]
    assert call(t, "GET", f"/v2/glossaries/{csv_id}/entries").text == "Haus, groß\tmansion\nBaum\ttree"
    assert call(t, "DELETE", f"/v2/glossaries/{gid}").status_code == 204
    for path in (f"/v2/glossaries/{gid}", f"/v2/glossaries/{gid}/entries"):
        r = call(t, "GET", path)
        assert r.status_code == 404 and set(r.json()) == {"message"}, r.text
    assert call(t, "DELETE", f"/v2/glossaries/{gid}").status_code == 404
    assert [x["name"] for x in stored(t)] == [f"{csv_id}.de-en"]


def test_glossary_language_pairs_are_the_served_ones_pivots_included(t):
    pairs = call(t, "GET", "/v2/glossary-language-pairs").json()["supported_languages"]
    assert {(p["source_lang"], p["target_lang"]) for p in pairs} == {("de", "en"), ("fr", "en"), ("en", "de"),
                                                                       ("fr", "de")}


@pytest.mark.parametrize("entries, fmt, words", [
    ("Hund\tdog\nKatze\tcat\nHund\thound", "tsv", "line 3, source: 'Hund' duplicates line 1"),
    ("Hund\tdog\n\tcat", "tsv", "line 2, source: an empty term"),
    ("Hund\t \n", "tsv", "line 1, target: an empty term"),
    ("Hund\tdog\nKatze\tcat\tTier", "tsv", "line 2: a tab inside a term"),
    ("Hund dog", "tsv", "line 1: no tab between source and target"),
    ('Hund,dog\n"Kat\tze",cat', "csv", "line 2, source: a tab inside the term"),
    ("Hund,dog,cat", "csv", "line 1: 3 columns"),
    ("Hund,dog,fr,en", "csv", "line 1: languages fr->en"),
    ("Hund\tdog\nHunde\tdogs", "tsv", "line 2"),          # one stem, two targets (translator/glossary.py)
    ("Hund\tdog\n!!\tbang", "tsv", "line 2"),             # no letter or digit to match
    ("Hund\t" + "d" * (MAX_GLOSSARY_TERM_CHARS + 1), "tsv", f"line 1, target: at most {MAX_GLOSSARY_TERM_CHARS}"),
    ("Hund\td\x07g", "tsv", "line 1, target: a control character (U+0007)"),
    ("".join(f"w{i}\tt{i}\n" for i in range(MAX_STORED_GLOSSARY_ENTRIES + 1)), "tsv",
     f"at most {MAX_STORED_GLOSSARY_ENTRIES} entries"),
    ("Hund\tdog", "xlsx", "entries_format"),
    ("", "tsv", "entries"),
])
def test_bad_entries_are_a_400_naming_line_and_field_and_store_nothing(t, entries, fmt, words):
    for form in (False, True):
        r = v2(t, entries=entries, fmt=fmt, form=form)
        assert r.status_code == 400 and set(r.json()) == {"message"}, r.text
        assert words in r.json()["message"], r.json()["message"]
    r = v3(t, dictionary("en", "de", "dog\tHund"), dictionary("de", "en", entries, fmt))
    assert r.status_code == 400 and "dictionaries[1]." in r.json()["message"] and words in r.json()["message"], r.text
    assert stored(t) == [] and call(t, "GET", "/v3/glossaries").json() == {"glossaries": []}


@pytest.mark.parametrize("fields, words", [
    ({"source_lang": "de", "target_lang": "ja"}, "no model here translates DE->JA"),
    ({"source_lang": "en", "target_lang": "fr"}, "EN->FR"),
    ({"source_lang": None}, "Parameter 'source_lang' not specified"),
    ({"name": ""}, "Parameter 'name' not specified"),
    ({"name": "n" * 1025}, "name: at most 1024 UTF-8 bytes"),
    ({"entries": None}, "Parameter 'entries' not specified"),
])
def test_bad_fields_are_a_400_naming_them(t, fields, words):
    body = {"name": "x", "source_lang": "de", "target_lang": "en", "entries": "Hund\tdog", **fields}
    r = call(t, "POST", "/v2/glossaries", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400 and words in r.json()["message"], r.text
    assert stored(t) == []


# ---- v3 ----------------------------------------------------------------------------------------------
def test_v3_create_get_entries_patch_put_delete_dictionary_and_glossary(t):
    r = v3(t, dictionary("de", "en", "Hund\tdog"), dictionary("EN", "DE", "dog,Hund\ncat,Katze", "csv"))
    assert r.status_code == 201, r.text
    g = r.json()
    gid = g["glossary_id"]
    assert g["name"] == "multi" and g["dictionaries"] == [
        {"source_lang": "de", "target_lang": "en", "entry_count": 1},
        {"source_lang": "en", "target_lang": "de", "entry_count": 2}]
    assert call(t, "GET", f"/v3/glossaries/{gid}").json() == g
    assert call(t, "GET", "/v3/glossaries").json() == {"glossaries": [g]}
    assert call(t, "GET", "/v2/glossaries").json() == {"glossaries": []}     # v2 lists glossaries of one pair
    assert call(t, "GET", f"/v2/glossaries/{gid}").status_code == 400
    e = call(t, "GET", f"/v3/glossaries/{gid}/entries", params={"source_lang": "EN", "target_lang": "DE"}).json()
    assert e == {"dictionaries": [{"source_lang": "en", "target_lang": "de", "entry_count": 2,
                                   "entries": "dog\tHund\ncat\tKatze", "entries_format": "tsv"}]}
    # PATCH: renamed, entries merged (a source already there takes the new target), a new pair added
    r = call(t, "PATCH", f"/v3/glossaries/{gid}", json={"name": "renamed", "dictionaries": [
        dictionary("en", "de", "cat\tKater\nbird\tVogel")]})
    assert r.status_code == 200 and r.json()["name"] == "renamed", r.text
    e = call(t, "GET", f"/v3/glossaries/{gid}/entries", params={"source_lang": "en", "target_lang": "de"}).json()
    assert e["dictionaries"][0]["entries"] == "dog\tHund\ncat\tKater\nbird\tVogel"
    r = call(t, "PATCH", f"/v3/glossaries/{gid}", json={"dictionaries": [dictionary("fr", "en", "chien\tdog")]})
    assert [(d["source_lang"], d["entry_count"]) for d in r.json()["dictionaries"]] == [("de", 1), ("en", 3), ("fr", 1)]
    assert call(t, "PATCH", f"/v3/glossaries/{gid}", json={}).status_code == 400
    # PUT: one dictionary replaced whole
    r = call(t, "PUT", f"/v3/glossaries/{gid}/dictionaries", json=dictionary("en", "de", "horse\tPferd"))
    assert r.status_code == 200 and r.json() == {"source_lang": "en", "target_lang": "de", "entry_count": 1}
    assert sorted(x["name"] for x in stored(t)) == sorted(f"{gid}.{p}" for p in ("de-en", "en-de", "fr-en"))
    q = {"source_lang": "fr", "target_lang": "en"}
    assert call(t, "DELETE", f"/v3/glossaries/{gid}/dictionaries", params=q).status_code == 204
    assert call(t, "DELETE", f"/v3/glossaries/{gid}/dictionaries", params=q).status_code == 404
    assert call(t, "GET", f"/v3/glossaries/{gid}/entries", params=q).status_code == 404
    assert call(t, "GET", f"/v3/glossaries/{gid}/entries", params={"source_lang": "fr"}).status_code == 400
    assert call(t, "DELETE", f"/v3/glossaries/{gid}/dictionaries", params={"source_lang": "en",
                                                                          "target_lang": "de"}).status_code == 204
    last = call(t, "DELETE", f"/v3/glossaries/{gid}/dictionaries", params={"source_lang": "de", "target_lang": "en"})
    assert last.status_code == 400 and "last dictionary" in last.json()["message"]
    assert call(t, "DELETE", f"/v3/glossaries/{gid}").status_code == 204
    assert call(t, "GET", f"/v3/glossaries/{gid}").status_code == 404 and stored(t) == []
    for method, path in (("PATCH", f"/v3/glossaries/{gid}"), ("PUT", f"/v3/glossaries/{gid}/dictionaries")):
        r = call(t, method, path, json={"name": "x", **dictionary("de", "en", "a\tb")})
        assert r.status_code == 404 and set(r.json()) == {"message"}, r.text


def test_v3_bad_input_changes_nothing(t):
    gid = v3(t, dictionary("de", "en", "Hund\tdog")).json()["glossary_id"]
    before = stored(t)
    for method, path, body in (
            ("PATCH", f"/v3/glossaries/{gid}", {"dictionaries": [dictionary("de", "en", "Hunde\tdogs")]}),  # a stem
            ("PATCH", f"/v3/glossaries/{gid}", {"name": "x", "dictionaries": [dictionary("de", "ja", "a\tb")]}),
            ("PUT", f"/v3/glossaries/{gid}/dictionaries", dictionary("de", "en", "a\tb\na\tc")),
            ("POST", "/v3/glossaries", {"name": "x", "dictionaries": [dictionary("de", "en", "a\tb")] * 2}),
            ("POST", "/v3/glossaries", {"name": "x", "dictionaries": []}),
            ("POST", "/v3/glossaries", {"name": "x", "dictionaries": "de\ten"})):
        r = call(t, method, path, json=body)
        assert r.status_code == 400 and set(r.json()) == {"message"}, (method, path, r.text)
    assert stored(t) == before and call(t, "GET", f"/v3/glossaries/{gid}").json()["name"] == "multi"


def test_a_v1_glossary_is_a_deepl_glossary_named_by_its_name(t):
    r = t.client.post("/v1/glossaries", headers={"Authorization": f"Bearer {A}"}, json={
        "name": "brand", "source_lang": "de", "target_lang": "en", "entries": [{"source": "Hund", "target": "hound"}]})
    assert r.status_code == 201, r.text
    assert call(t, "GET", "/v2/glossaries/brand").json()["name"] == "brand"
    r = call(t, "PATCH", "/v3/glossaries/brand", json={"dictionaries": [dictionary("fr", "en", "chien\tdog")]})
    assert r.status_code == 200 and len(r.json()["dictionaries"]) == 2, r.text
    assert sorted(x["name"] for x in stored(t)) == ["brand", "brand.fr-en"]
    assert call(t, "DELETE", "/v3/glossaries/brand").status_code == 204 and stored(t) == []


# ---- translating with it -----------------------------------------------------------------------------
def test_translate_takes_the_pairs_dictionary_after_detection_and_on_v1(t):
    gid = v3(t, dictionary("de", "en", "Hund\tdog"), dictionary("fr", "en", "chien\thound")).json()["glossary_id"]
    r = call(t, "POST", "/v2/translate", json={"text": ["Ein Hund.", "Le chien."], "target_lang": "EN-GB",
                                               "glossary_id": gid})
    assert r.status_code == 200, r.text
    assert {model: job.glossary for model, job in t.jobs} == {"de-en": (("Hund", "dog"),),
                                                              "fr-en": (("chien", "hound"),)}
    t.jobs.clear()
    r = call(t, "POST", "/v2/translate", json={"text": "Ein Hund.", "source_lang": "DE", "target_lang": "EN-US",
                                               "glossary_id": gid})
    assert r.status_code == 200 and t.jobs[-1][1].glossary == (("Hund", "dog"),)
    r = call(t, "POST", "/v2/translate", json={"text": "A dog.", "source_lang": "EN", "target_lang": "DE",
                                               "glossary_id": gid})
    assert r.status_code == 409 and "no dictionary for en->de" in r.json()["message"], r.text
    r = call(t, "POST", "/v2/translate", json={"text": "Ein Hund.", "target_lang": "EN-GB",
                                               "glossary_id": "96ab91fd-e715-41a1-adeb-5d701f84a483"})
    assert r.status_code == 404 and set(r.json()) == {"message"}
    r = t.client.post("/v1/translate", headers={"Authorization": f"Bearer {A}"},
                      json={"text": "Le chien.", "source_lang": "fr", "target_lang": "en", "glossary_id": gid})
    assert r.status_code == 200 and t.jobs[-1][1].glossary == (("chien", "hound"),), r.text


def test_glossary_ids_apply_up_to_five_in_order(t):
    first = v3(t, dictionary("de", "en", "Hund\tdog\nKatze\tcat"), name="first").json()["glossary_id"]
    second = v2(t, entries="Hunde\thounds\nMaus\tmouse", name="second").json()["glossary_id"]
    for ids in ([first, second], f"{first}, {second}"):
        r = call(t, "POST", "/v2/translate", json={"text": "Ein Hund.", "source_lang": "DE", "target_lang": "EN-GB",
                                                   "glossary_ids": ids})
        assert r.status_code == 200 and "x-ignored-fields" not in r.headers, r.text
        # "Hunde" has the stem of "Hund": the first glossary's target stays
        assert t.jobs[-1][1].glossary == (("Hund", "dog"), ("Katze", "cat"), ("Maus", "mouse"))
        assert t.jobs[-1][1].stored_glossary is True
    for body, words in (({"glossary_ids": [first] * 6}, "glossary_ids"),
                        ({"glossary_ids": [first], "glossary_id": second}, "glossary_ids"),
                        ({"glossary_ids": [first, "nope"]}, "nope")):
        r = call(t, "POST", "/v2/translate", json={"text": "Ein Hund.", "source_lang": "DE", "target_lang": "EN-GB",
                                                   **body})
        assert r.status_code in (400, 404) and words in r.json()["message"], r.text
    r = call(t, "POST", "/v2/document", data={"target_lang": "EN-GB", "source_lang": "DE",
                                              "glossary_ids": ",".join([first] * 6)},
             files={"file": ("a.txt", b"Ein Hund.")})
    assert r.status_code == 400 and "glossary_ids" in r.json()["message"], r.text


def test_another_key_cannot_see_use_change_or_delete_them(t):
    gid = v3(t, dictionary("de", "en", "Hund\tdog")).json()["glossary_id"]
    v2id = v2(t).json()["glossary_id"]
    assert call(t, "GET", "/v3/glossaries", key=B).json() == {"glossaries": []}
    assert call(t, "GET", "/v2/glossaries", key=B).json() == {"glossaries": []}
    for i in (gid, v2id):
        for method, path, kw in (("GET", f"/v3/glossaries/{i}", {}), ("GET", f"/v2/glossaries/{i}", {}),
                                 ("GET", f"/v2/glossaries/{i}/entries", {}),
                                 ("GET", f"/v3/glossaries/{i}/entries", {"params": {"source_lang": "de",
                                                                                     "target_lang": "en"}}),
                                 ("PATCH", f"/v3/glossaries/{i}", {"json": {"name": "mine"}}),
                                 ("PUT", f"/v3/glossaries/{i}/dictionaries", {"json": dictionary("de", "en", "a\tb")}),
                                 ("DELETE", f"/v3/glossaries/{i}", {}), ("DELETE", f"/v2/glossaries/{i}", {})):
            r = call(t, method, path, key=B, **kw)
            assert r.status_code == 404 and set(r.json()) == {"message"}, (method, path, r.text)
        r = call(t, "POST", "/v2/translate", key=B, json={"text": "Ein Hund.", "source_lang": "DE",
                                                          "target_lang": "EN-GB", "glossary_id": i})
        assert r.status_code == 404
    assert len(call(t, "GET", "/v3/glossaries").json()["glossaries"]) == 2
    for key in (None, "wrong"):
        r = t.client.get("/v3/glossaries", headers={"Authorization": f"DeepL-Auth-Key {key}"} if key else {})
        assert r.status_code == 403 and set(r.json()) == {"message"}, r.text
    r = call(t, "GET", "/v3/nothing")
    assert r.status_code == 404 and set(r.json()) == {"message"}
