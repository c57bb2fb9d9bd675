"""Checkpoint directories: ``config.json``, ``model.safetensors``, the tokenizer and ``metadata.json``.
The tokenizer is ``tokenizer.model`` (our joint SentencePiece model) or, for models imported from
MarianMT (``model/interop/marian.py``), ``source.spm`` + ``target.spm`` + ``vocab.json``, or for
NLLB-200, M2M100 and mBART-50 (``model/interop/multilingual.py``) their published tokenizer files,
named in metadata.json's ``multilingual`` record. Loading
reads JSON and safetensors only; nothing is unpickled. ``model.load.load_model`` also takes a
MarianMT directory itself (converted at load)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .lang_tokenizer import checkpoint_tokenizer
from .tag_tokenizer import checkpoint_tag_tokenizer
from .tokenizer import Tokenizer, VocabTokenizer
from .transformer import Transformer

# The shipped models, by name: German->English (the default) and English->German.
SHIPPED_CHECKPOINTS = {name: Path(__file__).resolve().parent / "checkpoints" / name for name in ("de-en", "en-de", "en-fr", "fr-en")}
DEFAULT_CHECKPOINT = SHIPPED_CHECKPOINTS["de-en"]

WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def unique_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The state dict without the aliases that tied (shared) embeddings create."""
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t
    return out


def save_weights(model: Transformer, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write the model's unique tensors to a safetensors file, cast to dtype."""
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in unique_state_dict(model).items()}
    save_file(tensors, str(path))


def load_weights(model: Transformer, path: str | Path) -> None:
    """Load a safetensors file into model (cast to the model's dtype). Raises KeyError on a mismatch."""
    tensors = load_file(str(path))
    p = next(model.parameters())
    expected = unique_state_dict(model)
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        raise KeyError(f"{path}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    with torch.no_grad():
        for name, t in expected.items():
            if t.shape != tensors[name].shape:
                raise KeyError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, expected {tuple(t.shape)}")
            t.copy_(tensors[name].to(p.device, t.dtype))


def save_checkpoint(directory: str | Path, model: Transformer, tokenizer_file: Union[str, Path, Sequence[Path]],
                    metadata: Optional[dict] = None, dtype: str = "float16") -> Path:
    """Write a checkpoint directory; weights stored in ``dtype`` (float16/bfloat16 to ship).
    ``tokenizer_file``: our SentencePiece model (copied as ``tokenizer.model``), or a list of files
    copied under their own names (``source.spm``, ``target.spm``, ``vocab.json`` of an import)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(model.cfg.to_json() + "\n")
    save_weights(model, d / "model.safetensors", WEIGHT_DTYPES[dtype])
    copies = ([(Path(f), d / Path(f).name) for f in tokenizer_file] if isinstance(tokenizer_file, (list, tuple))
              else [(Path(tokenizer_file), d / "tokenizer.model")])
    for src, dst in copies:
        if src.resolve() != dst.resolve():
            shutil.copyfile(src, dst)
    meta = dict(metadata or {})
    meta.setdefault("dtype", dtype)
    (d / "metadata.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return d


def load_metadata(directory: str | Path) -> dict:
    p = Path(directory) / "metadata.json"
    return json.loads(p.read_text()) if p.exists() else {}


def load_checkpoint(directory: str | Path = DEFAULT_CHECKPOINT, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> tuple[Transformer, Union[Tokenizer, VocabTokenizer], dict]:
    """(model in eval mode, tokenizer, metadata) of one of this project's checkpoint directories, with
    the weights upcast to ``dtype`` (fp32 by default) and nothing prepared for inference. For any
    directory a service or tool may be given (a MarianMT folder too), with the linear layers prepared
    for CPU inference, use ``model.load.load_model``.
    Raises FileNotFoundError when the directory lacks a required file, ValueError when its files disagree.
    """
    model, tok = _load_ours(Path(directory), device, dtype)
    if tok.vocab_size != model.cfg.target_vocab_size and not (
            (getattr(tok, "lang_ids", None) or getattr(tok, "tags", None)) and tok.vocab_size < model.cfg.target_vocab_size):   # NLLB: spare rows
        raise ValueError(f"tokenizer has {tok.vocab_size} pieces, config says {model.cfg.target_vocab_size}")
    return model.eval(), tok, load_metadata(directory)


def _load_ours(d: Path, device, dtype: torch.dtype) -> tuple[Transformer, Union[Tokenizer, VocabTokenizer]]:
    """Model and tokenizer of one of our checkpoint directories. Raises FileNotFoundError."""
    if "multilingual" in (meta := load_metadata(d)) or "t5" in meta:   # NLLB-200, M2M100, mBART-50, MADLAD-400
        for name in ("config.json", "model.safetensors"):
            if not (d / name).exists():
                raise FileNotFoundError(f"checkpoint {d} has no {name}")
        cfg = ModelConfig.from_dict(json.loads((d / "config.json").read_text()))
        model = Transformer(cfg).to(device=device, dtype=dtype)
        load_weights(model, d / "model.safetensors")
        if "t5" in meta:
            return model, checkpoint_tag_tokenizer(d, cfg, meta)
        return model, checkpoint_tokenizer(d, cfg, meta)
    marian_tok = not (d / "tokenizer.model").exists() and (d / "vocab.json").exists()
    tok_files = ("source.spm", "target.spm", "vocab.json") if marian_tok else ("tokenizer.model",)
    tok_files += ("target_vocab.json",) if marian_tok and (d / "target_vocab.json").exists() else ()
    for name in ("config.json", "model.safetensors") + tok_files:
        if not (d / name).exists():
            raise FileNotFoundError(f"checkpoint {d} has no {name}")
    cfg = ModelConfig.from_dict(json.loads((d / "config.json").read_text()))
    model = Transformer(cfg).to(device=device, dtype=dtype)
    load_weights(model, d / "model.safetensors")
    if not marian_tok:
        return model, Tokenizer(d / "tokenizer.model")
    vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
    target = json.loads((d / "target_vocab.json").read_text(encoding="utf-8")) if cfg.tgt_vocab_size else None
    piece = {i: p for p, i in (target or vocab).items()}
    tok = VocabTokenizer(d / "source.spm", d / "target.spm", vocab, target, decoder_start_id=cfg.bos_id,
                         eos=piece[cfg.eos_id], unk=piece[cfg.unk_id], pad=piece[cfg.pad_id],
                         clean_up_spaces=load_metadata(d).get("clean_up_tokenization_spaces") is True)
    return model, tok
