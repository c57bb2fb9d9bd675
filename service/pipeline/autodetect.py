"""``source_lang: "auto"`` (``/v1/translate``) and ``source: "auto"`` (``/translate``): each text's
language is detected (``service/translator/langid.py``) and the text goes to the model that reads it;
a list may mix languages (one job per model, run together, answers put back in request order).

    no letters ("12345", "😀")         passed through unchanged (as the translator does), detected "und" at 0
    letters, no language found ("A")   404 on the source field (every route, LibreTranslate's and DeepL's too:
                                       it depends on the text, which no schema states): send the source language
    detected == target                 passed through unchanged, ``passthrough: true``
    detected, a model reads it         translated by that model, with the detected language and confidence
    detected below UNSURE (50%), no    the most likely language of the text that a model reads (or the
    model for it                       target: passed through), with its own confidence: a short text
                                       ("A dog." is Croatian at 16%, English at 9%) is not refused for a guess
    detected, no model for it          404 (the same) naming the text, what was detected (with its
                                       confidence and runners-up) and what is served

A context (DeepL's ``context``: text around the texts, never translated) is read with each short text
that alone is detected below UNSURE (``detect_in_context``): a word or two says little of its language
("Gift" is German and English), the sentences around it say much.

``POST /detect`` answers LibreTranslate's ``[{"confidence", "language"}]`` from the same detector.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from service.protocol import (
    MAX_TEXT_CHARS,
    MAX_TEXTS,
    JobOrigin,
    ServiceError,
    TranslateResponse,
    Translation,
    Usage,
)
from service.translator.langid import NO_LANGUAGE, TOP, LanguageDetector

AUTO = "auto"
UNSURE = 50.0     # % below which a best guess no model reads gives way to the likeliest language one reads
NOT_SERVED = "language_not_served"     # the ServiceError type of both 404s (errors.py keeps them 404)
# texts of at most this many words are detected with the request's context (py3langid alone is right
# on 91% of 3-word texts and 45% of 1-word ones: docs/clients.md "Language identification")
SHORT_TEXT_WORDS = 3
_WORD = re.compile(r"\w*[^\W\d_]\w*")     # a word: a run of word characters with a letter among them
# Language names for messages (GET /languages uses libretranslate.LANGUAGE_NAMES, a subset)
NAMES = {"ar": "Arabic", "bg": "Bulgarian", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek",
         "en": "English", "es": "Spanish", "et": "Estonian", "fi": "Finnish", "fr": "French", "he": "Hebrew",
         "hi": "Hindi", "hr": "Croatian", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese",
         "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian", "nl": "Dutch", "pl": "Polish", "pt": "Portuguese",
         "ro": "Romanian", "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish", "th": "Thai",
         "tr": "Turkish", "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese"}


def is_auto(code: object) -> bool:
    return isinstance(code, str) and code.strip().lower() == AUTO


def named(code: str) -> str:
    return f"{NAMES[code]} ({code})" if code in NAMES else code


@dataclass(frozen=True)
class Routed:
    """Where one text goes: ``card_id`` None means it is passed through unchanged."""
    card_id: Optional[str]
    language: str                   # detected code, or NO_LANGUAGE ("und") for a text without letters
    confidence: float               # 0-100
    passthrough: bool = False


def check_sizes(texts: Sequence[str], origin: JobOrigin) -> None:
    """The service-wide limits checked before any detection (each model's check follows per group);
    messages name the texts as ``origin`` does. Raises ServiceError 413."""
    field = origin.field
    if len(texts) > MAX_TEXTS:
        raise ServiceError(413, f"{field}: at most {MAX_TEXTS} texts per request, got {len(texts)}", field)
    for i, t in enumerate(texts):
        if len(t) > MAX_TEXT_CHARS:
            raise ServiceError(413, f"{origin.where(i)}: at most {MAX_TEXT_CHARS} characters per text, got {len(t)}",
                               field)


def context_helps(text: str, cands: Sequence[tuple[str, float]]) -> bool:
    """Whether ``text`` is detected with the request's context: it has 1 to SHORT_TEXT_WORDS words
    and alone is detected below UNSURE or not at all ("und"). A text without letters is not (it is
    passed through), nor a longer or surely detected one (the context never outvotes the text)."""
    return bool(cands) and cands[0][1] < UNSURE and 0 < len(_WORD.findall(text)) <= SHORT_TEXT_WORDS


async def detect_texts(detector: LanguageDetector, texts: Sequence[str],
                       top: Optional[int] = None) -> list[list[tuple[str, float]]]:
    """Each text's candidates (``detector.detect(text, top)``; ``top`` None: the detector's own
    number, 0: every candidate, as ``route`` reads them), off the event loop (a list of long texts
    takes milliseconds; the model loads on first use)."""
    every = len(detector.requested) if top == 0 else top
    return counted(detector, await asyncio.to_thread(lambda: [detector.detect(t, every) for t in texts]))


async def detect_in_context(detector: LanguageDetector, texts: Sequence[str], context: Optional[str],
                            top: Optional[int] = None) -> tuple[list[list[tuple[str, float]]], list[bool]]:
    """``detect_texts``, where each text that ``context_helps`` is detected with ``context`` too
    (``detector.detect(text, top, context)``: the context chooses among the languages the text leaves
    open); and, per text, whether the context was read. A context without letters is never read."""
    every = len(detector.requested) if top == 0 else top
    use = bool(context) and _WORD.search(context) is not None

    def run():
        out, read = [], []
        for t in texts:
            cands = detector.detect(t, every)
            read.append(use and context_helps(t, cands))
            out.append(detector.detect(t, every, context) if read[-1] else cands)
        return out, read
    out, read = await asyncio.to_thread(run)
    return counted(detector, out), read


def counted(detector: LanguageDetector, detections: list[list[tuple[str, float]]]) -> list[list[tuple[str, float]]]:
    """``detections``, each text's best candidate (``und`` for none) handed to ``detector.on_detect``
    (the replica's ``DetectionMetrics.record``: language, whether at least UNSURE) when it is set."""
    on_detect = getattr(detector, "on_detect", None)     # a stand-in detector may have none
    if on_detect is not None:
        for cands in detections:
            lang, conf = cands[0] if cands else (NO_LANGUAGE, 0.0)
            on_detect(lang, conf >= UNSURE)
    return detections


def route(texts: Sequence[str], detections: Sequence[list[tuple[str, float]]], target: Optional[str],
          pick: Callable[[str], str], origin: JobOrigin, source_field: str, served: str = "") -> list[Routed]:
    """Each text's destination. ``pick(language)`` is the id of the model that translates it into the
    target, or raises ServiceError saying what is served (re-raised naming the text and its detection,
    on ``source_field``); ``served`` names what is served where no language was found. ``detections``:
    each text's candidates, best first (every candidate: ``detect_texts(..., top=0)``), read past the
    first only when it is below UNSURE and no model reads it."""
    out = []
    for i, cands in enumerate(detections):
        cands = _likeliest_served(cands, target, pick)
        if not cands:
            out.append(Routed(None, NO_LANGUAGE, 0.0, True))
            continue
        lang, conf = cands[0]
        where = origin.where(i)
        if lang == NO_LANGUAGE:
            raise ServiceError(404, f"{source_field}: auto cannot tell the language of {where} (too little text the "
                                    f"detector knows); send {source_field} to choose"
                                    f"{' (served: ' + served + ')' if served else ''}", source_field, type=NOT_SERVED)
        if target is not None and lang == target:
            out.append(Routed(None, lang, conf, True))
            continue
        try:
            out.append(Routed(pick(lang), lang, conf))
        except ServiceError as e:
            others = ", ".join(f"{c} {p:g}%" for c, p in cands[1:TOP])
            reason = e.message[len(e.field) + 2:] if e.field and e.message.startswith(f"{e.field}: ") else e.message
            raise ServiceError(404 if e.status in (400, 404) else e.status,
                               f"{source_field}: auto detected {named(lang)} in {where} (confidence "
                               f"{conf:g}%{'; then ' + others if others else ''}), which no model here "
                               f"translates{' into ' + target if target else ''}: {reason}; send "
                               f"{source_field} to choose", source_field, type=NOT_SERVED) from None
    return out


def _likeliest_served(cands: list[tuple[str, float]], target: Optional[str],
                      pick: Callable[[str], str]) -> list[tuple[str, float]]:
    """``cands`` from the likeliest language that is the target or that ``pick`` accepts, when the
    best candidate is below UNSURE and neither; else ``cands`` as they are."""
    if not cands or cands[0][1] >= UNSURE or cands[0][0] in (NO_LANGUAGE, target):
        return cands
    for k, (lang, _) in enumerate(cands):
        if lang == target:
            return cands[k:]
        try:
            pick(lang)
        except ServiceError:
            continue
        return cands[k:]
    return cands


def groups(routed: Sequence[Routed]) -> dict[str, list[int]]:
    """model id -> the indices of its texts, in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, r in enumerate(routed):
        if r.card_id is not None:
            out.setdefault(r.card_id, []).append(i)
    return out


async def gather_all(calls) -> list:
    """Await every call together; raise the first error once all have ended (none is left running)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def passthrough(text: str, r: Routed) -> Translation:
    """A text answered unchanged: no model ran (no tokens, no attention)."""
    return Translation(text=text, tokens=[], source_tokens=[], score=0.0, finish_reason="eos",
                       detected_language=r.language, detected_confidence=r.confidence, passthrough=True)


def merged(texts: Sequence[str], routed: Sequence[Routed], results: dict[str, TranslateResponse],
           by_model: dict[str, list[int]]) -> TranslateResponse:
    """One response in request order from each model's response (of its texts, in their order) and
    the passed-through texts. ``model``: the models that ran, joined by "," ("" when none ran)."""
    out: list[Optional[Translation]] = [None] * len(texts)
    for model, idx in by_model.items():
        for i, t in zip(idx, results[model].translations):
            out[i] = t.model_copy(update={"detected_language": routed[i].language,
                                          "detected_confidence": routed[i].confidence, "model": model})
    for i, r in enumerate(routed):
        if out[i] is None:
            out[i] = passthrough(texts[i], r)
    usage = Usage(source_tokens=sum(r.usage.source_tokens for r in results.values()),
                  generated_tokens=sum(r.usage.generated_tokens for r in results.values()))
    return TranslateResponse(model=",".join(by_model), translations=out, usage=usage)


def detect_answer(detections: Sequence[list[tuple[str, float]]]) -> list[dict]:
    """POST /detect's body, LibreTranslate's shape: [{"confidence", "language"}] best first. One text:
    its candidates; a list: each language's mean confidence over the texts. No letters anywhere:
    [{"confidence": 0.0, "language": "und"}] (LibreTranslate answers "en" at 0 there)."""
    total: dict[str, float] = {}
    for cands in detections:
        for lang, conf in cands:
            total[lang] = total.get(lang, 0.0) + conf
    if not total:
        return [{"confidence": 0.0, "language": NO_LANGUAGE}]
    n = len(detections)
    ranked = sorted(total.items(), key=lambda kv: -kv[1])
    return [{"confidence": round(c / n, 1), "language": lang} for lang, c in ranked]
