"""An imported OPUS-MT model translates as it does in transformers (model/interop/marian.py,
VocabTokenizer.decode, the search's forced-EOS and early-stopping rules): tiny random MarianMT
directories built at test time in the published layout (generation_config.json with the pad token
banned and EOS forced at the length limit), whose outputs hold pieces that only the source
SentencePiece model knows (and pieces only the target one knows), imported and translated with the
command-line tools as a new user would, against ``generate()`` and
``MarianTokenizer.batch_decode(skip_special_tokens=True)``: the same text for every sentence, for a
shared and separate vocabularies, greedy and beam 4, at the length cap and before it, for the
default import and --dtype float32. Then each generation setting: applied, refused naming it, or
noted."""
from __future__ import annotations

import functools
import io
import json

import pytest
import torch

pytest.importorskip("transformers")
import sentencepiece as spm  # noqa: E402
from transformers import MarianMTModel, MarianTokenizer  # noqa: E402

from model import translate  # noqa: E402
from model.checkpoint import load_metadata  # noqa: E402
from model.convert import main as convert  # noqa: E402
from model.inference import settings  # noqa: E402
from model.inference.generate import translate_lines  # noqa: E402
from model.inference.linear import pack_for_inference  # noqa: E402
from model.inference.beam import BeamSearch  # noqa: E402
from model.interop.marian import MarianImportError, load_marian  # noqa: E402
from model.load import load_model  # noqa: E402
from tiny_marian import DE, EN, make_marian_dir  # noqa: E402
from tiny_model import one_thread  # noqa: F401,E402 (autouse fixture)

# German with names and words the English target side never sees: their pieces are source-only
SOURCE = DE + ["Herr Müller wohnt neben dem Gebäude in Düsseldorf.", "Frau Schröder fährt nach München.",
               "Das Gebäude am Bahnhof gehört Jürgen Weißmann.", "Björn und Käthe besuchen Göttingen.",
               "Die Brücke über die Spree ist gesperrt."]
TARGET = EN + ["Mr Smith lives next to the building.", "The bridge is closed today."]
LAYOUTS = {"shared": dict(seed=1, eos_bias=2.5, vocab_sizes=(120, 60)),
           "separate": dict(seed=0, eos_bias=2.5, separate_vocabs=True, vocab_sizes=(120, 70))}
CAP, LONG = 8, 40           # max_new_tokens: most outputs reach the cap / most end before it


def build(directory, layout: str, **kw):
    return make_marian_dir(directory, source_lines=SOURCE, target_lines=TARGET, **LAYOUTS[layout], **kw)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return {name: build(root / name, name) for name in LAYOUTS}


@functools.lru_cache(maxsize=4)
def hf_loaded(d) -> tuple[MarianMTModel, MarianTokenizer]:
    """transformers' model (eval mode) and tokenizer of directory ``d``, loaded once: a test asks for
    the same directory's references up to eight times, and only reads them (each test builds its
    directories under its own tmp_path; the module's ``dirs`` are not changed where this reads them)."""
    return MarianMTModel.from_pretrained(d).eval(), MarianTokenizer.from_pretrained(d)


def hf_reference(d, texts, beam: int, max_new_tokens: int, **overrides) -> tuple[list[str], list[list[int]]]:
    """(text, generated ids without EOS) of transformers' generate() with the directory's generation
    config, decoded by MarianTokenizer.batch_decode(skip_special_tokens=True). With separate
    vocabularies MarianTokenizer looks its special tokens up in the source vocabulary, so it keeps
    the target's <pad> (the decoder start, padding) as text ("<pad> ..."): the generated ids alone
    are decoded there (with a shared vocabulary both ways give the same text, checked)."""
    hf, tok = hf_loaded(d)
    with torch.no_grad():
        out = hf.generate(**tok(texts, return_tensors="pt", padding=True), num_beams=beam,
                          max_new_tokens=max_new_tokens, **overrides)
    pad, eos = hf.generation_config.pad_token_id, hf.generation_config.eos_token_id
    generated = [[t for t in row[1:] if t != pad] for row in out.tolist()]
    text = tok.batch_decode(generated, skip_special_tokens=True)
    if not tok.separate_vocabs:
        assert tok.batch_decode(out, skip_special_tokens=True) == text
    return text, [g[: g.index(eos)] if eos in g else g for g in generated]


def linear_layers(monkeypatch, dtype: str) -> None:
    """The process's linear_dtype setting (what MT_LINEAR_DTYPE sets for the command-line tools)."""
    monkeypatch.setattr(settings, "_current", settings.InferenceSettings(linear_dtype=dtype))


def cli_translate(checkpoint, texts, beam: int, max_new_tokens: int, monkeypatch, capsys) -> list[str]:
    """``python -m model.translate --checkpoint DIR --beam-size B --max-new-tokens N < texts``,
    float32 linear layers (MT_LINEAR_DTYPE's setting; the CPU default int8 rounds activations)."""
    linear_layers(monkeypatch, "float32")
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(texts) + "\n"))
    capsys.readouterr()
    translate.main(["--checkpoint", str(checkpoint), "--beam-size", str(beam), "--max-new-tokens", str(max_new_tokens)])
    return capsys.readouterr().out.splitlines()


def float32_model(d):
    model, tok, meta = load_model(d, pack=False)
    pack_for_inference(model, dtype=torch.float32)
    return model, tok, meta


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cli_import_translates_as_transformers(dirs, layout, tmp_path, monkeypatch, capsys):
    """Imported by ``model.convert`` (the default and --dtype float32) and translated by
    ``model.translate``: every line equals transformers' text, greedy and beam 4, at the cap (EOS
    forced: cap - 1 tokens + EOS) and before it; outputs hold source-only pieces (raw ``▁Gebäude``
    from target.spm's decode_pieces before)."""
    d = dirs[layout]
    outs = {"default": tmp_path / "default", "float32": tmp_path / "float32"}
    assert convert(["--from-marian", str(d), "--out", str(outs["default"])]) == 0
    assert "weights stored as float32 (source: float32)" in capsys.readouterr().out
    assert convert(["--from-marian", str(d), "--out", str(outs["float32"]), "--dtype", "float32"]) == 0
    assert (outs["default"] / "model.safetensors").read_bytes() == (outs["float32"] / "model.safetensors").read_bytes()
    meta = load_metadata(outs["default"])
    assert meta["dtype"] == "float32" and "notes" not in meta
    assert meta["generation"] == {"from": "generation_config.json", "forced_eos": True, "early_stopping": False,
                                  "renormalize_logits": True, "num_beams": 4, "max_length": 512}
    target_spm = spm.SentencePieceProcessor(model_file=str(d / "target.spm"))
    source_spm = spm.SentencePieceProcessor(model_file=str(d / "source.spm"))
    tok = load_marian(d)[1]
    ended_early = reached_cap = source_only = target_only = 0
    for beam in (1, 4):
        for n in (CAP, LONG):
            want, ids = hf_reference(d, SOURCE, beam, n)
            for checkpoint in (outs["default"], outs["float32"]):
                assert cli_translate(checkpoint, SOURCE, beam, n, monkeypatch, capsys) == want, (beam, n, checkpoint)
            reached_cap += sum(len(g) == n - 1 for g in ids)        # the forced EOS ends them
            ended_early += sum(len(g) < n - 1 for g in ids)
            assert all(len(g) <= n - 1 for g in ids)
            pieces = [p for g in ids for p in tok.pieces(g)]
            source_only += sum(target_spm.piece_to_id(p) == target_spm.unk_id() for p in pieces)
            target_only += sum(source_spm.piece_to_id(p) == source_spm.unk_id() for p in pieces)
    assert reached_cap >= 20 and ended_early >= 10
    # source-only pieces (unknown to target.spm) and, as transformers 5 joins a shared vocabulary's
    # pieces with source.spm, target-only ones: some pieces are raw for either SentencePiece model
    assert (source_only > 20 and target_only > 20) == (layout == "shared")


def test_directory_translated_directly(dirs, monkeypatch, capsys):
    """A MarianMT directory given to ``model.translate`` as it is (converted at load), and
    ``translate_lines`` on the imported model: the same text."""
    d = dirs["shared"]
    want, _ = hf_reference(d, SOURCE, 4, CAP)
    assert cli_translate(d, SOURCE, 4, CAP, monkeypatch, capsys) == want
    model, tok, _ = float32_model(d)
    assert translate_lines(model, tok, SOURCE, beam_size=4, max_new_tokens=CAP) == want


def test_int8_linear_layers_noted(dirs, monkeypatch, capsys):
    """The CPU default, int8 linear layers, rounds activations: ``model.translate`` says so for an
    imported model (not for float32 ones)."""
    for dtype, noted in (("int8", True), ("float32", False)):
        monkeypatch.setattr("sys.stdin", io.StringIO(SOURCE[0] + "\n"))
        linear_layers(monkeypatch, dtype)
        translate.main(["--checkpoint", str(dirs["shared"]), "--max-new-tokens", str(CAP)])
        err = capsys.readouterr().err
        assert ("note: int8 linear layers (MT_LINEAR_DTYPE; int8 is the CPU default)" in err) == noted
        assert ("note:" in err) == noted


def test_float16_import_says_it_rounds(dirs, tmp_path, capsys):
    """--dtype float16 of a float32 source: allowed, noted in the output and the metadata; a float16
    source is kept in float16 by default, with no note."""
    d = dirs["shared"]
    assert convert(["--from-marian", str(d), "--out", str(tmp_path / "f16"), "--dtype", "float16"]) == 0
    captured = capsys.readouterr()
    assert "weights stored as float16 (source: float32)" in captured.out
    assert "note: float16 weights round the float32 ones: translations can differ slightly" in captured.err
    assert load_metadata(tmp_path / "f16")["notes"][0].startswith("float16 weights round the float32 ones")
    half = build(tmp_path / "half", "shared")
    from safetensors.torch import load_file, save_file
    weights = load_file(str(half / "model.safetensors"))
    save_file({k: v.half() for k, v in weights.items()}, str(half / "model.safetensors"), metadata={"format": "pt"})
    assert convert(["--from-marian", str(half), "--out", str(tmp_path / "kept")]) == 0
    captured = capsys.readouterr()
    assert "weights stored as float16 (source: float16)" in captured.out and "note:" not in captured.err
    assert load_metadata(tmp_path / "kept")["dtype"] == "float16"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_decode_equals_batch_decode(dirs, layout):
    """Any target ids, source-only and target-only pieces included, decode to MarianTokenizer's text;
    with clean_up_tokenization_spaces in tokenizer_config.json too."""
    d = dirs[layout]
    tok = load_marian(d)[1]
    hf_tok = MarianTokenizer.from_pretrained(d)
    g = torch.Generator().manual_seed(0)
    V = tok.vocab_size
    pad_id = tok.pad_id
    seqs = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (200,), generator=g)]
    seqs = [[t for t in s if t != pad_id] for s in seqs]    # MarianTokenizer keeps a separate target's <pad>
    assert [tok.decode(s) for s in seqs] == hf_tok.batch_decode(seqs, skip_special_tokens=True)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(config | {"clean_up_tokenization_spaces": True}))
    try:
        tok = load_marian(d)[1]
        hf_tok = MarianTokenizer.from_pretrained(d)
        seqs += [[tok.target_vocab[p] for p in tok.sp_target.encode("A man , a dog ! Who ? It 's done .", out_type=str)
                  if p in tok.target_vocab]]
        assert [tok.decode(s) for s in seqs] == hf_tok.batch_decode(seqs, skip_special_tokens=True)
    finally:
        (d / "tokenizer_config.json").write_text(json.dumps(config))


# ---- each generation setting ------------------------------------------------------------------

APPLIED = {   # generation_config.json fields over the published ones, each applied: the same text as transformers
    "early_stopping true": {"early_stopping": True},
    "early_stopping never, length_penalty 2": {"early_stopping": "never", "length_penalty": 2.0},
    "length_penalty 0.6": {"length_penalty": 0.6},
    "no forced EOS": {"forced_eos_token_id": None},
    "sampling fields ignored without do_sample": {"do_sample": False, "temperature": 0.7, "top_k": 10, "top_p": 0.9},
}


@pytest.mark.parametrize("case", list(APPLIED))
def test_generation_setting_applied(tmp_path, case):
    d = build(tmp_path / "m", "shared", generation=APPLIED[case])
    model, tok, meta = float32_model(d)
    lp = meta["generation"].get("length_penalty", 1.0)
    for beam in (1, 4):
        for n in (CAP, LONG):
            want, _ = hf_reference(d, SOURCE, beam, n)
            assert translate_lines(model, tok, SOURCE, beam_size=beam, max_new_tokens=n, length_penalty=lp) == want


def test_banned_tokens_never_generated(tmp_path):
    """bad_words_ids beyond the pad token (here the most frequent output token and EOS, which
    transformers never bans) are masked: the same text as transformers, without that token."""
    d = build(tmp_path / "m", "shared")
    _, ids = hf_reference(d, SOURCE, 1, CAP)
    common = max({t for g in ids for t in g}, key=lambda t: sum(g.count(t) for g in ids))
    pad = json.loads((d / "config.json").read_text())["pad_token_id"]
    d2 = build(tmp_path / "banned", "shared", generation={"bad_words_ids": [[pad], [common], [0]]})
    model, tok, _ = float32_model(d2)
    assert model.logits_bias[common] == float("-inf") and model.logits_bias.isfinite().sum() == len(model.logits_bias) - 1
    for beam in (1, 4):
        want, ids = hf_reference(d2, SOURCE, beam, CAP)
        assert translate_lines(model, tok, SOURCE, beam_size=beam, max_new_tokens=CAP) == want
        assert all(common not in g for g in ids)


def test_config_json_generation_fields(tmp_path):
    """An older release (pytorch_model.bin, no generation_config.json): config.json's generation
    fields are read, as transformers falls back to them."""
    d = build(tmp_path / "m", "shared", weights_file="pytorch_model.bin")
    assert not (d / "generation_config.json").exists()
    model, tok, meta = float32_model(d)
    assert meta["generation"]["from"] == "config.json" and (model.cfg.forced_eos, model.cfg.early_stopping) == (True, False)
    want, _ = hf_reference(d, SOURCE, 4, CAP)
    assert translate_lines(model, tok, SOURCE, beam_size=4, max_new_tokens=CAP) == want


REFUSED = {   # a field transformers applies and this project does not: one clear error naming it
    "do_sample": ({"do_sample": True}, "do_sample=true: sampling is not implemented"),
    "no_repeat_ngram_size": ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size=3 is not implemented"),
    "repetition_penalty": ({"repetition_penalty": 1.2}, "repetition_penalty=1.2 is not implemented"),
    "min_length": ({"min_length": 4}, "min_length=4 is not implemented"),
    "forced_bos_token_id": ({"forced_bos_token_id": 5}, "forced_bos_token_id=5 is not implemented"),
    "num_beam_groups": ({"num_beam_groups": 2, "diversity_penalty": 0.5}, "is not implemented"),
    "bad word sequence": ({"bad_words_ids": [[5, 6]]}, "banned sequences of several tokens are not implemented"),
    "forced other token": ({"forced_eos_token_id": 5}, "forced_eos_token_id 5 is not the EOS id 0"),
    "several eos": ({"eos_token_id": [0, 5]}, "eos_token_id [0, 5] is not config.json's eos_token_id 0"),
    "decoder start": ({"decoder_start_token_id": 5}, "decoder_start_token_id 5 differs from config.json's"),
    "early_stopping": ({"early_stopping": "sometimes"}, "early_stopping must be true, false or \"never\""),
    "unknown": ({"my_new_penalty": 0.5}, "unknown generation field my_new_penalty=0.5"),
}


def test_unimplemented_generation_settings_refused(dirs, tmp_path, capsys):
    src = dirs["shared"]
    published = json.loads((src / "generation_config.json").read_text())
    for case, (fields, message) in REFUSED.items():
        d = tmp_path / case.replace(" ", "-")
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "generation_config.json").write_text(json.dumps(published | fields))
        with pytest.raises(MarianImportError, match="generation_config.json: "):
            load_marian(d)
        assert convert(["--from-marian", str(d), "--out", str(tmp_path / "out")]) == 2, case
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (case, err)
        assert not (tmp_path / "out").exists()


def test_unreproducible_settings_noted(dirs, tmp_path, capsys):
    """Without renormalize_logits (transformers' beam scores keep the banned pad's probability) and
    without pad in bad_words_ids (transformers may generate it): imported, each noted; greedy
    outputs still equal transformers' where it does not pick pad."""
    d = build(tmp_path / "m", "shared", generation={"renormalize_logits": None, "bad_words_ids": None})
    assert convert(["--from-marian", str(d), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "note: generation_config.json: renormalize_logits is not true" in err
    assert "note: generation_config.json: bad_words_ids does not ban the pad token" in err
    assert len(load_metadata(tmp_path / "out")["notes"]) == 2
    model, tok, _ = float32_model(tmp_path / "out")
    want, _ = hf_reference(d, SOURCE, 1, CAP)
    hf, hf_tok = hf_loaded(d)
    with torch.no_grad():
        rows = hf.generate(**hf_tok(SOURCE, return_tensors="pt", padding=True), num_beams=1,
                           max_new_tokens=CAP).tolist()
    pad, eos = model.cfg.pad_id, model.cfg.eos_id
    picks_pad = [pad in (r[1: r.index(eos)] if eos in r else r[1:]) for r in rows]
    got = translate_lines(model, tok, SOURCE, beam_size=1, max_new_tokens=CAP)
    assert all(a == b for a, b, p in zip(got, want, picks_pad) if not p) and not all(picks_pad)


# ---- the search's rules, by hand --------------------------------------------------------------

def _run(search: BeamSearch, rows: list[list[tuple[int, float]]]) -> None:
    """Feed one step of (token, log-prob) candidates per alive row, best first, until done."""
    for _ in range(20):
        if search.done:
            return
        k = len(search.alive)
        search.step([[lp for _, lp in rows[b % len(rows)]] for b in range(k)],
                    [[t for t, _ in rows[b % len(rows)]] for b in range(k)])


def test_forced_eos_rule():
    """The last step a budget allows is EOS (log-prob 0), without asking the model; max_new_tokens 1
    gives an empty hypothesis; without forced_eos (our models) the budget ends with 'length'."""
    cands = [[(5, -0.1), (6, -0.2), (7, -0.3), (3, -5.0)]]
    for beam in (1, 2):
        forced = BeamSearch(beam, 3, 4, forced_eos=True)
        _run(forced, cands)
        best = forced.results()[0]
        assert (best.tokens, best.finish_reason) == ([5, 5, 5], "eos") and abs(best.log_prob + 0.3) < 1e-12
        plain = BeamSearch(beam, 3, 4)
        _run(plain, cands)
        assert (plain.results()[0].tokens, plain.results()[0].finish_reason) == ([5, 5, 5, 5], "length")
        one = BeamSearch(beam, 3, 1, forced_eos=True)
        _run(one, cands)
        assert [(h.tokens, h.finish_reason, h.log_prob) for h in one.results()] == [([], "eos", 0.0)]


def test_early_stopping_rule():
    """Two finished hypotheses at step 1 end a beam-2 search with early_stopping=True; with False it
    goes on while the best alive one's log_prob / length beats the worse finished score, and finds
    a better one."""
    # step 1: EOS (-1.0) and EOS... every row offers EOS at -1.0 and token 5 at -0.05
    cands = [[(5, -0.05), (3, -1.0), (6, -3.0), (7, -3.5)]]
    early = BeamSearch(2, 3, 10, early_stopping=True)
    late = BeamSearch(2, 3, 10, early_stopping=False)
    for s in (early, late):
        _run(s, cands)
    assert early.results()[0].tokens == [5] and len(early.finished) == 2
    # False: alive 5,5,... at -0.05 per token beats the finished -1.05 / 2 until the cap
    assert late.results()[0].score > early.results()[0].score
