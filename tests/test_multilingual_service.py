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
from service.protocol import ServiceError, TranslateJob  # noqa: E402
from service.translator import Translator, model_card  # noqa: E402
from service.translator.config import TextConfig, TranslatorSettings  # noqa: E402
from tiny_model import one_thread  # noqa: F401,E402 (autouse fixture)
from tiny_multilingual import DE, make_dir  # noqa: E402

HF_CODES = {"nllb": {"de": "deu_Latn", "fr": "fra_Latn", "en": "eng_Latn"}, "m2m100": {"de": "de", "fr": "fr", "en": "en"}}
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
    for tgt in ("fr", "en"):
        alone = [texts_of(loop.run_until_complete(t.translate(job([s], tgt, beam=beam))))[0] for s in sources]
        assert alone == want[tgt], (tgt, alone, want[tgt])
        assert texts_of(loop.run_until_complete(t.translate(job(sources, tgt, beam=beam)))) == want[tgt]

    async def both():
        return await asyncio.gather(*(t.translate(job(sources, tgt, beam=beam)) for tgt in ("fr", "en")))
    fr, en = loop.run_until_complete(both())
    assert (texts_of(fr), texts_of(en)) == (want["fr"], want["en"])
