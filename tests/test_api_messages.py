"""Messages that say what was wrong: an empty field is called empty (not missing), a string over
its limit names the length received, a glossary's languages must be served (as a pair when both are
given), and a suggestion for a pivoted pair names the legs that take it."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from local_services import local_services, upper_cased

from model.config import ModelConfig
from service.api.http import build_app
from service.translator import ModelCard

CFG = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    cards = [ModelCard("de-en", "", "de", "en", CFG), ModelCard("en-de", "", "en", "de", CFG),
             ModelCard("en-fr", "", "en", "fr", CFG)]
    where = tmp_path_factory.mktemp("store")
    return TestClient(build_app(local_services(cards, upper_cased([]), store_dir=str(where),
                                               memory_file=str(where / "memory.jsonl"))))


def test_an_empty_q_is_called_empty_and_a_missing_one_missing(client):
    empty = client.post("/translate", data={"q": "", "source": "de", "target": "en"})
    missing = client.post("/translate", data={"source": "de", "target": "en"})
    assert empty.status_code == missing.status_code == 400
    assert "empty q parameter" in empty.json()["error"] and "missing" not in empty.json()["error"]
    assert "missing q parameter" in missing.json()["error"]
    r = client.post("/suggest", data={"q": "Hallo", "s": "", "source": "de", "target": "en"})
    assert r.status_code == 400 and "empty s parameter" in r.json()["error"], r.text


def test_a_string_over_its_limit_names_the_length_received(client):
    r = client.post("/v1/translate", json={"text": "Hallo", "source_lang": "de", "target_lang": "en",
                                           "target_prefix": "x" * 1234})
    err = r.json()["error"]
    assert r.status_code == 422 and err["field"] == "target_prefix", r.text
    assert "at most 1000 characters (got 1234)" in err["message"] and "xxxx" not in err["message"]


@pytest.mark.parametrize("langs, status, field, named", [
    ({"source_lang": "xx", "target_lang": "en"}, 422, "source_lang", "served: de, en"),
    ({"source_lang": "de", "target_lang": "zz"}, 422, "target_lang", "served: de, en, fr"),
    ({"source_lang": "de", "target_lang": "de"}, 422, "target_lang", "de->en, de->fr, en->de, en->fr"),
    ({"source_lang": "DE"}, 422, "source_lang", "served: de, en"),
    ({"source_lang": "de", "target_lang": "fr"}, 201, None, None),        # a pivoted pair is served
    ({"target_lang": "fr"}, 201, None, None), ({}, 201, None, None)])
def test_a_glossarys_languages_are_ones_served_here(client, langs, status, field, named):
    body = {"name": f"g-{len(langs)}-{'-'.join(langs.values())}", "entries": [{"source": "Hund", "target": "dog"}], **langs}
    r = client.post("/v1/glossaries", json=body)
    assert r.status_code == status, r.text
    if field:
        assert r.json()["error"]["field"] == field and named in r.json()["error"]["message"]
        assert client.get(f"/v1/glossaries/{body['name']}").status_code == 404        # nothing stored
    else:
        assert client.get(f"/v1/glossaries/{body['name']}").json()["entry_count"] == 1


def test_a_suggestion_for_a_pivoted_pair_names_the_legs_that_take_it(client):
    r = client.post("/suggest", data={"q": "Hallo", "s": "Bonjour", "source": "de", "target": "fr"})
    assert r.status_code == 400 and "(de->en, en->fr)" in r.json()["error"] and "en-fr" in r.json()["error"], r.text
    for q, s, source, target in (("Hallo", "Hello there", "de", "en"), ("Hello there", "Salut", "en", "fr")):
        assert client.post("/suggest", data={"q": q, "s": s, "source": source, "target": target}).json() == {"success": True}


def test_a_content_type_without_a_media_type_is_named_as_sent(client):
    for path, read in (("/v1/translate", lambda j: j["error"]["message"]), ("/translate", lambda j: j["error"]),
                       ("/v2/translate", lambda j: j["message"]), ("/v1/documents", lambda j: j["error"]["message"])):
        r = client.post(path, content=b'{"text": "Hallo"}', headers={"Content-Type": ";;;==="})
        assert r.status_code in (400, 415) and "';;;==='" in read(r.json()), (path, r.text)
