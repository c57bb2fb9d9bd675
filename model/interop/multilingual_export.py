"""Export of an imported NLLB-200, M2M100 or mBART-50 checkpoint (``multilingual.py``) back to the
transformers layout it came from (config.json, model.safetensors, the tokenizer files), the input of
CTranslate2's own converter (``ct2.py``). Needs ``transformers`` (a dev extra, as for CTranslate2).
A checkpoint whose weights the families' classes cannot hold (a logits bias on an M2M100 model, from
banned generation tokens) raises ValueError naming it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..checkpoint import load_checkpoint, load_metadata
from .marian_layout import attention_blocks, layer_map


def transformers_state_dict(model) -> dict[str, torch.Tensor]:
    """transformers' M2M100 / MBart ForConditionalGeneration state dict of our model (the inverse of
    ``multilingual.multilingual_state_dict``)."""
    cfg, ours = model.cfg, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {"model.shared.weight": ours["src_embed.tok.weight"]}
    if cfg.separate_output:
        out["lm_head.weight"] = ours["out_proj.weight"]
    if cfg.final_logits_bias:
        out["final_logits_bias"] = ours["logits_bias"][None]
    for kind, embed, norm, n in (("encoder", "src_embed", "enc_norm", cfg.n_encoder_layers),
                                 ("decoder", "tgt_embed", "dec_norm", cfg.n_decoder_layers)):
        out[f"model.{kind}.embed_tokens.weight"] = ours["src_embed.tok.weight"]
        for p in ("weight", "bias"):
            out[f"model.{kind}.layer_norm.{p}"] = ours[f"{norm}.{p}"]
            if cfg.layernorm_embedding:
                out[f"model.{kind}.layernorm_embedding.{p}"] = ours[f"{embed}.norm.{p}"]
        if cfg.positional == "learned":
            out[f"model.{kind}.embed_positions.weight"] = ours[f"{embed}.pos.weight"]
        for i in range(n):
            for mine, theirs in layer_map(kind, i).items():
                out[theirs] = ours[mine]
            for mine, theirs in attention_blocks(kind):
                for p in ("weight", "bias"):
                    k, v = ours[f"{kind}.{i}.{mine}.w_kv.{p}"].chunk(2)
                    out[f"model.{kind}.layers.{i}.{theirs}.k_proj.{p}"] = k
                    out[f"model.{kind}.layers.{i}.{theirs}.v_proj.{p}"] = v
    return out


def export_multilingual(checkpoint: str | Path, out: str | Path) -> Path:
    """Write our imported checkpoint as a transformers directory (float32). Raises ValueError for a
    checkpoint that is not an imported multilingual one or that the family's class cannot hold."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration, MBartConfig, MBartForConditionalGeneration
    d, out = Path(checkpoint), Path(out)
    meta = load_metadata(d)
    rec = meta.get("multilingual")
    if rec is None:
        raise ValueError(f"{d / 'metadata.json'}: not an imported NLLB-200 / M2M100 / mBART-50 checkpoint")
    model, _, _ = load_checkpoint(d)
    cfg, mbart = model.cfg, rec["family"].startswith("mbart50")
    if cfg.final_logits_bias and not mbart:
        raise ValueError(f"{d / 'config.json'}: final_logits_bias (banned generation tokens) has no place in "
                         f"M2M100ForConditionalGeneration")
    fields = dict(vocab_size=cfg.vocab_size, d_model=cfg.d_model, encoder_layers=cfg.n_encoder_layers,
                  decoder_layers=cfg.n_decoder_layers, encoder_attention_heads=cfg.n_heads,
                  decoder_attention_heads=cfg.n_heads, encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
                  activation_function=cfg.activation, max_position_embeddings=cfg.max_len,
                  scale_embedding=cfg.scale_embedding, pad_token_id=cfg.pad_id, eos_token_id=cfg.eos_id,
                  decoder_start_token_id=cfg.bos_id, bos_token_id=0, tie_word_embeddings=not cfg.separate_output,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    # mBART's published config.json holds these (always so in transformers); CTranslate2's loader reads them
    pre_ln = dict(normalize_before=True, normalize_embedding=True, add_final_layer_norm=True,
                  tokenizer_class="MBart50Tokenizer")
    hf = (MBartForConditionalGeneration(MBartConfig(**fields, **pre_ln)) if mbart
          else M2M100ForConditionalGeneration(M2M100Config(**fields)))
    missing, unexpected = hf.load_state_dict(transformers_state_dict(model), strict=False)
    left = [k for k in missing if "embed_positions" not in k and k != "lm_head.weight"]
    if left or unexpected:
        raise ValueError(f"{d}: export mismatch (missing {left}, unexpected {unexpected})")
    hf.tie_weights()
    hf.save_pretrained(out)
    for name in rec["tokenizer"] + rec.get("tokenizer_config", []):
        shutil.copyfile(d / name, out / name)
    tok_cfg = out / "tokenizer_config.json"
    if mbart and tok_cfg.exists():               # transformers 5 writes no bos_token for MBart50Tokenizer; the
        c = json.loads(tok_cfg.read_text())      # published file and CTranslate2's loader have "<s>" (id 0)
        tok_cfg.write_text(json.dumps({"bos_token": "<s>"} | c, indent=2))
    gen = {"decoder_start_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id,
           "forced_eos_token_id": cfg.eos_id if cfg.forced_eos else None}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None}))
    return out
