"""Import of T5-family translation models from a local transformers directory: ``model_type`` ``t5``
(MADLAD-400, T5ForConditionalGeneration) and ``mt5`` (MT5ForConditionalGeneration), onto the one
network's flags (``ModelConfig``): RMSNorm without bias before each block and closing each stack,
heads of width ``d_kv``, unscaled attention logits, relative position buckets (one table per stack,
bidirectional in the encoder, causal in the decoder), no positional encoding, unscaled embeddings, a
gated-GELU (``gated-gelu``, tanh GELU) or ReLU feed-forward layer without biases, and the output layer
``lm_head`` of its own (``tie_word_embeddings: false``; tied: the decoder output × d_model^-0.5 for
``t5``, as transformers does).

A directory is config.json, model.safetensors (or its shards and model.safetensors.index.json) or
pytorch_model.bin, generation_config.json (else
config.json's generation fields, as for MarianMT: ``marian.generation_rules``), tokenizer.json and
tokenizer_config.json (``T5Tokenizer``), whose vocabulary holds the ``<2xx>`` target-language tags
(``model/tag_tokenizer.py``). Anything else this project cannot reproduce raises ``T5ImportError``
naming the file and field.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint import save_checkpoint, unique_state_dict
from ..config import ModelConfig
from ..tag_tokenizer import TagTokenizer
from ..transformer import Transformer
from .marian import (
    MarianImportError,
    _read_json,
    generation_rules,
    read_generation,
    read_marian_weights,
    source_dtype,
)

T5_TYPES = {"t5": "T5 / MADLAD-400", "mt5": "mT5"}                  # model_type -> family name
FEED_FORWARD = {"relu": ("relu", False), "gated-gelu": ("gelu_new", True)}   # feed_forward_proj -> (act, gated)
T5_TOKENIZERS = ("T5Tokenizer", "T5TokenizerFast")


class T5ImportError(MarianImportError):
    """A directory this importer cannot read or reproduce; the message names the file and field."""


def t5_config(hf: dict, where: str) -> ModelConfig:
    """Our ModelConfig of a transformers T5Config / MT5Config dict (search rules unset). Raises
    T5ImportError naming the field this network cannot reproduce."""
    kind = hf.get("model_type")
    if kind not in T5_TYPES:
        raise T5ImportError(f"{where}: model_type {kind!r} is not a T5 family type ({', '.join(T5_TYPES)})")

    def field(name):
        if name not in hf:
            raise T5ImportError(f"{where}: field {name!r} is missing")
        return hf[name]

    proj = hf.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD:
        raise T5ImportError(f"{where}: feed_forward_proj {proj!r} is not supported (choose from "
                            f"{', '.join(FEED_FORWARD)})")
    for name, bad in (("is_encoder_decoder", False), ("is_decoder", True)):
        if hf.get(name) is bad:
            raise T5ImportError(f"{where}: {name}={json.dumps(bad)} is not supported (an encoder-decoder is)")
    tied = hf.get("tie_word_embeddings", True) is not False
    if kind == "mt5" and tied:
        raise T5ImportError(f"{where}: tie_word_embeddings=true is not supported for model_type 'mt5' "
                            f"(transformers' versions disagree on its output scaling)")
    act, gated = FEED_FORWARD[proj]
    pad = hf.get("pad_token_id", 0)
    try:
        return ModelConfig(
            vocab_size=field("vocab_size"), d_model=field("d_model"), n_heads=field("num_heads"), d_kv=field("d_kv"),
            d_ff=field("d_ff"), n_encoder_layers=field("num_layers"),
            n_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
            dropout=float(hf.get("dropout_rate", 0.0)), activation=act, norm_first=True, positional="none",
            scale_embedding=False, max_len=int(hf.get("n_positions") or 512), share_embeddings=True,
            separate_output=not tied, layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)), norm="rmsnorm",
            scale_attention=False, relative_buckets=int(hf.get("relative_attention_num_buckets", 32)),
            relative_max_distance=int(hf.get("relative_attention_max_distance", 128)), gated_ffn=gated,
            linear_bias=False, scale_decoder_output=tied, pad_id=pad, eos_id=hf.get("eos_token_id", 1),
            bos_id=hf.get("decoder_start_token_id", pad) if hf.get("decoder_start_token_id") is not None else pad,
            unk_id=2)
    except (TypeError, ValueError) as e:
        raise T5ImportError(f"{where}: {e}") from None


def t5_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """Our unique state dict from a transformers T5 / MT5 ForConditionalGeneration state dict.
    Raises T5ImportError naming a missing tensor."""
    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise T5ImportError(f"{where}: tensor {name!r} is missing")
        return hf[name].float()

    shared = next((n for n in ("shared.weight", "encoder.embed_tokens.weight") if n in hf), "shared.weight")
    out = {"src_embed.tok.weight": get(shared), "enc_norm.weight": get("encoder.final_layer_norm.weight"),
           "dec_norm.weight": get("decoder.final_layer_norm.weight"),
           "enc_rel.table.weight": get("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
           "dec_rel.table.weight": get("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")}
    if cfg.separate_output:
        out["out_proj.weight"] = get("lm_head.weight")
    ffn = {"w1": "wi_0", "w3": "wi_1", "w2": "wo"} if cfg.gated_ffn else {"w1": "wi", "w2": "wo"}
    for kind, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        blocks = [("self_attn", 0, "SelfAttention")] + ([("cross_attn", 1, "EncDecAttention")] if kind == "decoder" else [])
        norms = ["res1", "res2"] if kind == "encoder" else ["res.0", "res.1", "res.2"]
        for i in range(n):
            theirs, ours = f"{kind}.block.{i}.layer", f"{kind}.{i}"
            for name, j, hf_name in blocks:
                a = f"{theirs}.{j}.{hf_name}"
                out[f"{ours}.{name}.w_q.weight"] = get(f"{a}.q.weight")
                out[f"{ours}.{name}.w_kv.weight"] = torch.cat([get(f"{a}.k.weight"), get(f"{a}.v.weight")])
                out[f"{ours}.{name}.w_o.weight"] = get(f"{a}.o.weight")
            f = len(blocks)
            for w, hf_w in ffn.items():
                out[f"{ours}.ffn.{w}.weight"] = get(f"{theirs}.{f}.DenseReluDense.{hf_w}.weight")
            for j, norm in enumerate(norms):
                out[f"{ours}.{norm}.norm.weight"] = get(f"{theirs}.{j}.layer_norm.weight")
    return out


def read_t5_weights(d: Path) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict, file name) of ``model.safetensors.index.json``'s shards (the larger published
    models, MADLAD-400 among them), else as ``marian.read_marian_weights``. Raises T5ImportError
    naming a missing or unreadable shard."""
    index = d / "model.safetensors.index.json"
    if not index.exists():
        return read_marian_weights(d)
    from safetensors.torch import load_file
    shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
    if not shards:
        raise T5ImportError(f"{index}: no weight_map")
    state: dict[str, torch.Tensor] = {}
    for name in shards:
        if not (d / name).exists():
            raise T5ImportError(f"{d / name}: missing (named by {index.name})")
        try:
            state.update(load_file(str(d / name)))
        except Exception as e:  # noqa: BLE001 - any unreadable shard is one clear error
            raise T5ImportError(f"{d / name}: cannot read weights ({type(e).__name__}: {e})") from None
    return state, index.name


def _tokenizer(d: Path, cfg: ModelConfig) -> tuple[TagTokenizer, list[int], dict]:
    """(tokenizer, its special ids, tokenizer_config.json) of a T5 directory."""
    tok_cfg = _read_json(d / "tokenizer_config.json")
    cls = tok_cfg.get("tokenizer_class")
    if cls not in T5_TOKENIZERS:
        raise T5ImportError(f"{d / 'tokenizer_config.json'}: tokenizer_class {cls!r} is not supported (choose from "
                            f"{', '.join(T5_TOKENIZERS)})")
    if not (d / "tokenizer.json").exists():
        hint = (" (spiece.model alone: write it once with transformers, AutoTokenizer.from_pretrained(DIR)"
                ".save_pretrained(DIR))") if (d / "spiece.model").exists() else ""
        raise T5ImportError(f"{d / 'tokenizer.json'}: missing (a T5 tokenizer is read from tokenizer.json){hint}")
    tok = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    special_ids = [t["id"] for t in tok.get("added_tokens", []) if t.get("special")]
    if isinstance((tok.get("model") or {}).get("unk_id"), int):     # the Unigram model's <unk> (T5: 2)
        cfg.unk_id = tok["model"]["unk_id"]
    specials = {"pad": cfg.pad_id, "unk": cfg.unk_id, "eos": cfg.eos_id, "bos": cfg.bos_id}
    try:
        t = TagTokenizer(d, specials, special_ids, tok_cfg.get("clean_up_tokenization_spaces") is True)
    except (OSError, ValueError) as e:
        raise T5ImportError(str(e)) from None
    if not t.target_languages:
        raise T5ImportError(f"{d / 'tokenizer.json'}: no <2xx> target-language tags in the vocabulary (a T5 model "
                            f"is imported as a translation model that names the target in the source, as MADLAD-400)")
    return t, special_ids, tok_cfg


def load_t5(directory: str | Path) -> tuple[Transformer, TagTokenizer, dict]:
    """(model in float32 eval mode, unpacked; tokenizer; metadata) of a T5 / mT5 / MADLAD-400 directory.
    Raises T5ImportError naming the file and field that is missing, inconsistent or not reproducible."""
    d = Path(directory)
    if not d.is_dir():
        raise T5ImportError(f"{d}: not a directory")
    hf = _read_json(d / "config.json")
    cfg = t5_config(hf, str(d / "config.json"))
    if not (d / "tokenizer_config.json").exists():
        raise T5ImportError(f"{d / 'tokenizer_config.json'}: missing (no tokenizer)")
    gen, gen_file = read_generation(d, hf)
    if gen.get("decoder_start_token_id") is not None:      # T5's configs keep it here
        cfg.bos_id = gen["decoder_start_token_id"]
    tok, special_ids, tok_cfg = _tokenizer(d, cfg)
    if tok.vocab_size > cfg.vocab_size:
        raise T5ImportError(f"{d / 'config.json'}: vocab_size {cfg.vocab_size} is smaller than the tokenizer's "
                            f"{tok.vocab_size} entries")
    rules = generation_rules(gen, gen_file, cfg)
    cfg.forced_eos, cfg.early_stopping = rules["forced_eos"], rules["early_stopping"]
    weights, wname = read_t5_weights(d)
    if not cfg.separate_output and "lm_head.weight" in weights and not torch.equal(
            weights["lm_head.weight"], weights.get("shared.weight", weights["lm_head.weight"])):
        raise T5ImportError(f"{d / 'config.json'}: tie_word_embeddings is true but {wname} has an lm_head.weight of "
                            f"its own")
    state = t5_state_dict(weights, cfg, str(d / wname))
    if rules["banned"]:
        cfg.final_logits_bias = True
        state["logits_bias"] = torch.zeros(cfg.vocab_size)
        state["logits_bias"][rules["banned"]] = float("-inf")
    model = Transformer(cfg)
    with torch.no_grad():
        for name, t in unique_state_dict(model).items():
            if tuple(state[name].shape) != tuple(t.shape):
                raise T5ImportError(f"{d / wname}: {name} has shape {tuple(state[name].shape)}, but config.json "
                                    f"implies {tuple(t.shape)}")
            t.copy_(state[name])
    meta = {"imported_from": f"{T5_TYPES[hf['model_type']]} directory {d.name}", "dtype": "float32",
            "t5": {"tokenizer": ["tokenizer.json"], "special_ids": sorted(special_ids),
                   "clean_up_tokenization_spaces": tok.clean_up_spaces},
            "source_languages": list(tok.source_languages), "target_languages": list(tok.target_languages),
            "generation": rules["defaults"], "notes": rules["notes"] or None, "source_dtype": source_dtype(weights)}
    return model.eval(), tok, {k: v for k, v in meta.items() if v is not None}


def convert_t5(directory: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write a T5 / mT5 / MADLAD-400 directory as our checkpoint: config.json, model.safetensors in
    ``dtype`` (default: the source weights' own), tokenizer.json and tokenizer_config.json, metadata.json.
    Raises T5ImportError; nothing is written then."""
    from .marian import DTYPE_NOTE, WEIGHT_DTYPES
    model, tok, meta = load_t5(directory)
    source = meta["source_dtype"]
    dtype = dtype or source
    notes = list(meta.get("notes", []))
    if WEIGHT_DTYPES[dtype].itemsize < WEIGHT_DTYPES[source].itemsize or {dtype, source} == {"float16", "bfloat16"}:
        notes.append(DTYPE_NOTE.format(dtype=dtype, source=source))
    d = Path(directory)
    meta = {**meta, "dtype": dtype} | ({"notes": notes} if notes else {})
    return save_checkpoint(out, model, [d / "tokenizer.json", d / "tokenizer_config.json"], meta, dtype)

