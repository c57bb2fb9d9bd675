"""The served models and the pivot routes between their languages, and the one model resolution
every API uses (``LanguageGraph.resolve``): a named model, the model of a language pair (models of
one target before multilingual ones), a pivot route, or the default model."""
from __future__ import annotations

from typing import Optional

from service.protocol import ServiceError, short_name, shown
from service.translator import ModelCard
from service.translator.card import match_language

from . import pivot


def checked_target(card: ModelCard, target_lang: Optional[str]) -> ModelCard:
    """The card, once a multilingual model's target_lang is one it knows. Raises ServiceError 422."""
    try:
        card.check_target(target_lang)
    except ValueError as e:
        raise ServiceError(422, f"target_lang: model {card.id!r}: {e}", "target_lang") from None
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
        self.sources = frozenset(c.source_lang for c in cards)          # the codes match_language maps to
        self.targets = frozenset(t for c in cards for t in c.targets) | {t for _, t in self.routes}

    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) pairs a served model or a pivot route translates, sorted."""
        return sorted({(c.source_lang, t) for c in self.cards.values() for t in c.targets} | set(self.routes))

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
        source_lang = match_language(source_lang, self.sources)
        target_lang = match_language(target_lang, self.targets)
        if model is not None:
            card = self.cards.get(model) or (self.pivots[model].card if model in self.pivots else None)
            if card is None:
                raise ServiceError(404, f"model: unknown model {shown(model)}; available: "
                                        f"{sorted(self.cards) + sorted(self.pivots)}", "model")
            for field, want, have in (("source_lang", source_lang, (card.source_lang,)),
                                      ("target_lang", target_lang, () if card.target_languages else card.targets)):
                if want is not None and have and want not in have:
                    raise ServiceError(404, f"{field}: model {shown(model)} translates {card.pair}, not {shown(want)}", field)
            return checked_target(card, target_lang)
        if source_lang is None and target_lang is None:
            return checked_target(self.cards[self.default], None)
        matches = [c for c in self.cards.values()
                   if source_lang in (None, c.source_lang) and (target_lang is None or target_lang in c.targets)]
        if matches:
            return checked_target(min(matches, key=lambda c: bool(c.target_languages)), target_lang)
        if (source_lang, target_lang) in self.routes:
            return self.routes[source_lang, target_lang].card
        field = "source_lang" if source_lang is not None and not any(
            c.source_lang == source_lang for c in self.cards.values()) else "target_lang"
        pair = f"{short_name(source_lang or '*')}->{short_name(target_lang or '*')}"
        raise ServiceError(404, f"{field}: no model for {pair}; available pairs: {self.describe()}", field)

    def describe(self) -> str:
        """Every pair served: "de-en (de-en), ..., de->fr (through en: de-en, en-fr)"."""
        return ", ".join([f"{c.pair} ({c.id})" for c in self.cards.values()] +
                         [r.describe() for r in self.pivots.values()])
