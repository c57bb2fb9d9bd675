"""Lexically constrained beam search with dynamic beam allocation (DBA; Post & Vilar, 2018, "Fast
Lexically Constrained Decoding with Dynamic Beam Allocation for Neural Machine Translation", NAACL;
vectorised by Hu et al., 2019): every constraint (a sequence of target token ids, e.g. a glossary
term) appears in the output, and the beam's k slots are shared between hypotheses that have met
different numbers of constraint tokens, so that hypotheses which have placed a term early do not
push out those that will place it later.

A phrase listed n times must occur n times (a term whose source occurs twice). Occurrences are
counted wherever the phrase's tokens stand in the output, inside another constraint's occurrence
too: with "two" and "two bikes" listed once each, "two bikes" meets both, so the search does not
force a second "two" (a term is never forced more often than it is listed).

One step of a ``ConstrainedBeamSearch`` (k = beam_size, n alive hypotheses):
  1. candidates: each alive hypothesis's 2k best next tokens (the shared top-k of ``search_step``)
     plus the tokens its constraint state allows (the next token of the term it is inside, else the
     first token of every unmet term), whose log-probs are read from the step's logits;
     EOS, and a token that ends a sentence (``ends``: final punctuation), only for a hypothesis that
     has met every constraint (a term is written before the sentence's end, not after it);
  2. each candidate's ``ConstraintState`` after its token; its bank = constraint tokens met (0..C);
  3. the k slots are divided among the C + 1 banks (k // (C + 1) each, the remainder to the top
     bank); a bank with fewer candidates passes its spare slots down to the bank below (Sockeye's
     rule); slots still spare go to the best remaining candidates of any bank;
  4. the chosen candidates, best log-prob first, go to ``BeamSearch.advance``: EOS ones finish,
     the others stay alive.
The term being written is the unmet one whose start the output's last tokens match longest; a
hypothesis that leaves it midway loses its progress on it (the term may start again later). Results
rank hypotheses that contain every term (as often as listed) before the others (a hypothesis that
hits max_new_tokens before meeting all is a "length" result and ranks last), then by score.

Invariant: a search without constraints is never a ``ConstrainedBeamSearch`` and ``search_step``
treats it exactly as before (the shared top-k is unchanged), so its result does not depend on
whether constrained searches share its step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from .beam import BeamSearch, Hypothesis

if TYPE_CHECKING:
    from .step import StepOutput

MIN_CONSTRAINED_BEAM = 4   # the beam a constrained sentence gets at least (greedy requests included)


@dataclass(frozen=True)
class Plan:
    """What a sentence's constraints ask, computed once per constraints tuple (``plan``)."""
    phrases: tuple[tuple[int, ...], ...]     # the distinct phrases, first listed first
    of: tuple[int, ...]                      # per listed constraint: its phrase
    need: tuple[int, ...]                    # per phrase: how often it is listed (occurrences needed)
    tail: int                                # output tokens kept to match phrases: the longest one's, less one


@functools.lru_cache(maxsize=4096)
def plan(constraints: tuple[tuple[int, ...], ...]) -> Plan:
    """The distinct phrases of ``constraints`` and how often each is listed."""
    phrases = tuple(dict.fromkeys(constraints))
    index = {p: j for j, p in enumerate(phrases)}
    of = tuple(index[c] for c in constraints)
    need = tuple(of.count(j) for j in range(len(phrases)))
    return Plan(phrases, of, need, max(map(len, phrases), default=1) - 1)


@dataclass(frozen=True, slots=True)
class ConstraintState:
    """One hypothesis's progress on its sentence's constraints."""
    met: tuple[bool, ...]                    # per constraint: written (a phrase listed n times: its first
                                             # c constraints, c = its occurrences so far)
    current: int = -1                        # the constraint being written (-1: none)
    done: int = 0                            # its tokens written so far
    counts: tuple[int, ...] = ()             # per phrase of ``plan``: its occurrences so far (() = none)
    tail: tuple[int, ...] = ()               # the output's last tokens (``Plan.tail`` of them)

    def met_tokens(self, constraints: Sequence[tuple[int, ...]]) -> int:
        """Constraint tokens met: the bank of the hypothesis."""
        return sum(len(c) for c, m in zip(constraints, self.met) if m) + self.done

    def all_met(self) -> bool:
        return all(self.met)

    def allowed(self, constraints: Sequence[tuple[int, ...]]) -> list[int]:
        """Tokens that advance a constraint: the next one of the term being written, else the first
        token of every unmet term."""
        if self.current >= 0:
            return [constraints[self.current][self.done]]
        return list(dict.fromkeys(c[0] for c, m in zip(constraints, self.met) if not m))

    def advance(self, constraints: Sequence[tuple[int, ...]], token: int) -> "ConstraintState":
        """The state after ``token``: each phrase that the output now ends with counts once more, and
        the term being written is the unmet one whose start the output ends with longest (first listed
        on a tie; module docstring)."""
        p = plan(tuple(constraints))
        seq = self.tail + (token,)
        counts = list(self.counts or (0,) * len(p.phrases))
        for j, phrase in enumerate(p.phrases):
            if seq[-len(phrase):] == phrase:
                counts[j] += 1
        met, seen = [], [0] * len(p.phrases)
        for j in p.of:                       # the first counts[j] constraints of phrase j are met
            met.append(seen[j] < counts[j])
            seen[j] += 1
        current, done = -1, 0
        for i, c in enumerate(constraints):
            if not met[i]:
                k = next((k for k in range(len(c) - 1, done, -1) if seq[-k:] == c[:k]), 0)
                if k > done:
                    current, done = i, k
        return ConstraintState(tuple(met), current, done, tuple(counts), seq[-p.tail:] if p.tail else ())


def bank_sizes(beam_size: int, counts: Sequence[int]) -> list[int]:
    """Slots per bank (Post & Vilar 2018, section 3.2): beam_size // num_banks each, the remainder to
    the top bank; from the top down, a bank with fewer candidates (``counts``) than slots passes the
    spare ones to the bank below. Bank 0's spare slots are returned to the caller as unassigned."""
    n = len(counts)
    size = beam_size // n
    assigned = [size] * n
    assigned[-1] += beam_size - size * n
    for i in reversed(range(n)):
        spare = assigned[i] - counts[i]
        if spare > 0:
            assigned[i] = counts[i]
            if i > 0:
                assigned[i - 1] += spare
    return assigned


def contains(tokens: Sequence[int], phrase: Sequence[int]) -> bool:
    """Whether ``phrase`` occurs in ``tokens`` as a contiguous run."""
    return occurrences(tokens, phrase) > 0


def occurrences(tokens: Sequence[int], phrase: Sequence[int]) -> int:
    """How often ``phrase`` occurs in ``tokens`` as a contiguous run (overlapping runs each count)."""
    n, phrase = len(phrase), tuple(phrase)
    return sum(tuple(tokens[i:i + n]) == phrase for i in range(len(tokens) - n + 1))


@dataclass
class ConstrainedBeamSearch(BeamSearch):
    """A ``BeamSearch`` whose output must contain every ``constraints`` phrase (target ids, EOS
    excluded; a phrase listed n times, n times), written before any of the ``ends`` tokens (those
    that end a sentence); see the module docstring. ``search_step`` calls ``constrained_step`` for it
    instead of ranking its candidates with the unconstrained searches'.
    Raises ValueError for beam_size < 2 (a beam of one would write every term at once; the engine
    raises greedy requests to MIN_CONSTRAINED_BEAM) or an empty constraint.
    """
    constraints: tuple = ()                  # tuple of tuples of target token ids
    ends: frozenset = frozenset()            # ids that end a sentence (final punctuation): once every term is met
    states: list = field(default_factory=list)   # ConstraintState of each alive hypothesis, in order

    def __post_init__(self) -> None:
        super().__post_init__()
        self.constraints = tuple(tuple(int(t) for t in c) for c in self.constraints)
        if self.beam_size < 2:
            raise ValueError(f"beam_size must be >= 2 with constraints, got {self.beam_size}")
        if not self.constraints or not all(self.constraints):
            raise ValueError("constraints must be non-empty token sequences")
        if any(t == self.eos_id for c in self.constraints for t in c):
            raise ValueError("constraints must not contain EOS")
        self.ends = frozenset(int(t) for t in self.ends)
        self.states = [ConstraintState((False,) * len(self.constraints))]

    def constrained_step(self, top_v: Sequence[list], top_i: Sequence[list], out: "StepOutput", first: int,
                         cross=None, decoder=None) -> tuple[list[int], list[int]]:
        """One DBA step (module docstring).

        Args:
            top_v, top_i: per alive row, its best log-probs and token ids (this search's rows of the
                shared top-k; the first 2k of each are read).
            out: the step's output holding the rows; first: this search's first row in it (the
                log-probs of allowed tokens outside the top-k are read from there).
            cross / decoder: per row, [L, H, S] / [L, H, T] attention, when tracked.
        Returns (parents, tokens) as ``BeamSearch.step``.
        """
        k, cons, eos = self.beam_size, self.constraints, self.eos_id
        if self.forced_eos and len(self.alive[0].tokens) >= self.max_new_tokens - 1:
            return self._end_with_eos()
        n = len(self.alive)
        cands: dict[tuple[int, int], float] = {}           # (parent row, token) -> log-prob
        for b in range(n):
            base = self.alive[b].log_prob
            for v, i in zip(top_v[b][: 2 * k], top_i[b][: 2 * k]):
                if v != float("-inf"):
                    cands[(b, int(i))] = base + float(v)
        allowed = [st.allowed(cons) for st in self.states]
        extra = [(b, t) for b in range(n) for t in allowed[b] if (b, t) not in cands]
        if extra:
            for (b, t), v in zip(extra, _token_log_probs(out, first, top_v, top_i, extra)):
                if v != float("-inf"):
                    cands[(b, t)] = self.alive[b].log_prob + v
        total = sum(len(c) for c in cons)
        scored = []                                        # (-log-prob, parent, token, state, bank)
        for (b, t), lp in cands.items():
            parent = self.states[b]
            if (t == eos or t in self.ends) and not parent.all_met() and t not in allowed[b]:
                continue                                   # the sentence ends once every term is written
            if t == eos:
                st = parent
            else:
                st = parent.advance(cons, t)
            scored.append((-lp, b, t, st, st.met_tokens(cons)))
        scored.sort(key=lambda x: x[:3])                   # best first; ties by parent row, then token id
        counts = [0] * (total + 1)
        for x in scored:
            counts[x[4]] += 1
        room = bank_sizes(k, counts)
        chosen, rest = [], []
        for x in scored:
            if room[x[4]] > 0:
                room[x[4]] -= 1
                chosen.append(x)
            else:
                rest.append(x)
        chosen += rest[: k - len(chosen)]                  # spare slots: the best remaining candidates
        chosen.sort(key=lambda x: x[:3])
        parents, tokens = self.advance([-x[0] for x in chosen], [x[1] for x in chosen], [x[2] for x in chosen],
                                       cross, decoder)
        self.states = [x[3] for x in chosen if x[2] != eos][: len(self.alive)]
        return parents, tokens

    def step(self, top_v: list, top_i: list, cross=None, decoder=None) -> tuple[list[int], list[int]]:
        raise TypeError("a ConstrainedBeamSearch advances by constrained_step (it needs the step's logits)")

    def met(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` contain every constraint, each phrase as often as it is listed."""
        p = plan(self.constraints)
        return all(occurrences(tokens, c) >= n for c, n in zip(p.phrases, p.need))

    def results(self) -> list[Hypothesis]:
        """The n_best hypotheses: those containing every constraint first, then by score."""
        if self.max_new_tokens == 0:
            return super().results()
        return sorted(self.finished, key=lambda h: (not self.met(h.tokens), -h.score))[: self.n_best]


def _token_log_probs(out: "StepOutput", first: int, top_v: Sequence[list], top_i: Sequence[list],
                     wanted: Sequence[tuple[int, int]]) -> list[float]:
    """The log-probabilities of (row, token) pairs of a step's output (rows counted from ``first``).
    From logits without a softmax over the vocabulary: each row's log-normaliser is its best token's
    logit minus that token's log-prob (``top_v``/``top_i``: the row's best, from the shared top-k),
    so a token's log-prob is its logit minus that. From ``log_probs`` when the step holds those."""
    dev = (out.logits if out.logits is not None else out.log_probs).device
    rows = torch.tensor([first + b for b, _ in wanted], device=dev)
    toks = torch.tensor([t for _, t in wanted], device=dev)
    if out.logits is None:
        return out.log_probs[rows, toks].double().tolist()
    best = torch.tensor([top_i[b][0] for b, _ in wanted], device=dev)
    best_lp = torch.tensor([top_v[b][0] for b, _ in wanted], dtype=torch.float64, device=dev)
    logits = out.logits
    return (logits[rows, toks].double() - logits[rows, best].double() + best_lp).tolist()
