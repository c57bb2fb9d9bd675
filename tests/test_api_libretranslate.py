"""The LibreTranslate-compatible API (service/api/libretranslate.py): POST /translate and GET
/languages of the running service over real HTTP, and its checks in-process."""
from __future__ import annotations

import re

import httpx
import pytest
from conftest import DATA, post, translate

from model.config import ModelConfig
from model.tokenizer import read_lines
from service.api.libretranslate import (
    MAX_IGNORED_NAMES,
    LibreRequest,
    checked_job,
    ignored_fields_header,
    parse,
)
from service.api.schemas import FormFields
from service.engine import EngineConfig
from service.engine.validation import ModelLimits
from service.pipeline import LanguageGraph
from service.protocol import MAX_TEXT_CHARS, ServiceError, TooLarge
from service.translator import ModelCard

SENTENCES = read_lines(DATA / "test_2016_flickr.de.gz")[:12]


@pytest.mark.slow
def test_libretranslate_languages(service_url):
    langs = httpx.get(service_url + "/languages").json()
    assert {"code": "de", "name": "German", "targets": ["en"]} in langs
    assert {"code": "en", "name": "English", "targets": ["de"]} in langs


@pytest.mark.slow
def test_libretranslate_translate_json_and_forms(service_url):
    s0, s1 = SENTENCES[6], SENTENCES[7]
    native = translate(service_url, [s0, s1], beam_size=4)["translations"]
    one = post(service_url, {"q": s0, "source": "de", "target": "en"}, path="/translate")
    assert one.status_code == 200 and one.json() == {"translatedText": native[0]["text"]}
    many = post(service_url, {"q": [s0, s1], "source": "de", "target": "en", "api_key": ""}, path="/translate")
    assert many.json() == {"translatedText": [native[0]["text"], native[1]["text"]]}
    assert "x-ignored-fields" not in one.headers and "x-ignored-fields" not in many.headers
    extra = post(service_url, {"q": s0, "source": "de", "target": "en", "colour": "red", "größe": 2}, path="/translate")
    assert extra.status_code == 200 and extra.json() == one.json()      # answered as LibreTranslate does,
    assert extra.headers["x-ignored-fields"] == "colour, gr\\u00f6\\u00dfe"   # but what it did not read is named
    upper = post(service_url, {"q": s0, "source": "DE", "target": "en-US"}, path="/translate")
    assert upper.status_code == 200 and upper.json() == one.json()
    form = httpx.post(service_url + "/translate", data={"q": s0, "source": "de", "target": "en", "format": "text"})
    assert form.json() == {"translatedText": native[0]["text"]}
    multipart = httpx.post(service_url + "/translate", files={"q": (None, s1), "source": (None, "de"),
                                                              "target": (None, "en")})
    assert multipart.json() == {"translatedText": native[1]["text"]}
    alts = post(service_url, {"q": s0, "source": "de", "target": "en", "alternatives": 2}, path="/translate").json()
    assert alts["translatedText"] == native[0]["text"] and isinstance(alts["alternatives"], list)
    assert len(alts["alternatives"]) <= 2 and native[0]["text"] not in alts["alternatives"]
    auto = post(service_url, {"q": [s0], "source": "auto", "target": "en"}, path="/translate").json()
    assert auto["translatedText"] == [native[0]["text"]] and set(auto) == {"translatedText", "detectedLanguage"}
    assert auto["detectedLanguage"][0]["language"] == "de" and 50 < auto["detectedLanguage"][0]["confidence"] < 100
    # auto is detected, not "the one source language serving the target" at confidence 100
    english = post(service_url, {"q": "A man is riding a bicycle down the street.", "source": "auto", "target": "en"},
                   path="/translate").json()
    assert english["translatedText"] == "A man is riding a bicycle down the street." and english["passthrough"] is True
    assert english["detectedLanguage"]["language"] == "en" and english["detectedLanguage"]["confidence"] < 100
    html = post(service_url, {"q": f"<p>{s0} <b>{s1}</b></p>", "source": "de", "target": "en", "format": "html"},
                path="/translate").json()["translatedText"]
    assert html.startswith("<p>") and "<b>" in html and html.endswith("</b></p>")
    # a sentence split by inline tags is translated as one sentence, each tag around its own words
    whole = translate(service_url, "Ein Mann mit einem roten Hut steht vor einem Gebäude.", beam_size=4)
    html = post(service_url, {"q": '<p>Ein Mann mit einem <b>roten Hut</b> steht vor einem <a href="/x">Gebäude</a>.</p>',
                              "source": "de", "target": "en", "format": "html"}, path="/translate").json()["translatedText"]
    assert re.sub(r"<[^>]+>", "", html) == f"{whole['translations'][0]['text']}", html
    assert re.search(r"<b>[^<]+</b>", html) and re.search(r'<a href="/x">[^<]+</a>', html), html
    # script/code text is not prose: kept verbatim; the model's entities are not escaped twice
    kept = '<script>var s = "Ein Hund" && n < 2;</script><code>a &lt; b</code>'
    html = post(service_url, {"q": kept + "<p>Ein Mann &amp; eine Frau.</p>", "source": "de", "target": "en",
                              "format": "html"}, path="/translate").json()["translatedText"]
    assert html.startswith(kept) and "&amp;amp;" not in html, html


@pytest.mark.slow
@pytest.mark.parametrize("body, words", [
    ({"source": "de", "target": "en"}, ["missing q"]),
    ({"q": "Hallo", "target": "en"}, ["missing source"]),
    ({"q": "Hallo", "source": "de"}, ["missing target"]),
    ({"q": "Hallo", "source": "xx", "target": "en"}, ["xx is not supported", "source languages: de, en"]),
    ({"q": "Hallo", "source": "de", "target": "auto"}, ["target auto is not supported"]),
    ({"q": "Hallo", "source": "de", "target": "de"}, ["not available as a target language"]),
    ({"q": "Hallo", "source": "de", "target": "en", "format": "pdf"}, ["pdf format is not supported"]),
    ({"q": "Hallo", "source": "de", "target": "en", "alternatives": "many"}, ["alternatives"]),
    ({"q": 5, "source": "de", "target": "en"}, ["q"]),
    ({"q": "x" * (MAX_TEXT_CHARS + 1), "source": "de", "target": "en"}, [str(MAX_TEXT_CHARS)]),
])
def test_libretranslate_errors(service_url, body, words):
    r = post(service_url, body, path="/translate")
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    for w in words:
        assert w in r.json()["error"]
    assert httpx.post(service_url + "/translate", content=b"[1]",
                      headers={"Content-Type": "application/json"}).json()["error"].startswith("Invalid JSON format")



@pytest.mark.slow
def test_libretranslate_raw_utf8_form_and_negative_alternatives(service_url):
    raw = "q=Ein Hund läuft.&source=de&target=en".encode("utf-8")  # what `curl -d` sends
    r = httpx.post(service_url + "/translate", content=raw,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    j = httpx.post(service_url + "/translate", json={"q": "Ein Hund läuft.", "source": "de", "target": "en"})
    assert r.status_code == 200 and r.json()["translatedText"] == j.json()["translatedText"]
    r = httpx.post(service_url + "/translate", json={"q": "x", "source": "de", "target": "en", "alternatives": -1})
    assert r.status_code == 400 and "alternatives" in r.json()["error"]
    # integers of any size, as JSON (400 digits, 1e400) or a form (5,000 digits): a 400, never a 500
    for raw in (b'{"q": "x", "source": "de", "target": "en", "alternatives": 1' + b"0" * 400 + b"}",
                b'{"q": "x", "source": "de", "target": "en", "alternatives": 1e400}'):
        r = httpx.post(service_url + "/translate", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "alternatives" in r.json()["error"], r.text
    r = httpx.post(service_url + "/translate", data={"q": "x", "source": "de", "target": "en", "alternatives": "9" * 5000})
    assert r.status_code == 400 and "0 <= alternatives <= 15" in r.json()["error"], r.text
    for body in (b"q=Hallo&source=%FF&target=en", b"q=%FF%FE&source=de&target=en", b"q=\xff&source=de"):
        r = httpx.post(service_url + "/translate", content=body,
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400 and "UTF-8" in r.json()["error"], body


# ---- in-process -------------------------------------------------------------------------------------
TINY = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
CARDS = [ModelCard("de-en", "", "de", "en", TINY), ModelCard("en-de", "", "en", "de", TINY)]
GRAPH = LanguageGraph(CARDS)


def test_parse_picks_the_model_and_the_options():
    req = parse(FormFields({"q": ["a", "b"], "source": "en", "target": "de", "alternatives": "2"}), GRAPH)
    assert (req.card.id, req.batch, req.auto, req.alternatives, req.html) == ("en-de", True, False, 2, False)
    auto = parse({"q": ["a", "b"], "source": "auto", "target": "de"}, GRAPH)     # the model: per text, once detected
    assert (auto.card, auto.auto, auto.target) == (None, True, "de")
    job, origin = req.job(req.texts), req.origin()
    assert (job.options.beam_size, job.options.n_best, origin.field, origin.is_list) == (4, 3, "q", True)
    with pytest.raises(ServiceError, match="not available as a target language") as e:
        parse({"q": "a", "source": "de", "target": "de"}, GRAPH)
    assert (e.value.status, e.value.field) == (400, "target")


def test_a_lone_surrogate_in_q_is_invalid_unicode():
    req = LibreRequest(["x", "\ud800"], True, CARDS[0], 0, False, False)
    with pytest.raises(ServiceError) as e:
        checked_job(req, req.texts)
    assert (e.value.status, e.value.field) == (422, "q"), e.value.message
    assert "Unicode" in e.value.message and "q" in e.value.message


@pytest.mark.slow
def test_html_alternatives_are_the_rebuilt_html_of_each_hypothesis(service_url):
    """format=html with alternatives: each alternative is the fragment rebuilt around hypothesis i of
    every segment, markup kept (it was [] before)."""
    q = '<p>Ein <b>großer</b> Hund läuft im <a href="/p">Park</a>.</p>'
    r = post(service_url, {"q": q, "source": "de", "target": "en", "format": "html", "alternatives": 2},
             path="/translate").json()
    tags = lambda h: re.findall(r"<[^>]+>", h)  # noqa: E731
    assert 1 <= len(r["alternatives"]) <= 2 and r["translatedText"] not in r["alternatives"], r
    assert all(tags(a) == tags(q) for a in r["alternatives"]), r


@pytest.mark.slow
def test_html_blocks_count_as_sentences_not_as_texts(service_url):
    """The 64-texts limit counts q items, not an HTML text's blocks: 300 blocks (more sentences than one
    request has in the engine at once) come back whole."""
    def html(n: int) -> str:
        return "<ul>" + "<li>Hund</li>" * n + "</ul>"      # 300 of them: 3,909 characters
    r = post(service_url, {"q": html(65), "source": "de", "target": "en", "format": "html"}, path="/translate")
    assert r.status_code == 200, r.text
    out = r.json()["translatedText"]
    assert out.startswith("<ul><li>") and out.count("<li>") == out.count("</li>") == 65, out
    r = post(service_url, {"q": html(300), "source": "de", "target": "en", "format": "html"}, path="/translate")
    assert r.status_code == 200, r.text
    out = r.json()["translatedText"]
    assert out.startswith("<ul><li>") and out.count("<li>") == out.count("</li>") == 300, out
    r = post(service_url, {"q": ["<p>Hund</p>"] * 65, "source": "de", "target": "en", "format": "html"},
             path="/translate")
    assert r.status_code == 400 and "at most 64 texts per request, got 65" in r.json()["error"], r.text
    # an HTML text's characters count its tags (as LibreTranslate's char_limit): refused at once, naming the item
    big = "<ul>" + "<li><b>Ein</b> <i>Hund</i></li>" * 200 + "</ul>"
    r = post(service_url, {"q": ["<p>Hund</p>", big], "source": "de", "target": "en", "format": "html"},
             path="/translate")
    assert r.status_code == 400 and r.json()["error"].startswith(
        f"q[1]: at most {MAX_TEXT_CHARS} characters per text, got {len(big)}"), r.text


def test_html_text_limit_counts_q_items_in_process():
    limits = ModelLimits.of("de-en", TINY, EngineConfig(max_num_seqs=4, max_waiting=512))
    req = LibreRequest(["<ul>" + "<li>Ein Hund</li>" * 100 + "</ul>"], False, CARDS[0], 0, True, False)
    job, origin = checked_job(req, ["Ein Hund"] * 100, n_texts=1)
    limits.check(job, origin)
    assert len(job.texts) == 100 and origin.n_texts == 1
    with pytest.raises(TooLarge, match="at most 64 texts per request, got 65"):
        limits.check(*checked_job(req, ["Ein Hund"] * 65))    # without n_texts the segments are the texts


def test_language_codes_match_ignoring_case_and_fall_back_from_a_region():
    """BCP 47 codes are case-insensitive, and "de-DE" / "pt_BR" name their language when only that
    is served; an unknown code comes back unchanged (the route's 400/404 names it)."""
    from service.translator.card import match_language
    known = {"de", "en", "fra"}
    assert [match_language(c, known) for c in ("de", "DE", "de-DE", "De_at", "FRA", "en-GB")] == \
        ["de", "de", "de", "de", "fra", "en"]
    assert match_language("xx", known) == "xx" and match_language("xx-DE", known) == "xx-DE"
    assert match_language(None, known) is None
    assert match_language("de-DE", known | {"de-DE"}) == "de-DE"      # a served full code wins


def test_ignored_fields_header_names_each_unread_field_shortened_and_counts_the_rest():
    assert ignored_fields_header({"q": "x", "source": "de", "target": "en", "format": "text", "alternatives": 1,
                                  "api_key": "k"}) is None
    many = {f"f{i}": i for i in range(MAX_IGNORED_NAMES + 3)}
    value = ignored_fields_header({"q": "x", "a\nb": 1, "x" * 1000: 2, **many})["X-Ignored-Fields"]
    names = value.split(", ")
    assert names[0] == "a\\nb" and names[1] == "x" * 32 + "...(1000 characters)"   # no raw newline in a header
    assert len(names) == MAX_IGNORED_NAMES + 1 and names[-1] == "... (5 more)" and value.isascii()
