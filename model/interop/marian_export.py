"""Export of our checkpoints as MarianMT directories (``python -m model.convert --to-marian``).

The written directory is what ``transformers``' ``save_pretrained`` and the OPUS-MT releases hold:
``config.json`` (``model_type: marian``), ``model.safetensors`` (transformers' parameter names),
``source.spm``, ``target.spm``, ``vocab.json`` (piece -> OUR id), ``tokenizer_config.json`` and
``generation_config.json``; ``MarianMTModel.from_pretrained`` and ``MarianTokenizer.from_pretrained``
load it (``tests/test_convert_export.py``).

What Marian cannot say directly, and the exact mapping used:

- **Sinusoid layout.** transformers recomputes Marian's position table at load (sines in the first
  ceil(d/2) dimensions, cosines in the rest; ``MarianSinusoidalPositionalEmbedding``, not a stored
  weight: ``save_pretrained`` drops it). Ours interleaves them (dimension 2i sine, 2i+1 cosine) with
  the same frequencies, so the split table is ours with its dimensions permuted. Permuting the
  residual stream's basis is an exact symmetry of the network: every linear layer reading the
  stream has its input columns permuted, every one writing it its output rows (and bias), LayerNorm
  (mean and variance do not depend on the order) its weight and bias, the embeddings their columns;
  logits (a dot product with the tied embedding) do not change. Outputs are equal up to float
  summation order.
- **Decoder start.** Marian starts the decoder with ``decoder_start_token_id`` (the pad token in
  OPUS-MT models); ours starts with ``<s>`` (``bos_id``), written as ``decoder_start_token_id``.
- **Ids.** ``vocab.json`` keeps our ids (pad 0, unk 1, ``<s>`` 2, ``</s>`` 3); ``<pad>`` and ``<s>``
  are never generated (``bad_words_ids`` in ``generation_config.json``, as our search masks them).
- No ``final_logits_bias`` in ours: zeros.

``config.json`` also records ``exported_from`` (our sinusoid layout and bias flag): the importer
(``model.interop.marian.load_marian``) undoes the permutation, so import(export(x)) has x's weights and config.
Refused, each with one ``MarianExportError`` naming the field: learned positions, pre-LN
(transformers' MarianMTModel is post-LN only), an untied output layer, a LayerNorm epsilon other
than transformers' 1e-5.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..checkpoint import WEIGHT_DTYPES, load_checkpoint, load_metadata, unique_state_dict
from ..config import ModelConfig
from ..tokenizer import Tokenizer, VocabTokenizer
from ..transformer import Transformer
from .marian_layout import attention_blocks, layer_map, permute_residual, split_order

ACTIVATION_NAMES = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}


class MarianExportError(ValueError):
    """A checkpoint MarianMT cannot express; the message names the field."""


def check_exportable(cfg: ModelConfig) -> None:
    """Raise MarianExportError naming the first ModelConfig field Marian has no equivalent for."""
    bad = [("norm", cfg.norm != "layernorm", "RMSNorm (T5)"),
           ("relative_buckets", cfg.relative_buckets > 0, "relative position buckets (T5)"),
           ("gated_ffn", cfg.gated_ffn, "a gated feed-forward layer (T5)"),
           ("d_kv", cfg.d_head * cfg.n_heads != cfg.d_model, "heads of width d_kv (T5)"),
           ("scale_attention", not cfg.scale_attention, "unscaled attention logits (T5)"),
           ("linear_bias", not cfg.linear_bias, "linear layers without biases (T5)"),
           ("positional", cfg.positional != "sinusoidal", "learned positions (Marian's are sinusoidal)"),
           ("norm_first", cfg.norm_first, "pre-LN (transformers' MarianMTModel is post-LN)"),
           ("share_embeddings", not (cfg.share_embeddings or cfg.tie_target_output),
            "an output layer untied from the target embedding"),
           ("separate_output", cfg.separate_output, "an output layer untied from the embeddings"),
           ("sinusoid_layout", cfg.sinusoid_layout == "fairseq", "fairseq's sinusoid (M2M100, NLLB)"),
           ("position_offset", cfg.position_offset != 0, f"a position offset of {cfg.position_offset}"),
           ("layernorm_embedding", cfg.layernorm_embedding, "a LayerNorm on the embeddings (mBART)"),
           ("layer_norm_eps", cfg.layer_norm_eps != 1e-5, f"LayerNorm epsilon {cfg.layer_norm_eps} (Marian: 1e-5)")]
    for field, is_bad, what in bad:
        if is_bad:
            raise MarianExportError(f"config.json: {field}: {what} cannot be exported to MarianMT")


def marian_config_dict(cfg: ModelConfig) -> dict:
    """transformers' MarianConfig fields (config.json) for our ModelConfig."""
    return {
        "model_type": "marian", "architectures": ["MarianMTModel"], "dtype": "float32",
        "activation_function": ACTIVATION_NAMES[cfg.activation], "d_model": cfg.d_model,
        "encoder_layers": cfg.n_encoder_layers, "decoder_layers": cfg.n_decoder_layers,
        "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff,
        "max_position_embeddings": cfg.max_len, "scale_embedding": cfg.scale_embedding,
        "vocab_size": cfg.vocab_size, "decoder_vocab_size": cfg.target_vocab_size,
        "share_encoder_decoder_embeddings": cfg.share_embeddings, "tie_word_embeddings": True,
        "pad_token_id": cfg.pad_id, "eos_token_id": cfg.eos_id, "decoder_start_token_id": cfg.bos_id,
        "bos_token_id": None, "forced_eos_token_id": cfg.eos_id if cfg.forced_eos else None,
        "static_position_embeddings": True, "normalize_before": False, "normalize_embedding": False,
        "add_bias_logits": False, "add_final_layer_norm": False, "is_encoder_decoder": True,
        "dropout": cfg.dropout, "attention_dropout": cfg.attention_dropout, "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "init_std": 0.02, "use_cache": True,
        "exported_from": {"sinusoid_layout": cfg.sinusoid_layout, "final_logits_bias": cfg.final_logits_bias},
    }


def generation_config_dict(cfg: ModelConfig) -> dict:
    """generation_config.json: our search's rules (beam 4; forced EOS at the length limit and
    early_stopping as ``cfg`` says: none and true for our own models, an imported model's own;
    pad and <s> never generated, log-probabilities renormalised after masking them)."""
    return {"decoder_start_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id,
            "bad_words_ids": [[cfg.pad_id], [cfg.bos_id]], "forced_eos_token_id": cfg.eos_id if cfg.forced_eos else None,
            "max_length": cfg.max_len, "num_beams": 4, "early_stopping": cfg.early_stopping, "length_penalty": 1.0,
            "renormalize_logits": True}


def marian_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """transformers' MarianMTModel state dict (float32, positions not stored) for our model; the
    residual stream is permuted to the split sinusoid layout when ours is interleaved."""
    cfg = model.cfg
    ours = {k: v.detach().float().cpu() for k, v in unique_state_dict(model).items()}
    if cfg.sinusoid_layout == "interleaved":
        ours = permute_residual(ours, split_order(cfg.d_model))
    V = cfg.target_vocab_size
    bias = ours.pop("logits_bias", torch.zeros(V))
    out = {"final_logits_bias": bias.reshape(1, V)}
    if cfg.share_embeddings:
        out["model.shared.weight"] = ours.pop("src_embed.tok.weight")
    else:
        out["model.encoder.embed_tokens.weight"] = ours.pop("src_embed.tok.weight")
        out["model.decoder.embed_tokens.weight"] = ours.pop("tgt_embed.tok.weight")
    for kind, n in (("encoder", cfg.n_encoder_layers), ("decoder", cfg.n_decoder_layers)):
        for i in range(n):
            for mine, theirs in layer_map(kind, i).items():
                out[theirs] = ours.pop(mine)
            blocks = attention_blocks(kind)
            for mine, theirs in blocks:
                for p in ("weight", "bias"):
                    k, v = ours.pop(f"{kind}.{i}.{mine}.w_kv.{p}").chunk(2)
                    out[f"model.{kind}.layers.{i}.{theirs}.k_proj.{p}"] = k
                    out[f"model.{kind}.layers.{i}.{theirs}.v_proj.{p}"] = v
    if ours:
        raise MarianExportError(f"model.safetensors: no MarianMT name for {sorted(ours)}")
    return {k: v.contiguous() for k, v in out.items()}


def _tokenizer_files(tok, out: Path) -> dict[str, dict[str, int]]:
    """Copy the SentencePiece model(s) as source.spm / target.spm; the vocabularies to write."""
    if isinstance(tok, VocabTokenizer):
        for src, name in zip(tok.model_files, ("source.spm", "target.spm")):
            shutil.copyfile(src, out / name)
        separate = tok.target_vocab is not tok.vocab
        return {"vocab.json": tok.vocab} | ({"target_vocab.json": tok.target_vocab} if separate else {})
    if not isinstance(tok, Tokenizer):
        raise MarianExportError(f"tokenizer {type(tok).__name__} cannot be exported")
    for name in ("source.spm", "target.spm"):          # one joint model serves both sides
        shutil.copyfile(tok.model_file, out / name)
    return {"vocab.json": {tok.sp.id_to_piece(i): i for i in range(tok.vocab_size)}}


def export_marian(checkpoint: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write our checkpoint directory as a MarianMT directory ``out`` (weights stored in ``dtype``).
    Raises MarianExportError for a model Marian cannot express, FileNotFoundError for a missing file."""
    model, tok, _ = load_checkpoint(checkpoint)
    cfg = model.cfg
    check_exportable(cfg)
    weights = marian_weights(model)
    meta = load_metadata(checkpoint)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocabs = _tokenizer_files(tok, out)
    for name, vocab in vocabs.items():
        (out / name).write_text(json.dumps(vocab, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    piece = {i: p for p, i in (vocabs.get("target_vocab.json") or vocabs["vocab.json"]).items()}
    tok_cfg = {"tokenizer_class": "MarianTokenizer", "source_lang": meta.get("source_lang"),
               "target_lang": meta.get("target_lang"), "model_max_length": cfg.max_len,
               "separate_vocabs": "target_vocab.json" in vocabs, "eos_token": piece[cfg.eos_id],
               "unk_token": piece[cfg.unk_id], "pad_token": piece[cfg.pad_id], "sp_model_kwargs": {}} | \
        ({"clean_up_tokenization_spaces": True} if meta.get("clean_up_tokenization_spaces") is True else {})
    files = {"config.json": marian_config_dict(cfg) | {"dtype": dtype}, "tokenizer_config.json": tok_cfg,
             "generation_config.json": generation_config_dict(cfg)}
    for name, data in files.items():
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    from safetensors.torch import save_file
    torch_dtype = WEIGHT_DTYPES[dtype]
    save_file({k: v.to(torch_dtype) for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)        # safetensors writes 0600; the other files are 0644
    return out
