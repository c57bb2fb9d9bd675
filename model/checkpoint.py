"""Checkpoint directories: ``config.json``, ``model.safetensors``, ``tokenizer.model`` and
``metadata.json``. Loading reads JSON and safetensors only; nothing is unpickled."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .tokenizer import Tokenizer
from .transformer import Transformer

# The shipped German->English model.
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "de-en"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


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


def save_checkpoint(directory: str | Path, model: Transformer, tokenizer_file: str | Path,
                    metadata: Optional[dict] = None, dtype: str = "float16") -> Path:
    """Write a checkpoint directory; weights stored in ``dtype`` (float16/bfloat16 to ship)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(model.cfg.to_json() + "\n")
    save_weights(model, d / "model.safetensors", _DTYPES[dtype])
    if Path(tokenizer_file).resolve() != (d / "tokenizer.model").resolve():
        shutil.copyfile(tokenizer_file, d / "tokenizer.model")
    meta = dict(metadata or {})
    meta.setdefault("dtype", dtype)
    (d / "metadata.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return d


def load_metadata(directory: str | Path) -> dict:
    p = Path(directory) / "metadata.json"
    return json.loads(p.read_text()) if p.exists() else {}


def load_checkpoint(directory: str | Path = DEFAULT_CHECKPOINT, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, pack: bool = True) -> tuple[Transformer, Tokenizer, dict]:
    """(model in eval mode, tokenizer, metadata). Weights are upcast to ``dtype`` (fp32 by default).
    With ``pack`` (default), CPU fp32 weights are also prepared for inference: int8 unless
    ``MT_LINEAR_DTYPE`` says float32 or bfloat16 (``Transformer.pack_for_inference``, ``model/linear.py``;
    gradients and other devices use the plain weights).

    Raises FileNotFoundError when the directory lacks a required file.
    """
    d = Path(directory)
    for name in ("config.json", "model.safetensors", "tokenizer.model"):
        if not (d / name).exists():
            raise FileNotFoundError(f"checkpoint {d} has no {name}")
    cfg = ModelConfig.from_dict(json.loads((d / "config.json").read_text()))
    model = Transformer(cfg).to(device=device, dtype=dtype)
    load_weights(model, d / "model.safetensors")
    tok = Tokenizer(d / "tokenizer.model")
    if tok.vocab_size != cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} pieces, config says {cfg.vocab_size}")
    model.eval()
    if pack:
        model.pack_for_inference()
    return model, tok, load_metadata(d)
