"""A model's card: what the gateway needs to know about a model without loading it, read from the
checkpoint's JSON files (``config.json``, ``metadata.json``; see ``model/checkpoint.py``)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class ModelCard:
    id: str                       # model id in requests and /v1/models
    checkpoint: str               # checkpoint directory
    source_lang: str
    target_lang: str
    config: dict                  # the checkpoint's config.json (ModelConfig fields)
    metadata: dict = field(default_factory=dict)      # the checkpoint's metadata.json
    test_bleu: Optional[float] = None                 # BLEU on the test set, from the metadata
    engine: dict = field(default_factory=dict)        # EngineConfig overrides for this model


def model_card(name: str, checkpoint: str | Path, source_lang: Optional[str] = None,
               target_lang: Optional[str] = None) -> ModelCard:
    """The card of the checkpoint in directory ``checkpoint``, served as ``name``.

    Raises FileNotFoundError when the checkpoint lacks config.json, ValueError when the languages
    are neither given nor in metadata.json.
    """
    d = Path(checkpoint)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"model {name!r}: checkpoint {d} has no config.json")
    config = json.loads((d / "config.json").read_text())
    meta = json.loads((d / "metadata.json").read_text()) if (d / "metadata.json").exists() else {}
    src = source_lang or meta.get("source_lang")
    tgt = target_lang or meta.get("target_lang")
    if not src or not tgt:
        raise ValueError(f"model {name!r}: source_lang/target_lang are not in {d / 'metadata.json'}; pass them")
    return ModelCard(name, str(d), src, tgt, config, meta, _test_bleu(meta))


def _test_bleu(meta: dict) -> Optional[float]:
    """BLEU on the test set as the checkpoint's metadata records it (``test_bleu`` or ``test*: {bleu}``)."""
    if isinstance(meta.get("test_bleu"), (int, float)):
        return float(meta["test_bleu"])
    for key, value in meta.items():
        if "test" in key and isinstance(value, dict) and isinstance(value.get("bleu"), (int, float)):
            return float(value["bleu"])
    return None
