"""A model's card: what the gateway needs to know about a model without loading it, read from the
checkpoint's JSON files (``config.json``, ``metadata.json``, ``vocab.json``; see ``model/checkpoint.py``).
A MarianMT (OPUS-MT) directory served as it is has the same card: its ``config.json`` read as our
``ModelConfig`` (``model.interop.marian.marian_config``), its languages from ``tokenizer_config.json``.

Multilingual MarianMT models (a vocabulary with ``>>xx<<`` target-language tokens, ``vocab.json`` of
the directory or of its converted checkpoint) list those codes as ``target_languages``; a request
names one of them (``model.translate.check_target_lang`` reads the card as it reads the tokenizer).

An imported NLLB-200, M2M100 or mBART-50 checkpoint (metadata.json's ``multilingual`` record,
``model/interop/multilingual.py``) lists every language it reads as ``source_languages`` and every
one it writes as ``target_languages``, in service codes; ``aliases`` maps the family's own codes
(``deu_Latn``, ``__de__``, ``de_DE``) to them. Its ``source_lang`` / ``target_lang`` are labels
(``mul``, or its generation config's fixed target). An imported T5 / MADLAD-400 checkpoint (``t5``
record) serves every pair of its ``<2xx>`` languages the same way (its source needs no language token)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from model.config import ModelConfig
from model.interop.marian import is_marian_dir, marian_config, marian_metadata, read_generation
from model.tokenizer import target_language_codes
from model.tokenizer import check_target_lang


@dataclass(frozen=True)
class ModelCard:
    id: str                       # model id in requests and /v1/models
    checkpoint: str               # checkpoint directory
    source_lang: str
    target_lang: str
    config: ModelConfig           # the checkpoint's config.json
    metadata: dict = field(default_factory=dict)      # the checkpoint's metadata.json
    test_bleu: Optional[float] = None                 # BLEU on the test set, from the metadata
    engine: dict = field(default_factory=dict)        # EngineConfig overrides for this model
    target_languages: tuple = ()                      # multilingual: the >>xx<< codes (else one target_lang)
    source_languages: tuple = ()                      # NLLB-200 / M2M100 / mBART-50: every source code (else ())
    aliases: dict = field(default_factory=dict)       # the family's codes -> service codes (deu_Latn -> de)

    @property
    def sources(self) -> tuple[str, ...]:
        """The source languages a request may name: the family model's codes, or the one source_lang."""
        return self.source_languages or (self.source_lang,)

    @property
    def lang_tokens(self) -> bool:
        """Whether the model reads a source-language token and forces a target-language token
        (NLLB-200, M2M100, mBART-50): the request's source_lang and target_lang are both required."""
        return bool(self.source_languages)

    @property
    def targets(self) -> tuple[str, ...]:
        """The target languages a request may name: the multilingual codes, or the one target_lang."""
        return self.target_languages or (self.target_lang,)

    @property
    def pair(self) -> str:
        """``source->target`` for messages (``de->fra|ita`` for a multilingual model; ``N languages``
        for an NLLB-200 / M2M100 / mBART-50 model, whose languages ``languages`` lists)."""
        if self.lang_tokens:
            return f"{len(set(self.sources) | set(self.targets))} languages, any pair"
        return f"{self.source_lang}->{'|'.join(self.targets)}"

    def languages(self) -> str:
        """Every language of the model, comma-separated, for messages."""
        return ", ".join(sorted(set(self.sources) | set(self.targets)))

    def check_source(self, source_lang: Optional[str]) -> None:
        """An NLLB-200 / M2M100 / mBART-50 model: raise ValueError naming its languages unless
        source_lang is one of them (required). Other models check nothing here."""
        if self.lang_tokens and source_lang not in self.source_languages:
            what = "name a source language" if source_lang is None else f"unknown source language {source_lang!r}"
            raise ValueError(f"{what}; the model knows {', '.join(self.source_languages)}")

    def check_target(self, target_lang: Optional[str]) -> None:
        """A multilingual model: raise ValueError naming the choices unless target_lang is one of its
        codes (``model.translate.check_target_lang``). A model of one target checks nothing here."""
        if self.target_languages:
            check_target_lang(self, target_lang)


def model_card(name: str, checkpoint: str | Path, source_lang: Optional[str] = None,
               target_lang: Optional[str] = None) -> ModelCard:
    """The card of the checkpoint (or MarianMT directory) ``checkpoint``, served as ``name``. A
    multilingual model's ``target_lang`` is the label its metadata gives (``mul`` without one).

    Raises FileNotFoundError when the checkpoint lacks config.json, ValueError when the languages
    are neither given nor in metadata.json / tokenizer_config.json, or (``MarianImportError``) when a
    MarianMT config.json is not one this project imports.
    """
    d = Path(checkpoint)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"model {name!r}: checkpoint {d} has no config.json")
    config = json.loads((d / "config.json").read_text())
    if is_marian_dir(d):
        generation = read_generation(d, config)
        config = marian_config(config, str(d / "config.json"), generation)
        meta = marian_metadata(d, cfg=config, generation=generation)
    else:   # the fields an older config.json leaves out take their defaults
        config = ModelConfig.from_dict(config)
        meta = json.loads((d / "metadata.json").read_text()) if (d / "metadata.json").exists() else {}
    if "multilingual" in meta:      # NLLB-200, M2M100, mBART-50: every pair of its languages
        return ModelCard(name, str(d), source_lang or "mul", target_lang or meta.get("default_target_lang") or "mul",
                         config, meta, _test_bleu(meta), target_languages=tuple(meta["target_languages"]),
                         source_languages=tuple(meta["source_languages"]),
                         aliases=dict(meta["multilingual"]["languages"]))
    if "t5" in meta:                # MADLAD-400: any pair of its languages; the target's <2xx> tag starts the source
        return ModelCard(name, str(d), source_lang or "mul", target_lang or "mul", config, meta, _test_bleu(meta),
                         target_languages=tuple(meta["target_languages"]),
                         source_languages=tuple(meta["source_languages"]))
    codes = target_language_codes(json.loads((d / "vocab.json").read_text(encoding="utf-8"))) \
        if (d / "vocab.json").exists() else ()
    src = source_lang or meta.get("source_lang")
    tgt = target_lang or meta.get("target_lang") or ("mul" if codes else None)
    if not src or not tgt:
        where = d / ("tokenizer_config.json" if is_marian_dir(d) else "metadata.json")
        raise ValueError(f"model {name!r}: source_lang/target_lang are not in {where}; pass them")
    return ModelCard(name, str(d), src, tgt, config, meta, _test_bleu(meta), target_languages=codes)


def _test_bleu(meta: dict) -> Optional[float]:
    """BLEU on the test set as the checkpoint's metadata records it (``test_bleu`` or ``test*: {bleu}``)."""
    if isinstance(meta.get("test_bleu"), (int, float)):
        return float(meta["test_bleu"])
    for key, value in meta.items():
        if "test" in key and isinstance(value, dict) and isinstance(value.get("bleu"), (int, float)):
            return float(value["bleu"])
    return None


def match_language(code: Optional[str], known) -> Optional[str]:
    """The served language code that ``code`` names: itself when served; else the one code of
    ``known`` equal to it ignoring case (BCP 47 codes are case-insensitive: "DE" is "de"); else, for
    a code with a region or script subtag ("de-DE", "pt_BR"), its primary language when that is
    served and the full code is not. Anything else comes back unchanged (the caller's 404/400 names
    it). None stays None."""
    if code is None or code in known:
        return code
    folded = {k.lower(): k for k in known}
    lower = code.lower()
    if lower in folded:
        return folded[lower]
    primary = lower.replace("_", "-").split("-")[0]
    return folded.get(primary, code) if primary != lower else code
