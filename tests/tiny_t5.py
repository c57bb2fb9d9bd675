"""Tiny random T5 / mT5 translation models in MADLAD-400's on-disk layout (not a test module):
config.json (``feed_forward_proj: gated-gelu``, ``tie_word_embeddings: false``, 32 buckets, maximum
distance 128), model.safetensors with an ``lm_head.weight`` of its own, generation_config.json, and
transformers' ``T5Tokenizer`` (tokenizer.json, tokenizer_config.json) built from a SentencePiece
unigram model trained here on a few sentences with the ``<2de> <2fr> <2en>`` tags as user-defined
pieces. Needs ``transformers``."""
from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm
import torch
from safetensors.torch import save_file
from tiny_multilingual import DE, EN, FR

TAGS = ["<2de>", "<2fr>", "<2en>"]


def _tokenizer(d: Path):
    from transformers import T5Tokenizer
    txt = d / "train.txt"
    txt.write_text("\n".join((DE + FR + EN) * 3) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(txt), model_prefix=str(d / "sp"), vocab_size=120, model_type="unigram",
                                   character_coverage=1.0, hard_vocab_limit=False, minloglevel=2, pad_id=0,
                                   eos_id=1, unk_id=2, bos_id=-1, user_defined_symbols=TAGS)
    sp = spm.SentencePieceProcessor(model_file=str(d / "sp.model"))
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    for f in ("train.txt", "sp.model", "sp.vocab"):
        (d / f).unlink()
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def make_t5_dir(directory: Path, model_type: str = "t5", seed: int = 0, eos_boost: float = 0.5,
                generation: dict | None = None, shards: int = 1, tied: bool = False, ffn: str = "gated-gelu",
                **config) -> Path:
    """Write a tiny random ``model_type`` ("t5": T5ForConditionalGeneration as MADLAD-400 publishes
    it; "mt5") model to directory: d_model 32, 4 heads of d_kv 16 (n_heads·d_kv = 64 != d_model),
    d_ff 64, 2+2 layers, untied. Weights are drawn wider than transformers' init so outputs depend on
    the source; ``eos_boost`` points the decoder's output towards EOS so outputs end at mixed lengths.
    The generation config bans pad, as this project's search never generates it (transformers would).
    ``shards`` > 1: the weights in that many files with model.safetensors.index.json (as the larger
    published models). ``tied``: no lm_head of its own (original T5: the decoder output × d_model^-0.5
    before the shared embedding); ``ffn``: feed_forward_proj. ``config`` overrides config.json fields."""
    from transformers import (
        MT5Config,
        MT5ForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
    )
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(d)
    tok.save_pretrained(d)
    cls, ccls = ((T5ForConditionalGeneration, T5Config) if model_type == "t5"
                 else (MT5ForConditionalGeneration, MT5Config))
    cfg = ccls(vocab_size=len(tok), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
               feed_forward_proj=ffn, tie_word_embeddings=tied, decoder_start_token_id=0,
               pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    state = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if "layer_norm" in name:
                state[name] = 1.0 + 0.1 * torch.randn_like(p)
            elif "relative_attention_bias" in name:
                state[name] = torch.randn_like(p)
            else:
                state[name] = torch.randn_like(p) * 2.0 / p.size(-1) ** 0.5
        state["shared.weight"] = state["shared.weight"] / state["shared.weight"].norm(dim=1, keepdim=True)
        lm = torch.randn(len(tok), 32) * 32 ** -0.5
        lm[1] += eos_boost * state["decoder.final_layer_norm.weight"]   # EOS likelier
        if tied:
            state["shared.weight"][1] = lm[1] * 4
            state.pop("lm_head.weight", None)
        else:
            state["lm_head.weight"] = lm
    state["encoder.embed_tokens.weight"] = state["decoder.embed_tokens.weight"] = state["shared.weight"]
    model.save_pretrained(d)                 # config.json as transformers writes it, then MADLAD's fields
    hf = json.loads((d / "config.json").read_text())
    hf.update({"tie_word_embeddings": tied, "architectures": [cls.__name__]}, **config)
    (d / "config.json").write_text(json.dumps(hf, indent=2))
    for f in d.glob("*.safetensors"):
        f.unlink()
    state = {k: v.contiguous().clone() for k, v in state.items()}
    if shards == 1:
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(state)
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: state[k] for k in names[i::shards]}
            save_file(part, str(d / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(part, file)
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    gen = {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, "bad_words_ids": [[0]],
           "renormalize_logits": True} | (generation or {})
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return d
