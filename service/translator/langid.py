"""Language identification: the language a text is written in, with a real confidence (0-100).

    LanguageDetector(served).detect(text)  -> [(code, confidence), ...], best first, at most ``top``;
                                              [] for a text without letters ("12345", "😀", "..."),
                                              [("und", 0.0)] for letters the model knows nothing of
    detect(text)                           -> the same, among COMMON_LANGUAGES

The model is py3langid's (a naive Bayes classifier over byte n-grams of 139 languages, shipped in its
wheel as ``py3langid/data/model.npz.xz``: nothing is downloaded). Its probabilities are a softmax of
the classifier's scores at a temperature of sqrt(text bytes) (py3langid >= 0.4), normalised over the
candidate languages: a detector's candidates are COMMON_LANGUAGES plus the languages the service
serves, so that text in a language no model reads is detected as that language (and refused by the
API) instead of as the nearest served one. Confidences are rounded down to 0.1 and at most 99.9: never 100.
Choice and figures (``python -m service.bench.langid``): docs/clients.md "Language identification".
Imports nothing of service/api.
"""
from __future__ import annotations

import copy
import math
import threading
import unicodedata
from typing import Callable, Iterable, Optional

# Widely used languages (all known to py3langid and lingua): the candidates besides the served ones.
COMMON_LANGUAGES = ("ar", "bg", "cs", "da", "de", "el", "en", "es", "et", "fi", "fr", "he", "hi", "hr", "hu",
                    "id", "it", "ja", "ko", "lt", "lv", "nl", "pl", "pt", "ro", "ru", "sk", "sl", "sv", "th",
                    "tr", "uk", "vi", "zh")
NO_LANGUAGE = "und"         # ISO 639-2 "undetermined": what a text without letters is reported as
TOP = 3                     # candidates returned per text
MAX_DETECT_CHARS = 1_000    # characters read per text, from its first letter (a language shows long before)
CONTEXT_FLOOR = 0.05        # with a context: languages under 1/20 of the text's best are ones the text rules out

_lock = threading.Lock()
_model = None               # the full py3langid identifier, loaded once per process


def _full_model():
    """py3langid's identifier over all its languages (loaded on first use, ~2 s, ~75 MB)."""
    global _model
    with _lock:
        if _model is None:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
            _model = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        return _model


def first_letter(text: str) -> int:
    """Index of the first letter (Unicode category L*) of ``text``, or -1 when it has none."""
    return next((i for i, c in enumerate(text) if unicodedata.category(c).startswith("L")), -1)


class LanguageDetector:
    """Detects among COMMON_LANGUAGES plus ``languages`` (those the model knows; others are skipped
    and listed in ``unknown``). Thread-safe once loaded; ``load()`` loads it ahead of the first call."""

    def __init__(self, languages: Iterable[str] = (), top: int = TOP):
        self.requested = tuple(dict.fromkeys([*COMMON_LANGUAGES, *languages]))
        self.top = top
        self._identifier = None
        self._lock = threading.Lock()
        self.languages: tuple[str, ...] = ()     # the candidates, once loaded
        self.unknown: tuple[str, ...] = ()       # requested codes the model does not know
        # called per text by service.pipeline.autodetect with (best language, at least 50% sure); None: not counted
        self.on_detect: Optional[Callable[[str, bool], None]] = None

    def load(self) -> "LanguageDetector":
        with self._lock:
            if self._identifier is None:
                full = _full_model()
                known = set(full.labels)
                self.languages = tuple(sorted(c for c in self.requested if c in known))
                self.unknown = tuple(c for c in self.requested if c not in known)
                ident = copy.copy(full)         # set_languages replaces the copy's arrays, not the shared ones
                ident.set_languages(list(self.languages))
                self._identifier = ident
        return self

    def detect(self, text: str, top: Optional[int] = None, context: Optional[str] = None) -> list[tuple[str, float]]:
        """[(code, confidence 0-100)] best first (at most ``top``, candidates below 0.1 left out);
        [] when the text has no letter; [("und", 0.0)] when it has letters but nothing the model
        knows (every candidate equally likely: "A", "ok"). ``context``: text around ``text``, in its
        language, that chooses among the languages the text leaves open (those at least
        CONTEXT_FLOOR as likely as its best: "Gift" leaves German and English open, "Привет" only
        Cyrillic ones): each one's probability given the text times its probability given the
        context, renormalised over them (naive Bayes over both). A context without letters or of
        nothing the model knows, or one that gives each open language nothing, changes nothing."""
        start = first_letter(text)
        if start < 0:
            return []
        ident = self._identifier or self.load()._identifier
        ranked = ident.rank(text[start:start + MAX_DETECT_CHARS])
        at = first_letter(context or "")
        if at >= 0:
            given = dict(ident.rank(context[at:at + MAX_DETECT_CHARS]))
            flat = max(given.values()) - min(given.values()) < 1e-6     # nothing known in the context either
            both = [] if flat else [(lang, p * given[lang]) for lang, p in ranked if p >= CONTEXT_FLOOR * ranked[0][1]]
            total = sum(p for _, p in both)
            if total > 0:
                ranked = sorted(((lang, p / total) for lang, p in both), key=lambda lp: -lp[1])
        if len(ranked) > 1 and ranked[0][1] - ranked[-1][1] < 1e-6:
            return [(NO_LANGUAGE, 0.0)]
        out = [(lang, min(math.floor(p * 1000), 999) / 10) for lang, p in ranked[:top or self.top]]
        return [(lang, c) for lang, c in out if c > 0] or out[:1]


_default: Optional[LanguageDetector] = None


def detect(text: str, top: int = TOP) -> list[tuple[str, float]]:
    """``LanguageDetector().detect(text, top)``: among COMMON_LANGUAGES, one detector per process."""
    global _default
    if _default is None:
        _default = LanguageDetector()
    return _default.detect(text, top)
