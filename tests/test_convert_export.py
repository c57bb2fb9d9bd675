"""MarianMT export (model/interop/marian_export.py, ``python -m model.convert --to-marian``): our checkpoints
written as MarianMT directories that ``transformers`` loads. import(export(x)) == x (config, weights,
outputs); transformers' logits on an export equal ours; the shipped de-en model exported gives, under
``generate()``, our engine's greedy output token for token on 100 test_2016_flickr sentences."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import MarianMTModel, MarianTokenizer  # noqa: E402

from conftest import DATA, build_tiny_checkpoint, shipped_model_available  # noqa: E402
from model.checkpoint import DEFAULT_CHECKPOINT, save_checkpoint, unique_state_dict
from model.load import load_model  # noqa: E402
from model.interop.marian import convert_marian, load_marian
from model.convert import main  # noqa: E402
from model.inference.generate import pad_batch  # noqa: E402
from model.tokenizer import read_lines  # noqa: E402
from model.tokenizer import encode_source  # noqa: E402
from model.inference.linear import pack_for_inference
from service.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402
from tiny_marian import DE, make_marian_dir  # noqa: E402
from tiny_model import one_thread  # noqa: F401,E402 (autouse fixture)

MARIAN_FILES = {"config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json",
                "tokenizer_config.json", "generation_config.json"}


def float32(model):
    """The model with float32 (prepacked) linear layers, as the comparisons need."""
    pack_for_inference(model, dtype=torch.float32)
    return model


def randomize(ckpt, **overrides):
    """Rewrite a checkpoint with random LayerNorm weights and biases (Xavier init leaves them 1 and 0,
    which would not show a wrong permutation) and config ``overrides``; returns the model."""
    model, tok, meta = load_model(ckpt, pack=False)
    cfg = model.cfg
    for k, v in overrides.items():
        setattr(cfg, k, v)
    fresh = type(model)(cfg)
    fresh.load_state_dict(model.state_dict(), strict=False)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    save_checkpoint(ckpt, fresh, [ckpt / "tokenizer.model"], meta, dtype="float32")
    return fresh.eval()


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "de", "en")


@pytest.mark.parametrize("overrides", [{}, {"activation": "gelu", "scale_embedding": False}])
def test_import_of_export_is_the_same_model(tiny_ckpt, tmp_path, overrides):
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    ours = randomize(ckpt, **overrides)
    out = tmp_path / "marian"
    assert main(["--to-marian", str(ckpt), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == MARIAN_FILES
    hf_cfg = json.loads((out / "config.json").read_text())
    assert (hf_cfg["model_type"], hf_cfg["decoder_start_token_id"], hf_cfg["pad_token_id"], hf_cfg["eos_token_id"]) == \
        ("marian", 2, 0, 3)
    back, tok, meta = load_marian(out)
    assert back.cfg == ours.cfg and meta["source_lang"] == "de"
    a, b = unique_state_dict(ours), unique_state_dict(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)      # exactly, not nearly
    _, ours_tok, _ = load_model(ckpt, pack=False)
    lines = read_lines(DATA / "val.de.gz")[:50]
    assert [tok.encode(t) for t in lines] == [ours_tok.encode(t) for t in lines]
    ids = ours_tok.encode("Ein Mann fährt mit dem Fahrrad.")
    assert tok.decode(ids) == ours_tok.decode(ids)
    # transformers reads the export: same source ids, same logits (the permuted residual stream is exact)
    hf = MarianMTModel.from_pretrained(out).eval()
    hf_tok = MarianTokenizer.from_pretrained(out)
    enc = hf_tok(lines[:8], return_tensors="pt", padding=True)
    src = pad_batch([encode_source(ours_tok, t, ours.cfg.max_len) for t in lines[:8]], 0)
    assert torch.equal(enc.input_ids, src)
    tgt = torch.randint(4, ours.cfg.vocab_size, (8, 6), generator=torch.Generator().manual_seed(1))
    tgt[:, 0] = ours.cfg.bos_id
    with torch.no_grad():
        ref = hf(**enc, decoder_input_ids=tgt).logits
        got = float32(ours)(src, tgt)
    assert ref.abs().max() > 1.0 and (got - ref).abs().max().item() < 1e-4


def test_reexport_of_an_imported_marian_model(tmp_path):
    """A MarianMT model with separate vocabularies (split sinusoids, final_logits_bias) imported, then
    exported: transformers gives the original's logits (the source vocabulary as renumbered at import)."""
    d = make_marian_dir(tmp_path / "orig", activation="swish", seed=1, separate_vocabs=True)
    ckpt = convert_marian(d, tmp_path / "ckpt")
    out = tmp_path / "export"
    assert main(["--to-marian", str(ckpt), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == MARIAN_FILES | {"target_vocab.json"}
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["share_encoder_decoder_embeddings"] is False and hf_cfg["exported_from"]["sinusoid_layout"] == "split"
    a, b = (MarianMTModel.from_pretrained(x).eval() for x in (d, out))
    enc_a, enc_b = (MarianTokenizer.from_pretrained(x)(DE, return_tensors="pt", padding=True) for x in (d, out))
    V = hf_cfg["decoder_vocab_size"]
    tgt = torch.randint(2, V - 1, (len(DE), 5), generator=torch.Generator().manual_seed(0))
    tgt[:, 0] = V - 1
    with torch.no_grad():
        ref, got = a(**enc_a, decoder_input_ids=tgt).logits, b(**enc_b, decoder_input_ids=tgt).logits
    assert ref.abs().max() > 1.0 and (got - ref).abs().max().item() < 1e-4
    assert load_marian(out)[0].cfg == load_marian(d)[0].cfg


@pytest.mark.parametrize("overrides, field", [({"norm_first": True}, "norm_first"),
                                              ({"positional": "learned"}, "positional")])
def test_what_marian_cannot_express_is_one_clear_error(tiny_ckpt, tmp_path, capsys, overrides, field):
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    randomize(ckpt, **overrides)
    assert main(["--to-marian", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config.json: {field}: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# slow (make test runs it, the quick loop does not): transformers' generate() on 140 sentences of the
# shipped model, ~6 s; in the quick loop the export's logits equal ours (test_import_of_export_is_the_same_model,
# test_reexport_of_an_imported_marian_model) and generate() on imported models equals our search, greedy
# and beam (tests/test_marian_parity.py)
@pytest.mark.slow
@pytest.mark.skipif(not shipped_model_available(), reason="the shipped de-en checkpoint is not present")
def test_shipped_model_exported_transformers_greedy_equals_engine(tmp_path):
    out = tmp_path / "opus-style-de-en"
    assert main(["--to-marian", str(DEFAULT_CHECKPOINT), "--out", str(out)]) == 0
    hf = MarianMTModel.from_pretrained(out).eval()
    hf_tok = MarianTokenizer.from_pretrained(out)
    model, tok, _ = load_model(DEFAULT_CHECKPOINT, pack=False)
    model = float32(model)
    lines = read_lines(DATA / "test_2016_flickr.de.gz")[:100]
    srcs = [encode_source(tok, t, model.cfg.max_len) for t in lines]
    enc = hf_tok(lines, return_tensors="pt", padding=True)
    assert [[i for i in row if i != model.cfg.pad_id] for row in enc.input_ids.tolist()] == srcs
    max_new = 64
    with torch.no_grad():      # plain greedy over our scores: see docs/model.md (MarianMT export)
        rows = hf.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=max_new, renormalize_logits=True,
                           bad_words_ids=[[model.cfg.pad_id], [model.cfg.bos_id]], forced_eos_token_id=None).tolist()
        # beam 4 with the exported generation_config.json's defaults: our beam search
        n_beam = 40
        beam_rows = hf.generate(**hf_tok(lines[:n_beam], return_tensors="pt", padding=True),
                                max_new_tokens=max_new).tolist()
    eos = model.cfg.eos_id

    def tokens(rows):
        out = [[t for t in r[1:] if t != model.cfg.pad_id] for r in rows]
        return [r[: r.index(eos)] if eos in r else r for r in out]

    ref, beam_ref = tokens(rows), tokens(beam_rows)

    async def run():
        engine = Engine(model, EngineConfig(max_num_seqs=256))
        await engine.start()
        try:
            jobs = [engine.translate(s, GenerationOptions(beam_size=beam, max_new_tokens=max_new))
                    for beam, some in ((1, srcs), (4, srcs[:n_beam])) for s in some]
            return [r.hypotheses[0].tokens for r in await asyncio.gather(*jobs)]
        finally:
            await engine.stop()

    got = asyncio.run(run())
    assert sum(len(r) for r in ref) > 1000 and all(0 < len(r) < max_new for r in ref)   # real translations that end
    assert got[:len(srcs)] == ref
    assert got[len(srcs):] == beam_ref and beam_ref != ref[:n_beam]      # beam search differs from greedy somewhere
    texts = hf_tok.batch_decode(rows, skip_special_tokens=True)
    assert texts == [tok.decode(g) for g in got[:len(srcs)]]
