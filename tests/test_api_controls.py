"""Translation controls over HTTP without Ray: the service's request model, the gateway's checks and
error handlers in front of one in-process Translator on the shipped de-en model. target_prefix,
confidence / min_confidence, repetition controls, return_alignment and their 422s; keep on the
LibreTranslate route."""
from __future__ import annotations

import contextlib
import json
import math

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from model.checkpoint import DEFAULT_CHECKPOINT
from service.api import libretranslate
from service.api.errors import add_exception_handlers
from local_services import local_services
from service.api.schemas import TranslateRequest
from service.engine import EngineConfig
from service.engine.validation import ModelLimits
from service.protocol import StreamToken, TranslateResponse, Translation, Usage
from service.replica import mapped_errors

pytestmark = pytest.mark.skipif(not (DEFAULT_CHECKPOINT / "config.json").exists(),
                                reason="the shipped model is not in this checkout")

ENGINE = {"max_num_seqs": 64}


@pytest.fixture(scope="module")
def client():
    """POST /v1/translate as the gateway answers it (schema, ModelLimits.check, the translator, the
    error handlers), and client.stream_job(job) -> (events, response) through the translator's stream."""
    from service.translator import Translator, model_card
    card = model_card("de-en", DEFAULT_CHECKPOINT)
    state = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        t = Translator(card)
        await t.reconfigure(ENGINE)
        state["t"] = t
        yield
        await t.stop()

    app = FastAPI(lifespan=lifespan)
    add_exception_handlers(app)
    limits = ModelLimits.of(card.id, card.config, EngineConfig.from_dict(ENGINE))

    @app.post("/v1/translate")
    async def translate(body: TranslateRequest):
        job = body.job()
        with mapped_errors(card.id):
            limits.check(job)
            result = await state["t"].translate(job)
        return result.body()

    @app.post("/stream")
    async def stream(body: TranslateRequest):
        events, final = [], None
        with mapped_errors(card.id):
            async for item in state["t"].stream(body.job()):
                if isinstance(item, StreamToken):
                    events.append(item.model_dump())
                elif isinstance(item, TranslateResponse):
                    final = item.body()
        return {"events": events, "response": final}

    with TestClient(app) as c:
        yield c


def post(client, **body) -> dict:
    r = client.post("/v1/translate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- target_prefix ------------------------------------------------------------------------------

@pytest.mark.parametrize("beam_size", [1, 4])
def test_target_prefix_starts_the_translation_greedy_and_beam(client, beam_size):
    text = "Ein Mann fährt mit dem Fahrrad die Straße entlang."
    free = post(client, text=text, beam_size=beam_size)["translations"][0]
    assert free["text"].startswith("A man")
    got = post(client, text=text, beam_size=beam_size, n_best=beam_size, target_prefix="The guy")["translations"][0]
    assert got["text"].startswith("The guy") and got["tokens"][:2] == ["▁The", "▁guy"], got
    assert "bicycle" in got["text"] or "bike" in got["text"]                 # then it translates freely
    assert all(a["text"].startswith("The guy") for a in got["alternatives"])  # every beam starts with it


def test_target_prefix_applies_to_the_first_sentence_of_each_text(client):
    texts = ["Ein Hund rennt. Eine Katze schläft.", "Zwei Kinder spielen."]
    free = [t["text"] for t in post(client, text=texts, beam_size=1)["translations"]]
    got = [t["text"] for t in post(client, text=texts, beam_size=1, target_prefix="One")["translations"]]
    assert all(t.startswith("One") for t in got), got
    assert got[0].split(". ", 1)[1] == free[0].split(". ", 1)[1]            # the second sentence is free


def test_streaming_with_a_prefix_streams_it_first_and_the_deltas_add_up(client):
    r = client.post("/stream", json={"text": "Ein Mann fährt Fahrrad.", "beam_size": 1, "target_prefix": "The guy"})
    assert r.status_code == 200, r.text
    events, final = r.json()["events"], r.json()["response"]
    assert "".join(e["text"] for e in events) == final["translations"][0]["text"]
    assert final["translations"][0]["text"].startswith("The guy") and events[0]["token"] == "▁The"


@pytest.mark.parametrize("beam_size", [1, 4])
def test_max_new_tokens_counts_after_the_prefix_and_a_prefix_filling_the_window_is_the_translation(client, beam_size):
    """A prefix longer than max_new_tokens is forced whole and max_new_tokens more follow; a prefix of
    more tokens than the model's window (max_len - 1) is the translation of each text's first
    sentence ("length"), with attention asked for and streamed too."""
    text = "Ein Mann fährt mit dem Fahrrad die Straße entlang."
    tr = post(client, text=text, beam_size=beam_size, target_prefix="A " * 40, max_new_tokens=3,
              min_new_tokens=3)["translations"][0]
    assert tr["tokens"][:40] == ["▁A"] * 40 and len(tr["tokens"]) == 43 and tr["finish_reason"] == "length"
    window = json.loads((DEFAULT_CHECKPOINT / "config.json").read_text())["max_len"] - 1
    long = "A " * (window + 20)
    body = post(client, text=[text, "Ein Hund rennt. Zwei Katzen schlafen."], beam_size=beam_size,
                target_prefix=long, return_attention=True)
    first, second = body["translations"]
    assert first["text"] == long.strip() and first["tokens"] == ["▁A"] * (window + 20)
    assert first["finish_reason"] == "length"
    rest = post(client, text="Zwei Katzen schlafen.", beam_size=beam_size)["translations"][0]["text"]
    assert second["text"] == long.strip() + " " + rest      # the prefix is the first sentence's only
    r = client.post("/stream", json={"text": text, "beam_size": beam_size, "target_prefix": long})
    assert r.status_code == 200, r.text
    events, final = r.json()["events"], r.json()["response"]
    assert "".join(e["text"] for e in events) == final["translations"][0]["text"] == long.strip()


# ---- confidence -------------------------------------------------------------------------------------

def test_confidence_is_in_range_and_follows_the_score(client):
    body = post(client, text=["Zwei Hunde spielen im Schnee.", "Ein Mann schläft."], beam_size=4, n_best=4)
    for tr in body["translations"]:
        hyps = [tr] + tr["alternatives"]
        for h in hyps:
            assert 0 < h["confidence"] <= 1 and "low_confidence" not in h
            # one sentence, length_penalty 1: score = log_prob / length, confidence = exp(score)
            assert math.isclose(h["confidence"], math.exp(h["score"]), rel_tol=1e-9)
        assert [h["confidence"] for h in hyps] == sorted((h["confidence"] for h in hyps), reverse=True)
    worse = post(client, text="Zwei Hunde spielen im Schnee.", beam_size=1, target_prefix="Seven cats")
    assert worse["translations"][0]["confidence"] < body["translations"][0]["confidence"]


def test_min_confidence_flags_and_never_drops(client):
    texts = ["Zwei Hunde spielen im Schnee.", "Ein Mann schläft."]
    plain = post(client, text=texts, beam_size=1)["translations"]
    cut = (plain[0]["confidence"] + plain[1]["confidence"]) / 2
    flagged = post(client, text=texts, beam_size=1, min_confidence=cut)["translations"]
    assert [t["text"] for t in flagged] == [t["text"] for t in plain]
    assert [t["low_confidence"] for t in flagged] == [t["confidence"] < cut for t in plain]
    assert sorted(t["low_confidence"] for t in flagged) == [False, True]


# ---- repetition controls, alignment ------------------------------------------------------------------

def test_repetition_controls_change_only_what_repeats(client):
    text = "Ein Mann und ein Mann und ein Mann."
    free = post(client, text=text, beam_size=1)["translations"][0]
    got = post(client, text=text, beam_size=1, no_repeat_ngram_size=2)["translations"][0]
    pieces = got["tokens"]
    grams = [tuple(pieces[i:i + 2]) for i in range(len(pieces) - 1)]
    assert len(grams) == len(set(grams)) and got["text"] != free["text"], (free["text"], got["text"])
    same = post(client, text="Ein Hund rennt.", beam_size=1, repetition_penalty=1.0)["translations"][0]
    assert same["text"] == post(client, text="Ein Hund rennt.", beam_size=1)["translations"][0]["text"]


def test_return_alignment_pairs_words(client):
    tr = post(client, text="Ein Hund rennt. Zwei Kinder spielen.", beam_size=1, return_alignment=True)["translations"][0]
    src = [p for p in tr["source_tokens"] if p.startswith("▁")]                 # one piece per word here
    tgt = [p for p in tr["tokens"] if p.startswith("▁")]
    pairs = [tuple(p) for p in tr["alignment"]]
    assert [t for _, t in pairs] == list(range(len(tgt))) and all(0 <= s < len(src) for s, _ in pairs), pairs
    for de, en in (("▁Hund", "▁dog"), ("▁Kinder", "▁children")):
        assert (src.index(de), tgt.index(en)) in pairs, (src, tgt, pairs)
    assert "attention" not in tr and "alignment" not in post(client, text="Ein Hund.")["translations"][0]


# ---- bad input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, field, words", [
    ({"target_prefix": "   "}, "target_prefix", "must not be empty"),
    ({"target_prefix": ""}, "target_prefix", "at least 1 character"),
    ({"target_prefix": "\u200b"}, "target_prefix", "has no tokens"),
    ({"min_confidence": 1.5}, "min_confidence", "less than or equal to 1"),
    ({"min_confidence": -0.1}, "min_confidence", "greater than or equal to 0"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"repetition_penalty": 11}, "repetition_penalty", "less than or equal to 10"),
    ({"no_repeat_ngram_size": 33}, "no_repeat_ngram_size", "less than or equal to 32"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size", "greater than or equal to 0"),
])
def test_bad_controls_are_422_naming_the_field_and_the_limit(client, extra, field, words):
    r = client.post("/v1/translate", json={"text": "Ein Hund rennt.", **extra})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field and words in err["message"], err
    assert post(client, text="Ein Hund rennt.", beam_size=1)["translations"][0]["text"] == "A dog runs."


# ---- keep on the LibreTranslate route ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def libre():
    from model.config import ModelConfig
    from service.translator import ModelCard
    cfg = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)
    cards = [ModelCard("de-en", "", "de", "en", cfg)]
    jobs = []

    async def run(model, job):
        jobs.append(job)
        return TranslateResponse(model=model, usage=Usage(source_tokens=1, generated_tokens=1), translations=[
            Translation(text=t, tokens=[], source_tokens=[], score=0.0, finish_reason="eos") for t in job.texts])
    app = FastAPI()
    add_exception_handlers(app)

    @app.post("/translate")
    async def route(request: Request):
        return await libretranslate.translate(request, local_services(cards, run, {"max_num_seqs": 4}))
    c = TestClient(app)
    c.jobs = jobs
    return c


def test_libre_keep_reaches_the_job_as_json_and_as_repeated_form_fields(libre):
    r = libre.post("/translate", json={"q": "Ein ACME Pro.", "source": "de", "target": "en", "keep": ["ACME Pro"]})
    assert r.status_code == 200 and "X-Ignored-Fields" not in r.headers, r.text
    assert libre.jobs[-1].keep == ("ACME Pro",)
    r = libre.post("/translate", data={"q": "x", "source": "de", "target": "en", "keep": ["ACME Pro", "Multi30k"]})
    assert r.status_code == 200 and libre.jobs[-1].keep == ("ACME Pro", "Multi30k")


@pytest.mark.parametrize("keep, words", [(["  "], "keep[0]: must not be empty"), ("ACME", "must be a list"),
                                         (["x" * 201], "keep[0]: at most 200 characters"),
                                         (["t"] * 101, "at most 100 terms")])
def test_libre_bad_keep_is_400_naming_it(libre, keep, words):
    r = libre.post("/translate", json={"q": "x", "source": "de", "target": "en", "keep": keep})
    assert r.status_code == 400 and words in r.json()["error"], r.text
