"""The one search step that offline ``generate`` and the serving engine's runner both take:
``search_step`` advances every search in flight (``ActiveSearch``, each a ``beam.BeamSearch``) by one
token from one decode step's output, with one top-k over all rows and one batched cache reorder.

``BeamSearch``, ``Hypothesis``, ``PartialHypothesis``, ``ATTENTION_KINDS`` and ``max_beam_size`` are
``beam.py``'s, imported here too: the service and the benchmarks name them from this module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import Tensor

from . import kernels, settings
from .beam import ATTENTION_KINDS, BeamSearch, Hypothesis, PartialHypothesis, max_beam_size
from .logits import process_step
from .topk import row_topk

if TYPE_CHECKING:
    from .logits import RepetitionControls
    from .step import StepOutput
    from .kv_cache import KVCache

__all__ = ["ATTENTION_KINDS", "ActiveSearch", "BeamSearch", "Hypothesis", "PartialHypothesis", "SearchUpdate",
           "decode_inputs", "max_beam_size", "rank_candidates", "search_step"]


@dataclass(eq=False)
class ActiveSearch:
    """A search in flight: its BeamSearch, the cache slots of its hypotheses, the next decoder input."""
    search: BeamSearch
    slots: list[int]                         # cache slots, one per hypothesis (beam_size); alive ones first
    tokens: list[int]                        # next decoder input of each alive hypothesis (BOS at first)
    position: int = 0                        # their target position (= tokens generated so far)
    min_new_tokens: int = 0                  # EOS is masked until this many tokens exist
    controls: Optional["RepetitionControls"] = None  # per-sequence logits processing (logits.py); None = none


@dataclass
class SearchUpdate:
    """What ``search_step`` did to the searches it was given."""
    running: list[ActiveSearch]              # still searching, in the order given (done ones left out)
    failed: dict[ActiveSearch, Exception]    # whose step raised (the others went on)


def decode_inputs(searches: Sequence[ActiveSearch]) -> tuple[list[int], list[int], list[int]]:
    """The next ``decode_step``'s (slots, tokens, positions), each [N] as a list: every alive
    hypothesis of ``searches``, in order (the rows ``search_step`` reads them back from)."""
    slots: list[int] = []
    tokens: list[int] = []
    positions: list[int] = []
    for s in searches:
        n = len(s.tokens)
        slots += s.slots[:n]
        tokens += s.tokens
        positions += [s.position] * n
    return slots, tokens, positions


def search_step(cache: "KVCache", parts: Sequence[tuple["StepOutput", Sequence[ActiveSearch]]]) -> SearchUpdate:
    """Advance every search by one token.

    Args:
        parts: decode outputs (log_probs [N, V], per-layer attention rows when tracked) with the
            searches whose alive hypotheses are their rows, in order (``decode_inputs``' layout).
            Usually one; the engine's runner passes several after decoding a failing batch piecewise.
            The top-k and the ranking run the compiled kernels where every output allows it
            (``StepOutput.cpu_kernels``: the switch of the cache its step ran on).
    One top-k over all rows (k = the largest beam; each search reads its own 2k), with EOS masked in
    the rows of searches below their min_new_tokens (log-probs are not renormalised); the candidates
    of every beam search (k > 1) ranked at once (``rank_candidates``), then each search's
    ``BeamSearch.advance`` (greedy ones: ``BeamSearch.step`` on their rows); ONE batched
    ``cache.reorder`` for all beams (positions < the longest beam's length: positions beyond a beam's
    own length are rewritten before they are read); then each running search's tokens and position
    are those of the next decode step. A search whose step raises is reported in ``failed`` and
    dropped; the others go on. Before all this, ``logits.process_step`` applies the repetition
    controls of the searches that have them to their own rows; a search still inside its
    ``target_prefix`` takes its next prefix token (``BeamSearch.force``) instead of a candidate; a
    lexically constrained search (``constraints.py``: glossary terms) reads its rows of the shared
    top-k and advances by its own ``constrained_step``.
    """
    process_step(parts)                          # per-sequence repetition controls, on their rows only
    k_max, masked, eos, base = 1, [], [], 0
    beams: list[tuple[int, BeamSearch]] = []     # (first row, search) of every search with k > 1
    constrained: dict[ActiveSearch, int] = {}    # lexically constrained searches -> their first row
    greedy_rows: list[int] = []
    forced = {s for _, searches in parts for s in searches if s.search.forcing}   # taking a prefix token
    for out, searches in parts:
        for s in searches:
            n = len(s.tokens)
            if s in forced:
                base += n
                continue
            k_max = max(k_max, s.search.beam_size)
            if s.position < s.min_new_tokens:
                masked.extend(range(base, base + n))
                eos.extend([s.search.eos_id] * n)
            if hasattr(s.search, "constrained_step"):   # glossary terms: constraints.py, below
                constrained[s] = base
            elif s.search.beam_size > 1:
                beams.append((base, s.search))
            else:
                greedy_rows.extend(range(base, base + n))
            base += n
    top_v, top_i = _candidates([out for out, _ in parts], k_max, masked, eos)
    ranked = iter(rank_candidates(top_v, top_i, beams, cpu_kernels=all(out.cpu_kernels for out, _ in parts)))
    if greedy_rows:                              # python lists of the greedy rows only, in order
        if len(greedy_rows) < top_v.size(0):
            rows = torch.tensor(greedy_rows, device=top_v.device)
            gv, gi = top_v.index_select(0, rows).tolist(), top_i.index_select(0, rows).tolist()
        else:
            gv, gi = top_v.tolist(), top_i.tolist()
    update = SearchUpdate([], {})
    moved_slots: list[int] = []
    parent_index: list[int] = []                 # into moved_slots
    length, g = 0, 0                             # g: the current greedy search's first row in gv
    for out, searches in parts:
        stacked: dict[str, Tensor] = {}          # kind -> [N, L, H, X], stacked once per part
        r = 0                                    # the current search's first row within this part
        for s in searches:
            n = len(s.tokens)
            try:
                greedy = s.search.beam_size == 1 and s not in constrained
                cands = None if greedy or s in forced or s in constrained else next(ranked)
                kinds = s.search.attention_kinds
                c = _attention_rows(out, "cross", stacked, r, n) if "cross" in kinds else None
                d = _attention_rows(out, "decoder", stacked, r, n) if "decoder" in kinds else None
                if s in forced:
                    parents, tokens = s.search.force(_forced_log_prob(out, r, s.search), c, d)
                elif s in constrained:           # glossary terms: dynamic beam allocation (constraints.py)
                    rows = slice(constrained[s], constrained[s] + n)
                    parents, tokens = s.search.constrained_step(top_v[rows].tolist(), top_i[rows].tolist(),
                                                                out, r, c, d)
                elif greedy:
                    tv, ti = (gv[g], gi[g]) if k_max == 1 else (gv[g][:2], gi[g][:2])
                    parents, tokens = s.search.step([tv], [ti], c, d)
                else:
                    parents, tokens = s.search.advance(*cands, c, d)
                if not s.search.done:
                    t = len(s.search.alive[0].tokens)  # every alive hypothesis has the same length
                    if parents != list(range(len(parents))):
                        m = max(len(parents), max(parents) + 1)   # fewer alive than parents' rows: the rest stay
                        parent_index += [len(moved_slots) + i for i in parents] + \
                            [len(moved_slots) + j for j in range(len(parents), m)]
                        moved_slots += s.slots[:m]
                        length = max(length, t)
                    s.tokens, s.position = tokens, t
                    update.running.append(s)
            except Exception as e:  # noqa: BLE001 - fails this search only
                update.failed[s] = e
            g += n if s.search.beam_size == 1 and s not in constrained and s not in forced else 0
            r += n
    if moved_slots:  # on an indirect cache this copies slot ids, not K/V
        cache.reorder(moved_slots, parent_index, length=length)
    return update


def _forced_log_prob(out: "StepOutput", row: int, search: BeamSearch) -> float:
    """The log-prob of ``search``'s next prefix token in row ``row`` of a step's output (after any
    logits processing), from that row alone."""
    tok = search.prefix[len(search.alive[0].tokens)]
    logits = out.pending_logits
    if logits is not None:
        return float(torch.log_softmax(logits[row].float(), dim=-1)[tok])
    return float(out.log_probs[row, tok])


def rank_candidates(top_v: Tensor, top_i: Tensor, rows: Sequence[tuple[int, BeamSearch]],
                    cpu_kernels: Optional[bool] = None) -> list[tuple[list, list, list]]:
    """The candidates of many beam searches ranked at once, as ``BeamSearch._beam_step`` ranks
    one sentence's: candidate = (parent's log-prob + token's log-prob, in float64), best first,
    ties by parent row then token id; each sentence keeps its best min(2k, all).

    Args:
        top_v, top_i: [N, W] per row, its best W log-probs (float32 or float64) and token ids,
            best first (a sentence with beam k reads the first min(2k, W) of each of its rows).
        rows: per sentence, (its first row in top_v, its BeamSearch): its alive hypotheses are rows
            first .. first + len(alive) - 1, in order.
    Returns per sentence the three lists ``BeamSearch.advance`` takes (log-probs, parent rows,
    token ids), the same values as ranking each sentence by itself (tests): on CPU (float32/float64),
    with ``cpu_kernels`` (default: the process's), in one compiled call (``kernels.rank_beams_op``),
    else in a few tensor ops over a [sentences, k_max * W] layout (``_rank_in_tensors``); then three
    ``tolist`` calls instead of a python sort per sentence.
    """
    if not rows:
        return []
    W = top_v.size(1)
    prefix = [h.log_prob for _, search in rows for h in search.alive]
    op = kernels.rank_beams_op() if settings.or_default("cpu_kernels", cpu_kernels) else None
    if op is not None and top_v.device.type == "cpu" and top_v.dtype in (torch.float32, torch.float64):
        first, count, beam = torch.tensor([x for f, search in rows for x in (f, len(search.alive), search.beam_size)]
                                          ).view(-1, 3).unbind(1)
        log_probs, parents, tokens = (x.tolist() for x in op(top_v, top_i, torch.tensor(prefix, dtype=torch.float64),
                                                               first, count, beam))
    else:
        log_probs, parents, tokens = _rank_in_tensors(top_v, top_i, rows, prefix)
    out = []
    for j, (_, search) in enumerate(rows):
        k2 = 2 * search.beam_size
        m = min(k2, len(search.alive) * min(k2, W))
        out.append((log_probs[j][:m], parents[j][:m], tokens[j][:m]))
    return out


def _rank_in_tensors(top_v: Tensor, top_i: Tensor, rows: Sequence[tuple[int, BeamSearch]], prefix: list[float]
                     ) -> tuple[list, list, list]:
    """``rank_candidates`` in tensor ops on top_v's device: the sentences' rows padded to
    [S * k_max, W], columns past a sentence's own 2k and missing rows set to NaN (sorted last), each
    row's candidates put in token-id order, then one stable sort of each sentence's negated
    log-probs (ties keep (row, id) order). Returns [S][T] lists (log-probs, parents, tokens)."""
    dev = top_v.device
    S, W = len(rows), top_v.size(1)
    K = max(search.beam_size for _, search in rows)
    src: list[int] = []
    dest: list[int] = []
    widths: list[int] = []                   # per source row: its sentence's columns
    for j, (first, search) in enumerate(rows):
        n = len(search.alive)
        src.extend(range(first, first + n))
        dest.extend(range(j * K, j * K + n))
        widths.extend([min(2 * search.beam_size, W)] * n)
    src_t = torch.tensor(src, device=dev)
    score = torch.tensor(prefix, dtype=torch.float64, device=dev)[:, None] + top_v.index_select(0, src_t).double()
    ids = top_i.index_select(0, src_t)
    if min(widths) < W:                      # columns past a sentence's own 2k are not its candidates
        past = torch.arange(W, device=dev) >= torch.tensor(widths, device=dev)[:, None]
        score.masked_fill_(past, float("nan"))
    ids, by_id = ids.sort(dim=1, stable=True)    # so that equal scores keep (row, id) order below
    score = score.gather(1, by_id)
    padded = torch.full((S * K, W), float("nan"), dtype=torch.float64, device=dev)
    padded_ids = torch.zeros((S * K, W), dtype=ids.dtype, device=dev)
    dest_t = torch.tensor(dest, device=dev)
    padded.index_copy_(0, dest_t, score)
    padded_ids.index_copy_(0, dest_t, ids)
    take = min(2 * K, K * W)
    # ascending on the negated score: best first; stable: ties in (row, id) order; NaN last
    neg, order = torch.sort(-padded.view(S, K * W), dim=1, stable=True)
    order = order[:, :take]
    return ((-neg[:, :take]).tolist(), (order // W).tolist(),
            padded_ids.view(S, K * W).gather(1, order).tolist())


def _candidates(outs: Sequence["StepOutput"], k: int, masked: list[int], eos: list[int]) -> tuple[Tensor, Tensor]:
    """Per row of the steps' outputs (in order), its min(2k, V) best log-probs and token ids, best
    first ([N, min(2k, V)] each, on the outputs' device); rows ``masked`` never get their ``eos``
    token (log-probs are not renormalised). Where the outputs allow the compiled kernels
    (``StepOutput.cpu_kernels``), from CPU logits in one compiled pass
    (``kernels.log_softmax_topk``: no [N, V] log-probabilities written), else log-softmax, mask,
    ``row_topk``."""
    logits = [out.pending_logits for out in outs]
    cpu_kernels = all(out.cpu_kernels for out in outs)
    op = kernels.log_softmax_topk_op() if cpu_kernels else None
    if op is not None and all(x is not None and x.device.type == "cpu" and x.dtype == torch.float32 for x in logits):
        x = logits[0] if len(logits) == 1 else torch.cat(logits)
        if 2 * k < x.size(1):
            banned = torch.full((x.size(0),), -1, dtype=torch.long)
            if masked:
                banned[torch.tensor(masked)] = torch.tensor(eos)
            return op(x, 2 * k, banned)
    lp = outs[0].log_probs if len(outs) == 1 else torch.cat([out.log_probs for out in outs])
    if masked:
        lp[torch.tensor(masked, device=lp.device), torch.tensor(eos, device=lp.device)] = float("-inf")
    return row_topk(lp, min(2 * k, lp.size(-1)), cpu_kernels=cpu_kernels)


def _attention_rows(out: "StepOutput", kind: str, stacked: dict, first: int, n: int) -> list[Tensor]:
    """Rows first..first+n-1 of a step's ``kind`` attention, each the [L, H, X] stack of that row's
    weights across layers (all rows are stacked once per step and kind)."""
    if kind not in stacked:
        stacked[kind] = torch.stack(getattr(out, kind), dim=1)   # [N, L, H, X]
    x = stacked[kind]
    return [x[first + j] for j in range(n)]
