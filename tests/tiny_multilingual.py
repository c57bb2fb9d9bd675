"""Tiny random NLLB-200, M2M100 and mBART-50 directories, saved the way the published models are
(not a test module): transformers' ``save_pretrained`` of the model (config.json, model.safetensors)
and of the family's own tokenizer class, built here from a tokenizer trained on a few sentences
(NLLB: a BPE ``tokenizer.json`` trained with ``tokenizers``; M2M100: a SentencePiece BPE model and
its vocab.json; mBART-50: a SentencePiece unigram model's pieces in a ``tokenizer.json``), and a
generation_config.json with the published fields (``published_generation``). Needs ``transformers``."""
from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm
import torch

DE = ["Ein Mann fährt mit dem Fahrrad die Straße entlang.", "Zwei Hunde spielen im Schnee.",
      "Eine Frau liest ein Buch im Park.", "Kinder spielen Fußball auf dem grünen Rasen.",
      "Der Preis ist 3,50 €.", "Danke.", "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.",
      "Herr Müller wohnt neben dem Gebäude in Düsseldorf.", "Frau Schröder fährt nach München.",
      "Die Brücke über die Spree ist gesperrt."]
FR = ["Un homme descend la rue à vélo.", "Deux chiens jouent dans la neige.", "Une femme lit un livre au parc.",
      "Des enfants jouent au football sur la pelouse verte.", "Le prix est de 3,50 €.", "Merci.",
      "Une petite fille grimpe dans une cabane en bois.", "Le pont est fermé aujourd'hui."]
EN = ["A man rides a bike down the street.", "Two dogs play in the snow.", "A woman reads a book in the park.",
      "Children play soccer on the green grass.", "The price is 3.50 €.", "Thank you."]
NLLB_CODES = ["deu_Latn", "eng_Latn", "fra_Latn", "zho_Hans", "zho_Hant"]


def published_generation(**over) -> dict:
    """generation_config.json as the published models have it (NLLB-200 / M2M100 / mBART-50: the
    decoder starts at ``</s>``, EOS forced at max_length, beam 5 in the config) with, as the
    published OPUS-MT configs, the pad token banned and logits renormalised (transformers otherwise
    keeps pad's probability in beam scores, which this project's search never generates)."""
    gen = {"bos_token_id": 0, "decoder_start_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
           "forced_eos_token_id": 2, "max_length": 200, "num_beams": 5, "early_stopping": True,
           "length_penalty": 1.0, "bad_words_ids": [[1]], "renormalize_logits": True}
    return {k: v for k, v in (gen | over).items() if v is not None}


def _lines() -> list[str]:
    return (DE + FR + EN) * 3


def _nllb_tokenizer(d: Path, extra: tuple[str, ...] = ()):
    from tokenizers import SentencePieceBPETokenizer
    from transformers import NllbTokenizer
    bpe = SentencePieceBPETokenizer()
    bpe.train_from_iterator(_lines() + list(extra), vocab_size=150, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                            show_progress=False)
    model = json.loads(bpe._tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return NllbTokenizer(vocab=model["vocab"], merges=merges, extra_special_tokens=list(NLLB_CODES),
                         src_lang="deu_Latn")


def _spm(d: Path, model_type: str, **kw) -> Path:
    txt = d / "train.txt"
    txt.write_text("\n".join(_lines()) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(txt), model_prefix=str(d / "sp"), vocab_size=120, model_type=model_type,
                                   character_coverage=1.0, hard_vocab_limit=False, minloglevel=2, **kw)
    txt.unlink()
    (d / "sp.vocab").unlink()
    return d / "sp.model"


def _m2m100_tokenizer(d: Path):
    from transformers import M2M100Tokenizer
    model = _spm(d, "bpe")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(sp.get_piece_size()):
        if not (sp.is_control(i) or sp.is_unknown(i)):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
    (d / "raw_vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tok = M2M100Tokenizer(str(d / "raw_vocab.json"), str(model), src_lang="de")
    return tok, [d / "raw_vocab.json", model]


def _mbart50_tokenizer(d: Path):
    from transformers import MBart50Tokenizer
    model = _spm(d, "unigram")
    sp = spm.SentencePieceProcessor(model_file=str(model))
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    model.unlink()
    return MBart50Tokenizer(vocab=vocab, src_lang="de_DE")


def make_dir(directory: Path, family: str, seed: int = 0, eos_boost: float = 0.5, generation: dict | None = None,
             extra_lines: tuple[str, ...] = ()) -> Path:
    """Write a tiny random model of ``family`` ("nllb", "m2m100", "mbart50", "mbart50-spm": mBART-50 with
    sentencepiece.bpe.model and no tokenizer.json; d_model 32, 2+2 layers,
    4 heads) to directory with its tokenizer files and generation config (``published_generation``
    with ``generation`` over it). Weights are drawn wider than transformers' init, so outputs depend
    on the source; ``eos_boost`` makes EOS likelier (the decoder's final LayerNorm bias points at
    its embedding), so outputs end at mixed lengths. ``extra_lines``: more text the NLLB tokenizer is
    trained on (a word repeated there becomes one piece)."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration, MBartConfig, MBartForConditionalGeneration
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    scratch = d / "scratch"
    scratch.mkdir()
    extra = []
    if family == "nllb":
        tok = _nllb_tokenizer(scratch, extra_lines)
    elif family == "m2m100":
        tok, extra = _m2m100_tokenizer(scratch)
    elif family == "mbart50-spm":   # mBART-50 as published without tokenizer.json: its SentencePiece model alone
        from transformers import MBart50Tokenizer
        from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES
        _spm(scratch, "unigram").rename(d / "sentencepiece.bpe.model")
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "MBart50Tokenizer", "src_lang": "de_DE", "bos_token": "<s>", "eos_token": "</s>",
            "additional_special_tokens": list(FAIRSEQ_LANGUAGE_CODES)}))
        tok = MBart50Tokenizer.from_pretrained(d)
    else:
        tok = _mbart50_tokenizer(scratch)
    if family != "mbart50-spm":
        tok.save_pretrained(d)
    if family == "m2m100":   # the published tokenizer_config.json lists the language tokens (transformers 5 writes none)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["additional_special_tokens"] = [tok.get_lang_token(c) for c in tok.lang_code_to_id]
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    for f in extra:
        f.unlink(missing_ok=True)
    scratch.rmdir()
    # M2M100: vocab.json, then the language tokens, then 8 "madeup words" (rows no piece names)
    V = tok.encoder_size + len(tok.lang_code_to_id) + tok.num_madeup_words if family == "m2m100" else len(tok)
    common = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, scale_embedding=True,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(seed)
    if family.startswith("mbart50"):
        model = MBartForConditionalGeneration(MBartConfig(activation_function="gelu", **common)).eval()
    else:
        model = M2M100ForConditionalGeneration(M2M100Config(activation_function="relu", **common)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "embed_positions" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 6.0 / p.size(-1) ** 0.5)
        emb = model.model.shared.weight
        emb.copy_(emb / emb.norm(dim=1, keepdim=True))
        eos = emb[2] / emb[2].norm()
        model.model.decoder.layer_norm.bias.add_(eos_boost * eos)
        if family.startswith("mbart50"):
            model.final_logits_bias.normal_(0.0, 0.5)
    model.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps(published_generation(**(generation or {})), indent=2))
    return d
