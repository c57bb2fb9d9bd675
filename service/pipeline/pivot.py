"""Pivoting: source -> target through a third language when no model translates the pair itself but
source -> X and X -> target models exist (X = ``pivot_lang``: English by default, ``AppArgs.pivot_lang``;
null turns pivoting off). A pivoted request is two ordinary jobs to two models, one after the other,
through whatever backend serves each model (``backends.Backend``): the routing layer knows nothing of
where a model runs. docs/controls.md#pivoting has the semantics; in short:

    routes(cards, "en")          {(source, target): PivotRoute} for every pair no model serves directly
    run(translate, route, job)   first leg (into X, 1-best), then the second leg on its text
    combined(route, a, b)        the second leg's response, each translation with ``path`` and ``pivot``

Which options apply to which leg (``leg_job``, the one place that decides it): beam_size,
length_penalty, max_new_tokens, min_new_tokens, keep (and the server's stored list), the memory,
split_sentences, the attention selection and the deadline (timeout_s: one deadline for both legs)
apply to both; what concerns the target language applies to the last leg only: n_best (the first
leg hands on its best hypothesis: ``alternatives`` are the last leg's n-best of that one text),
target_prefix, min_confidence, return_alignment and the glossary, whose source terms the first leg
keeps verbatim (as ``keep`` terms) so that the last leg finds them in its X text and writes their
target terms: the occurrences are found as the translator finds them (``translator/glossary.py``:
by Snowball stem of the source language, "Verträge" for "Vertrag"), each kept as written, and the
last leg's glossary also gets each form written otherwise than its entry ("Verträge" -> the entry's
target), since it matches with the stemmer of X (a kept word the last model cannot read goes back
as its target: ``Glossary.put_back``); target_lang is each leg's own (X, then the target).
Protected spans (URLs, numbers, keep terms) come back verbatim from each leg
(``translator/protect.py``), so they survive both.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable, Optional

from service.engine.validation import ModelLimits
from service.protocol import (
    MAX_ATTENTION_VALUES,
    MAX_JOB_GLOSSARY_ENTRIES,
    JobOrigin,
    PivotLeg,
    ServiceError,
    TranslateJob,
    TranslateResponse,
    Usage,
)
from service.translator import ModelCard
from service.translator.glossary import Glossary

DEFAULT_PIVOT_LANG = "en"
ROUTE_SEP = "+"     # a route's id: its models' ids joined ("de-en+en-fr"); a request may name it as `model`
# Fields of GenerationOptions / TranslateJob that only the last leg takes (they concern the target
# language); the first leg gets their defaults
LAST_LEG_ONLY = ("n_best",)
LAST_LEG_ONLY_JOB = ("target_prefix", "min_confidence", "return_alignment", "glossary", "stored_glossary")

Translate = Callable[[str, TranslateJob], Awaitable[TranslateResponse]]


@dataclass(frozen=True)
class Leg:
    card: ModelCard     # the model of this leg
    source_lang: str
    target_lang: str

    @property
    def pair(self) -> str:
        return f"{self.source_lang}-{self.target_lang}"


@dataclass(frozen=True)
class PivotRoute:
    """source -> via -> target over two models (``legs``)."""
    source_lang: str
    target_lang: str
    via: str
    legs: tuple[Leg, Leg]

    @property
    def id(self) -> str:
        return ROUTE_SEP.join(leg.card.id for leg in self.legs)

    @property
    def path(self) -> list[str]:
        """The language pair of each leg: ["de-en", "en-fr"]."""
        return [leg.pair for leg in self.legs]

    @property
    def card(self) -> ModelCard:
        """A card standing for the route where the API picks a model by languages (it is never loaded):
        its id is the route's, its languages the route's ends, its config the last leg's."""
        last = self.legs[-1].card
        return ModelCard(self.id, "", self.source_lang, self.target_lang, last.config,
                         {"pivot": self.via, "path": self.path})

    def info(self) -> dict:
        """GET /v1/models' entry (``schemas.PivotInfo``)."""
        return {"id": self.id, "source_lang": self.source_lang, "target_lang": self.target_lang, "via": self.via,
                "path": self.path, "models": [leg.card.id for leg in self.legs]}

    def describe(self) -> str:
        return f"{self.source_lang}->{self.target_lang} (through {self.via}: {', '.join(c.card.id for c in self.legs)})"


def routes(cards: Iterable[ModelCard], pivot_lang: Optional[str] = DEFAULT_PIVOT_LANG) -> dict[tuple[str, str], PivotRoute]:
    """Every (source, target) pair that no card translates but source -> pivot_lang -> target does,
    with the models of its two legs (models of one target before multilingual ones, then in the
    order given, as ``Gateway.resolve`` picks). {} when pivot_lang is None. An NLLB-200 / M2M100 /
    mBART-50 model is no leg: its pairs are direct."""
    cards = list(cards)
    if not pivot_lang:
        return {}
    direct = {(s, t) for c in cards for s in c.sources for t in c.targets}
    legs = [c for c in cards if not c.lang_tokens]      # an NLLB-200 / M2M100 / mBART-50 model serves its pairs directly
    first = sorted((c for c in legs if pivot_lang in c.targets and c.source_lang != pivot_lang),
                   key=lambda c: bool(c.target_languages))
    second = sorted((c for c in legs if c.source_lang == pivot_lang), key=lambda c: bool(c.target_languages))
    out: dict[tuple[str, str], PivotRoute] = {}
    for a in first:
        for b in second:
            for t in b.targets:
                pair = (a.source_lang, t)
                if t in (a.source_lang, pivot_lang) or pair in direct or pair in out:
                    continue
                out[pair] = PivotRoute(a.source_lang, t, pivot_lang,
                                       (Leg(a, a.source_lang, pivot_lang), Leg(b, pivot_lang, t)))
    return out


def leg_job(job: TranslateJob, route: PivotRoute, i: int, texts: Optional[list[str]] = None) -> TranslateJob:
    """The job of leg ``i`` (0 or 1): ``job`` with the leg's target_lang, and for the first leg the
    LAST_LEG_ONLY options and LAST_LEG_ONLY_JOB fields at their defaults and the glossary's source
    terms that occur in its texts added to ``keep`` as written there; for the last leg the glossary
    with those written otherwise than their entries added (module docstring; where that passes the
    entry limit, those that occur alone); ``texts``: the leg's input (the first leg's output).
    Raises InvalidRequest for a bad glossary (``glossary.Glossary``)."""
    leg = route.legs[i]
    options, fields = job.options, {}
    kept = occurring_terms(job, route.source_lang)      # as written in the texts -> target term
    if i < len(route.legs) - 1:
        defaults = {f.name: f.default for f in dataclasses.fields(options) if f.name in LAST_LEG_ONLY}
        options = dataclasses.replace(options, **defaults)
        fields = {f.name: f.default for f in dataclasses.fields(job) if f.name in LAST_LEG_ONLY_JOB}
        fields["keep"] = tuple(dict.fromkeys((*job.keep, *kept)))
    elif kept:
        entries = set(Glossary.normalized(job.glossary))
        extra = tuple((s, t) for s, t in kept.items() if (s, t) not in entries)
        limit = MAX_JOB_GLOSSARY_ENTRIES
        # over the entry limit with them: the occurring forms alone are what the last leg can match
        fields["glossary"] = job.glossary + extra if len(job.glossary) + len(extra) <= limit else tuple(kept.items())
    return dataclasses.replace(job, options=options, target_lang=leg.target_lang,
                               texts=list(job.texts if texts is None else texts), **fields)


def occurring_terms(job: TranslateJob, lang: str) -> dict[str, str]:
    """The job's glossary terms that occur in its texts, as written there (matched as the translator
    matches, with ``lang``'s stemmer), each with its target term, in order of appearance."""
    if not job.glossary:
        return {}
    g = _source_glossary(job.glossary, lang, "glossary_id" if job.stored_glossary else "glossary")
    out: dict[str, str] = {}
    for text in job.texts:
        text = unicodedata.normalize("NFC", text)
        for m in g.find(text):
            out.setdefault(text[m.start:m.end], g.entries[m.entry][1])
    return out


@functools.lru_cache(maxsize=32)
def _source_glossary(entries: tuple, lang: str, field: str) -> Glossary:
    """A glossary compiled for matching only (no tokenizer: the first leg's model writes none of its terms)."""
    return Glossary(entries, lang, None, 0, field, MAX_JOB_GLOSSARY_ENTRIES)


@dataclass(frozen=True)
class RouteLimits:
    """A route's limits: every leg's ``ModelLimits`` (duck-types ``ModelLimits.check``)."""
    route: PivotRoute
    legs: tuple[ModelLimits, ...]

    @property
    def model(self) -> str:
        return self.route.id

    def check(self, job: TranslateJob, origin: JobOrigin = JobOrigin()) -> None:
        """Each leg's check of its job (the second leg's texts are checked again once known, by its
        translator). Raises what ``ModelLimits.check`` raises."""
        for i, limits in enumerate(self.legs):
            limits.check(leg_job(job, self.route, i), origin)


def attention_values(attention: Optional[dict]) -> int:
    """The weights in a translation's ``attention`` ({kind: [layer][head][rows][cols]})."""
    def count(x) -> int:
        return sum(count(v) for v in x) if x and isinstance(x[0], list) else len(x)
    return sum(count(v) for v in (attention or {}).values())


def combined(route: PivotRoute, first: TranslateResponse, second: TranslateResponse) -> TranslateResponse:
    """The pivoted response: the second leg's translations (text, tokens, source_tokens, score,
    alternatives and attention of the last leg, whose source is the pivot text), each with ``path``
    and ``pivot`` (the first leg's text, tokens, score and attention); usage counts both legs.
    Raises ServiceError 413 when both legs' attention together holds more than MAX_ATTENTION_VALUES."""
    leg = route.legs[0]
    out = []
    for a, b in zip(first.translations, second.translations):
        pivot = PivotLeg(language=route.via, model=leg.card.id, text=a.text, tokens=a.tokens,
                         source_tokens=a.source_tokens, score=a.score, finish_reason=a.finish_reason,
                         attention=a.attention)
        out.append(b.model_copy(update={"path": route.path, "pivot": pivot}))
    n = sum(attention_values(t.attention) + attention_values(t.pivot.attention) for t in out)
    if n > MAX_ATTENTION_VALUES:
        raise ServiceError(413, f"return_attention: the attention of both legs of the pivot {route.describe()} holds {n:,} "
                       f"weights, at most {MAX_ATTENTION_VALUES:,} per response: select fewer attention.kinds, "
                       "attention.layers or attention.heads, or send shorter texts", "return_attention")
    usage = Usage(source_tokens=first.usage.source_tokens + second.usage.source_tokens,
                  generated_tokens=first.usage.generated_tokens + second.usage.generated_tokens)
    return TranslateResponse(model=route.id, translations=out, usage=usage)


def second_leg_error(e: ServiceError, route: PivotRoute) -> ServiceError:
    """``e`` (from the second leg) with a message saying it came from the pivot's second leg, on the
    first leg's output; status, field and Retry-After unchanged."""
    leg = route.legs[1]
    named = re.match(r"[A-Za-z_][\w.]*(?:\[\d+\])*: ", e.message)     # "text[1]: ..." keeps its head
    head = named.group(0) if named else ""
    return ServiceError(e.status, f"{head}pivot {route.describe()}, second leg ({leg.pair}, model {leg.card.id}) "
                                  f"on the first leg's {route.via} text: {e.message[len(head):]}",
                        e.field, e.retry_after, e.type)


async def first_leg(translate: Translate, route: PivotRoute, job: TranslateJob) -> tuple[TranslateResponse, TranslateJob]:
    """Run the first leg; returns its response and the second leg's job (its texts: the first leg's)."""
    first = await translate(route.legs[0].card.id, leg_job(job, route, 0))
    return first, leg_job(job, route, 1, [t.text for t in first.translations])


async def run(translate: Translate, route: PivotRoute, job: TranslateJob) -> TranslateResponse:
    """Both legs of ``route`` for ``job``, one after the other. ``translate(model, job)``: a backend's
    translate (the job's deadline covers both legs). Raises ServiceError as the legs do."""
    first, job2 = await first_leg(translate, route, job)
    try:
        second = await translate(route.legs[1].card.id, job2)
    except ServiceError as e:
        raise second_leg_error(e, route) from None
    return combined(route, first, second)
