"""The source side of one job's sentences: protect -> case -> encode, each distinct sentence once.

Splitting asks for it before the sentences are final (``text.cut_long`` measures candidate parts in
tokens; ``Split.translatable`` asks which sentences need the model), and the job's sentences ask
again; ``Sources`` answers each sentence from the first time.
"""
from __future__ import annotations

from .protect import Protected, Protector
from .spans import Terms


class Sources:
    """What the model reads of one job's sentences (``Translator.prepare``)."""

    def __init__(self, protector: Protector, keep: Terms, prefix: list[int], suffix: list[int] = (),
                 lang: str | None = None):
        self.protector = protector
        self.keep = keep                # the job's do-not-translate terms and the stored list
        self.prefix = prefix            # the ids every source starts with (a >>xx<< or source-language token, or none)
        self.suffix = list(suffix)      # the ids after EOS (NLLB's legacy template: the source-language token)
        self.lang = lang                # the sources' language where the job names it per text (else None)
        self._protected: dict[str, Protected] = {}  # sentence -> what the model sees of it
        self._encoded: dict[str, list[int]] = {}    # sentence -> its model text's ids, EOS included

    def protected(self, sentence: str) -> Protected:
        """protect -> case (``Protector.prepare``)."""
        if sentence not in self._protected:
            self._protected[sentence] = self.protector.prepare(sentence, self.keep)
        return self._protected[sentence]

    def ids(self, sentence: str) -> list[int]:
        """encode: the sentence's source ids, the prefix first, EOS (then the suffix) last (a new list each call)."""
        if sentence not in self._encoded:
            self._encoded[sentence] = self.protector.encode(self.protected(sentence))
        return self.prefix + self._encoded[sentence] + self.suffix

    def needs_model(self, sentence: str) -> bool:
        """Whether a letter is left for the model besides the placeholders."""
        return self.protected(sentence).needs_model

    def spans(self, sentence: str) -> list[tuple[int, int]]:
        """(start, end) of the sentence's protected spans: where ``text.cut_long`` never cuts."""
        return [(s.start, s.end) for s in self.protector.find_spans(sentence, keep=self.keep)]
