"""Building a ``TranslateResponse`` from the engine's results: per text its sentences' best
hypotheses rejoined with the input's whitespace, alternatives, and block-diagonal attention."""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from model.inference.search import Hypothesis
from service.protocol import (MAX_ATTENTION_VALUES, Alternative, AttentionSelection, TooLarge, TranslateJob,
                              TranslateResponse, Translation, Usage)
from service.engine import TranslationResult

from .align import sentence_alignment
from .text import Piece, Split


TextOf = Callable[[Piece, Hypothesis], str]   # a sentence's text from one of its hypotheses


def build_response(model: str, tok, job: TranslateJob, splits: Sequence[Optional[Split]],
                   pieces: Sequence[Piece], results: Sequence[TranslationResult],
                   text_of: TextOf, config: Optional[dict] = None) -> TranslateResponse:
    """One Translation per text of ``job`` (``results[k]`` is the engine's result for ``pieces[k]``).

    ``text_of`` turns a hypothesis into its sentence's text (the translator's: protected spans and
    case restored, ``protect.py``). ``config``: the model's config (``n_heads``, ``n_encoder_layers``,
    ``n_decoder_layers``), which gives a text without tokens its attention shape ([layers][heads] of
    empty matrices). Raises TooLarge when the attention asked for would hold more than
    MAX_ATTENTION_VALUES weights (checked before any matrix is built).
    """
    by_text: dict[int, list[tuple[Piece, TranslationResult]]] = {}
    for p, r in zip(pieces, results):
        by_text.setdefault(p.text_index, []).append((p, r))
    kinds = job.options.attention_kinds
    if kinds:
        n = sum(attention_values(kind, [r.hypotheses[0] for _, r in items], [p.src_ids for p, _ in items],
                                 job.attention) for items in by_text.values() for kind in kinds)
        if n > MAX_ATTENTION_VALUES:
            raise _too_large(f"holds {n:,}")
    translations, src_total, gen_total = [], 0, 0
    for i, split in enumerate(splits):
        items = by_text.get(i, [])
        tr = _translation(tok, split, items, job.options.n_best, kinds, job.attention, text_of, config)
        if job.min_confidence is not None:      # flagged, never dropped
            for t in (tr, *tr.alternatives):
                t.low_confidence = t.confidence < job.min_confidence
        if job.return_alignment:
            tr.alignment = text_alignment(tok, items)
        translations.append(tr)
        src_total += sum(len(p.src_ids) for p, _ in items)
        gen_total += sum(len(r.hypotheses[0].tokens) for _, r in items)
    return TranslateResponse(model=model, translations=translations,
                             usage=Usage(source_tokens=src_total, generated_tokens=gen_total))


def empty_attention(kind: str, config: Optional[dict], selection: AttentionSelection) -> list:
    """The attention of a text without tokens: [len(layers)][len(heads)] empty matrices (0 rows), the
    shape a client indexes as for any other text; [] without a config."""
    if not config:
        return []
    n_layers = config.n_encoder_layers if kind == "encoder" else config.n_decoder_layers
    return [[[] for _ in (selection.heads or range(config.n_heads))] for _ in (selection.layers or range(n_layers))]


def _translation(tok, split: Optional[Split], items: list[tuple[Piece, TranslationResult]], n_best: int,
                 kinds: tuple[str, ...], selection: AttentionSelection, text_of: TextOf,
                 config: Optional[dict] = None) -> Translation:
    if split is None or not split.pieces:   # empty, whitespace or invisible characters only: "";
        # no letters (only digits, punctuation, symbols): the text itself; neither touches the model
        return Translation(text=split.join([]) if split is not None else "", tokens=[], source_tokens=[],
                           score=0.0, finish_reason="eos", alternatives=[], confidence=1.0,
                           attention={k: empty_attention(k, config, selection) for k in kinds} if kinds else None)
    best = [r.hypotheses[0] for _, r in items]
    alternatives = []
    for k in range(1, n_best):
        # Alternative k of a text = each sentence's k-th hypothesis (its best when it has fewer).
        if all(len(r.hypotheses) <= k for _, r in items):
            break
        hyps = [r.hypotheses[min(k, len(r.hypotheses) - 1)] for _, r in items]
        alternatives.append(Alternative(**_joined(tok, split, items, hyps, text_of)))
    attention = None
    if kinds:
        sources = [p.src_ids for p, _ in items]
        attention = {kind: block_diagonal(kind, best, sources, selection.layers, selection.heads) for kind in kinds}
    return Translation(**_joined(tok, split, items, best, text_of),
                       source_tokens=[piece for p, _ in items for piece in tok.pieces(p.src_ids)],
                       alternatives=alternatives, attention=attention)


def _joined(tok, split: Split, items: list[tuple[Piece, TranslationResult]], hyps: list, text_of: TextOf) -> dict:
    """One hypothesis per sentence, as a text: text, tokens, mean score, finish_reason."""
    return {"text": split.join([text_of(p, h) for (p, _), h in zip(items, hyps)]),
            "tokens": [piece for h in hyps for piece in tok.pieces(h.tokens)],
            "score": _finite(sum(h.score for h in hyps) / len(hyps)),
            "finish_reason": "length" if any(h.finish_reason == "length" for h in hyps) else "eos",
            "confidence": confidence(hyps)}


def confidence(hyps: Sequence[Hypothesis]) -> float:
    """A text's confidence from its sentences' hypotheses: exp(sum of log_prob / sum of lengths),
    the geometric mean probability the model gave each token it generated (EOS included, a forced
    target prefix's tokens included), in [0, 1]; 1.0 for no tokens. Independent of length_penalty.
    Its Spearman correlation with sentence-level chrF: ``python -m service.bench.confidence``."""
    length = sum(len(h.tokens) + (h.finish_reason == "eos") for h in hyps)
    if not length:
        return 1.0
    lp = sum(h.log_prob for h in hyps)
    return min(1.0, math.exp(lp / length)) if math.isfinite(lp) else 0.0


def text_alignment(tok, items: list[tuple[Piece, TranslationResult]]) -> list[tuple[int, int]]:
    """A text's word alignment (``align.sentence_alignment`` per sentence, best hypothesis): pairs
    (source word, target word), word indices counted over the whole text (source words of
    ``source_tokens`` without "</s>" and ">>xx<<" tokens, target words of ``tokens``)."""
    pairs, s0, t0 = [], 0, 0
    for p, r in items:
        h = r.hypotheses[0]
        got, n_src, n_tgt = sentence_alignment(tok.pieces(p.src_ids), tok.pieces(h.tokens),
                                               (h.attention or {}).get("cross"))
        pairs += [(s + s0, t + t0) for s, t in got]
        s0, t0 = s0 + n_src, t0 + n_tgt
    return pairs


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -1e9


def _extent(kind: str, hyps: list, sources: list[list[int]]) -> tuple[list[int], list[int]]:
    """Rows and columns of each sentence's block (see ``block_diagonal``)."""
    rows = [len(h.tokens) if kind != "encoder" else len(s) for h, s in zip(hyps, sources)]
    cols = [len(s) if kind != "decoder" else len(h.tokens) for h, s in zip(hyps, sources)]
    return rows, cols


def _too_large(held: str) -> TooLarge:
    return TooLarge(f"return_attention: the attention asked for {held} weights, at most {MAX_ATTENTION_VALUES:,} "
                    "per response (each text's matrix is layers x heads x its tokens x its tokens, per kind): "
                    "select fewer attention.kinds, attention.layers or attention.heads, or send shorter texts",
                    "return_attention")


def check_attention_floor(job: TranslateJob, pieces: list, options: list, config) -> None:
    """Raises TooLarge before decoding when the attention ``job`` asks for must hold more than
    MAX_ATTENTION_VALUES weights whatever the translations' lengths: the encoder's weights depend on
    the source alone, and each hypothesis holds at least its target_prefix and min_new_tokens
    (``options[k]``: piece k's, None for the job's). A memory hit has no attention."""
    kinds, sel = job.options.attention_kinds, job.attention
    if not kinds:
        return
    lengths: dict[int, list[int]] = {}        # text -> [source tokens, least target tokens]
    for p, o in zip(pieces, options):
        if p.stored is None:
            o = o or job.options
            t = lengths.setdefault(p.text_index, [0, 0])
            t[0] += len(p.src_ids)
            t[1] += len(o.target_prefix) + o.min_new_tokens
    heads = len(sel.heads or range(config.n_heads))
    n = 0
    for src, tgt in lengths.values():
        for kind in kinds:
            layers = len(sel.layers or range(config.n_encoder_layers if kind == "encoder" else config.n_decoder_layers))
            rows, cols = {"encoder": (src, src), "cross": (tgt, src), "decoder": (tgt, tgt)}[kind]
            n += layers * heads * rows * cols
    if n > MAX_ATTENTION_VALUES:
        raise _too_large(f"would hold at least {n:,}")


def attention_values(kind: str, hyps: list, sources: list[list[int]], selection: AttentionSelection) -> int:
    """How many weights ``block_diagonal`` returns for one text: layers x heads x rows x cols."""
    ref = next((m for m in ((h.attention or {}).get(kind) for h in hyps) if m is not None and m.dim() == 4), None)
    if ref is None:
        return 0
    rows, cols = _extent(kind, hyps, sources)
    return (len(selection.layers or range(ref.shape[0])) * len(selection.heads or range(ref.shape[1]))
            * sum(rows) * sum(cols))


def block_diagonal(kind: str, hyps: list, sources: list[list[int]], layers: Optional[Sequence[int]],
                   heads: Optional[Sequence[int]]) -> list:
    """Per-sentence attention [L, H, rows, cols] placed on the diagonal of one text-level matrix.

    cross: rows = target tokens, cols = source tokens; encoder: both source; decoder: both target.
    Entries between different sentences are 0 (a token never attends to another sentence), so every
    row still sums to 1. ``layers`` / ``heads`` select indices (None = all). Returned as nested lists
    [len(layers)][len(heads)][rows][cols] rounded to 5 decimals ([] when no sentence has weights).
    """
    mats = [(h.attention or {}).get(kind) for h in hyps]     # none for a sentence never decoded
    rows, cols = _extent(kind, hyps, sources)
    ref = next((m for m in mats if m is not None and m.dim() == 4), None)
    if ref is None:
        return []
    L, H = ref.shape[:2]
    li = torch.tensor(list(layers) if layers else list(range(L)))
    hi = torch.tensor(list(heads) if heads else list(range(H)))
    out = torch.zeros(len(li), len(hi), sum(rows), sum(cols), dtype=torch.float64)
    r0 = c0 = 0
    for m, r, c in zip(mats, rows, cols):
        if r and c and m is not None and m.dim() == 4:
            block = m.detach().to("cpu", torch.float64).index_select(0, li).index_select(1, hi)
            out[:, :, r0:r0 + r, c0:c0 + c] = block[:, :, :r, :c]
        r0, c0 = r0 + r, c0 + c
    return out.mul(1e5).round().div(1e5).tolist()
