"""Language identification (service/translator/langid.py; its benchmark service/bench/langid.py),
source "auto" and POST /detect (service/pipeline/autodetect.py, libretranslate.py, gateway.py,
routes_libre.py): the detector and the routing in-process without Ray, then the running service
over HTTP (slow), LibreTranslate's own client among them."""
from __future__ import annotations

import json

import httpx
import pytest
from conftest import DATA, post, translate
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from model.config import ModelConfig
from model.tokenizer import read_lines
from service.api import libretranslate
from service.pipeline import LanguageGraph, autodetect
from local_services import local_services
from service.api.middleware.body import BodyMiddleware
from service.api.errors import add_exception_handlers
from service.protocol import JobOrigin, ServiceError, TranslateResponse, Translation, Usage
from service.translator import ModelCard
from service.translator.langid import (
    COMMON_LANGUAGES,
    MAX_DETECT_CHARS,
    NO_LANGUAGE,
    LanguageDetector,
    detect,
)

DE = read_lines(DATA / "val.de.gz")[:20] + read_lines(DATA / "test_2016_flickr.de.gz")[:20]
EN = read_lines(DATA / "val.en.gz")[:20] + read_lines(DATA / "test_2016_flickr.en.gz")[:20]
FR = ["Un homme en chemise bleue est assis sur un banc devant une maison.",
      "Deux enfants jouent dans le sable au bord de la mer.",
      "Une femme regarde par la fenêtre pendant qu'il pleut dehors.",
      "Le chien noir court après une balle rouge dans le parc."]
NO_LETTERS = ["12345", "\U0001F600", "...", "3 + 4 = 7", "", " \n "]

DETECTOR = LanguageDetector(["de", "en"])      # the test service's languages


# ---- the detector ----------------------------------------------------------------------------------
@pytest.mark.parametrize("lang, texts", [("de", DE), ("en", EN), ("fr", FR)])
def test_sentences_are_detected_with_a_real_confidence(lang, texts):
    for text in texts:
        found = DETECTOR.detect(text)
        assert found[0][0] == lang, (text, found)
        confs = [c for _, c in found]
        assert 50 < confs[0] < 100 and confs == sorted(confs, reverse=True) and sum(confs) <= 100, (text, found)
        assert len(found) <= 3


def test_text_without_letters_has_no_language_and_unknown_letters_are_undetermined():
    assert all(DETECTOR.detect(t) == [] for t in NO_LETTERS)
    assert DETECTOR.detect("A") == [(NO_LANGUAGE, 0.0)]      # letters, but no feature the model knows
    # a long run of digits before the words: the window starts at the first letter
    assert DETECTOR.detect("1" * (MAX_DETECT_CHARS * 3) + " " + DE[0])[0][0] == "de"


def test_short_texts_get_a_low_confidence_never_100():
    """One word is weak evidence: its confidence says so; a long sentence is never certain either."""
    conf = dict(DETECTOR.detect("Hund"))
    assert max(conf.values()) < 50, conf
    assert DETECTOR.detect(" ".join(EN[:10]))[0] == ("en", 99.9)


def test_candidates_are_the_common_languages_plus_the_served_ones():
    d = LanguageDetector(["de", "la", "xx"]).load()
    assert set(COMMON_LANGUAGES) <= set(d.languages) and "la" in d.languages
    assert d.unknown == ("xx",) and "xx" not in d.languages
    assert detect(FR[0])[0][0] == "fr"        # the module-level detector


# ---- routing --------------------------------------------------------------------------------------
def _detections(texts):
    return [DETECTOR.detect(t) for t in texts]


def test_route_sends_each_text_to_its_model_and_passes_through_the_rest():
    texts = [DE[0], EN[0], "12345", DE[1]]
    models = {"de": "de-en", "en": "en-de"}
    routed = autodetect.route(texts, _detections(texts), "en", lambda lang: models[lang], JobOrigin("q", True), "source")
    assert [(r.card_id, r.language, r.passthrough) for r in routed] == [
        ("de-en", "de", False), (None, "en", True), (None, NO_LANGUAGE, True), ("de-en", "de", False)]
    assert routed[2].confidence == 0.0 and 50 < routed[0].confidence < 100
    assert autodetect.groups(routed) == {"de-en": [0, 3]}
    routed = autodetect.route(texts, _detections(texts), None, lambda lang: models[lang], JobOrigin("text", True), "source_lang")
    assert autodetect.groups(routed) == {"de-en": [0, 3], "en-de": [1]}


def test_route_refuses_a_language_no_model_reads_naming_the_text_the_detection_and_what_is_served():
    def pick(lang):
        raise ServiceError(404, f"source_lang: no model for {lang}->en; available pairs: de->en (de-en)", "source_lang")
    with pytest.raises(ServiceError) as e:
        autodetect.route([DE[0], FR[0]], _detections([DE[0], FR[0]]), "en",
                         lambda lang: "de-en" if lang == "de" else pick(lang), JobOrigin("text", True), "source_lang")
    assert (e.value.status, e.value.field, e.value.type) == (404, "source_lang", autodetect.NOT_SERVED)
    msg = e.value.message
    assert "French (fr)" in msg and "text[1]" in msg and "confidence" in msg and "de->en (de-en)" in msg, msg
    assert "source_lang: source_lang" not in msg
    with pytest.raises(ServiceError) as e:
        autodetect.route(["A"], [[(NO_LANGUAGE, 0.0)]], "en", lambda lang: "x", JobOrigin("q", False), "source", "de, en")
    assert (e.value.status, e.value.field) == (404, "source") and "cannot tell" in e.value.message
    assert "served: de, en" in e.value.message


def test_an_unsure_guess_no_model_reads_gives_way_to_the_likeliest_served_language():
    """A short text's best guess under UNSURE that no model reads does not fail the request: the
    likeliest language a model reads takes it, with its own confidence; a sure one is still refused."""
    models = {"de": "de-en", "en": "en-de"}

    def pick(lang):
        if lang not in models:
            raise ServiceError(404, f"source_lang: no model for {lang}", "source_lang")
        return models[lang]
    texts = ["A dog.", DE[0], "Danke"]
    every = [DETECTOR.detect(t, len(DETECTOR.requested)) for t in texts]
    assert every[0][0][0] not in models and every[0][0][1] < autodetect.UNSURE   # the case itself
    routed = autodetect.route(texts, every, "fr", pick, JobOrigin("text", True), "source_lang")
    first_served = [next((lang, c) for lang, c in cands if lang in models) for cands in every]
    assert [(r.card_id, r.language, r.confidence) for r in routed] == [
        (models[lang], lang, c) for lang, c in first_served]
    assert routed[0].language == "en" and routed[1].language == "de"
    # the target among the candidates: passed through, as a text detected in it is
    routed = autodetect.route(["A dog."], every[:1], "en", pick, JobOrigin("text", False), "source_lang")
    assert (routed[0].card_id, routed[0].language, routed[0].passthrough) == (None, "en", True)
    # at UNSURE or above, no model reading the language is still a 404 naming it
    sure = [("es", autodetect.UNSURE), ("en", 10.0)]
    with pytest.raises(ServiceError) as e:
        autodetect.route(["Hola amigo"], [sure], "fr", pick, JobOrigin("text", False), "source_lang")
    assert e.value.status == 404 and "Spanish (es)" in e.value.message
    # under UNSURE with no served language among the candidates: refused too
    with pytest.raises(ServiceError) as e:
        autodetect.route(["Ciao"], [[("vi", 9.0), ("it", 8.8)]], "fr", pick, JobOrigin("text", False), "source_lang")
    assert e.value.status == 404 and "Vietnamese (vi)" in e.value.message and "it 8.8%" in e.value.message


def test_detect_answer_in_libretranslate_shape():
    one = autodetect.detect_answer(_detections([DE[0]]))
    assert one[0]["language"] == "de" and 50 < one[0]["confidence"] < 100 and set(one[0]) == {"confidence", "language"}
    both = autodetect.detect_answer(_detections([DE[0], EN[0]]))      # a list: mean over the texts
    assert {d["language"] for d in both[:2]} == {"de", "en"} and all(d["confidence"] < 60 for d in both)
    assert autodetect.detect_answer([[]]) == [{"confidence": 0.0, "language": "und"}]


# ---- LibreTranslate routes in-process (a fake translator) ------------------------------------------
TINY = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
CARDS = [ModelCard("de-en", "", "de", "en", TINY), ModelCard("en-de", "", "en", "de", TINY)]
ENGINE = {"max_num_seqs": 4, "max_waiting": 64}


@pytest.fixture
def libre():
    calls: list[tuple[str, list[str]]] = []

    async def run(model: str, job) -> TranslateResponse:
        calls.append((model, list(job.texts)))
        return TranslateResponse(model=model, usage=Usage(source_tokens=len(job.texts), generated_tokens=1),
                                 translations=[Translation(text=f"[{model}] {t}", tokens=["x"], source_tokens=["x"],
                                                           score=-1.0, finish_reason="eos") for t in job.texts])
    app = FastAPI()
    app.add_middleware(BodyMiddleware)
    add_exception_handlers(app)

    @app.post("/translate")
    async def translate_route(request: Request):
        return await libretranslate.translate(request, local_services(CARDS, run, ENGINE, DETECTOR))

    @app.post("/detect")
    async def detect_route(request: Request):
        return await libretranslate.detect(request, DETECTOR)
    client = TestClient(app)
    client.calls = calls
    return client


def test_libre_auto_detects_each_text_routes_it_and_passes_through_the_target_language(libre):
    r = libre.post("/translate", json={"q": [DE[0], EN[0], "12345", DE[1]], "source": "auto", "target": "en"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["translatedText"] == [f"[de-en] {DE[0]}", EN[0], "12345", f"[de-en] {DE[1]}"]
    assert [d["language"] for d in body["detectedLanguage"]] == ["de", "en", "und", "de"]
    assert all(0 < d["confidence"] < 100 for i, d in enumerate(body["detectedLanguage"]) if i != 2)
    assert body["passthrough"] == [False, True, True, False]
    assert libre.calls == [("de-en", [DE[0], DE[1]])]        # one job per model, the passed-through texts in none
    r = libre.post("/translate", data={"q": EN[0], "source": "auto", "target": "de"})
    assert r.json()["translatedText"] == f"[en-de] {EN[0]}" and r.json()["detectedLanguage"]["language"] == "en"
    assert "passthrough" not in r.json()
    r = libre.post("/translate", json={"q": EN[0], "source": "auto", "target": "en"}).json()
    assert r["translatedText"] == EN[0] and r["passthrough"] is True and r["detectedLanguage"]["language"] == "en"
    # never the old answer: "auto" resolved to the one source serving the target, at confidence 100
    assert r["detectedLanguage"]["confidence"] < 100


def test_libre_auto_html_detects_the_text_between_the_tags(libre):
    r = libre.post("/translate", json={"q": [f"<p>{DE[0]}</p>", "<br/>"], "source": "auto", "target": "en",
                                       "format": "html"}).json()
    assert r["translatedText"] == [f"<p>[de-en] {DE[0]}</p>", "<br/>"], r
    assert [d["language"] for d in r["detectedLanguage"]] == ["de", "und"]


@pytest.mark.parametrize("body, field_words", [
    # a text's language no model reads: 404, as on every route (a schema cannot state the text's language)
    ({"q": FR[0], "source": "auto", "target": "en"}, ["404", "French (fr)", "confidence", "source languages: de, en"]),
    ({"q": "A", "source": "auto", "target": "en"}, ["404", "cannot tell", "send source"]),
    ({"q": DE[0], "source": "de", "target": "auto"}, ["target auto is not supported", "de, en"]),
    ({"q": DE[0], "source": "auto", "target": "auto"}, ["target auto is not supported"]),
    ({"q": DE[0], "source": "auto", "target": "xx"}, ["xx is not supported", "target languages: de, en"]),
    ({"q": DE[0], "source": "xx", "target": "en"}, ["xx is not supported", "source languages: de, en"]),
    ({"q": ["x"] * 65, "source": "auto", "target": "en"}, ["at most 64 texts"]),
])
def test_libre_auto_errors_name_the_field(libre, body, field_words):
    r = libre.post("/translate", json=body)
    status = 404 if field_words[0] == "404" else 400
    assert r.status_code == status and set(r.json()) == {"error"}, r.text
    for w in field_words[status == 404:]:
        assert w in r.json()["error"], r.json()
    assert libre.calls == []


def test_libre_detect_json_form_and_errors(libre):
    r = libre.post("/detect", json={"q": DE[0]})
    assert r.status_code == 200 and r.json()[0]["language"] == "de" and 50 < r.json()[0]["confidence"] < 100
    assert libre.post("/detect", data={"q": FR[1]}).json()[0]["language"] == "fr"
    assert libre.post("/detect", json={"q": "\U0001F600"}).json() == [{"confidence": 0.0, "language": "und"}]
    many = libre.post("/detect", json={"q": [EN[0], EN[1], DE[0]]}).json()
    assert many[0]["language"] == "en" and many[1]["language"] == "de"
    r = libre.post("/detect", json={"q": DE[0], "source": "de"})
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "source"
    for body, word in (({}, "missing q"), ({"q": 5}, "q: must be a string or a list of strings"), ({"q": ["x"] * 65}, "at most 64 texts"),
                       ({"q": "x", "api_key": 5}, "api_key: Input should be a valid string")):
        r = libre.post("/detect", json=body)
        assert r.status_code == 400 and word in r.json()["error"], r.text


def test_parse_leaves_the_model_to_detection_with_auto():
    req = libretranslate.parse({"q": ["a", "b"], "source": "AUTO", "target": "en-US"}, LanguageGraph(CARDS))
    assert (req.card, req.auto, req.target, req.batch) == (None, True, "en", True)
    assert libretranslate.parse({"q": "a", "source": "de", "target": "en"}, LanguageGraph(CARDS)).card.id == "de-en"


# ---- the running service (slow) --------------------------------------------------------------------
@pytest.mark.slow
def test_detect_route_of_the_service(service_url):
    for lang, text in (("de", DE[2]), ("en", EN[2]), ("fr", FR[2])):
        r = httpx.post(service_url + "/detect", data={"q": text})
        assert r.status_code == 200 and r.json()[0]["language"] == lang and r.json()[0]["confidence"] < 100, r.text
    assert httpx.post(service_url + "/detect", json={"q": "12345"}).json() == [{"confidence": 0.0, "language": "und"}]
    r = httpx.post(service_url + "/detect", json={})
    assert r.status_code == 400 and "missing q" in r.json()["error"]


@pytest.mark.slow
def test_native_auto_routes_a_mixed_list_to_both_models(service_url):
    texts = [DE[3], EN[3], "12345", DE[4]]
    body = translate(service_url, texts, source_lang="auto")
    de = translate(service_url, [DE[3], DE[4]], source_lang="de", target_lang="en")["translations"]
    en = translate(service_url, [EN[3]], source_lang="en", target_lang="de")["translations"]
    got = body["translations"]
    assert [t["text"] for t in got] == [de[0]["text"], en[0]["text"], "12345", de[1]["text"]]
    assert [t.get("model") for t in got] == ["de-en", "tiny-en-de", None, "de-en"]
    assert [t["detected_language"] for t in got] == ["de", "en", "und", "de"]
    assert all(0 < t["detected_confidence"] < 100 for t in (got[0], got[1], got[3])) and got[2]["passthrough"] is True
    assert body["model"] == "de-en,tiny-en-de"
    assert body["usage"]["source_tokens"] > 0
    # target en: the English text is already in it, unchanged and said so
    same = translate(service_url, [EN[3], DE[3]], source_lang="auto", target_lang="en")["translations"]
    assert same[0]["text"] == EN[3] and same[0]["passthrough"] is True and same[0]["detected_language"] == "en"
    assert same[1]["text"] == de[0]["text"] and "passthrough" not in same[1]
    # one model only: streamed, with the detection in the closing response
    r = post(service_url, {"text": DE[3], "source_lang": "auto", "stream": True})
    assert r.status_code == 200 and '"detected_language": "de"' in r.text, r.text


@pytest.mark.slow
def test_native_auto_errors_name_the_field(service_url):
    r = post(service_url, {"text": [DE[0], FR[0]], "source_lang": "auto", "target_lang": "en"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "source_lang", r.text
    msg = r.json()["error"]["message"]
    assert "French (fr)" in msg and "text[1]" in msg and "de->en (de-en)" in msg, msg
    for body, status, field in (({"text": DE[0], "source_lang": "de", "target_lang": "auto"}, 422, "target_lang"),
                                ({"text": DE[0], "source_lang": "auto", "target_lang": "AUTO"}, 422, "target_lang"),
                                ({"text": DE[0], "source_lang": "auto", "target_lang": "xx"}, 404, "target_lang"),
                                ({"text": DE[0], "source_lang": "xx"}, 404, "source_lang"),
                                ({"text": "A", "source_lang": "auto"}, 404, "source_lang"),
                                ({"text": [DE[0], EN[0]], "source_lang": "auto", "stream": True}, 422, "stream")):
        r = post(service_url, body)
        assert (r.status_code, r.json()["error"]["field"]) == (status, field), (body, r.text)


@pytest.mark.slow
def test_libretranslate_client_detects_and_translates_with_auto(service_url):
    from libretranslatepy import LibreTranslateAPI
    lt = LibreTranslateAPI(service_url)
    found = lt.detect(DE[5])
    assert found[0]["language"] == "de" and 0 < found[0]["confidence"] < 100
    assert lt.detect(EN[5])[0]["language"] == "en"
    want = translate(service_url, DE[5], source_lang="de", target_lang="en")["translations"][0]["text"]
    assert lt.translate(DE[5], source="auto", target="en") == want
    assert lt.translate(EN[5], source="auto", target="en") == EN[5]      # English into English: unchanged
    assert lt.translate("12345", source="auto", target="en") == "12345"


def test_the_benchmark_scores_a_library_on_shipped_sentences():
    """python -m service.bench.langid's measurement, on the shipped val sentences (py3langid only)."""
    from service.bench.langid import ece, run_one, samples
    texts = samples(DATA, ["de", "en"], 20)
    assert [len(texts[k]) for k in ("full", "3w", "1w")] == [40, 40, 40] and texts["1w"][0] == ("de", "Eine")
    row = run_one("py3langid", "served", ["de", "en"], DATA, ["de", "en"], 20)
    assert row["full"] == 100.0 and 0 < row["ms"] < 50 and row["bad_high"] == 0.0 and row["mb"] > 0
    assert ece([(True, 1.0), (False, 0.0)]) == 0.0 and ece([(False, 0.95)]) == 95.0


@pytest.mark.parametrize("path, field", [("/translate", f) for f in ("q", "source", "target", "format", "alternatives",
                                                                     "api_key")] + [("/detect", "q"), ("/detect", "api_key")])
def test_an_integer_of_any_size_in_any_libretranslate_field_is_a_400_naming_it(libre, path, field):
    """#38: 400 digits (past every range) or 5,000 (past what Python's int() takes) in a JSON field:
    a 400 naming the field, never a 500 (body.load_json keeps it as a LongInteger, never converted)."""
    base = {"q": DE[0], "source": "de", "target": "en"} if path == "/translate" else {"q": DE[0]}
    for digits in (400, 5000):
        body = json.dumps({**base, field: 0}).replace(f'"{field}": 0', f'"{field}": {"9" * digits}')
        r = libre.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"].startswith(f"{field}: "), (digits, r.text)
        assert "LongInteger" not in r.text and len(r.text) < 300, r.text
