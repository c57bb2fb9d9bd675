"""The translator's settings: which text stages run, the stored do-not-translate list, the memory and
the result cache. ``AppArgs`` (service/app.py) builds them once, the environment included
(service/config.py); a ``Translator`` built directly gets these defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pydantic import ConfigDict


@dataclass(frozen=True)
class TextConfig:
    """What ``Translator(card, settings)`` does to a sentence besides translating it (docs/text.md);
    ``AppArgs.text``."""
    __pydantic_config__ = ConfigDict(extra="forbid")   # AppArgs refuses an unknown key of text:
    protect_spans: bool = True   # URLs, numbers, code, emoji... kept verbatim (protect.py); off: the keep terms too
    truecase: bool = True        # sentences in capitals or title case recased for the model (truecase.py)
    keep_file: str = ""          # the stored do-not-translate list, one term a line (spans.Terms.load); "": none


@dataclass(frozen=True)
class TranslatorSettings:
    """Everything a ``Translator`` takes besides its model, device and threads: one object from the
    config to every place a translator is built (in-process, a translator replica, the pool)."""
    text: TextConfig = field(default_factory=TextConfig)   # the text pipeline's stages and stored list
    memory_file: Optional[str] = None    # the translation memory's SQLite file (memory.MemoryStore); None: off
    cache_entries: int = 0               # LRU cache of the engine's results (memory.ResultCache); 0: off
