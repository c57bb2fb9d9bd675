"""The served models and the pivot routes between their languages, and the one model resolution
every API uses (``LanguageGraph.resolve``): a named model, the model of a language pair (models of
one target before multilingual ones), a pivot route, or the default model. An NLLB-200 / M2M100 /
mBART-50 model serves every pair of its languages directly (never a pivot leg), and its family's
codes (``deu_Latn``, ``__de__``, ``de_DE``) name the service's codes (``de``) in every request."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from service.protocol import ServiceError, TranslateJob, short_name, shown
from service.translator import ModelCard
from service.translator.card import match_language

from . import pivot


def checked_target(card: ModelCard, target_lang: Optional[str], source_lang: Optional[str] = None) -> ModelCard:
    """The card, once a multilingual model's target_lang is one it knows (and an NLLB-200 / M2M100 /
    mBART-50 model's source_lang). Raises ServiceError 422 naming the field and the model's languages."""
    for name, check, lang in (("source_lang", card.check_source, source_lang), ("target_lang", card.check_target, target_lang)):
        try:
            check(lang)
        except ValueError as e:
            raise ServiceError(422, f"{name}: model {card.id!r}: {e}", name) from None
    return card


class LanguageGraph:
    """Models (``cards``; the first is the default) and pivot routes (``pivot.routes``) by language.

    Args:
        cards: the served models' cards.
        pivot_lang: the language a pair no model serves is translated through; None: no pivoting.
    """

    def __init__(self, cards: list[ModelCard], pivot_lang: Optional[str] = pivot.DEFAULT_PIVOT_LANG):
        self.cards = {c.id: c for c in cards}                          # model id -> card
        self.default = cards[0].id
        self.routes = pivot.routes(cards, pivot_lang)                   # (source, target) -> PivotRoute
        self.pivots = {r.id: r for r in self.routes.values()}           # route id -> PivotRoute
        self.sources = frozenset(s for c in cards for s in c.sources)  # the codes match_language maps to
        self.targets = frozenset(t for c in cards for t in c.targets) | {t for _, t in self.routes}
        self.aliases = {k: v for c in cards for k, v in c.aliases.items()}   # deu_Latn -> de (family models)

    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) pairs a served model or a pivot route translates, sorted (an
        NLLB-200 / M2M100 / mBART-50 model: every pair of two different languages of it)."""
        return sorted({(s, t) for c in self.cards.values() for s in c.sources for t in c.targets
                       if s != t or not c.lang_tokens} | set(self.routes))

    def code(self, lang: Optional[str], known) -> Optional[str]:
        """The served code ``lang`` names: a family model's code (``deu_Latn``, ``__de__``, ``de_DE``)
        as the service's, then ``match_language`` (case, region)."""
        if lang is not None and lang not in known and self.aliases:
            lang = self.aliases.get(lang, self.aliases.get(f"__{lang}__", lang))
        return match_language(lang, known)

    def all_cards(self) -> list[ModelCard]:
        """The served models' cards, then a card per pivot route (``pivot.PivotRoute.card``)."""
        return list(self.cards.values()) + [r.card for r in self.pivots.values()]

    def resolve(self, model: Optional[str], source_lang: Optional[str], target_lang: Optional[str]) -> ModelCard:
        """The card of the model that serves this request: the named model, else the first that
        translates source_lang -> target_lang (models of one target before multilingual ones, which
        match every target their vocabulary knows), else the pivot route's card (its id is the
        route's, e.g. "de-en+en-fr", which ``model`` may name too), else the default.
        Language codes match ignoring case, and a code with a region falls back to its language
        ("de-DE" -> "de"; ``card.match_language``).

        Raises ServiceError: 404 for an unknown model or pair, 422 when a multilingual model's
        target_lang is missing or unknown (the message names its choices)."""
        source_lang = self.code(source_lang, self.sources)
        target_lang = self.code(target_lang, self.targets)
        if model is not None:
            card = self.cards.get(model) or (self.pivots[model].card if model in self.pivots else None)
            if card is None:
                raise ServiceError(404, f"model: unknown model {shown(model)}; available: "
                                        f"{sorted(self.cards) + sorted(self.pivots)}", "model")
            for field, want, have in (("source_lang", source_lang, () if card.lang_tokens else card.sources),
                                      ("target_lang", target_lang, () if card.target_languages else card.targets)):
                if want is not None and have and want not in have:
                    raise ServiceError(404, f"{field}: model {shown(model)} translates {card.pair}, not {shown(want)}", field)
            return checked_target(card, target_lang, source_lang)
        if source_lang is None and target_lang is None:
            return checked_target(self.cards[self.default], None)
        matches = [c for c in self.cards.values()
                   if (source_lang is None or source_lang in c.sources) and (target_lang is None or target_lang in c.targets)]
        if matches:
            card = min(matches, key=lambda c: bool(c.target_languages))
            return checked_target(card, target_lang, source_lang)
        if (source_lang, target_lang) in self.routes:
            return self.routes[source_lang, target_lang].card
        field = "source_lang" if source_lang is not None and not any(
            source_lang in c.sources for c in self.cards.values()) else "target_lang"
        pair = f"{short_name(source_lang or '*')}->{short_name(target_lang or '*')}"
        raise ServiceError(404, f"{field}: no model for {pair}; available pairs: {self.describe()}", field)

    def bind(self, card: Optional[ModelCard], job: TranslateJob, source_lang: Optional[str],
             source_langs: Sequence[str] = ()) -> TranslateJob:
        """The job with an NLLB-200 / M2M100 / mBART-50 model's languages in service codes (``code``):
        ``source_lang``, or ``source_langs`` one per text (detected), and its target_lang; the job
        itself for any other model (``card`` None: a pivot route)."""
        if card is None or not card.lang_tokens:
            return job
        return dataclasses.replace(job, source_lang=self.code(source_lang, self.sources),
                                   source_langs=tuple(self.code(s, self.sources) for s in source_langs),
                                   target_lang=self.code(job.target_lang, self.targets))

    def describe(self) -> str:
        """Every pair served: "de-en (de-en), ..., de->fr (through en: de-en, en-fr)"."""
        return ", ".join([f"{c.pair} ({c.id})" for c in self.cards.values()] +
                         [r.describe() for r in self.pivots.values()])
