"""Pivoting (service/pipeline/pivot.py, docs/controls.md#pivoting): a pair no model serves, translated through a third
language by two models one after the other. The route table and the leg jobs without a model; then
the service's HTTP app in-process over HTTP (FastAPI's TestClient, its translators in this process, no
Ray) with three tiny random models, de-en, en-fr and fr-en ("fr" is a label: its tokenizer reads
the repository's en/de text), so that de->fr is a real pivot through two distinct models; then a
LibreTranslate client through the running service (slow)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import types

import httpx
import pytest
from conftest import DATA, build_tiny_checkpoint, shipped_model_available, sse_events
from fastapi.testclient import TestClient

from model.config import ModelConfig
from model.tokenizer import read_lines
from service.pipeline import pivot
from service.engine import EngineConfig, GenerationOptions
from service.engine.validation import ModelLimits
from service.protocol import (
    MAX_ATTENTION_VALUES,
    ServiceError,
    TranslateJob,
    TranslateResponse,
    Translation,
    Usage,
)
from service.translator import ModelCard, model_card

DE = read_lines(DATA / "test_2016_flickr.de.gz")[:6]
TINY = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)


def card(name: str, source: str, target: str, targets: tuple = ()) -> ModelCard:
    return ModelCard(name, "", source, target, TINY, target_languages=targets)


# ---- the route table and the legs, without a model ----------------------------------------------
def test_routes_go_through_the_pivot_only_where_no_model_serves_the_pair():
    cards = [card("de-en", "de", "en"), card("en-de", "en", "de"), card("en-fr", "en", "fr"), card("fr-en", "fr", "en")]
    routes = pivot.routes(cards, "en")
    assert sorted(routes) == [("de", "fr"), ("fr", "de")]
    r = routes["de", "fr"]
    assert (r.id, r.path, r.via, [leg.card.id for leg in r.legs]) == ("de-en+en-fr", ["de-en", "en-fr"], "en",
                                                                       ["de-en", "en-fr"])
    assert (r.card.id, r.card.source_lang, r.card.targets) == ("de-en+en-fr", "de", ("fr",))
    assert r.info() == {"id": "de-en+en-fr", "source_lang": "de", "target_lang": "fr", "via": "en",
                        "path": ["de-en", "en-fr"], "models": ["de-en", "en-fr"]}
    assert pivot.routes(cards, None) == {}                               # pivot_lang null: off
    assert pivot.routes(cards, "de") == {}                               # de->X models: only de-en, en served directly
    direct = cards + [card("de-fr", "de", "fr")]
    assert sorted(pivot.routes(direct, "en")) == [("fr", "de")]         # a direct model always wins
    # a multilingual second leg: every code it knows is a pivot target; one-target models first
    multi = [card("de-en", "de", "en"), card("en-mul", "en", "mul", ("fr", "it")), card("en-fr", "en", "fr")]
    routes = pivot.routes(multi, "en")
    assert sorted(routes) == [("de", "fr"), ("de", "it")]
    assert routes["de", "fr"].legs[1].card.id == "en-fr" and routes["de", "it"].legs[1].card.id == "en-mul"


def _response(model: str, job: TranslateJob) -> TranslateResponse:
    """A fake translator: tags each text with the model, and returns n_best alternatives."""
    out = [Translation(text=f"[{model}>{job.target_lang}] {t}", tokens=["a", "b"], source_tokens=["c", "</s>"],
                       score=-1.0, finish_reason="eos",
                       alternatives=[{"text": f"alt{k}", "tokens": [], "score": -2.0, "finish_reason": "eos"}
                                     for k in range(job.options.n_best - 1)],
                       attention={"cross": [[[[0.5, 0.5]] * 2]]} if job.options.attention_kinds else None)
           for t in job.texts]
    return TranslateResponse(model=model, translations=out, usage=Usage(source_tokens=2 * len(job.texts),
                                                                        generated_tokens=2 * len(job.texts)))


def test_run_is_two_ordinary_jobs_n_best_on_the_last_leg_and_errors_name_the_leg():
    route = pivot.routes([card("de-en", "de", "en"), card("en-fr", "en", "fr")])["de", "fr"]
    calls = []

    async def translate(model, job):
        calls.append((model, job))
        return _response(model, job)
    job = TranslateJob(["eins", "zwei"], GenerationOptions(beam_size=5, n_best=3, length_penalty=0.7), keep=("Ray",),
                       deadline=123.0, timeout_s=9.0, target_lang="fr")
    out = asyncio.run(pivot.run(translate, route, job))
    (m1, j1), (m2, j2) = calls
    assert (m1, j1.texts, j1.target_lang, j1.options.n_best) == ("de-en", ["eins", "zwei"], "en", 1)
    assert (m2, j2.texts, j2.target_lang, j2.options.n_best) == ("en-fr", ["[de-en>en] eins", "[de-en>en] zwei"], "fr", 3)
    for j in (j1, j2):       # what applies to both legs: beam, length penalty, keep, one deadline
        assert (j.options.beam_size, j.options.length_penalty, j.keep, j.deadline, j.timeout_s) == (5, 0.7, ("Ray",),
                                                                                                   123.0, 9.0)
    assert job.options.n_best == 3 and job.texts == ["eins", "zwei"]     # the caller's job is left as it was
    t = out.translations[0]
    assert (out.model, t.text, t.path) == ("de-en+en-fr", "[en-fr>fr] [de-en>en] eins", ["de-en", "en-fr"])
    assert (t.pivot.language, t.pivot.model, t.pivot.text) == ("en", "de-en", "[de-en>en] eins")
    assert [a.text for a in t.alternatives] == ["alt0", "alt1"]             # the last leg's n-best
    assert out.usage == Usage(source_tokens=8, generated_tokens=8)         # both legs

    async def failing(model, job):
        if model == "en-fr":
            raise ServiceError(413, "text[1]: sentence 1 has 99 tokens (with EOS); model en-fr accepts at most 64",
                               "text")
        return _response(model, job)
    with pytest.raises(ServiceError) as e:
        asyncio.run(pivot.run(failing, route, job))
    assert (e.value.status, e.value.field) == (413, "text")
    assert e.value.message == ("text[1]: pivot de->fr (through en: de-en, en-fr), second leg (en-fr, model en-fr) on "
                               "the first leg's en text: sentence 1 has 99 tokens (with EOS); model en-fr accepts at "
                               "most 64"), e.value.message


def test_attention_of_both_legs_counts_against_one_limit():
    route = pivot.routes([card("de-en", "de", "en"), card("en-fr", "en", "fr")])["de", "fr"]
    job = TranslateJob(["x"], GenerationOptions(attention_kinds=("cross",)))
    first, second = _response("de-en", job), _response("en-fr", job)
    both = pivot.combined(route, first, second)
    assert both.translations[0].attention == second.translations[0].attention
    assert both.translations[0].pivot.attention == first.translations[0].attention
    assert pivot.attention_values(first.translations[0].attention) == 4
    big = first.model_copy(deep=True)
    big.translations[0].attention = {"cross": [[[[0.0] * 1000] * 1000] * (MAX_ATTENTION_VALUES // 10 ** 6 + 1)]}
    with pytest.raises(ServiceError) as e:
        pivot.combined(route, big, second)
    assert e.value.status == 413 and e.value.field == "return_attention" and "both legs" in e.value.message


def test_route_limits_check_each_leg_against_its_model():
    route = pivot.routes([card("de-en", "de", "en"), card("en-fr", "en", "fr")])["de", "fr"]
    small = dataclasses.replace(TINY, n_heads=2)
    limits = pivot.RouteLimits(route, (ModelLimits.of("de-en", TINY, EngineConfig()),
                                       ModelLimits.of("en-fr", small, EngineConfig())))
    limits.check(TranslateJob(["x"], GenerationOptions(attention_kinds=("cross",))))
    from service.engine.errors import EngineValidationError
    from service.protocol import AttentionSelection
    with pytest.raises(EngineValidationError, match="model en-fr"):     # head 3: the first leg has it, en-fr not
        limits.check(TranslateJob(["x"], GenerationOptions(attention_kinds=("cross",)),
                                  attention=AttentionSelection(heads=(3,))))


def test_default_models_are_every_checkpoint_folder(tmp_path):
    from service.app import shipped_models
    for name in ("de-en", "en-fr", "fr-en", "half-written"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        if name != "half-written":          # a folder without its weights yet (still being written)
            (tmp_path / name / "model.safetensors").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    assert [(m.name, m.checkpoint) for m in shipped_models(tmp_path)] == [
        (n, str(tmp_path / n)) for n in ("de-en", "en-fr", "fr-en")]


def test_app_args_pivot_lang():
    from service.app import AppArgs
    assert AppArgs.model_validate({}).pivot_lang == "en"
    assert AppArgs.model_validate({"pivot_lang": None}).pivot_lang is None
    with pytest.raises(ValueError, match="pivot_lang"):
        AppArgs.model_validate({"pivot_lang": ""})


# ---- the service's HTTP app in-process: three tiny models, de->fr through en ----------------------------
# A random model decodes to its length cap: this one keeps each leg short (and the tests quick).
TARGET_TOKENS = 12
MODELS = {"de-en": ("de", "en", ("de", "en")), "en-fr": ("en", "fr", ("en", "de")), "fr-en": ("fr", "en", ("de", "en"))}


@contextlib.contextmanager
def gateway_client(cards, pivot_lang="en", engine=None):
    """The service's HTTP app (``http.build_app``) with its translators in this process, behind
    FastAPI's TestClient. ``engine``: EngineConfig fields."""
    from service.api.http import build_app
    from service.api.services import IngressConfig, Services
    svc = Services.build(cards, config=IngressConfig(pivot_lang=pivot_lang))
    with TestClient(build_app(svc)) as client:
        client.portal.call(svc.reconfigure, {"engine": {"max_num_seqs": 8, "cpu_kernels": False, **(engine or {})}})
        svc.detector.load()
        client.services = svc
        try:
            yield client
        finally:
            for t in svc.backend.translators.values():
                client.portal.call(t.stop)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model/checkpoints/-like folders of the three tiny models (named by folder)."""
    root = tmp_path_factory.mktemp("pivot")
    folder = root / "checkpoints"
    folder.mkdir()
    for i, (name, (s, t, data)) in enumerate(MODELS.items()):
        (folder / name).symlink_to(build_tiny_checkpoint(root / name, s, t, seed=i, max_len=256, data_langs=data,
                                                              words_only=True))
    return folder


@pytest.fixture(scope="module")
def client(checkpoints):
    from service.app import shipped_models
    cards = [model_card(m.name, m.checkpoint) for m in shipped_models(checkpoints)]    # as the default config
    with gateway_client(cards, engine={"max_tgt_len": TARGET_TOKENS}) as c:
        yield c


def ok(client, body, path="/v1/translate") -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_pivot_output_equals_the_two_legs_run_one_after_the_other(client):
    texts = [DE[0], f"{DE[1]} {DE[2]}\n\n{DE[3]}", "", "12345"]
    got = ok(client, {"text": texts, "source_lang": "de", "target_lang": "fr", "beam_size": 2})
    first = ok(client, {"text": texts, "source_lang": "de", "target_lang": "en", "beam_size": 2})["translations"]
    second = ok(client, {"text": [t["text"] for t in first], "source_lang": "en", "target_lang": "fr",
                         "beam_size": 2})
    assert got["model"] == "de-en+en-fr"
    assert [t["text"] for t in got["translations"]] == [t["text"] for t in second["translations"]]
    assert [t["tokens"] for t in got["translations"]] == [t["tokens"] for t in second["translations"]]
    assert all(t["path"] == ["de-en", "en-fr"] for t in got["translations"])
    assert [t["pivot"]["text"] for t in got["translations"]] == [t["text"] for t in first]
    assert [t["pivot"]["tokens"] for t in got["translations"]] == [t["tokens"] for t in first]
    assert all(t["pivot"]["language"] == "en" and t["pivot"]["model"] == "de-en" for t in got["translations"])
    assert got["translations"][0]["tokens"] and got["translations"][0]["pivot"]["tokens"]    # words, both legs
    assert got["translations"][2]["text"] == "" and got["translations"][3]["text"] == "12345"
    assert "path" not in first[0] and "pivot" not in first[0]            # a direct translation: neither field
    legs = ok(client, {"text": texts, "source_lang": "de", "target_lang": "en", "beam_size": 2})["usage"]
    assert got["usage"]["source_tokens"] == legs["source_tokens"] + second["usage"]["source_tokens"]
    # the route may be named as the model; language codes match as elsewhere ("DE", "fr-FR")
    named = ok(client, {"text": texts[0], "model": "de-en+en-fr", "beam_size": 2})
    assert named["translations"][0]["text"] == got["translations"][0]["text"]
    cased = ok(client, {"text": texts[0], "source_lang": "DE", "target_lang": "fr-FR", "beam_size": 2})
    assert cased["translations"][0]["text"] == got["translations"][0]["text"]


def test_libretranslate_and_source_auto_pivot(client):
    native = ok(client, {"text": DE[4], "source_lang": "de", "target_lang": "fr"})["translations"][0]
    libre = ok(client, {"q": DE[4], "source": "de", "target": "fr"}, "/translate")
    assert libre == {"translatedText": native["text"]}
    html = ok(client, {"q": f"<p><b>{DE[4]}</b></p>", "source": "de", "target": "fr", "format": "html"}, "/translate")
    assert html == {"translatedText": f"<p><b>{native['text']}</b></p>"}
    auto = ok(client, {"q": [DE[4], DE[5]], "source": "auto", "target": "fr"}, "/translate")
    assert auto["translatedText"][0] == native["text"] and [d["language"] for d in auto["detectedLanguage"]] == ["de"] * 2
    n = ok(client, {"text": [DE[4]], "source_lang": "auto", "target_lang": "fr"})
    assert n["translations"][0]["text"] == native["text"] and n["translations"][0]["path"] == ["de-en", "en-fr"]
    assert (n["translations"][0]["detected_language"], n["translations"][0]["model"]) == ("de", "de-en+en-fr")
    # alternatives: the last leg's n-best of the first leg's best
    alt = ok(client, {"q": DE[4], "source": "de", "target": "fr", "alternatives": 2}, "/translate")
    last = ok(client, {"text": native["pivot"]["text"], "source_lang": "en", "target_lang": "fr", "n_best": 3})
    want = [a["text"] for a in last["translations"][0]["alternatives"] if a["text"] not in ("", native["text"])]
    assert alt["translatedText"] == native["text"] and alt["alternatives"] == list(dict.fromkeys(want))[:2]


def test_languages_and_models_list_the_pivot_targets(client):
    langs = {x["code"]: x for x in client.get("/languages").json()}
    assert langs["de"] == {"code": "de", "name": "German", "targets": ["en", "fr"], "via": {"fr": "en"}}
    assert langs["en"] == {"code": "en", "name": "English", "targets": ["fr"]}
    assert langs["fr"] == {"code": "fr", "name": "French", "targets": ["en"]}     # fr->de: no en->de model
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["de-en", "en-fr", "fr-en"]
    assert models["pivots"] == [{"id": "de-en+en-fr", "source_lang": "de", "target_lang": "fr", "via": "en",
                                 "path": ["de-en", "en-fr"], "models": ["de-en", "en-fr"]}]


def test_a_stream_streams_the_last_leg(client):
    body = {"text": [DE[0], DE[1]], "source_lang": "de", "target_lang": "fr", "beam_size": 1}
    whole = ok(client, body)
    r = client.post("/v1/translate", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1][0] == "response"
    streamed = ["".join(d["text"] for e, d in events if e == "token" and d["index"] == i) for i in range(2)]
    assert streamed == [t["text"] for t in whole["translations"]]
    final = events[-1][1]
    assert final["model"] == "de-en+en-fr" and [t["path"] for t in final["translations"]] == [["de-en", "en-fr"]] * 2
    assert [t["pivot"]["text"] for t in final["translations"]] == [t["pivot"]["text"] for t in whole["translations"]]


def test_return_attention_gives_each_legs_attention(client):
    body = {"text": DE[2], "beam_size": 2, "return_attention": True, "attention": {"kinds": ["cross", "encoder"]}}
    got = ok(client, {**body, "source_lang": "de", "target_lang": "fr"})["translations"][0]
    first = ok(client, {**body, "source_lang": "de", "target_lang": "en"})["translations"][0]
    second = ok(client, {**body, "text": first["text"], "source_lang": "en", "target_lang": "fr"})["translations"][0]
    assert got["pivot"]["attention"] == first["attention"] and got["attention"] == second["attention"]
    assert got["tokens"] and got["pivot"]["tokens"]
    cross = got["pivot"]["attention"]["cross"]      # [layer][head][target tokens][source tokens]
    assert (len(cross[0][0]), len(cross[0][0][0])) == (len(got["pivot"]["tokens"]), len(got["pivot"]["source_tokens"]))
    cross = got["attention"]["cross"]
    assert (len(cross[0][0]), len(cross[0][0][0])) == (len(got["tokens"]), len(got["source_tokens"]))


def test_n_best_is_the_last_legs_n_best_of_the_first_legs_best(client):
    got = ok(client, {"text": DE[3], "source_lang": "de", "target_lang": "fr", "beam_size": 4, "n_best": 3})
    first = ok(client, {"text": DE[3], "source_lang": "de", "target_lang": "en", "beam_size": 4})["translations"][0]
    second = ok(client, {"text": first["text"], "source_lang": "en", "target_lang": "fr", "beam_size": 4,
                         "n_best": 3})["translations"][0]
    t = got["translations"][0]
    assert t["pivot"]["text"] == first["text"] and "alternatives" not in t["pivot"]
    assert (t["text"], t["alternatives"]) == (second["text"], second["alternatives"])
    assert len(t["alternatives"]) == 2


@pytest.mark.skipif(not shipped_model_available(), reason="the shipped models are not in this checkout")
def test_protected_spans_and_keep_terms_survive_both_legs():
    """Real models (a tiny one's 500-piece vocabulary has no placeholder piece, so it protects
    nothing): the shipped de-en, and the shipped en-de served as if it were an "en-fr" model."""
    from model.checkpoint import SHIPPED_CHECKPOINTS
    cards = [model_card("de-en", SHIPPED_CHECKPOINTS["de-en"]),
             model_card("en-fr", SHIPPED_CHECKPOINTS["en-de"], source_lang="en", target_lang="fr")]
    url, term, number = "https://example.com/a?b=1", "Ray Serve", "1.234,5"
    text = f"Ein Mann mit {number} Hüten steht mit {term} vor {url} ."
    with gateway_client(cards) as client:
        t = ok(client, {"text": text, "source_lang": "de", "target_lang": "fr", "keep": [term], "beam_size": 2})
    t = t["translations"][0]
    assert t["path"] == ["de-en", "en-fr"]
    for span in (url, term, number):
        assert t["pivot"]["text"].count(span) == 1 and t["text"].count(span) == 1, (span, t["pivot"]["text"], t["text"])


@pytest.mark.parametrize("body, status, field, words", [
    ({"source_lang": "xx", "target_lang": "fr"}, 404, "source_lang", ["xx", "de->fr (through en: de-en, en-fr)"]),
    ({"source_lang": "de", "target_lang": "xx"}, 404, "target_lang", ["de->xx", "de->fr (through en: de-en, en-fr)"]),
    ({"source_lang": "fr", "target_lang": "de"}, 404, "target_lang", ["no model for fr->de", "de->fr (through en"]),
    ({"source_lang": "en", "target_lang": "de"}, 404, "target_lang", ["no model for en->de"]),
    ({"source_lang": "de", "target_lang": "auto"}, 422, "target_lang", ["auto detects the source language only",
                                                                         "one of en, fr"]),
    ({"source_lang": "auto", "target_lang": "xx"}, 404, "target_lang", ["target languages: en, fr"]),
    ({"model": "de-en+en-fr", "target_lang": "en"}, 404, "target_lang", ["translates de->fr, not 'en'"]),
    ({"model": "de-en+en-de"}, 404, "model", ["unknown model", "available: ['de-en', 'en-fr', 'fr-en', 'de-en+en-fr']"]),
])
def test_bad_languages_are_4xx_naming_the_field_and_what_is_served(client, body, status, field, words):
    r = client.post("/v1/translate", json={"text": DE[0], **body})
    assert (r.status_code, r.json()["error"]["field"]) == (status, field), r.text
    for w in words:
        assert w in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("body, words", [
    ({"source": "fr", "target": "de"}, ["German (de) is not available as a target language from French (fr)",
                                        "choose from en"]),
    ({"source": "de", "target": "xx"}, ["xx is not supported", "targets from de: en, fr"]),
    ({"source": "xx", "target": "fr"}, ["xx is not supported", "source languages: de, en, fr"]),
    ({"source": "de", "target": "auto"}, ["target auto is not supported", "one of en, fr"]),
    ({"source": "auto", "target": "xx"}, ["xx is not supported", "target languages: en, fr"]),
])
def test_libretranslate_bad_languages_name_the_field_and_what_is_served(client, body, words):
    r = client.post("/translate", json={"q": DE[0], **body})
    assert r.status_code == 400, r.text
    for w in words:
        assert w in r.json()["error"], r.json()


def test_pivot_off_serves_only_the_direct_pairs(checkpoints):
    from service.pipeline import LanguageGraph
    cards = [model_card(n, checkpoints / n) for n in MODELS]
    graph = LanguageGraph(cards, pivot_lang=None)
    assert graph.pivots == {} and graph.resolve(None, "de", "en").id == "de-en"
    with pytest.raises(ServiceError) as e:
        graph.resolve(None, "de", "fr")
    assert (e.value.status, e.value.field) == (404, "target_lang") and "through" not in e.value.message


# ---- through the running service: LibreTranslate's own client ------------------------------------
@pytest.mark.slow
def test_libretranslate_client_gets_a_pivoted_translation(pivot_service_url):
    from libretranslatepy import LibreTranslateAPI
    url = pivot_service_url
    lt = LibreTranslateAPI(url)
    first = httpx.post(url + "/v1/translate", json={"text": DE[5], "source_lang": "de", "target_lang": "en"},
                       timeout=120).json()["translations"][0]["text"]
    second = httpx.post(url + "/v1/translate", json={"text": first, "source_lang": "en", "target_lang": "fr"},
                        timeout=120).json()["translations"][0]["text"]
    assert lt.translate(DE[5], source="de", target="fr") == second
    assert lt.translate(DE[5], source="auto", target="fr") == second
    langs = {x["code"]: x["targets"] for x in lt.languages()}
    assert "fr" in langs["de"]
    pivoted = httpx.post(url + "/v1/translate", json={"text": DE[5], "source_lang": "de", "target_lang": "fr"},
                         timeout=120).json()["translations"][0]
    assert (pivoted["text"], pivoted["pivot"]["text"], pivoted["path"]) == (second, first, ["de-en", "en-fr"])


def test_the_pivot_bleu_benchmark_scores_both_legs(checkpoints, tmp_path, capsys):
    """python -m service.bench.pivot_bleu on the tiny models (the figures are random; the lines are checked)."""
    import gzip

    from service.bench.pivot_bleu import main
    for lang, data in (("de", "de"), ("en", "en"), ("fr", "en")):       # "fr" references: English lines
        with gzip.open(tmp_path / f"test_2016_flickr.{lang}.gz", "wt", encoding="utf-8") as f:
            f.write("\n".join(read_lines(DATA / f"test_2016_flickr.{data}.gz")[:3]) + "\n")
    rows = main(["--first", str(checkpoints / "de-en"), "--second", str(checkpoints / "en-fr"), "--data", str(tmp_path),
                 "--beam-sizes", "1", "--limit", "3"])
    assert [(r["beam"], r["sentences"]) for r in rows] == [(1, 3)] and 0 <= rows[0]["bleu"] <= 100
    assert {"first_leg", "second_leg"} <= set(rows[0])
    out = capsys.readouterr().out
    assert out.startswith("beam 1: pivot BLEU ") and "first leg alone" in out


def test_what_concerns_the_target_language_goes_to_the_last_leg_and_glossary_terms_survive_the_first():
    """The one place that decides each option's leg (pivot.leg_job), through the pipeline: the first
    leg gets no glossary, target_prefix, min_confidence or alignment and keeps the glossary's source
    terms that occur; the last leg gets them all."""
    import asyncio

    from local_services import local_services
    from service.protocol import GenerationOptions, TranslateJob, TranslateResponse, Translation, Usage
    seen = {}

    async def run(model, job):
        seen[model] = job
        return TranslateResponse(model=model, usage=Usage(source_tokens=1, generated_tokens=1), translations=[
            Translation(text=t, tokens=[], source_tokens=[], score=0.0, finish_reason="eos") for t in job.texts])
    cfg = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
    cards = [ModelCard("de-en", "", "de", "en", cfg), ModelCard("en-fr", "", "en", "fr", cfg)]
    svc = local_services(cards, run)
    job = TranslateJob(["Der Hund schläft im Vertrag."], GenerationOptions(beam_size=2, n_best=2), keep=("ACME",),
                       glossary=(("Vertrag", "contrat"), ("Katze", "chat")), target_prefix="Le",
                       min_confidence=0.5, return_alignment=True)
    out = asyncio.run(svc.pipeline.run("de-en+en-fr", svc.pipeline.deadline(job)))
    first, last = seen["de-en"], seen["en-fr"]
    assert (first.glossary, first.target_prefix, first.min_confidence, first.return_alignment) == ((), None, None, False)
    assert first.keep == ("ACME", "Vertrag") and first.options.n_best == 1 and first.target_lang == "en"
    assert last.glossary == job.glossary and last.target_prefix == "Le" and last.keep == ("ACME",)
    assert (last.min_confidence, last.return_alignment, last.options.n_best) == (0.5, True, 2)
    assert out.model == "de-en+en-fr" and out.translations[0].path == ["de-en", "en-fr"]
