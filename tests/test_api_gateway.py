"""The gateway (service/api/gateway.py): the native HTTP API of the running service over real HTTP
(tests/conftest.py starts it once), and its readiness probe in-process."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import DATA, SECOND_ENGINE, SECOND_MODEL, post, sse_events, translate
from model.tokenizer import read_lines
from service.protocol import MAX_BEAM_SIZE, MAX_TEXT_CHARS, MAX_TEXTS

from local_services import local_services
SENTENCES = read_lines(DATA / "test_2016_flickr.de.gz")[:12]


def same_json(a, b, tol: float = 1e-4) -> bool:
    """Equal JSON values, floats (scores) within tol: fp32 sums differ in their last bits with the
    batch a request shared (the engine guarantees tokens and scores within 1e-4, not bit equality)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_json(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_json(x, y, tol) for x, y in zip(a, b))
    return a == b


# ---- service endpoints -------------------------------------------------------------------------
@pytest.mark.slow
def test_health_ready_models_docs(service_url, service_info):
    assert httpx.get(service_url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(service_url + "/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "models": {"de-en": "ready", SECOND_MODEL: "ready"}}
    models = httpx.get(service_url + "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in models}
    assert [m["id"] for m in models] == ["de-en", SECOND_MODEL]
    assert (by_id["de-en"]["source_lang"], by_id["de-en"]["target_lang"]) == ("de", "en")
    assert (by_id[SECOND_MODEL]["source_lang"], by_id[SECOND_MODEL]["target_lang"]) == ("en", "de")
    assert by_id["de-en"]["config"]["d_model"] > 0 and by_id["de-en"]["config"]["max_len"] > 0
    # the engine settings the replica really runs with (user_config)
    assert by_id[SECOND_MODEL]["engine"]["max_num_seqs"] == SECOND_ENGINE["max_num_seqs"]
    assert "test_bleu" in by_id["de-en"]
    docs = httpx.get(service_url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    spec = httpx.get(service_url + "/openapi.json").json()
    assert {"/v1/translate", "/v1/models", "/translate", "/languages", "/healthz", "/readyz"} <= set(spec["paths"])


@pytest.mark.slow
def test_request_id_on_every_response(service_url):
    ok = httpx.get(service_url + "/healthz", headers={"X-Request-ID": "client-id-1"})
    assert ok.headers["x-request-id"] == "client-id-1"
    bad = post(service_url, {"text": "x", "beam_size": 0}, headers={"X-Request-ID": "client-id-2"})
    assert bad.status_code == 422 and bad.headers["x-request-id"] == "client-id-2"
    generated = [post(service_url, {"text": "x", "model": "nope"}).headers.get("x-request-id") for _ in range(2)]
    assert all(generated) and generated[0] != generated[1]


# ---- translations ------------------------------------------------------------------------------
@pytest.mark.slow
def test_list_request_returns_results_in_order(service_url):
    singles = [translate(service_url, s, beam_size=2)["translations"][0] for s in SENTENCES[:5]]
    batch = translate(service_url, SENTENCES[:5], beam_size=2)
    assert batch["model"] == "de-en"
    assert [t["text"] for t in batch["translations"]] == [t["text"] for t in singles]
    assert [t["tokens"] for t in batch["translations"]] == [t["tokens"] for t in singles]
    assert batch["usage"]["source_tokens"] == sum(len(t["source_tokens"]) for t in singles)
    assert batch["usage"]["generated_tokens"] == sum(len(t["tokens"]) for t in singles)


@pytest.mark.slow
def test_paragraph_of_three_sentences_comes_back_as_three_translated_sentences(service_url):
    a, b, c = SENTENCES[:3]
    alone = [translate(service_url, s, beam_size=1)["translations"][0] for s in (a, b, c)]
    paragraph = translate(service_url, f"{a} {b}\n\n  {c}", beam_size=1)["translations"][0]
    assert paragraph["text"] == f"{alone[0]['text']} {alone[1]['text']}\n\n  {alone[2]['text']}"
    assert paragraph["tokens"] == alone[0]["tokens"] + alone[1]["tokens"] + alone[2]["tokens"]
    assert paragraph["source_tokens"].count("</s>") == 3


@pytest.mark.slow
@pytest.mark.parametrize("text", ["", "   ", "\n\t ", "\u200b\x7f", " \x00 "])
def test_empty_text_translates_to_empty_without_the_model(service_url, text):
    out = translate(service_url, [text, SENTENCES[0]], beam_size=1)
    empty, real = out["translations"]
    assert empty == {"text": "", "tokens": [], "source_tokens": [], "score": 0.0, "finish_reason": "eos",
                     "alternatives": [], "confidence": 1.0}
    assert real["text"] and out["usage"]["source_tokens"] == len(real["source_tokens"])
    assert translate(service_url, text)["usage"] == {"source_tokens": 0, "generated_tokens": 0}


def _rows_sum_to_one(mat, n_rows, n_cols):
    assert len(mat) == n_rows
    for row in mat:
        assert len(row) == n_cols
        assert abs(sum(row) - 1.0) < 1e-3


@pytest.mark.slow
def test_attention_shapes_match_tokens_and_rows_sum_to_one(service_url, service_info):
    models = {m["id"]: m for m in httpx.get(service_url + "/v1/models").json()["data"]}
    cfg = models["de-en"]["config"]
    text = f"{SENTENCES[0]} {SENTENCES[1]}"     # two sentences: block-diagonal attention
    out = translate(service_url, text, beam_size=2, return_attention=True,
                    attention={"kinds": ["cross", "encoder", "decoder"]})["translations"][0]
    T, S = len(out["tokens"]), len(out["source_tokens"])
    att = out["attention"]
    assert set(att) == {"cross", "encoder", "decoder"}
    assert len(att["cross"]) == cfg["n_decoder_layers"] and len(att["encoder"]) == cfg["n_encoder_layers"]
    for layer in att["cross"]:
        assert len(layer) == cfg["n_heads"]
        for head in layer:
            _rows_sum_to_one(head, T, S)
    for layer in att["encoder"]:
        for head in layer:
            _rows_sum_to_one(head, S, S)
    for layer in att["decoder"]:
        for head in layer:
            _rows_sum_to_one(head, T, T)
    # a target token of sentence 2 never attends to sentence 1's source
    first_src = out["source_tokens"].index("</s>") + 1
    one = translate(service_url, SENTENCES[0], beam_size=2)["translations"][0]
    t1 = len(one["tokens"])
    assert all(v == 0 for row in att["cross"][0][0][t1:] for v in row[:first_src])
    # chosen layers and heads only; no attention unless asked
    small = translate(service_url, SENTENCES[0], return_attention=True,
                      attention={"kinds": ["cross"], "layers": [0], "heads": [0, 1]})["translations"][0]
    assert len(small["attention"]["cross"]) == 1 and len(small["attention"]["cross"][0]) == 2
    _rows_sum_to_one(small["attention"]["cross"][0][1], len(small["tokens"]), len(small["source_tokens"]))
    assert "attention" not in translate(service_url, SENTENCES[0])["translations"][0]
    # a text without tokens (empty; only digits and punctuation) has the same [layers][heads] shape, no rows
    for blank in ("", " 42 !"):
        empty = translate(service_url, [blank, SENTENCES[0]], return_attention=True, attention={
            "kinds": ["cross", "encoder"], "heads": [1, 3]})["translations"][0]
        assert empty["tokens"] == [] and empty["attention"] == {"cross": [[[], []]] * cfg["n_decoder_layers"],
                                                                 "encoder": [[[], []]] * cfg["n_encoder_layers"]}


@pytest.mark.slow
def test_long_attention_crosses_the_hop_and_too_much_is_a_413(service_url, service_info):
    """Over 4 MiB of weights (gRPC's default message cap between deployments) come through; more
    than MAX_ATTENTION_VALUES is a 413 naming the field, as JSON or as a stream's error event."""
    from service.protocol import MAX_ATTENTION_VALUES
    text = " ".join(SENTENCES)       # 12 sentences: ~800k cross weights
    out = translate(service_url, text, return_attention=True)["translations"][0]     # cross only
    T, S = len(out["tokens"]), len(out["source_tokens"])
    layers = out["attention"]["cross"]
    assert len(layers) * len(layers[0]) * T * S * 9 > 4 * 2**20, (T, S)    # > 4 MiB pickled (9 bytes a float)
    _rows_sum_to_one(layers[-1][-1], T, S)
    body = {"text": [text] * 2, "return_attention": True, "attention": {"kinds": ["cross", "encoder", "decoder"]}}
    r = post(service_url, body)
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert err["field"] == "return_attention" and f"at most {MAX_ATTENTION_VALUES:,}" in err["message"]
    assert "would hold at least" in err["message"]          # the encoder's weights alone: before decoding
    r = post(service_url, {**body, "stream": True})
    assert r.status_code == 413 and r.json()["error"]["field"] == "return_attention", r.text[:300]
    cross = {"text": [text] * 4, "return_attention": True}       # cross only: known to be too much once decoded
    r = post(service_url, cross)
    assert r.status_code == 413 and "holds" in r.json()["error"]["message"], r.text[:300]
    r = post(service_url, {**cross, "stream": True})
    assert r.status_code == 200 and sse_events(r.text)[-1][0] == "error"
    assert "return_attention" in sse_events(r.text)[-1][1]["error"]["message"]


@pytest.mark.slow
def test_n_best_alternatives(service_url):
    t = translate(service_url, SENTENCES[2], beam_size=4, n_best=3)["translations"][0]
    assert 1 <= len(t["alternatives"]) <= 2
    for alt in t["alternatives"]:
        assert set(alt) == {"text", "tokens", "score", "finish_reason", "confidence"}
        assert alt["score"] <= t["score"] + 1e-6 and 0 < alt["confidence"] <= 1
    assert translate(service_url, SENTENCES[2], beam_size=4)["translations"][0]["alternatives"] == []
    # n_best above beam_size: the beam is n_best wide, the beam_size sent is named as changing nothing
    ref = translate(service_url, SENTENCES[2], beam_size=3, n_best=3)["translations"][0]
    for auto in (False, True):
        r = httpx.post(f"{service_url}/v1/translate", json={"text": SENTENCES[2], "beam_size": 2, "n_best": 3,
                                                             **({"source_lang": "auto"} if auto else {})}, timeout=60)
        assert r.status_code == 200 and r.headers.get("x-ignored-fields") == "beam_size", (r.status_code, r.text)
        got = r.json()["translations"][0]
        assert [got["text"], *(a["text"] for a in got["alternatives"])] == \
            [ref["text"], *(a["text"] for a in ref["alternatives"])]


@pytest.mark.slow
def test_routing_by_model_and_by_languages(service_url):
    by_pair = translate(service_url, "A dog runs.", source_lang="en", target_lang="de", max_new_tokens=5)
    by_name = translate(service_url, "A dog runs.", model=SECOND_MODEL, max_new_tokens=5)
    assert by_pair["model"] == by_name["model"] == SECOND_MODEL
    assert by_pair["translations"] == by_name["translations"]
    assert translate(service_url, "Hallo.", max_new_tokens=3)["model"] == "de-en"     # the default
    assert translate(service_url, "Hallo.", target_lang="en", max_new_tokens=3)["model"] == "de-en"
    # codes match ignoring case, and a region falls back to its language
    assert translate(service_url, "A dog runs.", source_lang="EN", target_lang="de-DE", max_new_tokens=5) == by_pair


# ---- bad input: status code and a message naming the field and the limit ---------------------------
LONG_SENTENCE = " ".join(["Hund"] * 400)   # one "sentence" longer than any model's max_len


@pytest.mark.slow
@pytest.mark.parametrize("body, status, field, words", [
    ({"text": "x", "beam_size": 0}, 422, "beam_size", ["1"]),
    ({"text": "x", "beam_size": MAX_BEAM_SIZE + 1}, 422, "beam_size", [str(MAX_BEAM_SIZE)]),
    ({"text": "x", "beam_size": "4"}, 422, "beam_size", ["integer"]),
    ({"text": "x", "max_new_tokens": -1}, 422, "max_new_tokens", ["0"]),
    ({"text": "x", "max_new_tokens": 100000}, 422, "max_new_tokens", ["100000"]),
    ({"text": "x", "max_new_tokens": 5, "min_new_tokens": -1}, 422, "min_new_tokens", ["0"]),   # above max: exactly max
    ({"text": "x", "length_penalty": "big"}, 422, "length_penalty", []),
    ({"text": "x", "return_attention": True, "attention": {"kinds": ["cross", "sideways"]}}, 422,
     "attention.kinds", ["cross", "encoder", "decoder"]),
    ({"text": "x", "return_attention": True, "attention": {"layers": [99]}}, 422, "attention.layers", ["99"]),
    ({"text": "x", "return_attention": True, "attention": {"heads": [-1]}}, 422, "attention.heads", ["-1"]),
    ({"text": "x", "source_lang": ""}, 422, "source_lang", ["language code"]),
    ({"text": "x", "target_lang": " "}, 422, "target_lang", ["language code"]),
    ({"text": 5}, 422, "text", ["string"]),
    ({"text": ["ok", None]}, 422, "text", ["string", "text[1]"]),
    ({"text": "x", "colour": "red"}, 422, "colour", []),
    ({}, 422, "text", ["required"]),
    ({"text": "x" * (MAX_TEXT_CHARS + 1)}, 413, "text", [str(MAX_TEXT_CHARS)]),
    ({"text": ["x"] * (MAX_TEXTS + 1)}, 413, "text", [str(MAX_TEXTS)]),
    ({"text": "x", "model": "fr-en"}, 404, "model", ["fr-en", "de-en"]),
    ({"text": "x", "source_lang": "fr"}, 404, "source_lang", ["fr"]),
    ({"text": "x", "model": "de-en", "target_lang": "fr"}, 404, "target_lang", ["fr"]),
])
def test_bad_input_gets_its_status_and_a_message(service_url, body, status, field, words):
    r = post(service_url, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"].startswith(field), err
    assert field in err["message"], err
    for w in words:
        assert w in err["message"], err


@pytest.mark.slow
@pytest.mark.parametrize("raw", [b"{", b"[]", b"null", b'"text"', b'{"text": {"a": 1}}', b'{"text": [["x"]]}',
                                 b'{"text": "x", "beam_size": 1e309}', b'{"text": "x", "attention": []}',
                                 b'{"text": "\\ud800"}', b'{"text": "x", "stream": "yes"}'])
def test_malformed_bodies_never_cause_a_500(service_url, raw):
    r = httpx.post(service_url + "/v1/translate", content=raw, headers={"Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (raw, r.status_code, r.text)
    assert r.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("field", ["model", "source_lang", "target_lang"])
def test_a_lone_surrogate_in_a_name_is_invalid_unicode_not_unknown(service_url, field):
    raw = b'{"text": "Hallo", "%s": "de\\ud800"}' % field.encode()
    r = httpx.post(service_url + "/v1/translate", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    assert "Unicode" in r.json()["error"]["message"]


@pytest.mark.slow
def test_engine_limits_are_422_with_the_limit(service_url):
    # beam_size within the API limit but above the second model's KV-cache slots
    r = post(service_url, {"text": "A dog.", "model": SECOND_MODEL, "beam_size": SECOND_ENGINE["max_num_seqs"] + 1})
    assert r.status_code == 422
    assert r.json()["error"]["field"] == "beam_size"
    assert str(SECOND_ENGINE["max_num_seqs"]) in r.json()["error"]["message"]
    # more sentences than the engine's queue holds: they go in as earlier ones end, none is refused
    r = post(service_url, {"text": ". ".join(["A dog"] * (SECOND_ENGINE["max_waiting"] + 1)) + ".",
                           "model": SECOND_MODEL, "beam_size": 1})
    assert r.status_code == 200, r.text
    alone = post(service_url, {"text": "A dog.", "model": SECOND_MODEL, "beam_size": 1}).json()
    assert r.json()["translations"][0]["text"] == " ".join([alone["translations"][0]["text"]] *
                                                           (SECOND_ENGINE["max_waiting"] + 1))


@pytest.mark.slow
def test_a_sentence_longer_than_the_model_reads_is_cut_and_translated(service_url):
    """400 words in one sentence (the shipped model reads 256 tokens): cut into parts that fit,
    every source token translated; the source tokens are the parts' (each ending in </s>)."""
    r = post(service_url, {"text": LONG_SENTENCE, "beam_size": 1})
    assert r.status_code == 200, r.text
    tr = r.json()["translations"][0]
    pieces = tr["source_tokens"]
    assert pieces.count("</s>") >= 2 and len(pieces) - pieces.count("</s>") >= 400


# ---- streaming ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("beam_size", [1, 3])
def test_streamed_tokens_concatenate_to_the_final_text(service_url, beam_size):
    texts = [f"  {SENTENCES[3]}\n{SENTENCES[4]} ", SENTENCES[5], " "]
    r = post(service_url, {"text": texts, "beam_size": beam_size, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1][0] == "response" and all(e == "token" for e, _ in events[:-1])
    final = events[-1][1]
    for i, t in enumerate(final["translations"]):
        streamed = "".join(d["text"] for e, d in events[:-1] if d["index"] == i)
        assert streamed == t["text"]
    assert final["translations"][0]["text"].startswith("  ") and "\n" in final["translations"][0]["text"]
    assert final["translations"][2]["text"] == ""
    for i in range(len(texts)):   # whitespace before a sentence comes with its first token, never alone
        deltas = [d["text"] for e, d in events[:-1] if d["index"] == i]
        assert all(t.strip() for t in deltas[:-1]), deltas
    assert sum(1 for e, d in events if e == "token" and d["token"] is not None) > 0
    plain = translate(service_url, texts, beam_size=beam_size)
    assert plain["translations"] == final["translations"] and plain["usage"] == final["usage"]


@pytest.mark.slow
def test_stream_validation_errors_are_http_errors(service_url):
    r = post(service_url, {"text": "x", "max_new_tokens": 100000, "stream": True})
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["field"] == "max_new_tokens"


@pytest.mark.slow
def test_the_separate_layout_gives_the_same_answers(service_url, service_info):
    """The other layout (``ingress: separate``, a Gateway in front of the translator's own deployment)."""
    from ray import serve

    from service.app import build_app
    args = {"models": [{"name": SECOND_MODEL, "checkpoint": service_info.models[SECOND_MODEL]}],
            "ingress": "separate", "num_cpus": 0.1, "engine": {"max_num_seqs": 4}}
    serve.run(build_app(args), name="embedded", route_prefix="/embedded", blocking=False)
    try:
        deadline = time.time() + 30     # HAProxy learns the new route prefix from its next config reload
        while (ready := httpx.get(service_url + "/embedded/readyz", timeout=30)).status_code != 200 \
                and time.time() < deadline:
            time.sleep(0.5)
        assert ready.json()["models"] == {SECOND_MODEL: "ready"}
        body = {"text": ["A dog runs. A cat sleeps.", "Two men."], "beam_size": 2, "max_new_tokens": 8}
        here = post(service_url, body, path="/embedded/v1/translate")
        there = post(service_url, {**body, "model": SECOND_MODEL})
        assert here.status_code == 200 and same_json(here.json(), there.json())
        models = httpx.get(service_url + "/embedded/v1/models").json()["data"]
        assert models[0]["engine"]["max_num_seqs"] == 4
        streamed = post(service_url, {**body, "stream": True}, path="/embedded/v1/translate")
        assert same_json(sse_events(streamed.text)[-1][1], there.json())
        bad = post(service_url, {"text": "x", "beam_size": 5}, path="/embedded/v1/translate")
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "beam_size"
    finally:
        serve.delete("embedded")


@pytest.mark.slow
def test_invalid_json_names_the_body(service_url):
    r = httpx.post(service_url + "/v1/translate", content=b'{"text": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["field"] == "body" and "invalid JSON" in err["message"]


@pytest.mark.slow
@pytest.mark.parametrize("ctype, content", [("text/plain", b"Ein Hund"),
                                            ("application/x-www-form-urlencoded", b"text=Ein+Hund")])
def test_a_body_that_is_not_json_gets_415_naming_the_content_type(service_url, ctype, content):
    r = httpx.post(service_url + "/v1/translate", content=content, headers={"Content-Type": ctype})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["field"] == "Content-Type" and ctype in err["message"] and "application/json" in err["message"]
    r = httpx.post(service_url + "/v1/translate", content=b'{"text": ""}')   # no Content-Type at all
    assert r.status_code == 415 and "got none" in r.json()["error"]["message"]
    r = httpx.post(service_url + "/v1/translate", content=b'{"text": ""}',
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["translations"][0]["text"] == ""


@pytest.mark.slow
def test_framework_errors_use_the_error_shape(service_url):
    r = httpx.get(service_url + "/v1/translate")
    assert r.status_code == 405 and "/v1/translate" in r.json()["error"]["message"]
    r = httpx.get(service_url + "/no/such/path")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
    # a query parameter would be ignored: 422 naming it (the fields are the body's)
    r = httpx.post(service_url + "/v1/translate?beam_size=99", json={"text": "Ein Hund."})
    assert r.status_code == 422 and r.json()["error"]["field"] == "beam_size" and "JSON body" in r.json()["error"]["message"]
    # a trailing slash is another path: a 404, not a redirect to a URL built from the Host header
    r = httpx.post(service_url + "/v1/translate/", json={"text": "Ein Hund."}, headers={"Host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers and r.json()["error"]["type"] == "not_found"
    r = httpx.post(service_url + "/v1/translate", content='{"text": "l\u00e4uft"}'.encode("latin-1"),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "body"


@pytest.mark.slow
def test_unknown_target_language_blames_target_lang(service_url):
    r = httpx.post(service_url + "/v1/translate", json={"text": "Hallo", "target_lang": "xx"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "target_lang"


# ---- readiness, in-process ---------------------------------------------------------------------
def test_readyz_answers_quickly_while_a_model_loads(monkeypatch):
    """A model whose replica is not up yet must not hold the readiness probe: 503 within ~the probe
    timeout; a model that answered once stays ready while it is merely slow."""
    import asyncio
    import time
    from model.config import ModelConfig
    from service.api.routes import native as routes_native
    from service.translator import ModelCard

    class Backend:   # what readyz uses of the backend
        async def ready(self, name):
            if name == "de-en":
                return True
            await asyncio.sleep(3600)    # no replica yet: the call would wait for one

    cfg = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
    state = local_services([ModelCard("de-en", "", "de", "en", cfg), ModelCard("fr-en", "", "fr", "en", cfg)], None)
    state.backend = Backend()
    monkeypatch.setattr(routes_native, "READY_PROBE_S", 0.2)

    async def probe():
        t0 = time.monotonic()
        resp = await routes_native.readyz(state)
        return resp.status_code, json.loads(resp.body), time.monotonic() - t0

    status, body, took = asyncio.run(probe())
    assert status == 503 and body["models"] == {"de-en": "ready", "fr-en": "loading"} and took < 2.0
    assert state.ready_seen == {"de-en"}
    state.ready_seen.add("fr-en")       # it answered before: now busy, not loading
    status, body, _ = asyncio.run(probe())
    assert status == 200 and body["status"] == "ready"
