"""DeepL's ``model_type`` (decoding settings, ``model_type_used``), ``context`` (read by language
detection of short texts only: never translated nor billed) and the DeepL features not offered here
(``style_id``, ``custom_instructions``, ``/v2/write/*``, ``/v3/style_rules``), on the service's own
app in process: through ``TestClient``, and through the official client (``deepl`` 1.32) against the
app served by uvicorn in a thread. ``run`` records every job the translators would get."""
from __future__ import annotations

import json
import socket
import threading
import time
import types

import deepl as deepl_client
import pytest
import uvicorn
from fastapi.testclient import TestClient
from local_services import local_services

from model.config import ModelConfig
from service.api.http import build_app
from service.api.middleware.guard import Guard, GuardSettings
from service.pipeline import autodetect
from service.protocol import TranslateResponse, Translation, Usage
from service.translator import ModelCard
from service.translator.langid import LanguageDetector

CFG = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
# de-fr records a length penalty as an imported model's generation config does; en-fr none (1.0)
CARDS = [ModelCard("de-fr", "", "de", "fr", CFG, {"generation": {"length_penalty": 0.6}}),
         ModelCard("en-fr", "", "en", "fr", CFG)]
EN_CONTEXT = "The parcel arrived yesterday by mail, wrapped in paper."
DE_CONTEXT = "Das Paket kam gestern mit der Post an, in Papier eingewickelt."


def recording_services(**kwargs):
    jobs = []

    async def run(model, job):
        jobs.append((model, job))
        return TranslateResponse(model=model, usage=Usage(source_tokens=1, generated_tokens=1), translations=[
            Translation(text=f"[{model}] {t}", tokens=[], source_tokens=[], score=0.0, finish_reason="eos")
            for t in job.texts])
    return local_services(CARDS, run, **kwargs), jobs


@pytest.fixture
def app():
    svc, jobs = recording_services()
    with TestClient(build_app(svc)) as client:
        yield types.SimpleNamespace(client=client, jobs=jobs, svc=svc)


def translate(app, **body):
    app.jobs.clear()
    return app.client.post("/v2/translate", json={"target_lang": "FR", **body})


# ---- model_type ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type, beam_size, length_penalty, used", [
    ("latency_optimized", 1, 0.6, "latency_optimized"),             # greedy, the model's length penalty
    ("quality_optimized", 4, 0.6, "quality_optimized"),             # beam 4, the model's length penalty
    ("prefer_quality_optimized", 4, 0.6, "quality_optimized"),      # quality is always available here
    (None, 4, 1.0, None),                                           # absent: the service's default, as before
])
def test_model_type_sets_the_decoding_and_is_answered_as_model_type_used(app, model_type, beam_size,
                                                                         length_penalty, used):
    body = {"text": ["Ein Hund läuft.", "Zwei Männer."], "source_lang": "DE"}
    r = translate(app, **body, **({"model_type": model_type} if model_type else {}))
    assert r.status_code == 200, r.text
    assert [(m, j.options.beam_size, j.options.length_penalty) for m, j in app.jobs] == \
        [("de-fr", beam_size, length_penalty)]
    for item in r.json()["translations"]:
        assert item.get("model_type_used") == used
        assert ("model_type_used" in item) == (model_type is not None)
    assert "model_type" not in r.headers.get("X-Ignored-Fields", "")


def test_model_type_takes_each_models_own_length_penalty_and_a_form_body(app):
    app.jobs.clear()
    r = app.client.post("/v2/translate", data={"text": "A dog runs.", "source_lang": "EN", "target_lang": "FR",
                                               "model_type": "quality_optimized"})
    assert r.status_code == 200, r.text
    assert [(m, j.options.beam_size, j.options.length_penalty) for m, j in app.jobs] == [("en-fr", 4, 1.0)]
    assert r.json()["translations"][0]["model_type_used"] == "quality_optimized"


@pytest.mark.parametrize("value", ["fast", "QUALITY", "", 4])
def test_an_invalid_model_type_is_deepls_400_naming_the_field(app, value):
    r = translate(app, text="Ein Hund.", source_lang="DE", model_type=value)
    assert r.status_code == 400 and set(r.json()) == {"message"}, r.text
    assert r.json()["message"].startswith("Value for 'model_type' not supported")
    assert "latency_optimized" in r.json()["message"] and not app.jobs


# ---- context -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, context, detected", [
    ("Gift", None, "DE"),            # alone: Danish 8.5%, Swedish 7.5%, German 7.2%: the likeliest served
    ("Gift", EN_CONTEXT, "EN"),      # the English sentence around it: the English word
    ("Gift", DE_CONTEXT, "DE"),
    ("Kind", None, "DE"),            # alone: German 46%
    ("Kind", EN_CONTEXT, "EN"),
    ("Kind", DE_CONTEXT, "DE"),
])
def test_a_short_texts_language_is_detected_from_it_and_the_context(app, text, context, detected):
    r = translate(app, text=text, **({"context": context} if context else {}))
    assert r.status_code == 200, r.text
    item = r.json()["translations"][0]
    model = f"{detected.lower()}-fr"
    assert item == {"detected_source_language": detected, "text": f"[{model}] {text}", "billed_characters": len(text)}
    assert [(m, j.texts) for m, j in app.jobs] == [(model, [text])]         # the context never reaches a model
    assert "context" not in r.headers.get("X-Ignored-Fields", "")           # it was read


def test_a_text_without_a_language_of_its_own_takes_the_contexts(app):
    assert translate(app, text="Rat").status_code == 404        # "Rat": letters the detector knows nothing of
    r = translate(app, text="Rat", context=DE_CONTEXT)
    assert r.status_code == 200 and r.json()["translations"][0]["detected_source_language"] == "DE", r.text


def test_the_context_never_outvotes_a_surely_detected_or_longer_text(app):
    texts = ["Das ist gut", "Ein Hund läuft über die Straße."]       # German at 99% alone; 6 words
    r = translate(app, text=texts, context=EN_CONTEXT)
    assert r.status_code == 200, r.text
    assert [t["detected_source_language"] for t in r.json()["translations"]] == ["DE", "DE"]
    assert r.headers["X-Ignored-Fields"] == "context"               # read by nothing: said so


def test_the_context_is_never_translated_nor_billed(app):
    texts = ["Gift", "Zwei Männer spielen."]
    r = translate(app, text=texts, context=EN_CONTEXT, show_billed_characters=True)
    assert r.status_code == 200, r.text
    assert [t["billed_characters"] for t in r.json()["translations"]] == [4, 20]
    sent = [t for _, j in app.jobs for t in j.texts]
    assert sorted(sent) == sorted(texts) and not any(EN_CONTEXT in t for t in sent)
    assert app.client.get("/v2/usage").json()["character_count"] == len("Gift") + len("Zwei Männer spielen.")


def test_with_source_lang_the_context_changes_nothing_and_is_named_ignored(app):
    r = translate(app, text="Gift", source_lang="DE", context=EN_CONTEXT)
    assert r.status_code == 200 and r.json()["translations"][0]["detected_source_language"] == "DE", r.text
    assert [(m, j.texts) for m, j in app.jobs] == [("de-fr", ["Gift"])]
    assert r.headers["X-Ignored-Fields"] == "context"


@pytest.mark.parametrize("value", [3, ["a"], "\ud800 x"])
def test_an_invalid_context_is_deepls_400_naming_the_field(app, value):
    body = json.dumps({"text": "Gift", "target_lang": "FR", "context": value})      # "\ud800" escaped, as JSON may
    r = app.client.post("/v2/translate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "context" in r.json()["message"], r.text


def test_the_context_chooses_only_among_languages_the_text_leaves_open():
    d = LanguageDetector(["de", "en"])
    assert d.detect("Gift", context=EN_CONTEXT)[0][0] == "en" and d.detect("Gift", context=DE_CONTEXT)[0][0] == "de"
    # Cyrillic letters rule English out, whatever the context says
    assert {lang for lang, _ in d.detect("Привет", top=3, context=EN_CONTEXT)} <= {"bg", "ru", "uk"}
    assert d.detect("Gift", context="12 / 34") == d.detect("Gift")        # no letters: nothing to read
    assert autodetect.context_helps("Kind regards", d.detect("Kind regards"))
    assert not autodetect.context_helps("Das ist gut", d.detect("Das ist gut"))          # sure alone
    assert not autodetect.context_helps("Gift für den Hund heute", d.detect("Gift für den Hund heute"))  # 5 words


# ---- features not offered here -------------------------------------------------------------------
@pytest.mark.parametrize("field, value, feature", [
    ("style_id", "7ff9bfd6-cd85-4190-8503-d6215a321519", "style rules"),
    ("custom_instructions", ["Use a friendly tone"], "custom instructions"),
])
def test_style_rules_and_custom_instructions_are_400_naming_the_feature(app, field, value, feature):
    r = translate(app, text="Ein Hund.", source_lang="DE", **{field: value})
    assert r.status_code == 400 and set(r.json()) == {"message"}, r.text
    message = r.json()["message"]
    assert message.startswith(f"Value for '{field}' not supported") and f"{feature} ({field}) are not offered" in message
    assert not app.jobs


def test_formality_stays_named_ignored(app):
    r = translate(app, text="Ein Hund.", source_lang="DE", formality="more", model_type="latency_optimized")
    assert r.status_code == 200 and r.headers["X-Ignored-Fields"] == "formality", r.text


@pytest.mark.parametrize("method, path, feature", [
    ("POST", "/v2/write/rephrase", "DeepL Write"),
    ("POST", "/v2/write/correct", "DeepL Write"),
    ("GET", "/v3/style_rules", "style rules"),
    ("POST", "/v3/style_rules", "style rules"),
    ("GET", "/v3/style_rules/7ff9bfd6", "style rules"),
    ("PATCH", "/v3/style_rules/7ff9bfd6", "style rules"),
    ("DELETE", "/v3/style_rules/7ff9bfd6", "style rules"),
    ("PUT", "/v3/style_rules/7ff9bfd6/custom_instructions/1", "style rules"),
])
def test_write_and_style_rule_routes_are_deepls_404_naming_the_feature(app, method, path, feature):
    r = app.client.request(method, path, json={"text": ["Ein Hund."], "name": "x", "language": "de"})
    assert r.status_code == 404 and set(r.json()) == {"message"}, r.text
    assert r.json()["message"].startswith(f"{method} {path}: {feature}") and "not offered by this server" in \
        r.json()["message"]


def test_a_v3_route_answers_a_missing_key_in_deepls_shape():
    svc, _ = recording_services(guard=Guard(GuardSettings(failed_key_limit=None), env="key-alpha"))
    with TestClient(build_app(svc)) as client:
        r = client.get("/v3/style_rules")
        assert r.status_code == 403 and set(r.json()) == {"message"}, r.text
        r = client.get("/v3/style_rules", headers={"Authorization": "DeepL-Auth-Key key-alpha"})
        assert r.status_code == 404 and "style rules" in r.json()["message"], r.text


# ---- the official client -------------------------------------------------------------------------
@pytest.fixture
def served():
    """The app on 127.0.0.1 at a free port (uvicorn in a thread), stopped at the end."""
    svc, jobs = recording_services()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(svc), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{sock.getsockname()[1]}", jobs=jobs)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_the_official_client_gets_model_type_used_and_context_detection(served):
    client = deepl_client.DeepLClient("any-key", server_url=served.url)
    for model_type, beam, used in ((deepl_client.ModelType.LATENCY_OPTIMIZED, 1, "latency_optimized"),
                                   ("quality_optimized", 4, "quality_optimized"),
                                   ("prefer_quality_optimized", 4, "quality_optimized")):
        served.jobs.clear()
        result = client.translate_text("Ein Hund läuft.", source_lang="DE", target_lang="FR", model_type=model_type)
        assert (result.text, result.model_type_used, result.billed_characters) == \
            ("[de-fr] Ein Hund läuft.", used, 15)
        assert [(j.options.beam_size, j.options.length_penalty) for _, j in served.jobs] == [(beam, 0.6)]
    assert client.translate_text("Ein Hund läuft.", target_lang="FR").model_type_used is None
    served.jobs.clear()
    results = client.translate_text(["Gift", "Kind"], target_lang="FR", context=EN_CONTEXT,
                                    model_type="latency_optimized")
    assert [(r.detected_source_lang, r.text, r.billed_characters, r.model_type_used) for r in results] == \
        [("EN", "[en-fr] Gift", 4, "latency_optimized"), ("EN", "[en-fr] Kind", 4, "latency_optimized")]
    assert [(m, j.texts) for m, j in served.jobs] == [("en-fr", ["Gift", "Kind"])]
    assert client.translate_text("Gift", target_lang="FR", context=DE_CONTEXT).detected_source_lang == "DE"
    assert client.get_usage().character.count == 15 * 4 + 8 + 4


def test_the_official_client_raises_naming_each_feature_not_offered(served):
    client = deepl_client.DeepLClient("any-key", server_url=served.url)
    calls = [
        (lambda: client.translate_text("Ein Hund.", target_lang="FR", style_rule="7ff9bfd6"), "style rules (style_id)"),
        (lambda: client.translate_text("Ein Hund.", target_lang="FR", custom_instructions=["Be brief"]),
         "custom instructions (custom_instructions)"),
        (lambda: client.translate_text("Ein Hund.", target_lang="FR", model_type="fastest"), "'model_type'"),
        (lambda: client.rephrase_text("Ein Hund.", target_lang="DE"), "DeepL Write"),
        (lambda: client.correct_text("Ein Hund.", target_lang="DE"), "DeepL Write"),
        (lambda: client.get_all_style_rules(), "style rules (/v3/style_rules)"),
        (lambda: client.create_style_rule("house", "de"), "style rules (/v3/style_rules)"),
    ]
    for call, feature in calls:
        with pytest.raises(deepl_client.DeepLException) as e:
            call()
        assert feature in str(e.value) and e.value.http_status_code in (400, 404), str(e.value)
    assert not served.jobs
