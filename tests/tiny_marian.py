"""Tiny random MarianMT directories, saved the way published OPUS-MT models are (not a test module):
``save_pretrained`` (config.json, model.safetensors), generation_config.json as the published models
have it (``published_generation``), two small SentencePiece models trained here (source.spm,
target.spm), one joint vocab.json (``</s>`` 0, ``<unk>`` 1, the pieces of both, ``<pad>`` last) and
tokenizer_config.json. Needs ``transformers`` (a dev extra)."""
from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm
import torch

DE = ["Ein Mann fährt mit dem Fahrrad die Straße entlang.", "Zwei Hunde spielen im Schnee.",
      "Eine Frau liest ein Buch im Park.", "Kinder spielen Fußball auf dem grünen Rasen.",
      "Der Preis ist 3,50 €.", "Danke.", "Ein kleines Mädchen klettert in ein Spielhaus aus Holz."]
EN = ["A man rides a bike down the street.", "Two dogs play in the snow.", "A woman reads a book in the park.",
      "Children play soccer on the green grass.", "The price is 3.50 €.", "Thank you.",
      "A little girl climbs into a wooden playhouse."]


def train_spm(lines: list[str], prefix: Path, vocab_size: int = 60) -> Path:
    """A unigram SentencePiece model trained on lines, saved as ``prefix.spm``."""
    txt = prefix.with_suffix(".txt")
    txt.write_text("\n".join(lines * 3) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(txt), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
                                   minloglevel=2)
    txt.unlink()
    prefix.with_suffix(".vocab").unlink()
    return prefix.with_suffix(".model").rename(prefix.with_suffix(".spm"))


def joint_vocab(spm_files: list[Path], codes: tuple = ()) -> dict[str, int]:
    """``</s>`` 0, ``<unk>`` 1, the target-language tokens ``>>xx<<`` of ``codes``, every piece of
    the models in order (once), ``<pad>`` last (OPUS-MT's layout)."""
    vocab = {"</s>": 0, "<unk>": 1} | {f">>{c}<<": 2 + i for i, c in enumerate(codes)}
    for f in spm_files:
        sp = spm.SentencePieceProcessor(model_file=str(f))
        for i in range(sp.get_piece_size()):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    return vocab


def published_generation(pad_id: int, eos_id: int = 0) -> dict:
    """generation_config.json of the published OPUS-MT models (e.g. opus-mt-en-zh): pad never
    generated, EOS forced at the length limit, beam 4, logits renormalised after masking."""
    return {"bad_words_ids": [[pad_id]], "bos_token_id": 0, "decoder_start_token_id": pad_id, "eos_token_id": eos_id,
            "forced_eos_token_id": eos_id, "max_length": 512, "num_beams": 4, "pad_token_id": pad_id,
            "renormalize_logits": True}


def make_marian_dir(directory: Path, activation: str = "swish", scale_embedding: bool = True, seed: int = 0,
                    weights_file: str = "model.safetensors", separate_vocabs: bool = False,
                    target_languages: tuple = (), generation: dict | None = None, eos_bias: float = 3.0,
                    source_lines: list[str] = DE, target_lines: list[str] = EN, vocab_sizes: tuple = ()) -> Path:
    """Write a tiny random MarianMT model (d_model 32, 2+2 layers, 4 heads) to directory.

    Weights are drawn wider than transformers' init (std 0.02 makes every logit nearly equal, so
    outputs would hinge on rounding) and ``final_logits_bias`` is random, so that outputs depend on
    the source and end with EOS at mixed lengths. ``weights_file="pytorch_model.bin"`` saves a pickled state dict
    instead of safetensors (older published models). ``separate_vocabs``: a source vocab.json and a
    smaller target_vocab.json ("tc-big" models; ``share_encoder_decoder_embeddings: false``), each laid
    out as the joint one, so the source's ``<pad>`` id differs from the target's (config.json's).
    ``target_languages``: a multilingual model, whose sources start with ``>>xx<<`` (one per code).
    ``generation``: fields over ``published_generation`` (None drops one) for generation_config.json;
    the pytorch_model.bin layout (older releases) has no such file, its config.json holds them.
    ``eos_bias``: added to EOS's logit bias. ``source_lines`` / ``target_lines``: what the source /
    target SentencePiece models are trained on, ``vocab_sizes`` their sizes."""
    from transformers import MarianConfig, MarianMTModel
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    sizes = vocab_sizes or (80 if separate_vocabs else 60, 60)
    files = [train_spm(source_lines, d / "source", sizes[0]), train_spm(target_lines, d / "target", sizes[1])]
    vocab = joint_vocab(files[:1] if separate_vocabs else files, target_languages)
    target = joint_vocab(files[1:]) if separate_vocabs else vocab
    V, V_tgt = len(vocab), len(target)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    if separate_vocabs:
        (d / "target_vocab.json").write_text(json.dumps(target, ensure_ascii=False), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps({"source_lang": "de", "target_lang": "en",
                                                         "model_max_length": 512, "separate_vocabs": separate_vocabs}))
    cfg = MarianConfig(vocab_size=V, decoder_vocab_size=V_tgt, share_encoder_decoder_embeddings=not separate_vocabs,
                       d_model=32, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       max_position_embeddings=64, pad_token_id=V_tgt - 1, eos_token_id=0, decoder_start_token_id=V_tgt - 1,
                       forced_eos_token_id=0, activation_function=activation, scale_embedding=scale_embedding)
    torch.manual_seed(seed)
    model = MarianMTModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" in name:
                continue
            if "layer_norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("weight") else torch.zeros_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, 6.0 / p.size(-1) ** 0.5)
        for emb in {id(e.weight): e.weight for e in (model.model.encoder.embed_tokens,
                                                     model.model.decoder.embed_tokens)}.values():
            emb.copy_(emb / emb.norm(dim=1, keepdim=True))    # unit rows: no token wins by its norm alone
        model.final_logits_bias.normal_(0.0, 0.5)
        model.final_logits_bias[0, 0] += eos_bias             # EOS likelier: outputs of mixed lengths
    gen = {k: v for k, v in (published_generation(V_tgt - 1) | (generation or {})).items() if v is not None}
    if weights_file == "pytorch_model.bin":
        model.config.save_pretrained(d)
        torch.save(model.state_dict(), d / weights_file)
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config | gen, indent=2))
    else:
        model.save_pretrained(d)
        (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return d
