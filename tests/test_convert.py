"""MarianMT import (model/interop/marian.py): tiny random MarianMT directories built with ``transformers`` at
test time, in the on-disk format of the published OPUS-MT models. Imported, our logits equal
transformers' (float32), and greedy and beam-4 outputs equal ``generate()``'s (with the model's own
generation config) token for token for a batch of mixed lengths, offline and through the engine; bad
directories give one clear error. Text, the length cap and generation configs: test_marian_parity.py."""
from __future__ import annotations

import asyncio
import functools
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from transformers import MarianMTModel, MarianTokenizer  # noqa: E402

from model.checkpoint import DEFAULT_CHECKPOINT
from model.load import load_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.interop.marian import MarianImportError, load_marian
from model.convert import main  # noqa: E402
from model.inference.generate import generate, pad_batch  # noqa: E402
from model.layers import sinusoidal_table  # noqa: E402
from model.inference import settings
from model.inference.linear import pack_for_inference
from service.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402
from tiny_marian import DE, make_marian_dir  # noqa: E402
from tiny_model import one_thread  # noqa: F401,E402 (autouse fixture)

MAX_NEW = 20
VARIANTS = {"swish": dict(activation="swish", seed=4),
            "gelu-unscaled": dict(activation="gelu", scale_embedding=False, seed=4),
            "relu-bin": dict(activation="relu", seed=3, weights_file="pytorch_model.bin"),
            "separate": dict(activation="swish", seed=1, separate_vocabs=True),
            "multilingual": dict(activation="swish", seed=2, target_languages=("deu", "fra"))}


@pytest.fixture(scope="module")
def marian_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("marian")
    return {name: make_marian_dir(root / name, **kw) for name, kw in VARIANTS.items()}


@functools.cache
def hf_model(directory):
    """transformers' model of one of ``marian_dirs`` (eval mode), loaded once: several tests read it."""
    return MarianMTModel.from_pretrained(directory).eval()


@functools.cache
def hf_tokenizer(directory):
    """MarianTokenizer of one of ``marian_dirs``, loaded once (the directories are never changed)."""
    return MarianTokenizer.from_pretrained(directory)


def float32_model(directory):
    """Our model of a MarianMT directory with float32 (prepacked) linear layers, and its tokenizer."""
    model, tok, meta = load_model(directory, pack=False)
    pack_for_inference(model, dtype=torch.float32)
    return model, tok, meta


def hf_generate(hf, tok_hf, texts, beam: int, pad_id: int) -> list[list[int]]:
    """transformers' generate() as a user runs it: the directory's generation config (the published
    one: pad banned, EOS forced at the length limit, early_stopping false, logits renormalised),
    num_beams and max_new_tokens given; the generated ids, EOS and padding left out."""
    enc = tok_hf(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf.generate(**enc, num_beams=beam, max_new_tokens=MAX_NEW)
    eos = hf.config.eos_token_id
    return [[t for t in row[1:] if t != pad_id][: row[1:].index(eos) if eos in row[1:] else None]
            for row in out.tolist()]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers(marian_dirs, variant):
    d = marian_dirs[variant]
    hf = hf_model(d)
    model, tok, meta = float32_model(d)
    cfg = model.cfg
    assert (cfg.activation, cfg.sinusoid_layout, cfg.final_logits_bias) == (VARIANTS[variant]["activation"], "split", True)
    assert cfg.scale_embedding == VARIANTS[variant].get("scale_embedding", True)
    V = cfg.target_vocab_size
    assert (cfg.eos_id, cfg.unk_id, cfg.pad_id, cfg.bos_id) == (0, 1, V - 1, V - 1)
    assert (V < cfg.vocab_size) == (variant == "separate") and meta["source_lang"] == "de"
    enc = hf_tokenizer(d)(DE, return_tensors="pt", padding=True)
    src = pad_batch([tok.encode(t) + [tok.eos_id] for t in DE], cfg.pad_id)   # ours (renumbered if separate)
    tgt = torch.randint(2, V - 1, (len(DE), 7), generator=torch.Generator().manual_seed(0))
    tgt[:, 0] = cfg.bos_id
    with torch.no_grad():
        ref = hf(**enc, decoder_input_ids=tgt).logits
        got = model(src, tgt)
    assert ref.abs().max() > 1.0                      # not a near-constant output
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant", ["swish", "separate"])
def test_tokenizer_matches_marian_tokenizer(marian_dirs, variant):
    d = marian_dirs[variant]
    _, tok, _ = load_marian(d)
    hf_tok = hf_tokenizer(d)
    texts = DE + ["Zwei Männer spielen Fußball.", "Ein völlig neues Wort: Xylophon 🎻!"]
    source_piece = {i: p for p, i in tok.vocab.items()}
    hf_source_piece = {i: p for p, i in hf_tok.encoder.items()}
    for text in texts:
        ids = hf_tok(text).input_ids
        if variant == "swish":
            assert tok.encode(text) + [tok.eos_id] == ids
        # the same pieces (a separate source vocabulary is renumbered: its pad and eos take the target's ids)
        assert [source_piece[i] for i in tok.encode(text) + [tok.eos_id]] == [hf_source_piece[i] for i in ids]
    ids = [tok.target_vocab[p] for p in tok.sp_target.encode("Two dogs play in the snow.", out_type=str)]
    assert tok.unk_id in tok.encode("🎻")          # not in the vocabulary: <unk>, as MarianTokenizer
    for seq in ([5, 9, 12], ids, ids + [tok.eos_id]):
        # target ids decode through the target vocabulary and target.spm (use_source_tokenizer=False)
        assert tok.decode(seq) == hf_tok.decode(seq, skip_special_tokens=True, use_source_tokenizer=False)
    # pad is dropped too (MarianTokenizer looks special tokens up in the source vocabulary only, so it
    # misses a separate target vocabulary's <pad>)
    assert tok.decode(ids + [tok.pad_id]) == tok.decode(ids) == "Two dogs play in the snow."


@pytest.mark.parametrize("variant,beam", [("swish", 1), ("swish", 4), ("gelu-unscaled", 4), ("relu-bin", 1),
                                          ("separate", 1), ("separate", 4)])
def test_generate_equals_transformers(marian_dirs, variant, beam):
    d = marian_dirs[variant]
    hf = hf_model(d)
    model, tok, _ = float32_model(d)
    ref = hf_generate(hf, hf_tokenizer(d), DE, beam, model.cfg.pad_id)
    srcs = [tok.encode(t) + [tok.eos_id] for t in DE]
    assert len({len(s) for s in srcs}) >= 4                       # a batch of mixed lengths
    got = [h[0].tokens for h in generate(model, srcs, beam_size=beam, max_new_tokens=MAX_NEW)]
    assert got == ref
    assert len({tuple(g) for g in got}) >= 2 and any(len(g) < MAX_NEW for g in got)   # outputs differ, some end


@pytest.mark.parametrize("variant", ["swish", "separate"])
def test_engine_equals_transformers(marian_dirs, variant):
    d = marian_dirs[variant]
    hf = hf_model(d)
    model, tok, _ = float32_model(d)
    hf_tok = hf_tokenizer(d)
    refs = {beam: hf_generate(hf, hf_tok, DE, beam, model.cfg.pad_id) for beam in (1, 4)}

    async def run():
        engine = Engine(model, EngineConfig(max_num_seqs=32))
        await engine.start()
        try:
            jobs = [engine.translate(tok.encode(t) + [tok.eos_id], GenerationOptions(beam_size=beam, max_new_tokens=MAX_NEW))
                    for beam in (1, 4) for t in DE]
            return [r.hypotheses[0].tokens for r in await asyncio.gather(*jobs)]
        finally:
            await engine.stop()

    got = asyncio.run(run())
    assert got == refs[1] + refs[4]
    assert tok.decode(got[0]) == hf_tok.decode(refs[1][0], skip_special_tokens=True, use_source_tokenizer=False)


@pytest.mark.parametrize("variant", ["swish", "separate"])
def test_convert_cli_writes_equivalent_checkpoint(marian_dirs, tmp_path, variant):
    d = marian_dirs[variant]
    out = tmp_path / "ckpt"
    assert main(["--from-marian", str(d), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "source.spm", "target.spm",
                                               "vocab.json", "metadata.json"} | \
        ({"target_vocab.json"} if variant == "separate" else set())
    a, tok_a, _ = float32_model(d)
    b, tok_b, meta = float32_model(out)
    assert a.cfg == b.cfg and meta["imported_from"] == f"MarianMT directory {d.name}" and meta["dtype"] == "float32"
    srcs = [tok_b.encode(t) + [tok_b.eos_id] for t in DE]
    assert srcs == [tok_a.encode(t) + [tok_a.eos_id] for t in DE]
    ga = generate(a, srcs, beam_size=4, max_new_tokens=MAX_NEW)
    gb = generate(b, srcs, beam_size=4, max_new_tokens=MAX_NEW)
    assert [h[0].tokens for h in ga] == [h[0].tokens for h in gb]
    assert [h[0].score for h in ga] == [h[0].score for h in gb]


def _broken(src, tmp_path, edit):
    d = tmp_path / "broken"
    shutil.copytree(src, d)
    edit(d)
    return d


def _set_json(path, **kw):
    data = json.loads(path.read_text())
    data.update(kw)
    path.write_text(json.dumps(data))


def _drop_vocab_entry(d):
    vocab = json.loads((d / "vocab.json").read_text())
    vocab.pop("<pad>")
    (d / "vocab.json").write_text(json.dumps(vocab))


BAD = {
    "missing source.spm": (lambda d: (d / "source.spm").unlink(), "source.spm: missing"),
    "missing weights": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors or pytorch_model.bin"),
    "not marian": (lambda d: _set_json(d / "config.json", model_type="bart"), "model_type is 'bart', not 'marian'"),
    "vocab size": (lambda d: _set_json(d / "config.json", vocab_size=500, decoder_vocab_size=500),
                   "vocab.json: 90 entries, but config.json vocab_size is 500"),
    "vocab entry": (_drop_vocab_entry, "vocab.json: 89 entries, but config.json vocab_size is 90"),
    "weights shape": (lambda d: _set_json(d / "config.json", d_model=16), "has shape"),
    "activation": (lambda d: _set_json(d / "config.json", activation_function="tanh"), "activation_function 'tanh'"),
    "pre-LN": (lambda d: _set_json(d / "config.json", normalize_before=True), "normalize_before=true is not supported"),
    "bad json": (lambda d: (d / "vocab.json").write_text("{"), "vocab.json: not valid JSON"),
    "separate_vocabs": (lambda d: _set_json(d / "tokenizer_config.json", separate_vocabs=True),
                        "separate_vocabs=true but config.json share_encoder_decoder_embeddings=true"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_directory_one_clear_error(marian_dirs, tmp_path, capsys, case):
    edit, message = BAD[case]
    src = marian_dirs["swish"]
    if case in ("vocab size", "vocab entry"):
        n = len(json.loads((src / "vocab.json").read_text()))
        message = message.replace("90", str(n)).replace("89", str(n - 1))
    d = _broken(src, tmp_path, edit)
    with pytest.raises(MarianImportError, match=message.replace("(", r"\(")):
        load_marian(d)
    assert main(["--from-marian", str(d), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_defaults_unchanged_and_split_sinusoid():
    """The shipped checkpoint's config gets today's behaviour from the new fields' defaults, and the
    split layout is transformers' Marian table."""
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
    shipped = json.loads((DEFAULT_CHECKPOINT / "config.json").read_text())
    cfg = ModelConfig.from_dict(shipped)
    assert (cfg.activation, cfg.sinusoid_layout, cfg.scale_embedding, cfg.final_logits_bias) == \
        ("relu", "interleaved", True, False)
    hf_pe = MarianSinusoidalPositionalEmbedding(50, 32)
    assert torch.allclose(sinusoidal_table(50, 32, "split"), hf_pe.create_weight(), atol=1e-6)
    inter = sinusoidal_table(50, 32)
    assert torch.equal(inter[:, 0::2], sinusoidal_table(50, 32, "split")[:, :16])


def test_translate_cli_on_marian_dir_with_max_new_tokens(marian_dirs, monkeypatch, capsys):
    """``model.translate`` reads a MarianMT directory directly; --max-new-tokens fixes every budget."""
    import io

    from model import translate
    d = marian_dirs["swish"]
    model, tok, _ = float32_model(d)
    srcs = [tok.encode(t) + [tok.eos_id] for t in DE]
    want = [tok.decode(h[0].tokens) for h in generate(model, srcs, beam_size=1, max_new_tokens=3)]
    monkeypatch.setattr(settings, "_current", settings.InferenceSettings(linear_dtype="float32"))
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(DE) + "\n"))
    translate.main(["--checkpoint", str(d), "--beam-size", "1", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.splitlines() == want
    with pytest.raises(SystemExit) as e:
        translate.main(["--checkpoint", str(d), "--max-new-tokens", "64"])
    assert e.value.code == 2 and "--max-new-tokens must be in 1..63" in capsys.readouterr().err


def test_multilingual_target_language_token(marian_dirs, monkeypatch, capsys):
    """A multilingual model: the source starts with >>xx<< (chosen by target_lang), outputs equal
    generate()'s on the same prefixed text, and a missing or unknown target names the choices."""
    import io

    from model import translate
    from model.inference.generate import translate_lines
    from model.tokenizer import encode_source
    d = marian_dirs["multilingual"]
    hf = hf_model(d)
    hf_tok = hf_tokenizer(d)
    model, tok, _ = float32_model(d)
    assert tok.target_languages == ("deu", "fra") and hf_tok.supported_language_codes == [">>deu<<", ">>fra<<"]
    got = {}
    for lang in ("deu", "fra"):
        texts = [f">>{lang}<< {t}" for t in DE]
        srcs = [encode_source(tok, t, model.cfg.max_len, lang) for t in DE]
        assert srcs == [hf_tok(t).input_ids for t in texts] and all(s[0] == tok.vocab[f">>{lang}<<"] for s in srcs)
        got[lang] = [h[0].tokens for h in generate(model, srcs, beam_size=4, max_new_tokens=MAX_NEW)]
        assert got[lang] == hf_generate(hf, hf_tok, texts, 4, model.cfg.pad_id)
    assert sum(a != b for a, b in zip(got["deu"], got["fra"])) >= 3       # the token steers the output
    with pytest.raises(ValueError, match="name a target language, one of deu, fra"):
        translate_lines(model, tok, DE)
    with pytest.raises(ValueError, match="unknown target language 'spa'; the model knows one of deu, fra"):
        translate_lines(model, tok, DE, target_lang="spa")
    monkeypatch.setattr("sys.stdin", io.StringIO(DE[0] + "\n"))
    monkeypatch.setattr(settings, "_current", settings.InferenceSettings(linear_dtype="float32"))
    for argv, message in ((["--target-lang", "spa"], "unknown target language 'spa'"), ([], "one of deu, fra")):
        with pytest.raises(SystemExit) as e:
            translate.main(["--checkpoint", str(d)] + argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    translate.main(["--checkpoint", str(d), "--target-lang", "fra", "--beam-size", "4", "--max-new-tokens", str(MAX_NEW)])
    out = capsys.readouterr().out.splitlines()
    assert out == [tok.decode(got["fra"][0])]
