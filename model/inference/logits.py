"""Per-sequence logits processing inside a shared decode step: repetition controls as CTranslate2
defines them, applied to the raw logits of each controlled row before its log-softmax.

- ``repetition_penalty`` p (Keskar et al., 2019, CTRL; CTranslate2's ``RepetitionPenalty``): the
  logit z of every token already in the hypothesis becomes z / p where z > 0 and z * p where z < 0
  (once per token, however often it occurred); p > 1 discourages repetition, p < 1 encourages it.
- ``no_repeat_ngram_size`` n (CTranslate2's ``NoRepeatNgram``, fairseq's ``--no-repeat-ngram-size``):
  a token that would complete an n-gram the hypothesis already holds gets logit -inf (the last n-1
  tokens are looked up among the hypothesis's earlier (n-1)-grams; each follower is forbidden).
  n = 1 forbids every token already generated. Nothing is forbidden before n tokens exist.

"Already in the hypothesis" means its tokens so far (a forced ``target_prefix`` included), never
the source or BOS. Both act on logits, so the log-softmax that follows renormalises over what is
left, as in CTranslate2. Rows without controls are not touched: a sentence without them gets
bit-identical results in a batch with controlled sentences (tests/test_controls.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class RepetitionControls:
    """One sentence's repetition controls (the defaults change nothing)."""
    repetition_penalty: float = 1.0      # > 0; 1 = off
    no_repeat_ngram_size: int = 0        # >= 0; 0 = off

    @property
    def active(self) -> bool:
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0


def banned_tokens(tokens: Sequence[int], n: int) -> list[int]:
    """The tokens that would repeat an n-gram of ``tokens`` if generated next, in ascending order:
    every token that follows an earlier occurrence of the last n-1 tokens. [] when n < 1 or fewer
    than n tokens exist."""
    if n < 1 or len(tokens) < n:
        return []
    t = list(tokens)
    if n == 1:
        return sorted(set(t))
    tail = t[len(t) - n + 1:]
    return sorted({t[i + n - 1] for i in range(len(t) - n + 1) if t[i: i + n - 1] == tail})


def apply_repetition_controls(logits: Tensor, rows: Sequence[tuple[int, Sequence[int], RepetitionControls]]) -> None:
    """In place on ``logits`` [N, V] (float; -inf entries stay -inf): for each (row, tokens so far,
    controls), the repetition penalty on the logits of ``tokens``, then -inf on the tokens
    ``banned_tokens`` forbids. Rows not listed are not read or written."""
    for row, tokens, c in rows:
        if c.repetition_penalty != 1.0 and tokens:
            ids = torch.tensor(sorted(set(tokens)), device=logits.device)
            z = logits[row].index_select(0, ids)
            logits[row].index_copy_(0, ids, torch.where(z < 0, z * c.repetition_penalty, z / c.repetition_penalty))
        if c.no_repeat_ngram_size > 0:
            banned = banned_tokens(tokens, c.no_repeat_ngram_size)
            if banned:
                logits[row, torch.tensor(banned, device=logits.device)] = float("-inf")


def process_step(parts) -> None:
    """The one call ``search_step`` makes before choosing tokens: per decode output of ``parts``
    ((StepOutput, searches) pairs, rows in ``decode_inputs``' order), the repetition controls of
    every search that has them (``ActiveSearch.controls``), on each of its alive rows. On a step's
    logits when it holds them (``StepOutput.pending_logits``); on log-probabilities otherwise (the
    controlled rows then renormalised with a log-softmax; the engine's runner asks for logits
    whenever a sequence has controls, so this is the offline fallback)."""
    for out, searches in parts:
        rows, r = [], 0
        for s in searches:
            c = getattr(s, "controls", None)
            if c is not None and c.active:
                rows += [(r + b, h.tokens, c) for b, h in enumerate(s.search.alive[: len(s.tokens)])]
            r += len(s.tokens)
        if not rows:
            continue
        logits = out.pending_logits
        if logits is not None:
            apply_repetition_controls(logits, rows)
        else:
            lp = out.log_probs
            apply_repetition_controls(lp, rows)
            idx = torch.tensor([row for row, _, _ in rows], device=lp.device)
            lp[idx] = torch.log_softmax(lp.index_select(0, idx), dim=-1)
