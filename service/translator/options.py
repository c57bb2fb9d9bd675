"""Each sentence's decoding options: the job's, adjusted to what the sentence needs from the engine;
the ids a source starts with (``source_prefix``) and ``target_prefix``'s (``prefix_ids``)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from model.tag_tokenizer import TAG
from model.tokenizer import check_target_lang, encode_target
from service.engine import GenerationOptions
from service.protocol import InvalidRequest, TranslateJob

from .glossary import Glossary
from .protect import Protected
from .text import Piece


def source_prefix(tok, model: str, target_lang: Optional[str]) -> list[int]:
    """The ids every source starts with: a multilingual model's ``>>target_lang<<`` token, as
    ``model.tokenizer.encode_source`` puts it; [] for a model of one target (the gateway has
    matched target_lang to it). Raises InvalidRequest naming the choices for a multilingual
    model's missing or unknown target_lang."""
    if not tok.target_languages:
        return []
    try:
        check_target_lang(tok, target_lang)
    except ValueError as e:
        raise InvalidRequest(f"target_lang: model {model!r}: {e}", "target_lang") from None
    return tok.encode(getattr(tok, "tag_format", ">>{}<<").format(target_lang))   # MADLAD-400: <2xx>


def prefix_ids(tok, model: str, prefix: Optional[str], target_lang: Optional[str] = None) -> tuple[int, ...]:
    """``target_prefix``'s target ids (``model.tokenizer.encode_target``); () for None. Any length:
    max_new_tokens counts the tokens after it, and a prefix that fills the model's target window
    is the sentence's answer (finish_reason "length"; ``service.engine.validation``). A T5 model's
    (``<2xx>`` tags) leading tag of ``target_lang`` is dropped: the tag is the source's.
    Raises InvalidRequest when it has no tokens, pieces the target vocabulary lacks (<unk>), or
    (T5) a language tag after that."""
    if prefix is not None and getattr(tok, "tags", None):
        lead = tok.tag_format.format(target_lang)
        if prefix.lstrip().startswith(lead):
            prefix = prefix.lstrip()[len(lead):].lstrip() or None
        if prefix is not None and any(m.group(1) in tok.tags for m in TAG.finditer(prefix)):
            raise InvalidRequest(f"target_prefix: holds a language tag; model {model!r} reads target_lang's tag "
                                 f"({lead}) in the source: leave it out", "target_prefix")
    if prefix is None:
        return ()
    ids = encode_target(tok, prefix)
    if not ids:
        raise InvalidRequest(f"target_prefix: has no tokens for model {model} (got {prefix!r}); leave it out",
                             "target_prefix")
    unknown = [p for p, i in zip(tok.pieces(ids), ids) if i == tok.unk_id or p == "<unk>"]
    if unknown:
        raise InvalidRequest(f"target_prefix: model {model}'s target vocabulary cannot produce it: "
                             f"{len(unknown)} unknown piece(s) (<unk>) in {prefix!r}", "target_prefix")
    return tuple(ids)


def sentence_options(job: TranslateJob, pieces: list[Piece], protected: list[Optional[Protected]],
                     glossary: Optional[Glossary], prefix: tuple[int, ...]) -> list[Optional[GenerationOptions]]:
    """Each piece's options: the job's, ``prefix`` (``target_prefix``'s target ids) on the first
    sentence of each text, the glossary's constraints where its terms occur (a memory hit's, None:
    no engine run)."""
    firsts = {p.text_index: k for k, p in reversed(list(enumerate(pieces)))}
    return [None if prot is None else
            _options(prot, job.options, job.return_alignment, prefix if firsts[p.text_index] == k else (), glossary)
            for k, (p, prot) in enumerate(zip(pieces, protected))]


def _options(prepared: Protected, options: GenerationOptions, alignment: bool = False,
             prefix: tuple[int, ...] = (), glossary: Optional[Glossary] = None) -> GenerationOptions:
    """A sentence with inner protected spans also tracks cross-attention (to place them), as does
    every sentence when the job returns alignments; ``prefix``: its forced target ids; one with
    glossary terms outside its protected spans gets their target ids as decoding constraints, one per
    occurrence, and the target pieces that end a sentence, which come after them (``glossary.py``)."""
    if (prepared.spans or alignment) and "cross" not in options.attention_kinds:
        options = dataclasses.replace(options, attention_kinds=(*options.attention_kinds, "cross"))
    if prefix:
        options = dataclasses.replace(options, target_prefix=prefix)
    terms = glossary.terms(prepared.source, prepared.covered) if glossary else ()
    return dataclasses.replace(options, constraints=terms, sentence_ends=glossary.ends) if terms else options
