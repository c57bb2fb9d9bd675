"""Incremental decoding: ``prefill`` and ``decode_step`` are the only model math; offline ``generate``
(greedy and beam search) and the serving engine are built on them.

The search itself (``BeamSearch``, the one ``search_step`` both take) is in ``model/search.py``; the
per-row top-k of candidates in ``model/topk.py``; the KV cache in ``model/kv_cache.py``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import fused_step, kernels
from .dense_step import dense_forward, plan_dense, step_logits
from .kv_cache import KVCache
from .paged_cache import PagedKVCache
from .search import ATTENTION_KINDS, ActiveSearch, BeamSearch, Hypothesis, decode_inputs, search_step
from .transformer import Transformer, padding_mask

__all__ = ["ATTENTION_KINDS", "BeamSearch", "Hypothesis", "StepOutput", "beam_search", "decode_step",
           "encode_into_cache", "generate", "greedy_search", "length_groups", "pad_batch", "prefill"]


class StepOutput:
    """One decoder step's result: next-token log-probabilities ``log_probs`` [N, V] and, when asked for,
    per-layer attention rows: ``cross`` [N, H, S], ``decoder`` [N, H, T], ``encoder`` [B, H, S, S] (prefill).

    Built from ``log_probs``, or from ``logits`` [N, V] float32 with padding and BOS at -inf (what
    ``decode_step`` returns on CPU): then ``log_probs`` is computed on first use, and ``search_step``,
    which needs only each row's top candidates, takes them from the logits in one compiled pass
    (``kernels.log_softmax_topk``) without ever writing the [N, V] log-probabilities.
    Raises ValueError unless exactly one of log_probs and logits is given.
    """

    __slots__ = ("_log_probs", "logits", "cross", "decoder", "encoder")

    def __init__(self, log_probs: Optional[Tensor] = None, cross: Optional[list[Tensor]] = None,
                 decoder: Optional[list[Tensor]] = None, encoder: Optional[list[Tensor]] = None, *,
                 logits: Optional[Tensor] = None):
        if (log_probs is None) == (logits is None):
            raise ValueError("StepOutput takes either log_probs or logits")
        self._log_probs, self.logits = log_probs, logits
        self.cross, self.decoder, self.encoder = cross, decoder, encoder

    @property
    def log_probs(self) -> Tensor:
        if self._log_probs is None:
            self._log_probs = torch.log_softmax(self.logits, dim=-1)
        return self._log_probs

    @property
    def pending_logits(self) -> Optional[Tensor]:
        """The logits while ``log_probs`` has not been computed from them, else None."""
        return self.logits if self._log_probs is None else None

    @property
    def num_rows(self) -> int:
        return (self.logits if self._log_probs is None else self._log_probs).size(0)


@torch.no_grad()
def decode_step(model: Transformer, cache: KVCache, slots: Tensor, tokens: Tensor, positions: Tensor,
                need_weights: bool = False, dense: Optional[bool] = None, self_weights: bool = True) -> StepOutput:
    """One incremental decoder step for any set of slots, each at its own position.

    Every row attends to its own cached keys only (its own target history and its own source), so
    a row's result does not depend on the other rows. On CPU, rows of different lengths are
    attended packed, each over its own keys only (see ``AttentionPlan``); on CUDA in one padded call
    (except on a paged cache, which is always read packed, through its block tables). With ``dense``
    (default: a paged cache on CUDA) and no weights asked for, keys are gathered into a padded block
    and attended with the fused ``scaled_dot_product_attention`` (``model/dense_step.py``).

    Args:
        slots: [N] cache slots; tokens: [N] input token of each (the last generated, or BOS);
        positions: [N] target position of that token (0 for BOS).
    Returns a ``StepOutput``: its log-probabilities [N, V] (held as logits, computed when read; the
    dense path gives them directly) and, with need_weights, attention rows: cross [N, H, S] and,
    unless ``self_weights`` is False, decoder [N, H, T] per layer, zero-padded to the longest row
    (cross-attention rows alone still take the compiled layer step).
    Raises ValueError when a position reaches the cache's max_tgt_len.
    """
    if dense is None:
        dense = slots.device.type == "cuda" and isinstance(cache, PagedKVCache)
    if dense and not need_weights:  # fixed shapes, fused attention (model/dense_step.py)
        return StepOutput(dense_forward(model, cache, plan_dense(cache, slots, tokens, positions)))
    attend = cache.plan_step(slots, positions, packed=slots.device.type == "cpu")
    if not (need_weights and self_weights):  # each decoder layer in one compiled call where it applies
        fused = fused_step.decode_logits(model, attend, tokens, positions, cross_weights=need_weights)
        if fused is not None:                  # (model/fused_step.py)
            return StepOutput(logits=step_logits(model, fused[0]), cross=fused[1])
    logits, w = model.decode(tokens[:, None], None, None, None, positions[:, None], attend, need_weights)
    logits = step_logits(model, logits[:, -1])
    if not need_weights:
        return StepOutput(logits=logits)
    return StepOutput(logits=logits, cross=[x[:, :, 0] for x in w["cross"]], decoder=[x[:, :, 0] for x in w["self"]])


@torch.no_grad()
def encode_into_cache(model: Transformer, cache: KVCache, slots: Sequence[Sequence[int]] | Tensor, src: Tensor,
                      src_lengths: Optional[Tensor] = None, need_weights: bool = False) -> Optional[list[Tensor]]:
    """The encoder half of prefill: encoder pass and cross-attention K/V of every decoder layer,
    stored once per sentence (in its first slot) and shared by all of its slots (all hypotheses of a
    beam attend to one source).

    Args:
        slots: per sentence, its slots (a [B, k] tensor, or B lists of any lengths >= 1).
        src: [B, S] source ids (EOS-terminated, right-padded with pad_id).
        src_lengths: [B] real lengths (default: counted from padding).
    Returns encoder self-attention weights [B, H, S, S] per layer with need_weights, else None.
    Raises ValueError when S exceeds the cache's max_src_len.
    """
    rows = [list(map(int, r)) for r in (slots.tolist() if isinstance(slots, Tensor) else slots)]
    if len(rows) != src.size(0) or any(not r for r in rows):
        raise ValueError(f"need a non-empty slot list for each of the {src.size(0)} sentences")
    src_mask = padding_mask(src, model.cfg.pad_id)
    if src_lengths is None:
        src_lengths = src_mask[:, 0, 0].sum(-1)
    first = torch.tensor([r[0] for r in rows], dtype=torch.long, device=src.device)
    enc_w = None
    if not need_weights and cache.kernel_ok():
        # packed: only the real tokens go through the encoder (no padding, one call for any mix of lengths;
        # the same computation for a sentence whatever it is batched with)
        keep = torch.arange(src.size(1), device=src.device)[None, :] < src_lengths[:, None]
        memory = model.encode_packed(src[keep], src_lengths)                    # [NT, d_model]
        cache.write_cross_packed(first, model.cross_kv(memory[:, None]), src_lengths)
    else:
        memory, enc_w = model.encode(src, src_mask, need_weights)
        cache.write_cross(first, model.cross_kv(memory), src_lengths)
    others = [(s, r[0]) for r in rows for s in r[1:]]
    if others:  # the other hypotheses of a beam read the first slot's cross K/V
        cache.share_cross(torch.tensor([s for s, _ in others], device=src.device),
                          torch.tensor([o for _, o in others], device=src.device))
    return enc_w


@torch.no_grad()
def prefill(model: Transformer, cache: KVCache, slots: Tensor, src: Tensor,
            need_weights: bool = False, src_lengths: Optional[Tensor] = None) -> StepOutput:
    """Encoder pass, cross-attention K/V for every decoder layer, and the first decoder step (BOS).

    Args:
        slots: [B] or [B, k] cache slots per sentence; cross K/V are written to all k slots of a
            sentence (its beam), the first step runs on ``slots[:, 0]`` only.
        src: [B, S] source ids (EOS-terminated, right-padded with pad_id).
        src_lengths: [B] real lengths (default: counted from padding).
    Returns StepOutput with log_probs [B, V] for the first target token; with need_weights also
    encoder self-attention [B, H, S, S] per layer and first-step rows.
    The serving engine calls ``encode_into_cache`` and runs the first step inside its shared decode
    step instead (one decoder forward per engine step).
    """
    if slots.dim() == 1:
        slots = slots[:, None]
    enc_w = encode_into_cache(model, cache, slots, src, src_lengths, need_weights)
    first = slots[:, 0]
    bos = torch.full((slots.size(0),), model.cfg.bos_id, dtype=torch.long, device=src.device)
    out = decode_step(model, cache, first, bos, torch.zeros_like(bos), need_weights)
    out.encoder = enc_w
    return out


@torch.no_grad()
def generate(model: Transformer, sources: Sequence[Sequence[int]], beam_size: int = 1, n_best: int = 1,
             max_new_tokens: int | Sequence[int] = 128, length_penalty: float = 1.0, attention_kinds: Sequence[str] = (),
             cache: Optional[KVCache] = None) -> list[list[Hypothesis]]:
    """Translate a static batch: every sentence is prefilled together and decoded until the last ends.

    Args:
        sources: token ids per sentence, EOS included (see ``encode_source``).
        beam_size / n_best / max_new_tokens / length_penalty: see ``BeamSearch``; max_new_tokens
            may also be a list with one budget per sentence.
        attention_kinds: any of "cross", "encoder", "decoder" to return per-head weights.
    Returns per sentence its n_best hypotheses, best first.
    Raises ValueError for an empty source, a source longer than max_len, or bad search options.
    """
    cfg = model.cfg
    model.eval()
    kinds = tuple(attention_kinds)
    for kind in kinds:
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention kind {kind!r}; choose from {ATTENTION_KINDS}")
    budgets = [max_new_tokens] * len(sources) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(sources):
        raise ValueError(f"got {len(budgets)} max_new_tokens for {len(sources)} sources")
    for m in budgets:
        if m > cfg.max_len - 1:
            raise ValueError(f"max_new_tokens must be <= {cfg.max_len - 1}, got {m}")
    if 2 * beam_size > cfg.target_vocab_size:
        raise ValueError(f"beam_size must be <= {cfg.target_vocab_size // 2} (half the vocabulary), got {beam_size}")
    for s in sources:
        if not 0 < len(s) <= cfg.max_len:
            raise ValueError(f"source length must be in 1..{cfg.max_len}, got {len(s)}")
    B = len(sources)
    searches = [BeamSearch(beam_size, cfg.eos_id, m, n_best, length_penalty, kinds, len(s))
                for s, m in zip(sources, budgets)]
    todo = [b for b in range(B) if not searches[b].done]
    if todo:
        device = next(model.parameters()).device
        if cache is None:
            # Beam reorders copy slot ids instead of K/V (an indirect cache) where the compiled decode
            # attention reads keys through an index anyway; eager attention would have to gather them,
            # which costs more than the copies at the small batches offline decoding often runs.
            p = next(model.parameters())
            indirect = beam_size > 1 and kernels.applies(p.device, p.dtype)
            cache = KVCache.for_model(model, len(todo) * beam_size, max(budgets) + 1, max(len(s) for s in sources),
                                      indirect=indirect)
        slots: list[list[int]] = []
        try:
            for _ in todo:
                slots.append(cache.slots.allocate(beam_size))
            _run(model, cache, [sources[b] for b in todo], [searches[b] for b in todo], slots, device)
        finally:
            for s in slots:
                cache.slots.free(s)
    return [s.results() for s in searches]


def _run(model: Transformer, cache: KVCache, sources: Sequence[Sequence[int]], searches: list[BeamSearch],
         slots: list[list[int]], device) -> None:
    """Prefill all sentences, then step all alive hypotheses together until every search is done.
    Raises what a search's step raised."""
    cfg = model.cfg
    need = any(s.attention_kinds for s in searches)
    src = pad_batch(sources, cfg.pad_id, device)
    out = prefill(model, cache, torch.tensor(slots, device=device), src, need_weights=need)
    running = [ActiveSearch(s, sl, [cfg.bos_id]) for s, sl in zip(searches, slots)]
    for i, s in enumerate(searches):
        s.keep_encoder_attention(out.encoder, i)
    while running:
        update = search_step(cache, [(out, running)])
        if update.failed:
            raise next(iter(update.failed.values()))
        running = update.running
        if running:
            step_slots, tokens, positions = decode_inputs(running)
            out = decode_step(model, cache, torch.tensor(step_slots, device=device),
                              torch.tensor(tokens, device=device), torch.tensor(positions, device=device), need)


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> Tensor:
    """Right-pad id lists into a [B, max_len] long tensor."""
    T = max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out.to(device) if device is not None else out


def greedy_search(model: Transformer, sources, max_new_tokens: int = 128, **kw) -> list[Hypothesis]:
    """Greedy decoding (beam search with beam_size 1); one Hypothesis per sentence."""
    return [h[0] for h in generate(model, sources, 1, 1, max_new_tokens, **kw)]


def beam_search(model: Transformer, sources, beam_size: int = 4, n_best: int = 1, max_new_tokens: int = 128,
                length_penalty: float = 1.0, **kw) -> list[list[Hypothesis]]:
    """Beam search; per sentence its n_best hypotheses, best first."""
    return generate(model, sources, beam_size, n_best, max_new_tokens, length_penalty, **kw)


def length_groups(lengths: Sequence[int], call_cost: int) -> list[list[int]]:
    """Split rows into groups of similar length, each computed by its own call.

    Work on a padded batch grows with batch size x longest row; each extra call costs a fixed
    overhead instead. Sorting by length and choosing contiguous groups that minimise
    sum(call_cost + size x longest) (dynamic programming, O(n^2) over distinct lengths) balances
    the two. ``call_cost`` is in units of length (tokens). Returns lists of indices into
    ``lengths``, shortest group first; every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if len(order) <= 1:
        return [order] if order else []
    # rows of equal length never need to be split: run the DP over runs of equal lengths
    runs: list[list[int]] = []
    for i in order:
        if runs and lengths[runs[-1][0]] == lengths[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    n = len(runs)
    size = [0] * (n + 1)
    for j, r in enumerate(runs):
        size[j + 1] = size[j] + len(r)
    best = [0.0] + [float("inf")] * n      # best[j]: cost of the first j runs
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[runs[j - 1][0]]
        for i in range(j):
            c = best[i] + call_cost + (size[j] - size[i]) * longest
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append([x for r in runs[cut[j]: j] for x in r])
        j = cut[j]
    return groups[::-1]
