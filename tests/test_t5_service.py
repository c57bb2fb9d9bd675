"""Serving an imported T5 / MADLAD-400 model: the translator (continuous-batching engine, paged KV
cache, CPU) puts the request's target as the ``<2xx>`` tag at the start of each source, and its text
equals transformers' ``generate`` + ``batch_decode`` on ``"<2xx> " + text``, greedy and beam 4, with
French and English jobs in the engine at once; a target the model lacks is a 422 naming target_lang.
Over HTTP: source_lang auto, inline and stored glossaries (/v1/translate, LibreTranslate, DeepL) and
target_prefix (transformers' ``decoder_input_ids``; a ``<2xx>`` tag in it is the source's)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

pytest.importorskip("transformers")
from conftest import build_tiny_checkpoint
from local_services import local_services
from test_multilingual_parity import SOURCE
from tiny_model import one_thread  # noqa: F401 (autouse fixture)
from tiny_t5 import make_t5_dir
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from model.convert import main as convert
from service.api.http import build_app
from service.engine import GenerationOptions
from service.pipeline import LanguageGraph
from service.pool import weights_bytes
from service.protocol import InvalidRequest, TranslateJob
from service.replica import mapped_errors
from service.translator import Translator, model_card
from service.translator.config import TextConfig, TranslatorSettings

N = 24          # max_new_tokens, as transformers counts them
PLAIN = TranslatorSettings(text=TextConfig(protect_spans=False, truecase=False))   # the model sees the text as sent


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5svc")
    d = make_t5_dir(root / "t5", "t5", seed=0)
    assert convert(["--from-transformers", str(d), "--out", str(root / "ckpt")]) == 0
    card = model_card("madlad", root / "ckpt")
    loop = asyncio.new_event_loop()
    t = Translator(card, device="cpu", settings=PLAIN)
    loop.run_until_complete(t.reconfigure({"linear_dtype": "float32", "max_num_seqs": 64}))
    bilingual = model_card("de-en", build_tiny_checkpoint(root / "de-en", "de", "en", max_len=64))
    yield d, card, loop, t, bilingual
    loop.run_until_complete(t.stop())
    loop.close()


def hf_text(d, texts, target: str, beam: int) -> list[str]:
    hf, tok = AutoModelForSeq2SeqLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)
    enc = tok([f"<2{target}> {s}" for s in texts], return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = hf.generate(**enc, num_beams=beam, max_new_tokens=N)
    return tok.batch_decode(ids, skip_special_tokens=True)


def job(texts, target: str, beam: int) -> TranslateJob:
    return TranslateJob(list(texts), GenerationOptions(beam_size=beam, length_penalty=1.0, max_new_tokens=N),
                        target_lang=target)


@pytest.mark.parametrize("beam", [1, 4])
def test_translator_equals_transformers_two_targets_at_once(served, beam):
    d, card, loop, t, _ = served
    assert card.targets == ("de", "en", "fr")
    want = {tgt: hf_text(d, SOURCE, tgt, beam) for tgt in ("fr", "en")}
    assert want["fr"] != want["en"]

    async def both():
        return await asyncio.gather(*(t.translate(job(SOURCE, tgt, beam)) for tgt in ("fr", "en")))

    fr, en = loop.run_until_complete(both())
    assert [x.text for x in fr.translations] == want["fr"]
    assert [x.text for x in en.translations] == want["en"]
    alone = loop.run_until_complete(t.translate(job(SOURCE[3:4], "fr", beam)))
    assert [x.text for x in alone.translations] == want["fr"][3:4]


def test_unknown_target_is_a_422(served):
    _, _, loop, t, _ = served
    with pytest.raises(InvalidRequest) as e:
        loop.run_until_complete(t.translate(job(SOURCE[:1], "xx", 1)))
    assert e.value.status == 422 and e.value.field == "target_lang" and "fr" in e.value.message, e.value.message


@pytest.fixture(scope="module")
def client(served):
    """``call(method, path, **kw)``: the APIs in this process over the T5 model beside a bilingual
    de->en card (never run)."""
    d, card, loop, t, bilingual = served

    async def run(model, job):
        with mapped_errors(model):
            return await t.translate(job)
    c = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(local_services([bilingual, card], run))),
                          base_url="http://t")
    yield lambda method, path, **kw: loop.run_until_complete(c.request(method, path, **kw))
    loop.run_until_complete(c.aclose())


def test_graph_and_http(served, client):
    """Beside a bilingual de->en model: the graph serves every other pair of the model's languages
    by it (de->en stays the bilingual model's); the pool sizes it before loading; /v1/translate de->fr gives transformers' text;
    /languages lists the pairs; an unknown target is a 4xx naming target_lang."""
    d, card, loop, t, bilingual = served
    graph = LanguageGraph([bilingual, card], "en")
    assert graph.resolve(None, "de", "en").id == "de-en"
    assert {graph.resolve(None, s, g).id for s, g in (("de", "fr"), ("en", "fr"), ("fr", "de"))} == {"madlad"}
    assert weights_bytes(card.checkpoint) == 4 * t.model.num_parameters()     # the pool's size before a load
    body = {"text": SOURCE[:4], "source_lang": "de", "target_lang": "fr", "beam_size": 1, "max_new_tokens": N}
    r = client("POST", "/v1/translate", json=body)
    assert r.status_code == 200 and r.json()["model"] == "madlad", r.text
    assert [x["text"] for x in r.json()["translations"]] == hf_text(d, SOURCE[:4], "fr", 1)
    libre = {x["code"]: x["targets"] for x in client("GET", "/languages").json()}
    assert set(libre["de"]) == {"en", "fr"} and set(libre["fr"]) == {"de", "en"}
    r = client("POST", "/v1/translate", json={**body, "model": "madlad", "target_lang": "xx"})
    assert 400 <= r.status_code < 500 and r.json()["error"]["field"] == "target_lang", r.text


def hf_prefixed(d, text: str, target: str, prefix: str) -> str:
    """transformers' greedy text of ``text`` into target, its decoder started with ``prefix``'s pieces."""
    hf, tok = AutoModelForSeq2SeqLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)
    enc = tok([f"<2{target}> {text}"], return_tensors="pt")
    start = torch.tensor([[hf.config.decoder_start_token_id] + tok(prefix, add_special_tokens=False).input_ids])
    with torch.no_grad():
        ids = hf.generate(**enc, decoder_input_ids=start, num_beams=1, max_new_tokens=N)
    return tok.batch_decode(ids, skip_special_tokens=True)[0]


def test_source_auto_glossaries_and_target_prefix_over_http(served, client):
    """source_lang auto: German detected, routed to the T5 model, the text transformers'; an inline
    glossary and a stored one (/v1/translate's glossary_id, LibreTranslate's and DeepL's) put the
    target term in the text; target_prefix starts the decoder as transformers' decoder_input_ids do
    (a leading tag of the target dropped; another tag a 422 naming target_prefix)."""
    d = served[0]
    body = {"text": SOURCE[:3], "source_lang": "auto", "target_lang": "fr", "beam_size": 1, "max_new_tokens": N}
    r = client("POST", "/v1/translate", json=body)
    assert r.status_code == 200, r.text
    assert [x["text"] for x in r.json()["translations"]] == hf_text(d, SOURCE[:3], "fr", 1)
    assert {x["detected_language"] for x in r.json()["translations"]} == {"de"}
    dogs = {"text": "Zwei Hunde spielen im Schnee.", "source_lang": "de", "target_lang": "fr", "max_new_tokens": N}
    assert "chiens" not in client("POST", "/v1/translate", json=dogs).json()["translations"][0]["text"]
    entries = [{"source": "Hunde", "target": "chiens"}]
    r = client("POST", "/v1/translate", json={**dogs, "glossary": entries})
    assert r.status_code == 200 and "chiens" in r.json()["translations"][0]["text"], r.text
    stored = {"name": "t5-hunde", "source_lang": "de", "target_lang": "fr", "entries": entries}
    assert client("POST", "/v1/glossaries", json=stored).status_code == 201
    r = client("POST", "/v1/translate", json={**dogs, "glossary_id": "t5-hunde"})
    assert r.status_code == 200 and "chiens" in r.json()["translations"][0]["text"], r.text
    r = client("POST", "/translate", json={"q": dogs["text"], "source": "de", "target": "fr", "glossary_id": "t5-hunde"})
    assert r.status_code == 200 and "chiens" in r.json()["translatedText"], r.text
    r = client("POST", "/v2/translate", json={"text": [dogs["text"]], "source_lang": "DE", "target_lang": "FR",
                                              "glossary_id": "t5-hunde"})
    assert r.status_code == 200 and "chiens" in r.json()["translations"][0]["text"], r.text
    prefixed = {**dogs, "beam_size": 1, "target_prefix": "Deux chiens"}
    r = client("POST", "/v1/translate", json=prefixed)
    assert r.status_code == 200, r.text
    text = r.json()["translations"][0]["text"]
    assert text.startswith("Deux chiens") and text == hf_prefixed(d, dogs["text"], "fr", "Deux chiens")
    r = client("POST", "/v1/translate", json={**prefixed, "target_prefix": "<2fr> Deux chiens"})   # the target's tag: dropped
    assert r.status_code == 200 and r.json()["translations"][0]["text"] == text, r.text
    for prefix in ("<2en> Deux", "Deux <2fr>"):     # a tag is the source's: never the decoder's
        r = client("POST", "/v1/translate", json={**prefixed, "target_prefix": prefix})
        assert r.status_code == 422 and r.json()["error"]["field"] == "target_prefix", r.text
        assert "<2fr>" in r.json()["error"]["message"]
