"""The one mapping of engine and Ray handle errors to HTTP (service/api/errors.py), in-process."""
from __future__ import annotations

import asyncio
import json
import pickle

import pytest
import ray
from local_services import local_services
from ray.serve.exceptions import BackPressureError

from model.config import ModelConfig
from service.api.errors import (
    MAX_DETAILS,
    add_exception_handlers,
    error_response,
    libre_error_response,
)
from service.api.schemas import TranslateRequest
from service.engine import (
    EngineError,
    EngineStoppedError,
    EngineValidationError,
    QueueFullError,
)
from service.protocol import (
    MAX_NAME_CHARS,
    RETRY_AFTER_S,
    ErrorRecord,
    GenerationOptions,
    JobOrigin,
    ServiceError,
    TranslateJob,
    shown,
)
from service.replica import mapped_errors, to_service_error
from service.translator import ModelCard


@pytest.mark.parametrize("exc, status, words, retry", [
    (QueueFullError("8 requests wait"), 503, "engine queue is full", True),
    (EngineValidationError("beam_size", "must be <= max_num_seqs (4), got 5"), 422, "beam_size: must be <= max_num_seqs",
     False),
    (EngineStoppedError("engine stopped"), 503, "engine is restarting", True),
    (EngineError("a runner bug"), 500, "engine error: a runner bug", False),
    (BackPressureError(num_queued_requests=4, max_queued_requests=4), 503, "model m is overloaded", True),
    (ray.exceptions.ActorUnavailableError("gone", b"\0" * 16), 503, "model m is unavailable", True),
])
def test_engine_and_ray_errors_map_to_their_status(exc, status, words, retry):
    err = to_service_error(exc, "m")
    assert err.status == status and words in err.message
    assert (err.retry_after == RETRY_AFTER_S) if retry else err.retry_after is None
    if isinstance(exc, EngineValidationError):
        assert err.field == "beam_size" and err.message.count("beam_size") == 1


def test_a_wrapped_cause_is_mapped_and_other_errors_are_not():
    class Wrapped(Exception):
        cause = QueueFullError("full")
    assert to_service_error(Wrapped(), "m").status == 503
    assert to_service_error(KeyError("bug"), "m") is None
    with pytest.raises(KeyError):
        with mapped_errors("m"):
            raise KeyError("bug")
    with pytest.raises(ServiceError) as e:
        with mapped_errors("m"):
            raise EngineStoppedError("stopping")
    assert e.value.status == 503


def test_a_service_error_crosses_as_a_record():
    err = ServiceError(413, "text: at most 64 texts per request, got 65", "text")
    record = pickle.loads(pickle.dumps(err.record))
    assert record == ErrorRecord(413, err.message, "text", None, "payload_too_large")
    again = ServiceError.from_record(record)
    assert (again.status, again.message, again.field, again.type) == (413, err.message, "text", "payload_too_large")


def test_error_bodies_native_and_libretranslate():
    err = ServiceError(503, "model m is overloaded; retry later", retry_after=0.2)
    r = error_response(err)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert json.loads(r.body) == {"error": {"type": "overloaded", "message": err.message, "field": None}}
    r = libre_error_response(ServiceError(422, "q: bad", "q"))
    assert r.status_code == 400 and json.loads(r.body) == {"error": "q: bad"}


def test_body_errors_say_what_is_wrong():
    """Too-deep JSON is named as such (FastAPI's parser gives up with a RecursionError), a lone
    surrogate is a "field: message" error, a LibreTranslate body that was not read because of its
    Content-Type says so, and a non-integer ``alternatives`` is refused (no Ray: test_api_body's app)."""
    from fastapi.testclient import TestClient
    from pydantic import ValidationError
    from test_api_body import make_app

    from service.api.errors import JSON_TOO_DEEP, format_validation_error
    from service.api.libretranslate import parse
    from service.api.schemas import FormFields, TranslateRequest
    client = TestClient(make_app())
    deep = b"[" * 20_000 + b"]" * 20_000      # beyond the recursion limit, within the test app's body cap
    for path in ("/v1/translate", "/translate"):
        r = client.post(path, content=deep, headers={"Content-Type": "application/json"})
        message = r.json()["error"]["message"] if path == "/v1/translate" else r.json()["error"]
        assert r.status_code in (400, 422) and JSON_TOO_DEEP in message and "nested too deep" in message, r.text
    r = client.post("/v1/translate", content=b'{"text": "\xff"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "not valid UTF-8" in r.json()["error"]["message"], r.text

    with pytest.raises(ValidationError) as e:
        TranslateRequest(text=["x", "a\ud800"])
    field, message = format_validation_error(e.value.errors()[0])
    assert field == "text" and message.startswith("text[1]: not valid Unicode: a lone surrogate (U+D800) at "
                                                  "character 1"), message

    body = json.dumps({"q": "Hallo", "source": "de", "target": "en"}).encode()
    for ctype in (None, "text/plain"):
        r = client.post("/translate", content=body, headers={"Content-Type": ctype} if ctype else {})
        assert r.status_code == 415 and "missing q" not in r.json()["error"], r.text
        assert "application/json" in r.json()["error"] and "application/x-www-form-urlencoded" in r.json()["error"]
    from test_api_libretranslate import GRAPH as cards
    for bad in (1.5, True, "1.5", "zwei", [1]):
        with pytest.raises(ServiceError) as e:
            parse(FormFields({"q": "Hallo", "source": "de", "target": "en", "alternatives": bad}), cards)
        assert (e.value.status, e.value.field) == (400, "alternatives") and "0 <= alternatives <= 15" in e.value.message
    assert [parse(FormFields({"q": "x", "source": "de", "target": "en", "alternatives": ok}), cards).alternatives
            for ok in ("2", "", "+2", "002", " 3 ")] == [2, 0, 2, 2, 3]                  # a form's text
    assert [parse({"q": "x", "source": "de", "target": "en", "alternatives": ok}, cards).alternatives or 0
            for ok in (2, 2.0, None)] == [2, 2, 0]                                        # JSON
    for bad in ("2", ""):       # JSON: a number, as the document says
        with pytest.raises(ServiceError, match="whole number or null"):
            parse({"q": "x", "source": "de", "target": "en", "alternatives": bad}, cards)
    # Whole numbers of any size are refused by their range, never by an OverflowError or ValueError (500)
    for big, bound in ((10 ** 300, "less than"), (-10 ** 300, "greater than"), ("9" * 5000, ""), ("-" + "9" * 5000, ""),
                       (1e300, "less than"), (16, "less than"), ("16", "less than"), (-1, "greater than")):
        with pytest.raises(ServiceError) as e:
            parse(FormFields({"q": "x", "source": "de", "target": "en", "alternatives": big}), cards)
        assert (e.value.status, e.value.field) == (400, "alternatives"), e.value.message
        assert "0 <= alternatives <= 15" in e.value.message and (bound in e.value.message or "maximum size" in
                                                                 e.value.message), e.value.message
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ServiceError, match="finite number.*0 <= alternatives <= 15"):
            parse({"q": "x", "source": "de", "target": "en", "alternatives": bad}, cards)


def test_errors_do_not_echo_long_names_or_list_thousands_of_errors():
    """An unknown field named by 100,000 characters is named shortened (its start and length), and a
    body with 500 unknown fields lists MAX_DETAILS of them and counts the rest: the 422 stays small,
    whatever the client sent (no Ray: the real request model behind the service's error handlers)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    app = FastAPI()
    add_exception_handlers(app)

    @app.post("/v1/translate")
    async def native(body: TranslateRequest):   # module-level name: this file's annotations are strings
        return {"ok": True}
    client = TestClient(app)
    long_name = "x" * 100_000
    r = client.post("/v1/translate", json={"text": "Hallo", long_name: 1})
    assert r.status_code == 422 and len(r.content) < 1_000, len(r.content)
    err = r.json()["error"]
    assert err["field"] == "x" * (MAX_NAME_CHARS // 2) + "...(100000 characters)", err["field"]
    assert err["message"].startswith(err["field"] + ": ") and "xxxx" * 100 not in r.text

    r = client.post("/v1/translate", json={"text": "Hallo", **{f"extra_{i}": i for i in range(500)}})
    err = r.json()["error"]
    assert r.status_code == 422 and len(err["details"]) == MAX_DETAILS + 1, r.text[:300]
    assert [d["field"] for d in err["details"][:MAX_DETAILS]] == [f"extra_{i}" for i in range(MAX_DETAILS)]
    assert err["details"][-1]["message"] == f"body: {500 - MAX_DETAILS} more errors not listed (the first {MAX_DETAILS} are)"

    r = client.post("/v1/translate", json={"text": "Hallo", "extra": 1})   # a short name: whole, as before
    assert r.json()["error"]["field"] == "extra" and "details" not in r.json()["error"]
    assert shown("de") == "'de'" and shown(long_name) == repr("x" * (MAX_NAME_CHARS // 2) + "...(100000 characters)")


def test_an_unknown_deepl_path_is_a_404_in_deepls_shape():
    """DeepL's clients tell a wrong server_url or an endpoint this server lacks (GET /v2/glossaries:
    ``deepl.Translator.list_glossaries``) by its 404; invalid input on a route that exists stays 400."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    app = FastAPI()
    add_exception_handlers(app)

    @app.post("/v2/translate")
    async def deepl_translate():
        raise ServiceError(404, "target_lang: no model for de->ja", "target_lang")   # unknown pair: DeepL's 400
    client = TestClient(app)
    r = client.get("/v2/glossaries")
    assert r.status_code == 404 and r.json() == {"message": "GET /v2/glossaries: Not Found"}, r.text
    r = client.get("/v2/translate")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    r = client.post("/v2/translate")
    assert r.status_code == 400 and r.json() == {"message": "target_lang: no model for de->ja"}, r.text


def test_a_message_that_names_the_value_does_not_repeat_it():
    from service.api.errors import format_validation_error
    err = {"type": "value_error", "loc": ("body", "source_lang"), "input": "",
           "msg": "Value error, must be a language code, got ''"}
    field, message = format_validation_error(err)
    assert field == "source_lang" and message.count("got ''") == 1, message
    err = {"type": "greater_than_equal", "loc": ("body", "beam_size"), "input": 0, "msg": "Input should be >= 1"}
    assert format_validation_error(err) == ("beam_size", "beam_size: Input should be >= 1 (got 0)")


def test_a_huge_number_is_named_shortened_in_the_engine_check():
    """A value the engine's check refuses is repeated as its start and length past MAX_NAME_CHARS."""
    from fastapi.testclient import TestClient
    from local_services import local_services

    from model.config import ModelConfig
    from service.api.http import build_app
    from service.translator import ModelCard
    card = ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
    client = TestClient(build_app(local_services([card], None)))
    r = client.post("/v1/translate", content='{"text": "Hallo", "max_new_tokens": 1e308}',
                    headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 422 and err["field"] == "max_new_tokens" and "(309 characters)" in err["message"]
    assert len(err["message"]) < 200


def test_a_translators_error_names_the_text_as_the_request_did():
    """A translator names text i of its job ``text[i]``; the pipeline names it by the job's origin
    (``q[i]``, ``text`` for a lone string, ``text[3]`` for the one text of an autodetected group, ``file[i]``)."""
    card = ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
    tail = "sentence 2 has 99 tokens (with EOS); model de-en accepts at most 64 per sentence: split it"

    async def run(model, job):
        raise ServiceError(413, f"text[1]: {tail}", "text")
    svc = local_services([card], run)
    job = TranslateJob(["a", "b"], GenerationOptions())
    for origin, head, field in ((JobOrigin("q", True), "q[1]", "q"), (JobOrigin(), "text", "text"),
                                (JobOrigin("text", True), "text[1]", "text"), (JobOrigin("text[3]"), "text[3]", "text[3]"),
                                (JobOrigin("file", True), "file[1]", "file")):
        with pytest.raises(ServiceError) as e:
            asyncio.run(svc.pipeline.run("de-en", job, origin))
        assert (e.value.status, e.value.message, e.value.field) == (413, f"{head}: {tail}", field)


def test_deepl_too_many_texts_or_too_long_a_text_is_a_413_naming_the_limit():
    from fastapi.testclient import TestClient
    from local_services import local_services, upper_cased

    from service.api.http import build_app
    from service.protocol import MAX_TEXT_CHARS, MAX_TEXTS
    card = ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
    client = TestClient(build_app(local_services([card], upper_cased([]))))
    for texts, limit, got in ((["Hallo"] * (MAX_TEXTS + 1), f"at most {MAX_TEXTS} texts", f"got {MAX_TEXTS + 1}"),
                              (["Hallo", "x" * (MAX_TEXT_CHARS + 1)], f"at most {MAX_TEXT_CHARS} characters",
                               f"got {MAX_TEXT_CHARS + 1}")):
        r = client.post("/v2/translate", json={"text": texts, "target_lang": "EN-GB", "source_lang": "DE"})
        assert r.status_code == 413 and limit in r.json()["message"] and got in r.json()["message"], r.text
    r = client.post("/v2/translate", json={"text": ["Hallo"] * MAX_TEXTS, "target_lang": "EN-GB", "source_lang": "DE"})
    assert r.status_code == 200 and [t["text"] for t in r.json()["translations"]] == ["HALLO"] * MAX_TEXTS


def test_a_text_whose_language_cannot_be_told_is_a_404_naming_source_lang_on_deepls_route_too():
    """The text is valid; this server has no model for it: 404 on every route, named the same way."""
    from fastapi.testclient import TestClient
    from local_services import local_services, upper_cased

    from service.api.http import build_app
    card = ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
    client = TestClient(build_app(local_services([card], upper_cased([]))))
    r = client.post("/v2/translate", json={"text": ["x"], "target_lang": "EN-GB"})
    assert r.status_code == 404 and "cannot tell the language of text[0]" in r.json()["message"], r.text
    r = client.post("/v1/translate", json={"text": ["x"], "source_lang": "auto", "target_lang": "en"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "source_lang", r.text
