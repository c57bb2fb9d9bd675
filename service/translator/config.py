"""The text pipeline's settings: which stages run, and the stored do-not-translate list."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class TextConfig:
    """What ``Translator(card, text=...)`` does to a sentence besides translating it (docs/text.md)."""
    protect_spans: bool = True   # URLs, numbers, code, emoji... kept verbatim (protect.py); off: the keep terms too
    truecase: bool = True        # sentences in capitals or title case recased for the model (truecase.py)
    keep_file: str = ""          # the stored do-not-translate list, one term a line (spans.Terms.load); "": none

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "TextConfig":
        """The settings the environment gives: ``MT_PROTECT_SPANS=0`` and ``MT_TRUECASE=0`` turn those
        stages off, ``MT_KEEP_FILE`` names the stored list; the defaults for what it leaves out."""
        return cls(protect_spans=environ.get("MT_PROTECT_SPANS", "1") != "0",
                   truecase=environ.get("MT_TRUECASE", "1") != "0",
                   keep_file=environ.get("MT_KEEP_FILE", ""))
