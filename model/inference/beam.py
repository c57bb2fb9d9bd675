"""The search state of one sentence: beam search over ``decode_step``'s log-probabilities, one step
at a time (``BeamSearch``), and the hypotheses it returns. ``search.py`` advances many at once.

Beam search follows the common NMT recipe (Wu et al., 2016; fairseq): every alive hypothesis is
extended by its top-2k tokens, the best 2k candidates are ranked, candidates ending in EOS that rank
within the top k are finished, and the first k non-EOS candidates stay alive. A sentence is done when
it has k finished hypotheses or reaches max_new_tokens. Greedy search is beam search with k = 1.
Scores: log_prob is the sum of token log-probabilities (EOS included); score = log_prob / length **
length_penalty, where length counts generated tokens including EOS. A ``prefix`` (target ids) is
forced first: while it lasts the search keeps one alive hypothesis, extended by the next prefix
token at the model's log-prob for it (counted in log_prob), so every beam starts with it; the first
``free_prefix`` of them (a multilingual model's target-language token) at log-prob 0, as
transformers' ``forced_bos_token_id`` forces it (they count in the length all the same).

Two rules of transformers' ``generate()``, for models whose generation config asks for them
(``ModelConfig.forced_eos`` / ``early_stopping``, set by the MarianMT import):

- ``forced_eos``: the last step a budget allows emits EOS (``forced_eos_token_id``): hypotheses
  reaching max_new_tokens - 1 tokens end there with EOS, at log-prob 0 for it (transformers sets
  every other score to -inf and EOS's to 0), so the model is not asked for that step.
- ``early_stopping=False``: with k finished hypotheses the search goes on while the best alive
  hypothesis's log_prob / its length ** length_penalty beats the k-th best finished score;
  ``"never"`` (length_penalty > 0) divides by max_new_tokens ** length_penalty instead.
  ``True`` (ours): done at k finished hypotheses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

__all__ = ["ATTENTION_KINDS", "BeamSearch", "Hypothesis", "PartialHypothesis", "max_beam_size"]

ATTENTION_KINDS = ("cross", "encoder", "decoder")


def max_beam_size(target_vocab_size: int) -> int:
    """The largest beam a vocabulary allows: each step ranks 2 x beam_size candidates per sentence
    (beam_size of them may end with EOS), so a beam may hold at most half the target vocabulary."""
    return target_vocab_size // 2


@dataclass
class Hypothesis:
    """One finished translation hypothesis."""
    tokens: list[int]                       # generated ids, EOS excluded
    log_prob: float                         # sum of token log-probs, EOS included
    score: float                            # log_prob / length ** length_penalty
    finish_reason: str                      # "eos" or "length"
    attention: Optional[dict[str, Tensor]] = None  # kind -> [L, H, len(tokens), S] (decoder: [L, H, T, T])


@dataclass(slots=True)
class PartialHypothesis:
    """One alive hypothesis: a prefix still being extended."""
    tokens: tuple = ()                      # generated ids so far
    log_prob: float = 0.0                   # sum of their log-probs
    cross: tuple = ()                       # per step: [L, H, S] rows
    decoder: tuple = ()                     # per step: [L, H, t+1] rows


@dataclass
class BeamSearch:
    """Search state of one sentence; its alive hypotheses occupy ``slots`` rows in order.

    ``step`` consumes the log-probabilities of the alive rows and returns, for the next step, the
    parent row of every new alive hypothesis (for ``KVCache.reorder``) and its input token.
    Raises ValueError for beam_size < 1, n_best outside 1..beam_size or max_new_tokens < 0.
    """
    beam_size: int
    eos_id: int
    max_new_tokens: int
    n_best: int = 1
    length_penalty: float = 1.0
    attention_kinds: tuple = ()             # subset of ATTENTION_KINDS to keep
    src_len: int = 0                        # trims attention rows to the real source length
    encoder_attention: Optional[Tensor] = None  # [L, H, S, S], set at prefill when tracked
    forced_eos: bool = False                # the last step a budget allows emits EOS (module docstring)
    early_stopping: object = True           # True, False or "never" (module docstring)
    prefix: tuple = ()                      # target ids forced first (``force``), then free decoding
    free_prefix: int = 0                    # the first this many prefix ids are forced at log-prob 0 (a
                                            # language token: transformers' forced_bos_token_id)
    alive: list = field(default_factory=lambda: [PartialHypothesis()])
    finished: list = field(default_factory=list)
    done: bool = False

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be >= 1, got {self.beam_size}")
        if not 1 <= self.n_best <= self.beam_size:
            raise ValueError(f"n_best must be in 1..beam_size ({self.beam_size}), got {self.n_best}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        self.done = self.max_new_tokens == 0
        if len(self.prefix) > self.max_new_tokens:
            raise ValueError(f"the target prefix has {len(self.prefix)} tokens, more than max_new_tokens "
                             f"({self.max_new_tokens})")

    @property
    def forcing(self) -> bool:
        """Whether the next token is a forced one of ``prefix`` (the search then has one alive hypothesis)."""
        return bool(self.alive) and len(self.alive[0].tokens) < len(self.prefix)

    def force(self, log_prob: float, cross: Optional[list] = None, decoder: Optional[list] = None
              ) -> tuple[list[int], list[int]]:
        """Advance by the next ``prefix`` token, whatever the model prefers (as CTranslate2's
        ``target_prefix``): the one alive hypothesis is extended by it at ``log_prob`` (the model's
        log-prob of that token, added to the hypothesis's); every beam thus starts with the prefix.
        Returns as ``step``."""
        if self.forced_eos and len(self.alive[0].tokens) >= self.max_new_tokens - 1:
            return self._end_with_eos()
        beam = self.alive[0]
        tok = self.prefix[len(beam.tokens)]
        if len(beam.tokens) < self.free_prefix:
            log_prob = 0.0                       # transformers: every other score -inf, the forced one's 0
        new = self._extend(beam, 0, tok, beam.log_prob + log_prob, cross, decoder)
        if len(new.tokens) >= self.max_new_tokens:
            self.finished.append(self._final(new, "length"))
            self.done, self.alive = True, []
            return [], []
        self.alive = [new]
        return [0], [tok]

    def keep_encoder_attention(self, encoder: Optional[list[Tensor]], row: int) -> None:
        """When "encoder" is tracked, keep this sentence's prefill encoder self-attention: row ``row``
        of each layer's [B, H, S, S], trimmed to its own src_len."""
        if "encoder" in self.attention_kinds and encoder is not None:
            n = self.src_len
            self.encoder_attention = torch.stack([w[row, :, :n, :n] for w in encoder])   # [L, H, n, n]

    def _final(self, beam: PartialHypothesis, reason: str) -> Hypothesis:
        length = len(beam.tokens) + (reason == "eos")
        lp = beam.log_prob
        return Hypothesis(list(beam.tokens), lp, lp / max(length, 1) ** self.length_penalty, reason,
                          self._attention(beam) if self.attention_kinds else None)

    def _attention(self, beam: PartialHypothesis) -> dict:
        out = {}
        n = len(beam.tokens)
        if "encoder" in self.attention_kinds and self.encoder_attention is not None:
            out["encoder"] = self.encoder_attention
        if "cross" in self.attention_kinds and beam.cross:
            out["cross"] = torch.stack(beam.cross[:n], dim=2) if n else torch.zeros(0)
        if "decoder" in self.attention_kinds and beam.decoder:
            rows = beam.decoder[:n]
            out["decoder"] = torch.zeros(0)     # no tokens (EOS first): empty, as cross
            if n:
                L, H = rows[0].shape[:2]
                mat = rows[0].new_zeros(L, H, n, n)
                for t, r in enumerate(rows):
                    mat[:, :, t, : t + 1] = r[:, :, : t + 1]
                out["decoder"] = mat
        return out

    def step(self, top_v: list, top_i: list,
             cross: Optional[list] = None, decoder: Optional[list] = None) -> tuple[list[int], list[int]]:
        """Advance by one token.

        Args:
            top_v, top_i: per row, the 2k best log-probs and their token ids (python lists).
            cross / decoder: per row, [L, H, S] / [L, H, T] attention, when tracked.
        Returns (parents, tokens): per new alive hypothesis, its parent row and next input token;
        empty when the sentence is done.
        """
        if self.forced_eos and len(self.alive[0].tokens) >= self.max_new_tokens - 1:
            return self._end_with_eos()          # max_new_tokens 1: the first step is the forced one
        if self.beam_size == 1:
            return self._greedy_step(top_v[0], top_i[0], cross, decoder)
        return self._beam_step(top_v, top_i, cross, decoder)

    def _end_with_eos(self) -> tuple[list[int], list[int]]:
        """The forced last step: every alive hypothesis ends with EOS, at its log-prob (EOS's is 0)."""
        self.finished.extend(self._final(b, "eos") for b in self.alive)
        self.done = True
        self.alive = []
        return [], []

    def _stops(self, best_alive: float, n_generated: int) -> bool:
        """Whether a search with alive hypotheses of n_generated tokens, the best at log-prob
        ``best_alive``, is done by its finished ones (``early_stopping``, module docstring)."""
        k = self.beam_size
        if len(self.finished) < k:
            return False
        if self.early_stopping is True:
            return True
        length = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else n_generated
        worst = sorted((h.score for h in self.finished), reverse=True)[k - 1]
        return best_alive / length ** self.length_penalty <= worst

    def _greedy_step(self, tv: list, ti: list, cross, decoder) -> tuple[list[int], list[int]]:
        """``step`` for k = 1 without building and sorting the candidate list (the engine's most
        frequent case): the candidate with the best log-prob, the lower id on a tie, as the sort
        ranks them; EOS finishes the sentence. The same result as ``_beam_step`` with k = 1."""
        beam = self.alive[0]
        lp, tok = beam.log_prob + tv[0], ti[0]
        for v, i in zip(tv[1:], ti[1:]):
            cand = beam.log_prob + v
            if cand > lp or (cand == lp and i < tok):
                lp, tok = cand, i
        if tok == self.eos_id:
            self.finished.append(self._final(self._extend(beam, 0, tok=None, lp=lp, cross=cross, decoder=decoder), "eos"))
        else:
            new = self._extend(beam, 0, tok, lp, cross, decoder)
            if len(new.tokens) < self.max_new_tokens - self.forced_eos:
                self.alive = [new]
                return [0], [tok]
            self.finished.append(self._final(new, "eos" if self.forced_eos else "length"))
        self.done = True
        self.alive = []
        return [], []

    def _beam_step(self, top_v: list, top_i: list, cross, decoder) -> tuple[list[int], list[int]]:
        """``step`` for any k: rank every alive row's candidates, then ``advance``."""
        # (negated score, parent row, token id): ascending order ranks the best score first, ties by
        # row then id (negation is exact, so -neg is the candidate's log-prob bit for bit)
        cands = sorted([(-(beam.log_prob + v), b, i) for b, beam in enumerate(self.alive)
                        for v, i in zip(top_v[b], top_i[b])])[: 2 * self.beam_size]
        return self.advance([-neg for neg, _, _ in cands], [b for _, b, _ in cands],
                            [i for _, _, i in cands], cross, decoder)

    def advance(self, log_probs: list, parents: list, tokens: list, cross=None, decoder=None
                ) -> tuple[list[int], list[int]]:
        """``step`` from candidates already ranked: the best min(2k, all) candidates of this sentence,
        best first (ties by parent row, then token id), as three lists: each candidate's log-prob (its
        parent's plus its token's, in float64), parent row and token id. ``step`` ranks them itself;
        ``search.search_step`` ranks every sentence's at once (``search.rank_candidates``). Returns as ``step``."""
        k, eos, alive = self.beam_size, self.eos_id, self.alive
        if self.forced_eos and len(alive[0].tokens) >= self.max_new_tokens - 1:
            return self._end_with_eos()
        new_alive, new_parents = [], []
        for rank, (lp, b, tok) in enumerate(zip(log_probs, parents, tokens)):
            if tok == eos:
                if rank < k:
                    self.finished.append(self._final(self._extend(alive[b], b, tok=None, lp=lp, cross=cross,
                                                                         decoder=decoder), "eos"))
                continue
            new_alive.append(self._extend(alive[b], b, tok, lp, cross, decoder))
            new_parents.append(b)
            if len(new_alive) == k:  # ranks from here on are >= k: no more EOS finishes either
                break
        self.alive = new_alive
        n_generated = len(new_alive[0].tokens) if new_alive else 0
        if not new_alive or self._stops(new_alive[0].log_prob, n_generated):
            self.done = True
        elif n_generated >= self.max_new_tokens:
            self.finished.extend(self._final(b, "length") for b in new_alive)
            self.done = True
        elif self.forced_eos and n_generated == self.max_new_tokens - 1:
            return self._end_with_eos()
        if self.done:
            self.alive = []
            return [], []
        return new_parents, [b.tokens[-1] for b in new_alive]

    def _extend(self, parent: PartialHypothesis, row: int, tok: Optional[int], lp: float, cross,
                decoder) -> PartialHypothesis:
        tokens = parent.tokens if tok is None else parent.tokens + (tok,)
        c = parent.cross + (cross[row][:, :, : self.src_len],) if cross is not None else parent.cross
        d = parent.decoder + (decoder[row],) if decoder is not None else parent.decoder
        return PartialHypothesis(tokens, lp, c, d)

    def results(self) -> list[Hypothesis]:
        """The n_best hypotheses, best score first (only meaningful once done)."""
        if self.max_new_tokens == 0:
            return [Hypothesis([], 0.0, 0.0, "length", {} if self.attention_kinds else None)]
        return sorted(self.finished, key=lambda h: -h.score)[: self.n_best]
