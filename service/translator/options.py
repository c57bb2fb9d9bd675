"""Each sentence's decoding options: the job's, adjusted to what the sentence needs from the engine."""
from __future__ import annotations

import dataclasses
from typing import Optional

from service.engine import GenerationOptions
from service.protocol import TranslateJob

from .glossary import Glossary
from .protect import Protected
from .text import Piece


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
