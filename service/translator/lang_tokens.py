"""The language tokens of an NLLB-200, M2M100 or mBART-50 model (``model.lang_tokenizer.LangTokenizer``)
for one job: each text's source is ``[src_lang] pieces </s>`` (NLLB's legacy template: ``pieces </s>
[src_lang]``), and every sentence's decoder is forced to start with the target-language token (at
log-prob 0: ``GenerationOptions.free_prefix``), so that sentences into different targets share the
engine's steps. ``target_prefix`` comes after that token. Errors are InvalidRequest naming the field
and the model's languages."""
from __future__ import annotations

import dataclasses
from typing import Optional

from service.engine import GenerationOptions
from service.protocol import InvalidRequest, TranslateJob


def has_lang_tokens(tok) -> bool:
    """Whether ``tok`` is a family tokenizer with a source-language token and a forced target token."""
    return hasattr(tok, "forced_token")


class LangTokens:
    """One job's language tokens on model ``name`` (its tokenizer ``tok``, a ``LangTokenizer``).

    Raises InvalidRequest (field ``source_lang`` / ``target_lang``) for a missing or unknown language."""

    def __init__(self, tok, name: str, job: TranslateJob):
        self.tok, self.name = tok, name
        self.forced = self._id(job.target_lang, "target_lang")                     # the decoder's first token
        langs = job.source_langs or (job.source_lang,) * len(job.texts)
        self.source_langs = [tok.resolve(lang) for lang in langs]                   # per text, service codes
        for lang in set(self.source_langs):
            self._id(lang, "source_lang")

    def _id(self, code: Optional[str], field: str) -> int:
        try:
            return self.tok.check_language(code, field)
        except ValueError as e:
            raise InvalidRequest(f"{field}: model {self.name!r}: {str(e).partition(': ')[2]}", field) from None

    def around(self, lang: str) -> tuple[list[int], list[int]]:
        """(ids before, ids after) a source's pieces + EOS: ``[lang]`` before, or after in NLLB's legacy template."""
        lang_id = self.tok.lang_ids[lang]
        return ([], [lang_id]) if self.tok.legacy else ([lang_id], [])

    def prefix_text(self, prefix: Optional[str]) -> Optional[str]:
        """``target_prefix`` without a leading language code equal to the forced one (``fra_Latn
        Bonjour`` -> ``Bonjour``). Raises InvalidRequest when it names another language."""
        if prefix is None:
            return None
        head, _, rest = prefix.strip().partition(" ")
        code = self.tok.resolve(head)
        if code in self.tok.lang_ids or head in self.tok.family_ids:
            if self.tok.lang_ids.get(code) != self.forced:
                raise InvalidRequest(f"target_prefix: starts with language {head!r}, but model {self.name!r} is forced to "
                                     f"start with target_lang's token; leave the language out of target_prefix",
                                     "target_prefix")
            return rest.lstrip() or None
        return prefix

    def check_prefix_ids(self, ids: tuple[int, ...]) -> None:
        """Raise InvalidRequest when target_prefix's ids hold a language token (it contradicts the forced one)."""
        if set(ids) & set(self.tok.lang_ids.values()):
            raise InvalidRequest(f"target_prefix: holds a language token; model {self.name!r} forces target_lang's "
                                 f"token first: leave it out", "target_prefix")

    def options(self, options: list[Optional[GenerationOptions]]) -> list[Optional[GenerationOptions]]:
        """Each sentence's options with the target-language token forced first (before target_prefix's ids)."""
        return [None if o is None else dataclasses.replace(o, target_prefix=(self.forced, *o.target_prefix),
                                                           free_prefix=1) for o in options]
