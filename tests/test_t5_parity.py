"""Imported T5 / mT5 translation models (MADLAD-400's layout) translate as they do in transformers
(model/interop/t5.py, model/tag_tokenizer.py, the one network's RMSNorm / d_kv / unscaled attention /
relative position bucket / gated-GELU / untied-output flags, the ``<2xx>`` tag at the start of the
source): tiny random models built at test time by transformers (tests/tiny_t5.py), imported with
``python -m model.convert --from-transformers`` and translated with ``python -m model.translate
--target-lang fr|en``, against ``generate`` + ``batch_decode(skip_special_tokens=True)`` on
``"<2xx> " + text``: the same text for 20 sentences into two target languages, greedy and beam 4; both
targets mixed in one batch; then what the import refuses, in one line naming the file and field."""
from __future__ import annotations

import functools
import io
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from test_multilingual_parity import SOURCE
from tiny_model import one_thread  # noqa: F401 (autouse fixture)
from tiny_t5 import make_t5_dir
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from model import translate
from model.checkpoint import load_metadata
from model.convert import main as convert
from model.inference import settings
from model.inference.generate import generate
from model.load import load_model
from model.tokenizer import encode_source

TYPES = ("t5", "mt5")
LONG = 30


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    return {t: make_t5_dir(root / t, t, seed=i, shards=1 + i) for i, t in enumerate(TYPES)}   # mt5: 2 shards


@functools.lru_cache(maxsize=4)
def hf_loaded(d):
    return AutoModelForSeq2SeqLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)


def hf_reference(d, texts, targets: list[str], beam: int, max_new_tokens: int) -> list[str]:
    """transformers' text of each source with its own ``<2xx>`` tag, in one generate() batch."""
    hf, tok = hf_loaded(d)
    enc = tok([f"<2{t}> {s}" for s, t in zip(texts, targets)], return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = hf.generate(**enc, num_beams=beam, max_new_tokens=max_new_tokens)
    return tok.batch_decode(ids, skip_special_tokens=True)


def float32_linear(monkeypatch) -> None:
    monkeypatch.setattr(settings, "_current", settings.InferenceSettings(linear_dtype="float32"))


@pytest.mark.parametrize("kind", TYPES)
def test_cli_import_translates_as_transformers(dirs, kind, tmp_path, monkeypatch, capsys):
    """``model.convert --from-transformers`` then ``model.translate --target-lang fr|en``: every line
    equals transformers' text, greedy and beam 4; outputs end at mixed lengths."""
    d, out = dirs[kind], tmp_path / "ckpt"
    assert convert(["--from-transformers", str(d), "--out", str(out)]) == 0
    assert "weights stored as float32 (source: float32)" in capsys.readouterr().out
    meta = load_metadata(out)
    assert meta["target_languages"] == ["de", "en", "fr"] and meta["generation"]["early_stopping"] is False
    float32_linear(monkeypatch)
    texts = set()
    for beam in (1, 4):
        for target in ("fr", "en"):
            want = hf_reference(d, SOURCE, [target] * len(SOURCE), beam, LONG)
            monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(SOURCE) + "\n"))
            capsys.readouterr()
            translate.main(["--checkpoint", str(out), "--target-lang", target, "--beam-size", str(beam),
                            "--max-new-tokens", str(LONG)])
            assert capsys.readouterr().out.splitlines() == want, (beam, target)
            texts |= set(want)
    assert len(texts) >= 30                       # the outputs depend on the source and the target
    assert len({len(t) for t in texts}) >= 10


def test_tied_relu_t5(tmp_path, monkeypatch):
    """The original T5 layout (tied output: the decoder output × d_model^-0.5 before the shared
    embedding; ReLU feed-forward) translates as transformers, greedy and beam 4."""
    d = make_t5_dir(tmp_path / "tied", "t5", seed=5, tied=True, ffn="relu")
    float32_linear(monkeypatch)
    model, tok, _ = load_model(d, pack=False)
    assert model.cfg.scale_decoder_output and model.out_proj is None and not model.cfg.gated_ffn
    srcs = [encode_source(tok, s, model.cfg.max_len, "fr") for s in SOURCE]
    for beam in (1, 4):
        want = hf_reference(d, SOURCE, ["fr"] * len(SOURCE), beam, LONG)
        assert len(set(want)) >= 10
        hyps = generate(model, srcs, beam_size=beam, max_new_tokens=LONG)
        assert [tok.decode(h[0].tokens) for h in hyps] == want, beam


@pytest.mark.parametrize("kind", TYPES)
def test_two_targets_in_one_batch(dirs, kind, monkeypatch):
    """French and English targets alternating in ONE generate() batch (the tag is per source): each
    sentence's text equals transformers', greedy and beam 4; the same alone."""
    float32_linear(monkeypatch)
    model, tok, _ = load_model(dirs[kind], pack=False)
    targets = ["fr" if i % 2 else "en" for i in range(len(SOURCE))]
    srcs = [encode_source(tok, s, model.cfg.max_len, t) for s, t in zip(SOURCE, targets)]
    hf_tok = hf_loaded(dirs[kind])[1]
    assert srcs == hf_tok([f"<2{t}> {s}" for s, t in zip(SOURCE, targets)]).input_ids
    for beam in (1, 4):
        want = hf_reference(dirs[kind], SOURCE, targets, beam, LONG)
        hyps = generate(model, srcs, beam_size=beam, max_new_tokens=LONG)
        assert [tok.decode(h[0].tokens) for h in hyps] == want, beam
        alone = [generate(model, [s], beam_size=beam, max_new_tokens=LONG)[0][0].tokens for s in srcs[:4]]
        assert alone == [h[0].tokens for h in hyps[:4]]


def test_decoding_equals_transformers(dirs):
    """The decoding of random target ids equals transformers' ``batch_decode(skip_special_tokens=True)``."""
    _, tok, _ = load_model(dirs["t5"], pack=False)
    hf_tok = hf_loaded(dirs["t5"])[1]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, tok.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 12, (200,), generator=g)]
    assert [tok.decode(s) for s in seqs] == hf_tok.batch_decode(seqs, skip_special_tokens=True)


def _refused(argv, capsys, *needles) -> None:
    assert convert(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err


def test_refusals(dirs, tmp_path, capsys):
    """T5 settings the network cannot reproduce: exit 2, one line naming the file and field, nothing written."""
    cases = {
        "ffn": ("config.json", {"feed_forward_proj": "gated-silu"}, "feed_forward_proj 'gated-silu'"),
        "decoder": ("config.json", {"is_encoder_decoder": False}, "is_encoder_decoder=false"),
        "tied-mt5": ("config.json", {"model_type": "mt5", "tie_word_embeddings": True}, "tie_word_embeddings=true"),
        "tied": ("config.json", {"tie_word_embeddings": True}, "lm_head.weight of its own"),
        "vocab": ("config.json", {"vocab_size": 20}, "vocab_size 20"),
        "tokenizer": ("tokenizer_config.json", {"tokenizer_class": "BertTokenizer"}, "tokenizer_class 'BertTokenizer'"),
        "sampling": ("generation_config.json", {"no_repeat_ngram_size": 3}, "no_repeat_ngram_size=3"),
    }
    for name, (file, change, needle) in cases.items():
        d = tmp_path / name
        shutil.copytree(dirs["t5"], d)
        (d / file).write_text(json.dumps(json.loads((d / file).read_text()) | change))
        _refused(["--from-transformers", str(d), "--out", str(tmp_path / f"out-{name}")], capsys, file, needle)
        assert not (tmp_path / f"out-{name}").exists()
    d = tmp_path / "spiece"
    shutil.copytree(dirs["t5"], d)
    (d / "tokenizer.json").rename(d / "spiece.model")      # (its content does not matter here)
    _refused(["--from-transformers", str(d), "--out", str(tmp_path / "out-spiece")], capsys,
             "tokenizer.json: missing", "save_pretrained")


def test_to_ct2_and_export_refusals(dirs, tmp_path, capsys):
    """``--to-ct2`` of the published directory runs CTranslate2's own T5 converter; our imported
    checkpoint is refused by name for --to-ct2 and --to-marian (no export back), nothing written."""
    pytest.importorskip("ctranslate2")
    assert convert(["--to-ct2", str(dirs["t5"]), "--out", str(tmp_path / "ct2")]) == 0
    assert (tmp_path / "ct2" / "model.bin").exists()
    ckpt = tmp_path / "ckpt"
    assert convert(["--from-transformers", str(dirs["t5"]), "--out", str(ckpt)]) == 0
    capsys.readouterr()                          # (the converter's progress lines)
    _refused(["--to-ct2", str(ckpt), "--out", str(tmp_path / "x")], capsys, "T5 checkpoint")
    _refused(["--to-marian", str(ckpt), "--out", str(tmp_path / "y")], capsys, "norm: RMSNorm (T5)")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
