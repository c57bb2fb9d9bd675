"""Serving an imported NLLB-200 / M2M100 model (service side of issue 47): its card lists every
language, the language graph picks it for any pair it serves (a bilingual model of the pair first,
as before), the translator puts the source-language token on each source and forces the target
token first, so that requests into different targets share the engine, and the text equals
transformers' ``generate`` + ``batch_decode`` on the same tiny random model (tests/tiny_multilingual.py),
alone and batched; then /v1/translate over HTTP: the family's codes, target_prefix, source_lang
auto, the 4xx of a language the model lacks or a target_prefix naming another language, and the
listings."""
from __future__ import annotations

import asyncio
import dataclasses
import functools

import httpx
import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

from conftest import build_tiny_checkpoint  # noqa: E402
from local_services import local_services  # noqa: E402
from model.convert import main as convert  # noqa: E402
from service.api.http import build_app  # noqa: E402
from service.engine import GenerationOptions  # noqa: E402
from service.pipeline import LanguageGraph  # noqa: E402
from service.protocol import ServiceError, StreamToken, TranslateJob  # noqa: E402
from service.replica import mapped_errors  # noqa: E402
from service.translator import Translator, model_card  # noqa: E402
from service.translator.config import TextConfig, TranslatorSettings  # noqa: E402
from tiny_model import one_thread  # noqa: F401,E402 (autouse fixture)
from tiny_multilingual import DE, make_dir  # noqa: E402

HF_CODES = {"nllb": {"de": "deu_Latn", "fr": "fra_Latn", "en": "eng_Latn"}, "m2m100": {"de": "de", "fr": "fr", "en": "en"},
            "mbart50": {"de": "de_DE", "fr": "fr_XX", "en": "en_XX"}}
N = 12          # transformers' max_new_tokens (the forced language token counted); the service's is N - 1
PLAIN = TranslatorSettings(text=TextConfig(protect_spans=False, truecase=False))   # the model sees the text as sent


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlsvc")
    out = {}
    for family in HF_CODES:
        d = make_dir(root / family, family)
        assert convert(["--from-transformers", str(d), "--out", str(root / f"{family}-ckpt")]) == 0
        out[family] = (d, root / f"{family}-ckpt")
    out["de-en"] = (None, build_tiny_checkpoint(root / "de-en", "de", "en", max_len=64))
    return out


@functools.lru_cache(maxsize=2)
def hf_loaded(d):
    return AutoModelForSeq2SeqLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)


def hf_text(d, family: str, texts: list[str], source: str, target: str, beam: int) -> list[str]:
    """transformers' text of each source (service codes) into target, ``max_new_tokens`` N."""
    hf, tok = hf_loaded(d)
    codes = HF_CODES[family]
    tok.src_lang = codes[source]
    forced = tok.get_lang_id(codes[target]) if family == "m2m100" else tok.convert_tokens_to_ids(codes[target])
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = hf.generate(**enc, forced_bos_token_id=forced, num_beams=beam, max_new_tokens=N)
    return tok.batch_decode(ids, skip_special_tokens=True)


def job(texts, target: str, source: str = "de", beam: int = 1, **kw) -> TranslateJob:
    return TranslateJob(list(texts), GenerationOptions(beam_size=beam, length_penalty=1.0, max_new_tokens=N - 1),
                        target_lang=target, source_lang=source, **kw)


@pytest.fixture(scope="module")
def served(ckpts):
    """Running translators of the NLLB and M2M100 imports (float32 linear layers), and their cards."""
    loop = asyncio.new_event_loop()
    translators = {}
    for family in HF_CODES:
        t = Translator(model_card(family, ckpts[family][1]), device="cpu", settings=PLAIN)
        loop.run_until_complete(t.reconfigure({"linear_dtype": "float32", "max_num_seqs": 64}))
        translators[family] = t
    yield loop, translators
    for t in translators.values():
        loop.run_until_complete(t.stop())
    loop.close()


def texts_of(response) -> list[str]:
    return [t.text for t in response.translations]


def test_card_lists_every_language_and_the_graph_prefers_direct_models(ckpts):
    card = model_card("nllb", ckpts["nllb"][1])
    assert card.lang_tokens and {"de", "fr", "en", "zh", "zho_Hant"} <= set(card.sources) == set(card.targets)
    assert card.aliases["deu_Latn"] == "de" and card.aliases["zho_Hant"] == "zho_Hant"
    bilingual = model_card("de-en", ckpts["de-en"][1])
    graph = LanguageGraph([bilingual, card], "en")
    assert graph.resolve(None, "de", "en").id == "de-en"              # the model of one pair first, as before
    assert graph.resolve(None, "de", "fr").id == "nllb"               # direct, not de-en + a second leg
    assert graph.resolve(None, "deu_Latn", "fra_Latn").id == "nllb"   # the family's codes
    assert graph.resolve(None, "fr", "zho_Hant").id == "nllb"
    assert graph.routes == {} and not graph.pivots                    # no pivot through a model of every pair
    assert ("fr", "de") in graph.pairs() and ("de", "de") not in graph.pairs()
    assert len(graph.pairs()) == len(card.sources) * (len(card.sources) - 1)
    assert "nllb" in graph.describe() and "any pair" in graph.describe()
    for src, tgt, field in (("xx", "fr", "source_lang"), ("de", "yy", "target_lang")):
        with pytest.raises(ServiceError) as e:
            graph.resolve("nllb", src, tgt)
        assert e.value.status == 422 and e.value.field == field and "zho_Hant" in e.value.message, e.value.message
    with pytest.raises(ServiceError) as e:     # a named family model needs both languages
        graph.resolve("nllb", None, "fr")
    assert e.value.status == 422 and e.value.field == "source_lang"
    # without a family model, the graph is as it was
    assert LanguageGraph([bilingual], "en").pairs() == [("de", "en")]


@pytest.mark.parametrize("family", list(HF_CODES))
@pytest.mark.parametrize("beam", [1, 4])
def test_translator_equals_transformers_alone_and_batched(served, ckpts, family, beam):
    """Every sentence into French and into English: one job per sentence (alone), one job of all
    (batched), and both targets' jobs at once (one engine batch): each text equals transformers'."""
    loop, translators = served
    t, d = translators[family], ckpts[family][0]
    sources = DE[:8]
    want = {tgt: hf_text(d, family, sources, "de", tgt, beam) for tgt in ("fr", "en")}
    assert want["fr"] != want["en"]
    steps = {}
    for tgt in ("fr", "en"):
        alone = [texts_of(loop.run_until_complete(t.translate(job([s], tgt, beam=beam))))[0] for s in sources]
        assert alone == want[tgt], (tgt, alone, want[tgt])
        before = t.engine.stats().steps
        assert texts_of(loop.run_until_complete(t.translate(job(sources, tgt, beam=beam)))) == want[tgt]
        steps[tgt] = t.engine.stats().steps - before

    async def both():
        return await asyncio.gather(*(t.translate(job(sources, tgt, beam=beam)) for tgt in ("fr", "en")))
    before = t.engine.stats().steps
    fr, en = loop.run_until_complete(both())
    assert (texts_of(fr), texts_of(en)) == (want["fr"], want["en"])
    assert t.engine.stats().steps - before < steps["fr"] + steps["en"]      # the two targets shared steps

    async def streamed():     # the stream's tokens and its closing response: the same text
        items = [x async for x in t.stream(job(sources[:2], "fr", beam=beam))]
        return "".join(x.text for x in items if isinstance(x, StreamToken) and x.index == 0), items[-1]
    first, final = loop.run_until_complete(streamed())
    assert texts_of(final) == want["fr"][:2] and first == want["fr"][0]


@pytest.fixture(scope="module")
def client(served, ckpts):
    """The native, LibreTranslate and DeepL APIs in this process over the NLLB and M2M100 translators
    and a bilingual de->en model card (never run here)."""
    loop, translators = served
    cards = [model_card("de-en", ckpts["de-en"][1])] + [t.card for t in translators.values()]

    async def run(model, job):
        with mapped_errors(model):      # as a replica answers: domain errors as ServiceError
            return await translators[model].translate(job)
    app = build_app(local_services(cards, run))
    return loop, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def post(client, path, **kw):
    loop, c = client
    return loop.run_until_complete(c.post(path, **kw))


def get(client, path, **kw):
    loop, c = client
    return loop.run_until_complete(c.get(path, **kw))


def test_v1_translate_with_the_family_codes_and_source_auto(client, served, ckpts):
    loop, translators = served
    want = hf_text(ckpts["nllb"][0], "nllb", DE[:4], "de", "fr", 1)
    for src, tgt in (("de", "fr"), ("deu_Latn", "fra_Latn"), ("DE", "fr-FR")):
        r = post(client, "/v1/translate", json={"text": DE[:4], "model": "nllb", "source_lang": src, "target_lang": tgt,
                                                "beam_size": 1, "max_new_tokens": N - 1})
        assert r.status_code == 200, r.text
        assert [t["text"] for t in r.json()["translations"]] == want, (src, tgt)
    r = post(client, "/v1/translate", json={"text": DE[:4], "model": "mbart50", "source_lang": "de_DE",
                                            "target_lang": "fr_XX", "beam_size": 1, "max_new_tokens": N - 1})
    assert [t["text"] for t in r.json()["translations"]] == hf_text(ckpts["mbart50"][0], "mbart50", DE[:4], "de", "fr", 1)
    # by languages alone: de -> fr is served by nllb (first in order among the family models), de -> en by de-en
    body = {"text": DE[:4], "source_lang": "de", "target_lang": "fr", "beam_size": 1, "max_new_tokens": N - 1}
    r = post(client, "/v1/translate", json=body)
    assert r.status_code == 200 and r.json()["model"] == "nllb"
    assert [t["text"] for t in r.json()["translations"]] == want
    # source_lang auto: detected German, routed to the model of the pair, the German token on each source
    r = post(client, "/v1/translate", json={**body, "source_lang": "auto", "text": DE[:3]})
    assert r.status_code == 200, r.text
    assert [t["text"] for t in r.json()["translations"]] == want[:3]
    assert {t["detected_language"] for t in r.json()["translations"]} == {"de"}


def test_v1_translate_target_prefix_comes_after_the_forced_token(client):
    body = {"text": DE[0], "model": "m2m100", "source_lang": "de", "target_lang": "fr", "beam_size": 1,
            "max_new_tokens": N - 1}
    free = post(client, "/v1/translate", json=body).json()["translations"][0]["text"]
    r = post(client, "/v1/translate", json={**body, "target_prefix": "Un homme"})
    assert r.status_code == 200, r.text
    text = r.json()["translations"][0]["text"]
    assert text.startswith("Un homme") and text != free
    same = post(client, "/v1/translate", json={**body, "target_prefix": "__fr__ Un homme"})   # the forced token, again
    assert same.json()["translations"][0]["text"] == text


@pytest.mark.parametrize("body, field, words", [
    ({"source_lang": "de", "target_lang": "xx"}, "target_lang", ["zho_Hant", "fr"]),
    ({"source_lang": "xx", "target_lang": "fr"}, "source_lang", ["zho_Hant", "de"]),
    ({"target_lang": "fr"}, "source_lang", ["name a source language", "zho_Hant"]),
    ({"source_lang": "de", "target_lang": "fr", "target_prefix": "eng_Latn Hello"}, "target_prefix", ["eng_Latn"]),
])
def test_v1_translate_bad_languages_are_4xx_naming_the_field_and_the_languages(client, body, field, words):
    r = post(client, "/v1/translate", json={"text": DE[0], "model": "nllb", **body})
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["field"] == field and all(w in err["message"] for w in words), err


def test_listings_show_every_language_of_the_model(client, served, ckpts):
    models = {m["id"]: m for m in get(client, "/v1/models").json()["data"]}
    card = model_card("nllb", ckpts["nllb"][1])
    assert set(models["nllb"]["source_langs"]) == set(card.sources) and set(models["nllb"]["target_langs"]) == set(card.targets)
    assert models["de-en"]["source_langs"] == ["de"] and models["de-en"]["target_langs"] == ["en"]
    libre = {x["code"]: x["targets"] for x in get(client, "/languages").json()}
    assert {"fr", "en", "zho_Hant"} <= set(libre["de"]) and "de" in libre["zho_Hant"] and "de" not in libre["de"]
    deepl_src = {x["language"] for x in get(client, "/v2/languages", params={"type": "source"}).json()}
    assert {"DE", "FR", "EN", "ZH"} <= deepl_src
    loop, translators = served
    t = translators["nllb"]

    def direct(options: GenerationOptions) -> str:
        return texts_of(loop.run_until_complete(t.translate(TranslateJob([DE[0]], options, target_lang="fr",
                                                                         source_lang="de"))))[0]
    r = post(client, "/translate", json={"q": DE[0], "source": "de", "target": "fr"})     # de -> fr: nllb's
    assert r.status_code == 200, r.text
    assert r.json()["translatedText"] == direct(GenerationOptions(beam_size=4, n_best=1, length_penalty=1.0))
    r = post(client, "/v2/translate", json={"text": [DE[0]], "source_lang": "DE", "target_lang": "FR"})
    assert r.status_code == 200, r.text
    assert r.json()["translations"][0]["text"] == direct(GenerationOptions())
    spec = get(client, "/openapi.json").json()
    assert len(str(spec)) < 2_000_000


def test_the_pool_knows_a_family_models_size_before_loading(ckpts, tmp_path):
    """Before its first load the pool counts an imported model's float32 weights, read from the
    safetensors header (the parameters the loaded model holds); a bilingual model stays unknown (0)
    until loaded, as before; ``pool.models_dir`` finds the converted checkpoint."""
    import shutil
    import types

    from model.load import load_model
    from service.pool import Pool, discover_models, weights_bytes
    model, _, _ = load_model(ckpts["nllb"][1], pack=False)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert weights_bytes(ckpts["nllb"][1]) == params
    cards = [model_card("nllb", ckpts["nllb"][1]), model_card("de-en", ckpts["de-en"][1])]
    pool = types.SimpleNamespace(cards={c.id: c for c in cards}, _sizes={})   # a Pool's state before any load
    assert Pool.cards_bytes(pool, "nllb") == params and Pool.cards_bytes(pool, "de-en") == 0
    shutil.copytree(ckpts["nllb"][1], tmp_path / "nllb-tiny")
    assert list(discover_models(tmp_path)) == ["nllb-tiny"]


def test_controls_work_on_a_family_model(client):
    """glossary and glossary_id (its target term in the text: the constrained search after the
    forced language token), alignment and attention (shapes of the tokens returned), min_confidence on /v1/translate."""
    body = {"text": "Zwei Hunde spielen im Schnee.", "model": "nllb", "source_lang": "de", "target_lang": "fr",
            "max_new_tokens": N - 1}
    r = post(client, "/v1/translate", json={**body, "glossary": [{"source": "Hunde", "target": "chiens"}]})
    assert r.status_code == 200, r.text
    assert "chiens" in r.json()["translations"][0]["text"]
    stored = {"name": "hunde", "source_lang": "de", "target_lang": "fr", "entries": [{"source": "Hunde", "target": "chiens"}]}
    assert post(client, "/v1/glossaries", json=stored).status_code == 201
    r = post(client, "/v1/translate", json={**body, "glossary_id": "hunde"})      # a stored glossary of the pair
    assert r.status_code == 200, r.text
    assert "chiens" in r.json()["translations"][0]["text"]
    r = post(client, "/v1/translate", json={**body, "return_alignment": True, "return_attention": True,
                                            "min_confidence": 0.5})
    assert r.status_code == 200, r.text
    tr = r.json()["translations"][0]
    assert tr["alignment"] and all(0 <= s < len(tr["source_tokens"]) and 0 <= t < len(tr["tokens"])
                                   for s, t in tr["alignment"])
    cross = tr["attention"]["cross"][0][0]         # layer 0, head 0: [len(tokens)][len(source_tokens)]
    assert len(cross) == len(tr["tokens"]) and all(len(row) == len(tr["source_tokens"]) for row in cross)
    assert tr["source_tokens"][0] == "deu_Latn" and isinstance(tr["low_confidence"], bool)


def test_openapi_stays_small_for_a_200_language_model(ckpts):
    """A model of 200 languages (40,000 pairs) adds one schema branch of enums per request body, not
    one per pair: the document grows by about its language lists, not by pairs."""
    import json
    bilingual = model_card("de-en", ckpts["de-en"][1])
    nllb = model_card("nllb", ckpts["nllb"][1])
    langs = tuple(f"l{i:03d}" for i in range(200))
    big = dataclasses.replace(nllb, source_languages=langs, target_languages=langs, aliases={})

    def size(cards) -> int:
        async def fetch():
            app = build_app(local_services(cards, None))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return (await c.get("/openapi.json")).json()
        return len(json.dumps(asyncio.run(fetch())))
    base, grown = size([bilingual]), size([bilingual, big])
    assert grown - base < 1_000 * 200, (base, grown)    # linear in languages (3.6 MB when GlossaryCreate had a branch per pair)
