"""Imported MarianMT (OPUS-MT) models over HTTP, served beside de-en: a tiny random MarianMT directory
named directly as a served model's checkpoint, and a tiny multilingual one (``>>xx<<`` target tokens)
converted with ``model.convert``. Both are built at test time (tests/tiny_marian.py) and served by a
second small app (``ingress: translator``, one process) on the shared Ray instance, under /marian.
Routing by model id and by languages, GET /v1/models and /languages, attention shapes, streaming,
the target-language token and the 4xx naming the choices; model cards in-process."""
from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

pytest.importorskip("transformers")
from conftest import post, sse_events, translate  # noqa: E402
from model.load import load_model  # noqa: E402
from model.interop.marian import convert_marian, marian_config  # noqa: E402
from model.inference.generate import generate  # noqa: E402
from model.tokenizer import encode_source  # noqa: E402
from service.translator import model_card  # noqa: E402
from tiny_marian import DE, make_marian_dir  # noqa: E402

TARGETS = ("fra", "ita")
PREFIX = "/marian"
# No numbers or URLs: the model sees each sentence as it is. Random weights with a likely EOS: these
# are sentences whose greedy outputs are not empty (checked against generate() below).
SINGLE = [DE[3], DE[6]]               # opus-tiny (seed 4): the attention test's text
MULTI = [DE[0], DE[2], DE[3]]         # opus-multi (seed 2), to either target
ALL_KINDS = {"kinds": ["cross", "encoder", "decoder"]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("opus")
    single = make_marian_dir(root / "opus-tiny", seed=4)
    multi = convert_marian(make_marian_dir(root / "opus-multi-src", seed=2, target_languages=TARGETS),
                           root / "opus-multi")
    return {"opus-tiny": single, "opus-multi": multi}


@pytest.fixture(scope="module")
def url(service_info, dirs):
    """Base URL of an app serving de-en, opus-tiny (the MarianMT directory) and opus-multi (converted)."""
    from ray import serve

    from service.app import build_app
    models = [{"name": "de-en", "checkpoint": service_info.models["de-en"]}]
    models += [{"name": name, "checkpoint": str(d)} for name, d in dirs.items()]
    serve.run(build_app({"models": models, "ingress": "translator", "num_cpus": 0.1}), name="marian",
              route_prefix=PREFIX, blocking=False)
    base = service_info.url + PREFIX
    deadline = time.time() + 120
    while httpx.get(base + "/readyz", timeout=10).status_code != 200:
        assert time.time() < deadline, "the MarianMT app did not become ready within 120 s"
        time.sleep(0.5)
    yield base
    serve.delete("marian")


@pytest.fixture(scope="module")
def offline(dirs):
    """Each imported model loaded here as the service loads it (same linear layers)."""
    return {name: load_model(d)[:2] for name, d in dirs.items()}


def expected(offline, name: str, text: str, target_lang=None, max_new: int = 8) -> tuple[list[str], list[str]]:
    """(source pieces, greedy target pieces) of text, by model.tokenizer.encode_source and generate."""
    model, tok = offline[name]
    src = encode_source(tok, text, model.cfg.max_len, target_lang)
    out = generate(model, [src], beam_size=1, max_new_tokens=max_new)[0][0].tokens
    return tok.pieces(src), tok.pieces([t for t in out if t != tok.eos_id])


@pytest.mark.slow
def test_models_and_languages_list_the_targets(url, dirs):
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert list(models) == ["de-en", "opus-tiny", "opus-multi"]
    assert (models["de-en"]["target_lang"], models["de-en"]["target_langs"]) == ("en", ["en"])
    assert (models["opus-tiny"]["source_lang"], models["opus-tiny"]["target_langs"]) == ("de", ["en"])
    assert (models["opus-multi"]["target_lang"], models["opus-multi"]["target_langs"]) == (None, list(TARGETS))
    hf = json.loads((dirs["opus-tiny"] / "config.json").read_text())     # transformers' config, read as ours
    cfg = models["opus-tiny"]["config"]
    assert (cfg["d_model"], cfg["n_heads"], cfg["n_decoder_layers"]) == (hf["d_model"], hf["decoder_attention_heads"],
                                                                          hf["decoder_layers"])
    assert cfg["sinusoid_layout"] == "split" and cfg["activation"] == "swish"
    langs = {lang["code"]: lang["targets"] for lang in httpx.get(url + "/languages").json()}
    assert langs["de"] == sorted({"en", *TARGETS}) and all(langs[t] == [] for t in TARGETS)


@pytest.mark.slow
def test_routing_by_model_and_by_languages(url, offline):
    # sentences the random model does not end at once (which ones depends on the CPU's int8 weights)
    single = [text for text in DE if expected(offline, "opus-tiny", text)[1]][:2]
    assert single
    for text in single:
        got = translate(url, text, model="opus-tiny", source_lang="de", beam_size=1, max_new_tokens=8)
        tr = got["translations"][0]
        assert got["model"] == "opus-tiny" and tr["tokens"]
        assert (tr["source_tokens"], tr["tokens"]) == expected(offline, "opus-tiny", text)
    outputs = {}
    for lang in TARGETS:
        got = translate(url, MULTI, source_lang="de", target_lang=lang, beam_size=1, max_new_tokens=8)
        assert got["model"] == "opus-multi"
        for text, tr in zip(MULTI, got["translations"]):
            assert tr["source_tokens"][0] == f">>{lang}<<" and tr["tokens"]
            assert (tr["source_tokens"], tr["tokens"]) == expected(offline, "opus-multi", text, lang)
        outputs[lang] = [tr["tokens"] for tr in got["translations"]]
    assert outputs["fra"] != outputs["ita"]                            # the token steers the output
    assert translate(url, MULTI[0], source_lang="de", target_lang="en", max_new_tokens=3)["model"] == "de-en"
    assert translate(url, MULTI[0], source_lang="de", max_new_tokens=3)["model"] == "de-en"   # one target first


@pytest.mark.slow
def test_attention_shapes_follow_the_tiny_model(url, dirs, offline):
    hf = json.loads((dirs["opus-tiny"] / "config.json").read_text())
    layers, heads = hf["decoder_layers"], hf["decoder_attention_heads"]
    body = translate(url, " ".join(SINGLE), model="opus-tiny", beam_size=2, max_new_tokens=6, min_new_tokens=2,
                     return_attention=True, attention=ALL_KINDS)
    tr = body["translations"][0]
    T, S = len(tr["tokens"]), len(tr["source_tokens"])
    assert T >= 4 and tr["source_tokens"].count("</s>") == 2          # two sentences, block-diagonal
    for kind, shape in (("cross", (T, S)), ("encoder", (S, S)), ("decoder", (T, T))):
        att = tr["attention"][kind]
        assert (len(att), len(att[0])) == (layers, heads), kind
        assert all(len(m) == shape[0] and all(len(row) == shape[1] for row in m) for layer in att for m in layer)


@pytest.mark.slow
def test_empty_translations_with_attention(url, offline):
    """A sentence whose first token is EOS, and max_new_tokens 0: a 200 with no tokens, not a 500."""
    assert expected(offline, "opus-tiny", DE[0])[1] == []                # EOS first
    for fields in ({"beam_size": 1}, {"max_new_tokens": 0}):
        body = translate(url, DE[0], model="opus-tiny", return_attention=True, attention=ALL_KINDS, **fields)
        tr = body["translations"][0]
        assert tr["tokens"] == [] and tr["text"] == "" and set(tr["attention"]) == set(ALL_KINDS["kinds"])


@pytest.mark.slow
def test_streaming_deltas_equal_the_final_text(url):
    body = {"text": [MULTI[0], " ".join(MULTI[1:])], "model": "opus-multi", "target_lang": "ita",
            "beam_size": 2, "max_new_tokens": 8, "min_new_tokens": 2, "stream": True}
    with httpx.stream("POST", url + "/v1/translate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = sse_events(text)
    assert events[-1][0] == "response"
    final = events[-1][1]["translations"]
    deltas = ["", ""]
    for kind, data in events[:-1]:
        assert kind == "token"
        deltas[data["index"]] += data["text"]
    assert deltas == [t["text"] for t in final] and all(t["source_tokens"][0] == ">>ita<<" for t in final)
    assert all(t["text"] for t in final)
    plain = translate(url, body["text"], model="opus-multi", target_lang="ita", beam_size=2, max_new_tokens=8,
                      min_new_tokens=2)
    assert [t["tokens"] for t in plain["translations"]] == [t["tokens"] for t in final]


@pytest.mark.slow
@pytest.mark.parametrize("fields, status, field", [
    ({"model": "opus-multi"}, 422, "target_lang"),                       # missing target
    ({"model": "opus-multi", "target_lang": "spa"}, 422, "target_lang"),   # unknown target
    ({"model": "opus-multi", "source_lang": "en", "target_lang": "fra"}, 404, "source_lang"),
    ({"source_lang": "de", "target_lang": "spa"}, 404, "target_lang"),  # no model knows it: the pairs
])
def test_missing_or_unknown_target_names_the_choices(url, fields, status, field):
    r = post(url, {"text": "Hallo.", **fields})
    err = r.json()["error"]
    assert (r.status_code, err["field"]) == (status, field), r.text
    assert all(t in err["message"] for t in TARGETS), err["message"]


@pytest.mark.slow
def test_libretranslate_picks_the_target_token(url):
    r = httpx.post(url + "/translate", json={"q": MULTI, "source": "de", "target": "fra"}, timeout=60)
    native = translate(url, MULTI, model="opus-multi", target_lang="fra")   # beam 4, as /translate
    assert r.status_code == 200 and r.json()["translatedText"] == [t["text"] for t in native["translations"]]
    assert any(r.json()["translatedText"])
    r = httpx.post(url + "/translate", json={"q": MULTI[0], "source": "de", "target": "spa"}, timeout=60)
    assert r.status_code == 400 and all(t in r.json()["error"] for t in TARGETS), r.text


# ---- cards, in-process ------------------------------------------------------------------------------
def test_cards_read_the_targets_without_the_weights(dirs, tmp_path):
    """A MarianMT directory's card equals its converted checkpoint's, from JSON files alone."""
    src = dirs["opus-multi"].parent / "opus-multi-src"
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "vocab.json", "tokenizer_config.json"):    # no weights, no spm
        shutil.copy(src / name, bare / name)
    direct, converted = model_card("m", bare), model_card("m", dirs["opus-multi"])
    assert direct.target_languages == converted.target_languages == TARGETS
    assert direct.config == converted.config == marian_config(json.loads((src / "config.json").read_text()))
    assert (direct.source_lang, direct.targets, direct.pair) == ("de", TARGETS, "de->fra|ita")
    with pytest.raises(ValueError, match="one of fra, ita"):
        direct.check_target(None)
    single = model_card("s", dirs["opus-tiny"])
    assert (single.target_languages, single.targets) == ((), ("en",))
    single.check_target("xx")        # one target: routing has matched it, nothing to check here
