"""Imported NLLB-200, M2M100 and mBART-50 models translate as they do in transformers
(model/interop/multilingual.py, model/lang_tokenizer.py, the one network's pre-LN / fairseq-sinusoid /
learned-offset / layernorm_embedding flags, the forced target-language token): tiny random models
built at test time by transformers in the published layout (tests/tiny_multilingual.py), imported
with ``python -m model.convert --from-transformers`` and translated with ``python -m model.translate
--source-lang de --target-lang fr|en`` as a user would, against ``generate(forced_bos_token_id=...)``
+ ``batch_decode(skip_special_tokens=True)``: the same text for 20 sentences into two target
languages, greedy and beam 4, at the length cap and before it; and both targets mixed in one batch.
Then what the import refuses, in one line naming the file and field."""
from __future__ import annotations

import functools
import io
import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

from model import translate  # noqa: E402
from model.checkpoint import load_metadata  # noqa: E402
from model.convert import main as convert  # noqa: E402
from model.inference import settings  # noqa: E402
from model.inference.generate import generate  # noqa: E402
from model.inference.linear import pack_for_inference  # noqa: E402
from model.load import load_model  # noqa: E402
from tiny_model import one_thread  # noqa: F401,E402 (autouse fixture)
from tiny_multilingual import DE, make_dir  # noqa: E402

SOURCE = DE + ["Das Wetter ist heute schön.", "Wir fahren morgen nach Berlin.", "Ich trinke gern Kaffee.",
               "Die Katze schläft auf dem Sofa.", "Im Garten blühen die Rosen.", "Er spielt Gitarre in einer Band.",
               "Der Zug hat zehn Minuten Verspätung.", "Sie kauft Brot beim Bäcker.", "Das Museum ist montags zu.",
               "Ein Vogel singt im Baum."]
FAMILIES = {   # family -> (service codes of German, French, English; transformers' codes of the same)
    "nllb": (("de", "fr", "en"), ("deu_Latn", "fra_Latn", "eng_Latn")),
    "m2m100": (("de", "fr", "en"), ("de", "fr", "en")),
    "mbart50": (("de", "fr", "en"), ("de_DE", "fr_XX", "en_XX")),
}
CAP, LONG = 8, 40


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multilingual")
    return {f: make_dir(root / f, f) for f in FAMILIES}


@functools.lru_cache(maxsize=4)
def hf_loaded(d):
    return AutoModelForSeq2SeqLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)


def lang_id(family: str, hf_tok, code: str) -> int:
    return hf_tok.convert_tokens_to_ids(hf_tok.get_lang_token(code) if family == "m2m100" else code)


def hf_reference(d, family: str, texts, targets: list[str], beam: int, max_new_tokens: int,
                 lengths: list | None = None) -> list[str]:
    """transformers' text of each source (German) into its own target language (its codes): one
    generate() call per target language (the target token is one per call there). ``lengths``
    collects each output's generated tokens before EOS (the language token included)."""
    hf, tok = hf_loaded(d)
    tok.src_lang = FAMILIES[family][1][0]
    out = [""] * len(texts)
    for code in sorted(set(targets)):
        idx = [i for i, t in enumerate(targets) if t == code]
        enc = tok([texts[i] for i in idx], return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = hf.generate(**enc, forced_bos_token_id=lang_id(family, tok, code), num_beams=beam,
                              max_new_tokens=max_new_tokens)
        for i, text in zip(idx, tok.batch_decode(ids, skip_special_tokens=True)):
            out[i] = text
        if lengths is not None:
            lengths += [row[1:].index(2) if 2 in row[1:] else len(row) - 1 for row in ids.tolist()]
    return out


def float32_linear(monkeypatch) -> None:
    monkeypatch.setattr(settings, "_current", settings.InferenceSettings(linear_dtype="float32"))


def cli_translate(checkpoint, texts, target: str, beam: int, n: int, monkeypatch, capsys) -> list[str]:
    float32_linear(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(texts) + "\n"))
    capsys.readouterr()
    translate.main(["--checkpoint", str(checkpoint), "--source-lang", "de", "--target-lang", target,
                    "--beam-size", str(beam), "--max-new-tokens", str(n)])
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cli_import_translates_as_transformers(dirs, family, tmp_path, monkeypatch, capsys):
    """Imported by ``model.convert --from-transformers`` and translated by ``model.translate``: every
    line equals transformers' text, into French and English, greedy and beam 4, at the cap (EOS
    forced after cap - 1 tokens, the language token counted) and before it."""
    d, out = dirs[family], tmp_path / "ckpt"
    assert convert(["--from-transformers", str(d), "--out", str(out)]) == 0
    assert "weights stored as float32 (source: float32)" in capsys.readouterr().out
    meta = load_metadata(out)
    assert meta["generation"]["forced_eos"] is True and meta["generation"]["num_beams"] == 5
    assert {"de", "fr", "en"} <= set(meta["target_languages"])
    reached_cap = ended_early = 0
    for beam in (1, 4):
        for n in (CAP, LONG):
            for service, code in zip(FAMILIES[family][0][1:], FAMILIES[family][1][1:]):
                lengths = []
                want = hf_reference(d, family, SOURCE, [code] * len(SOURCE), beam, n, lengths)
                assert cli_translate(out, SOURCE, service, beam, n, monkeypatch, capsys) == want, (beam, n, service)
                assert all(x <= n - 1 for x in lengths)
                reached_cap += sum(x == n - 1 for x in lengths)        # the forced EOS ends them
                ended_early += sum(x < n - 1 for x in lengths)
    assert reached_cap >= 20 and ended_early >= 20


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_targets_in_one_batch(dirs, family, monkeypatch):
    """French and English targets alternating in ONE generate() batch (the forced language token is
    per sequence): each sentence's text equals transformers' for its own target, greedy and beam 4."""
    d = dirs[family]
    float32_linear(monkeypatch)
    model, tok, _ = load_model(d, pack=False)
    pack_for_inference(model, dtype=torch.float32)
    (de, fr, en), (_, fr_code, en_code) = FAMILIES[family]
    targets = [fr if i % 2 else en for i in range(len(SOURCE))]
    codes = [fr_code if i % 2 else en_code for i in range(len(SOURCE))]
    srcs = [tok.source_ids(s, de, model.cfg.max_len) for s in SOURCE]
    for beam in (1, 4):
        want = hf_reference(d, family, SOURCE, codes, beam, LONG)
        hyps = generate(model, srcs, beam_size=beam, max_new_tokens=LONG, free_prefix=1,
                        target_prefix=[(tok.forced_token(t),) for t in targets])
        assert [tok.decode(h[0].tokens) for h in hyps] == want, beam


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tokenizer_equals_transformers(dirs, family):
    """Source ids (``[src_lang] pieces </s>``) and the decoding of random target ids equal
    transformers' tokenizer's; the language tokens' ids equal its."""
    d = dirs[family]
    _, tok, _ = load_model(d, pack=False)
    hf_tok = hf_loaded(d)[1]
    hf_tok.src_lang = FAMILIES[family][1][0]
    for text in SOURCE:
        assert tok.source_ids(text, "de", 512) == hf_tok(text).input_ids
    for service, code in zip(*FAMILIES[family]):
        assert tok.forced_token(service) == tok.forced_token(code) == lang_id(family, hf_tok, code)
        assert tok.resolve(code) == service
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, tok.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 12, (200,), generator=g)]
    assert [tok.decode(s) for s in seqs] == hf_tok.batch_decode(seqs, skip_special_tokens=True)


def test_service_codes(dirs):
    """NLLB's codes map to ISO 639-1 where one exists, the full code otherwise (zho_Hant)."""
    meta = load_model(dirs["nllb"], pack=False)[2]
    assert meta["multilingual"]["languages"] == {"deu_Latn": "de", "eng_Latn": "en", "fra_Latn": "fr",
                                                 "zho_Hans": "zh", "zho_Hant": "zho_Hant"}
    mbart = load_model(dirs["mbart50"], pack=False)[2]["multilingual"]["languages"]
    assert mbart["de_DE"] == "de" and mbart["en_XX"] == "en" and mbart["zh_CN"] == "zh"


def _refused(argv, capsys, *needles) -> None:
    assert convert(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err


def test_refusals(dirs, tmp_path, capsys):
    """Another model type, a missing tokenizer, a vocabulary size that disagrees with the tokenizer
    or the weights, a forced_bos_token_id that is no language token: exit 2, one line naming the
    file and field, nothing written."""
    import shutil
    cases = {
        "bart": ("config.json", lambda c: c | {"model_type": "bart"}, "model_type 'bart'"),
        "vocab": ("config.json", lambda c: c | {"vocab_size": 20}, "vocab_size 20"),
        "weights": ("config.json", lambda c: c | {"vocab_size": c["vocab_size"] + 3}, "model.safetensors"),
        "lang": ("generation_config.json", lambda c: c | {"forced_bos_token_id": 5}, "forced_bos_token_id 5"),
        "sampling": ("generation_config.json", lambda c: c | {"no_repeat_ngram_size": 3}, "no_repeat_ngram_size=3"),
    }
    for name, (file, change, needle) in cases.items():
        d = tmp_path / name
        shutil.copytree(dirs["nllb"], d)
        (d / file).write_text(json.dumps(change(json.loads((d / file).read_text()))))
        _refused(["--from-transformers", str(d), "--out", str(tmp_path / f"out-{name}")], capsys, file, needle)
        assert not (tmp_path / f"out-{name}").exists()
    d = tmp_path / "notok"
    shutil.copytree(dirs["nllb"], d)
    (d / "tokenizer.json").unlink()
    _refused(["--from-transformers", str(d), "--out", str(tmp_path / "out-notok")], capsys, "tokenizer.json: missing")
    assert not (tmp_path / "out-notok").exists()


def test_cli_language_errors(dirs, monkeypatch, capsys):
    """A source or target language the model lacks: the command exits naming the option and the
    model's languages."""
    float32_linear(monkeypatch)
    for args, needle in ((["--source-lang", "xx", "--target-lang", "fr"], "--source-lang"),
                         (["--source-lang", "de", "--target-lang", "xx"], "--target-lang"),
                         (["--target-lang", "fr"], "--source-lang")):
        monkeypatch.setattr("sys.stdin", io.StringIO("Danke.\n"))
        with pytest.raises(SystemExit):
            translate.main(["--checkpoint", str(dirs["nllb"])] + args)
        err = capsys.readouterr().err
        assert needle in err and "zho_Hant" in err, err


def test_marian_through_from_transformers(tmp_path, capsys):
    """``--from-transformers`` of a MarianMT directory is ``--from-marian``: the same files."""
    from tiny_marian import make_marian_dir
    d = make_marian_dir(tmp_path / "marian")
    assert convert(["--from-transformers", str(d), "--out", str(tmp_path / "a")]) == 0
    assert convert(["--from-marian", str(d), "--out", str(tmp_path / "b")]) == 0
    for name in ("config.json", "model.safetensors", "vocab.json", "metadata.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_tokenizer_class_refused(dirs, tmp_path, capsys):
    """An mBART directory whose tokenizer is mBART-cc25's (other source and decoder rules): refused."""
    import shutil
    d = tmp_path / "cc25"
    shutil.copytree(dirs["mbart50"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"tokenizer_class": "MBartTokenizer"}))
    _refused(["--from-transformers", str(d), "--out", str(tmp_path / "out")], capsys, "tokenizer_config.json",
             "tokenizer_class 'MBartTokenizer'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ct2_export_translates_as_transformers(dirs, family, tmp_path, capsys):
    """``--to-ct2`` of the import (exported back to the transformers layout, then CTranslate2's own
    converter) and of the directory itself: CTranslate2's greedy ids, the target token as ``target_prefix``, equal transformers'
    for every sentence (CTranslate2's max_decoding_length counts the prefix, not the forced EOS)."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    d = dirs[family]
    assert convert(["--from-transformers", str(d), "--out", str(tmp_path / "ckpt")]) == 0
    assert convert(["--to-ct2", str(tmp_path / "ckpt"), "--out", str(tmp_path / "ct2")]) == 0
    vocab = json.loads((tmp_path / "ct2" / "shared_vocabulary.json").read_text(encoding="utf-8"))
    hf, tok = hf_loaded(d)
    tok.src_lang = FAMILIES[family][1][0]
    fr = lang_id(family, tok, FAMILIES[family][1][1])
    with torch.no_grad():
        ids = hf.generate(**tok(SOURCE, return_tensors="pt", padding=True), forced_bos_token_id=fr, num_beams=1,
                          max_new_tokens=LONG).tolist()
    want = [[t for t in row[1:] if t != 1] for row in ids]
    want = [w[: w.index(2)] if 2 in w else w for w in want]
    index = {p: i for i, p in enumerate(vocab)}
    outs = ["ct2"]
    if family != "mbart50":       # the published directory itself (transformers 5's mBART-50 files: see docs)
        assert convert(["--to-ct2", str(d), "--out", str(tmp_path / "ct2-dir")]) == 0
        outs.append("ct2-dir")
    for out in outs:
        translator = ctranslate2.Translator(str(tmp_path / out))
        results = translator.translate_batch([[vocab[i] for i in tok(s).input_ids] for s in SOURCE],
                                             target_prefix=[[vocab[fr]]] * len(SOURCE), beam_size=1,
                                             max_decoding_length=LONG - 1, suppress_sequences=[["<pad>"]])
        assert [[index[p] for p in r.hypotheses[0]] for r in results] == want, out


def test_nllb_legacy_source_template(dirs, tmp_path):
    """NLLB's ``legacy_behaviour`` tokenizers put the language after ``</s>``: so does the import."""
    import shutil
    d = tmp_path / "legacy"
    shutil.copytree(dirs["nllb"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"legacy_behaviour": True}))
    tok = load_model(d, pack=False)[1]
    hf_tok = AutoTokenizer.from_pretrained(d)
    hf_tok.src_lang = "deu_Latn"
    assert [tok.source_ids(s, "de", 512) for s in SOURCE] == [hf_tok(s).input_ids for s in SOURCE]
    assert tok.source_ids(SOURCE[0], "de", 512)[-2:] == [2, tok.forced_token("de")]


def test_mbart50_without_tokenizer_json(tmp_path, monkeypatch, capsys):
    """An mBART-50 directory with sentencepiece.bpe.model and no tokenizer.json (fairseq's id
    offset, as transformers builds the tokenizer): the same source ids, decoding and translations
    (greedy and beam 4) as transformers."""
    d = make_dir(tmp_path / "mbart", "mbart50-spm", seed=1)
    assert convert(["--from-transformers", str(d), "--out", str(tmp_path / "ckpt")]) == 0
    tok = load_model(tmp_path / "ckpt", pack=False)[1]
    hf_tok = AutoTokenizer.from_pretrained(d)
    hf_tok.src_lang = "de_DE"
    assert [tok.source_ids(s, "de", 512) for s in SOURCE] == [hf_tok(s).input_ids for s in SOURCE]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, tok.vocab_size + 1, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 12, (100,), generator=g)]
    assert [tok.decode(s) for s in seqs] == hf_tok.batch_decode(seqs, skip_special_tokens=True)
    for beam in (1, 4):
        want = hf_reference(d, "mbart50", SOURCE, ["fr_XX"] * len(SOURCE), beam, LONG)
        assert cli_translate(tmp_path / "ckpt", SOURCE, "fr", beam, LONG, monkeypatch, capsys) == want


@pytest.mark.parametrize("family", ["nllb", "mbart50"])
async def test_engine_translates_as_transformers(dirs, family, monkeypatch):
    """The serving engine (continuous batching) on the import: French and English requests in one
    batch, greedy and beam 4, each text equal to transformers' (the language token as a free prefix,
    max_new_tokens counted after it)."""
    import asyncio
    from service.engine import Engine, EngineConfig, GenerationOptions
    float32_linear(monkeypatch)
    model, tok, _ = load_model(dirs[family], pack=False)
    pack_for_inference(model, dtype=torch.float32)
    (de, fr, en), (_, fr_code, en_code) = FAMILIES[family]
    targets = [fr if i % 2 else en for i in range(len(SOURCE))]
    engine = Engine(model, EngineConfig(max_num_seqs=128))
    await engine.start()
    try:
        for beam in (1, 4):
            opts = [GenerationOptions(beam_size=beam, max_new_tokens=LONG - 1, target_prefix=(tok.forced_token(t),),
                                      free_prefix=1) for t in targets]
            got = await asyncio.gather(*[engine.translate(tok.source_ids(s, de, model.cfg.max_len), o)
                                         for s, o in zip(SOURCE, opts)])
            want = hf_reference(dirs[family], family, SOURCE, [fr_code if t == fr else en_code for t in targets],
                                beam, LONG)
            assert [tok.decode(r.hypotheses[0].tokens) for r in got] == want, beam
    finally:
        await engine.stop()
