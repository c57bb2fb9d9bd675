"""The shipped French models (model/checkpoints/en-fr and fr-en, #35) through HTTP: the gateway
with its translators in this process behind FastAPI's TestClient (tests/test_pivot.py's
``gateway_client``) serving every shipped checkpoint as the default config does. Each direction
translates Multi30k test sentences at a real BLEU, and German<->French goes through English, equal to
the two legs run one after the other."""
from __future__ import annotations

import pytest
import sacrebleu

from conftest import DATA
from model.checkpoint import SHIPPED_CHECKPOINTS
from model.tokenizer import read_lines
from service.translator import model_card
from test_pivot import gateway_client, ok


def shipped(name: str) -> bool:
    return (SHIPPED_CHECKPOINTS[name] / "model.safetensors").exists()


FRENCH = [m for m in ("en-fr", "fr-en") if shipped(m)]
pytestmark = pytest.mark.skipif(not (FRENCH and shipped("de-en") and shipped("en-de")),
                                reason="no shipped French model in this checkout")
N = 40    # the first N sentences of test_2016_flickr (the full-set BLEU is in each metadata.json)
TEXT = {lang: read_lines(DATA / f"test_2016_flickr.{lang}.gz")[:N] for lang in ("de", "en", "fr")}


@pytest.fixture(scope="module")
def client():
    from service.app import shipped_models
    cards = [model_card(m.name, m.checkpoint) for m in shipped_models()]
    # the compiled kernels and room for 16 beam-4 sentences, as a replica has (the eager int8 path with
    # 8 slots took a minute here)
    with gateway_client(cards, engine={"max_num_seqs": 64, "cpu_kernels": True}) as c:
        yield c


@pytest.mark.parametrize("source, target, min_bleu", [("en", "fr", 40.0), ("fr", "en", 35.0)])
def test_each_french_model_translates_at_a_real_bleu(client, source, target, min_bleu):
    if f"{source}-{target}" not in FRENCH:
        pytest.skip(f"{source}-{target} is not shipped")
    got = ok(client, {"text": TEXT[source], "source_lang": source, "target_lang": target, "beam_size": 4})
    assert got["model"] == f"{source}-{target}"
    hyps = [t["text"] for t in got["translations"]]
    bleu = sacrebleu.corpus_bleu(hyps, [TEXT[target]]).score
    assert bleu >= min_bleu, (bleu, hyps[:3])
    # LibreTranslate's route gives the same text
    libre = ok(client, {"q": TEXT[source][:3], "source": source, "target": target}, "/translate")
    greedy = ok(client, {"text": TEXT[source][:3], "source_lang": source, "target_lang": target})
    assert libre["translatedText"] == [t["text"] for t in greedy["translations"]]


@pytest.mark.parametrize("source, target, legs", [("de", "fr", ["de-en", "en-fr"]), ("fr", "de", ["fr-en", "en-de"])])
def test_german_french_goes_through_english(client, source, target, legs):
    if legs[0] not in ("de-en", *FRENCH) or legs[1] not in ("en-de", *FRENCH):
        pytest.skip(f"{' or '.join(legs)} is not shipped")
    texts = TEXT[source][:8]
    got = ok(client, {"text": texts, "source_lang": source, "target_lang": target, "beam_size": 2})
    first = ok(client, {"text": texts, "source_lang": source, "target_lang": "en", "beam_size": 2})
    second = ok(client, {"text": [t["text"] for t in first["translations"]], "source_lang": "en",
                         "target_lang": target, "beam_size": 2})
    assert got["model"] == "+".join(legs) and all(t["path"] == legs for t in got["translations"])
    assert [t["text"] for t in got["translations"]] == [t["text"] for t in second["translations"]]
    assert sacrebleu.corpus_bleu([t["text"] for t in got["translations"]], [TEXT[target][:8]]).score > 15


def test_languages_list_french_both_ways(client):
    langs = {x["code"]: x for x in client.get("/languages").json()}
    assert {"de", "en"} <= set(langs)
    if "en-fr" in FRENCH:
        assert sorted(langs["de"]["targets"]) == ["en", "fr"] and langs["de"]["via"] == {"fr": "en"}
        assert sorted(langs["en"]["targets"]) == ["de", "fr"] and "via" not in langs["en"]
    if "fr-en" in FRENCH:
        assert sorted(langs["fr"]["targets"]) == ["de", "en"] and langs["fr"]["via"] == {"de": "en"}
    detected = ok(client, {"q": TEXT["fr"][0]}, "/detect")
    assert detected[0]["language"] == "fr" and 0 < detected[0]["confidence"] <= 100
