"""Load any model directory the service and the tools accept, ready for inference: one of this
project's checkpoints (``model/checkpoint.py``), a MarianMT (OPUS-MT) directory or an NLLB-200,
M2M100 or mBART-50 directory, converted at load (``model/interop/marian.py``, ``multilingual.py``), with the linear layers prepared for CPU inference
(``model/inference/linear.py``)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from .checkpoint import DEFAULT_CHECKPOINT, SHIPPED_CHECKPOINTS, load_checkpoint
from .inference.linear import pack_for_inference
from .interop.marian import is_marian_dir, load_marian
from .interop.multilingual import is_multilingual_dir, load_multilingual, model_type
from .interop.t5 import T5_TYPES, load_t5
from .tokenizer import Tokenizer, VocabTokenizer
from .transformer import Transformer

__all__ = ["DEFAULT_CHECKPOINT", "SHIPPED_CHECKPOINTS", "load_model"]


def load_model(directory: str | Path = DEFAULT_CHECKPOINT, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, pack: bool = True, linear_dtype: Optional[str] = None,
               ) -> tuple[Transformer, Union[Tokenizer, VocabTokenizer], dict]:
    """(model in eval mode, tokenizer, metadata) of a checkpoint or MarianMT directory, weights upcast
    to ``dtype``. With ``pack`` (default), CPU fp32 linear layers are prepared for inference in
    ``linear_dtype`` ("int8", "float32" or "bfloat16"; default ``model.inference.settings.current()``; see
    ``model.inference.linear.pack_for_inference``); gradients and other devices use the plain weights.
    Raises FileNotFoundError when the directory lacks a required file, ValueError (a
    ``MarianImportError`` for MarianMT directories) when its files disagree or ``linear_dtype`` is unknown.
    """
    d = Path(directory)
    if model_type(d) in T5_TYPES:
        model, tok, meta = load_t5(d)
        model = model.to(device=device, dtype=dtype)
    elif is_multilingual_dir(d):
        model, tok, meta = load_multilingual(d)
        model = model.to(device=device, dtype=dtype)
    elif is_marian_dir(d):
        model, tok, meta = load_marian(d)
        model = model.to(device=device, dtype=dtype)
        if tok.vocab_size != model.cfg.target_vocab_size:
            raise ValueError(f"tokenizer has {tok.vocab_size} pieces, config says {model.cfg.target_vocab_size}")
    else:
        model, tok, meta = load_checkpoint(d, device, dtype)
    if pack:
        pack_for_inference(model, linear_dtype)
    return model.eval(), tok, meta
