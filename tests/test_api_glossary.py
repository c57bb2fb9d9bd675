"""Glossaries over HTTP on the running service (tests/conftest.py starts it once): the ``glossary`` and
``glossary_id`` fields of /v1/translate and LibreTranslate's /translate, streaming, the stored
glossaries API and the 4xx of bad glossaries."""
from __future__ import annotations

import httpx
import pytest

from conftest import post, sse_events, translate
from service.protocol import MAX_GLOSSARY_ENTRIES

SENTENCE = "Ein Mann fährt mit dem Fahrrad die Straße entlang."
OTHER = "Zwei Hunde spielen im Schnee."
TERM = [{"source": "Fahrrad", "target": "bike"}]


@pytest.mark.slow
def test_glossary_terms_in_output_and_other_texts_unchanged(service_url):
    plain = translate(service_url, [SENTENCE, OTHER])["translations"]
    assert "bike" not in plain[0]["text"]            # the model's own choice is "bicycle"
    for beam in (1, 4):
        got = translate(service_url, [SENTENCE, OTHER], beam_size=beam, glossary=TERM)["translations"]
        assert "bike" in got[0]["text"], got[0]["text"]
        alone = translate(service_url, OTHER, beam_size=beam)["translations"][0]
        assert got[1]["text"] == alone["text"] and got[1]["tokens"] == alone["tokens"]
    upper = translate(service_url, SENTENCE.upper(), glossary=[{"source": "fahrräder", "target": "bike"}])
    assert "BIKE" in upper["translations"][0]["text"]   # inflection and case matched; the output keeps capitals


@pytest.mark.slow
def test_glossary_streaming(service_url):
    r = post(service_url, {"text": SENTENCE, "beam_size": 1, "stream": True, "glossary": TERM})
    assert r.status_code == 200
    events = sse_events(r.text)
    final = events[-1][1]["translations"][0]["text"]
    assert "bike" in final
    assert "".join(d["text"] for e, d in events if e == "token") == final


@pytest.mark.slow
def test_stored_glossary_api_and_glossary_id(service_url):
    url = service_url + "/v1/glossaries"
    body = {"name": "test-bikes", "entries": TERM, "source_lang": "de", "target_lang": "en"}
    created = httpx.post(url, json=body)
    assert created.status_code == 201, created.text
    assert created.json()["entry_count"] == 1 and created.json()["shared"] is False
    assert httpx.post(url, json=body).status_code == 409
    assert "test-bikes" in [g["name"] for g in httpx.get(url).json()["data"]]
    assert httpx.get(url + "/test-bikes").json()["entries"] == TERM
    got = translate(service_url, SENTENCE, glossary_id="test-bikes")["translations"][0]["text"]
    assert "bike" in got
    libre = httpx.post(service_url + "/translate", json={"q": SENTENCE, "source": "de", "target": "en",
                                                         "glossary_id": "test-bikes"})
    assert libre.status_code == 200 and "bike" in libre.json()["translatedText"]
    wrong_pair = post(service_url, {"text": "A man.", "source_lang": "en", "target_lang": "de",
                                    "glossary_id": "test-bikes"})
    assert wrong_pair.status_code == 409 and wrong_pair.json()["error"]["field"] == "glossary_id"
    assert httpx.delete(url + "/test-bikes").status_code == 204
    gone = post(service_url, {"text": SENTENCE, "glossary_id": "test-bikes"})
    assert gone.status_code == 404 and gone.json()["error"]["field"] == "glossary_id"
    assert httpx.delete(url + "/test-bikes").status_code == 404


@pytest.mark.slow
def test_libretranslate_glossary_field(service_url):
    r = httpx.post(service_url + "/translate", data={"q": SENTENCE, "source": "de", "target": "en",
                                                      "glossary": '[{"source": "Fahrrad", "target": "bike"}]'})
    assert r.status_code == 200 and "bike" in r.json()["translatedText"] and "x-ignored-fields" not in r.headers
    bad = httpx.post(service_url + "/translate", json={"q": SENTENCE, "source": "de", "target": "en",
                                                       "glossary": [{"source": "", "target": "x"}]})
    assert bad.status_code == 400 and "glossary[0].source" in bad.json()["error"]


@pytest.mark.slow
@pytest.mark.parametrize("glossary, status, field, words", [
    ([{"source": "Fahrrad", "target": "bike"}, {"source": "Fahrräder", "target": "bicycles"}], 422,
     "glossary[1].source", "conflicts with glossary[0]"),
    ([{"source": "  ", "target": "x"}], 422, "glossary", "glossary[0].source: must not be empty"),
    ([{"source": f"w{i}", "target": "x"} for i in range(MAX_GLOSSARY_ENTRIES + 1)], 422, "glossary",
     f"at most {MAX_GLOSSARY_ENTRIES} entries"),
    ([{"source": "Fahrrad", "target": "🐶" * 100}], 422, "glossary[0].target", "tokens (the model's max_len)"),
])
def test_bad_glossaries_are_4xx_naming_the_field(service_url, glossary, status, field, words):
    r = post(service_url, {"text": SENTENCE, "glossary": glossary})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and words in err["message"], err
    unknown = post(service_url, {"text": SENTENCE, "glossary_id": "no-such-glossary"})
    assert unknown.status_code == 404 and unknown.json()["error"]["field"] == "glossary_id"
