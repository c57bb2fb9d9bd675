"""Incremental decoding: ``prefill`` and ``decode_step`` are the only model math; greedy and beam
search (and the serving engine) are built on them.

Beam search follows the common NMT recipe (Wu et al., 2016; fairseq): every alive hypothesis is
extended by its top-2k tokens, the best 2k candidates are ranked, candidates ending in EOS that rank
within the top k are finished, and the first k non-EOS candidates stay alive. A sentence is done when
it has k finished hypotheses or reaches max_new_tokens. Greedy search is beam search with k = 1.
Scores: log_prob is the sum of token log-probabilities (EOS included); score = log_prob / length **
length_penalty, where length counts generated tokens including EOS.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import kernels
from .kv_cache import KVCache
from .transformer import Transformer, padding_mask

ATTENTION_KINDS = ("cross", "encoder", "decoder")


@dataclass
class StepOutput:
    log_probs: Tensor                                  # [N, V] next-token log-probabilities
    cross: Optional[list[Tensor]] = None               # per layer [N, H, S] cross-attention rows
    decoder: Optional[list[Tensor]] = None             # per layer [N, H, T] self-attention rows
    encoder: Optional[list[Tensor]] = None             # per layer [B, H, S, S] (prefill only)


@torch.no_grad()
def decode_step(model: Transformer, cache: KVCache, slots: Tensor, tokens: Tensor, positions: Tensor,
                need_weights: bool = False) -> StepOutput:
    """One incremental decoder step for any set of slots, each at its own position.

    Every row attends to its own cached keys only (its own target history and its own source), so
    a row's result does not depend on the other rows. On CPU, rows of different lengths are
    attended packed, each over its own keys only (see ``AttentionPlan``); on CUDA in one padded call.

    Args:
        slots: [N] cache slots; tokens: [N] input token of each (the last generated, or BOS);
        positions: [N] target position of that token (0 for BOS).
    Returns log-probabilities [N, V] (and attention rows with need_weights: cross [N, H, S] and
    decoder [N, H, T] per layer, zero-padded to the longest row).
    Raises ValueError when a position reaches the cache's max_tgt_len.
    """
    attend = cache.attention(slots, positions, packed=slots.device.type == "cpu")
    logits, w = model.decode(tokens[:, None], None, None, None, positions[:, None], attend, need_weights)
    logits = logits[:, -1]
    logits[:, model.cfg.pad_id] = float("-inf")  # never generated: padding and BOS
    logits[:, model.cfg.bos_id] = float("-inf")
    log_probs = torch.log_softmax(logits, dim=-1)
    if not need_weights:
        return StepOutput(log_probs)
    return StepOutput(log_probs, cross=[x[:, :, 0] for x in w["cross"]], decoder=[x[:, :, 0] for x in w["self"]])


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


@dataclass
class Hypothesis:
    """One finished translation hypothesis."""
    tokens: list[int]                       # generated ids, EOS excluded
    log_prob: float                         # sum of token log-probs, EOS included
    score: float                            # log_prob / length ** length_penalty
    finish_reason: str                      # "eos" or "length"
    attention: Optional[dict[str, Tensor]] = None  # kind -> [L, H, len(tokens), S] (decoder: [L, H, T, T])


@dataclass(slots=True)
class _Beam:
    tokens: tuple = ()                      # generated ids so far
    log_prob: float = 0.0
    cross: tuple = ()                       # per step: [L, H, S] rows
    decoder: tuple = ()                     # per step: [L, H, t+1] rows


@dataclass
class BeamSearch:
    """Search state of one sentence; its alive hypotheses occupy ``slots`` rows in order.

    ``step`` consumes the log-probabilities of the alive rows and returns, for the next step, the
    parent row of every new alive hypothesis (for ``KVCache.reorder``) and its input token.
    """
    beam_size: int
    eos_id: int
    max_new_tokens: int
    n_best: int = 1
    length_penalty: float = 1.0
    attention_kinds: tuple = ()             # subset of ATTENTION_KINDS to keep
    src_len: int = 0                        # trims attention rows to the real source length
    encoder_attention: Optional[Tensor] = None  # [L, H, S, S], set at prefill when tracked
    alive: list = field(default_factory=lambda: [_Beam()])
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

    def _final(self, beam: _Beam, reason: str, extra_lp: float = 0.0) -> Hypothesis:
        length = len(beam.tokens) + (reason == "eos")
        lp = beam.log_prob + extra_lp
        return Hypothesis(list(beam.tokens), lp, lp / max(length, 1) ** self.length_penalty, reason,
                          self._attention(beam) if self.attention_kinds else None)

    def _attention(self, beam: _Beam) -> dict:
        out = {}
        n = len(beam.tokens)
        if "encoder" in self.attention_kinds and self.encoder_attention is not None:
            out["encoder"] = self.encoder_attention
        if "cross" in self.attention_kinds and beam.cross:
            out["cross"] = torch.stack(beam.cross[:n], dim=2) if n else torch.zeros(0)
        if "decoder" in self.attention_kinds and beam.decoder:
            rows = beam.decoder[:n]
            if n:
                L, H = rows[0].shape[:2]
                mat = rows[0].new_zeros(L, H, n, n)
                for t, r in enumerate(rows):
                    mat[:, :, t, : t + 1] = r[:, :, : t + 1]
                out["decoder"] = mat
        return out

    def step(self, log_probs: Tensor, top_v: list, top_i: list,
             cross: Optional[list] = None, decoder: Optional[list] = None) -> tuple[list[int], list[int]]:
        """Advance by one token.

        Args:
            log_probs: [A, V] rows of the A alive hypotheses (only used for shapes).
            top_v, top_i: per row, the 2k best log-probs and their token ids (python lists).
            cross / decoder: per row, [L, H, S] / [L, H, T] attention, when tracked.
        Returns (parents, tokens): per new alive hypothesis, its parent row and next input token;
        empty when the sentence is done.
        """
        k, eos, alive = self.beam_size, self.eos_id, self.alive
        # (negated score, parent row, token id): ascending order ranks the best score first, ties by
        # row then id (negation is exact, so -neg is the candidate's log-prob bit for bit)
        cands = sorted([(-(beam.log_prob + v), b, i) for b, beam in enumerate(alive)
                        for v, i in zip(top_v[b], top_i[b])])
        new_alive, parents = [], []
        for rank, (neg, b, tok) in enumerate(cands[: 2 * k]):
            if tok == eos:
                if rank < k:
                    self.finished.append(self._final(self._extend(alive[b], b, None, -neg, cross, decoder), "eos"))
                continue
            new_alive.append(self._extend(alive[b], b, tok, -neg, cross, decoder))
            parents.append(b)
            if len(new_alive) == k:  # ranks from here on are >= k: no more EOS finishes either
                break
        self.alive = new_alive
        n_generated = len(new_alive[0].tokens) if new_alive else 0
        if len(self.finished) >= k or not new_alive:
            self.done = True
        elif n_generated >= self.max_new_tokens:
            self.finished.extend(self._final(b, "length") for b in new_alive)
            self.done = True
        if self.done:
            self.alive = []
            return [], []
        return parents, [b.tokens[-1] for b in new_alive]

    def _extend(self, parent: _Beam, row: int, tok: Optional[int], lp: float, cross, decoder) -> _Beam:
        tokens = parent.tokens if tok is None else parent.tokens + (tok,)
        c = parent.cross + (cross[row][:, :, : self.src_len],) if cross is not None else parent.cross
        d = parent.decoder + (decoder[row],) if decoder is not None else parent.decoder
        return _Beam(tokens, lp, c, d)

    def results(self) -> list[Hypothesis]:
        """The n_best hypotheses, best score first (only meaningful once done)."""
        if self.max_new_tokens == 0:
            return [Hypothesis([], 0.0, 0.0, "length", {} if self.attention_kinds else None)]
        return sorted(self.finished, key=lambda h: -h.score)[: self.n_best]


def top_candidates(log_probs: Tensor, k: int) -> tuple[list, list]:
    """Per row the 2k best (log-prob, token id) as python lists; the one device sync of a step."""
    v, i = row_topk(log_probs, min(2 * k, log_probs.size(-1)))
    return v.tolist(), i.tolist()


TOPK_CHUNK = 64  # vocabulary entries per chunk of ``row_topk``


def row_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=-1)`` of a [N, V] matrix (values descending), faster for small k and large V.

    On CPU (float32/float64) the compiled kernel (``model.kernels.topk_op``) reads each row once,
    keeping a sorted list of the k best (ties go to the lower index, as in ``torch.topk`` here).
    Otherwise: the k largest entries of a row lie in the k chunks (of TOPK_CHUNK entries) with the largest
    maxima: any other chunk's maximum is at most the k-th largest of those. So chunk maxima (a cheap
    reduction), then top-k of the k * TOPK_CHUNK candidates, instead of a top-k over all V (2x faster
    for k = 8 and 6x for k = 2 at V = 8000 and 220 rows on CPU). Among exactly equal values the
    chosen ids may differ from ``torch.topk``'s; the values are the same (a row with fewer than k
    values above -inf may repeat an id among its -inf entries).
    """
    N, V = x.shape
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and 1 <= k <= V:
        compiled = kernels.topk_op()
        if compiled is not None:  # one pass per row (``model/csrc/row_topk.cpp``)
            v, i = compiled(x, k)
            return v, i
    C = TOPK_CHUNK
    n_chunks = -(-V // C)
    if N < 2 or n_chunks < 4 * k or x.device.type != "cpu":
        return x.topk(k, dim=-1)
    full = V // C
    chunk_max = x[:, : full * C].reshape(N, full, C).amax(-1)                   # [N, V / C]
    if full < n_chunks:                                                         # a shorter last chunk
        chunk_max = torch.cat([chunk_max, x[:, full * C:].amax(-1, keepdim=True)], dim=1)
    chunks = chunk_max.topk(k, dim=-1).indices                                  # [N, k]
    ids = (chunks[:, :, None] * C + torch.arange(C, device=x.device)).view(N, k * C)
    if full == n_chunks:
        v, j = x.gather(1, ids).topk(k, dim=-1)
        return v, ids.gather(1, j)
    past = ids >= V                                          # past the end of the shorter last chunk
    cand = x.gather(1, ids.clamp(max=V - 1)).masked_fill_(past, float("-inf"))
    v, j = cand.topk(k, dim=-1)
    return v, ids.gather(1, j).clamp_(max=V - 1)


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
    if 2 * beam_size > cfg.vocab_size:
        raise ValueError(f"beam_size must be <= {cfg.vocab_size // 2} (half the vocabulary), got {beam_size}")
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
        slots = {b: cache.allocate(beam_size) for b in todo}
        try:
            _run(model, cache, [sources[b] for b in todo], [searches[b] for b in todo], [slots[b] for b in todo],
                 kinds, device)
        finally:
            for s in slots.values():
                cache.free(s)
    return [s.results() for s in searches]


def _run(model, cache, sources, searches, slots, kinds, device) -> None:
    """Prefill all sentences, then step all alive hypotheses together until every search is done."""
    cfg = model.cfg
    need = bool(kinds)
    src = pad_batch(sources, cfg.pad_id, device)
    out = prefill(model, cache, torch.tensor(slots, device=device), src, need_weights=need)
    k = searches[0].beam_size
    rows = [[i] for i in range(len(searches))]  # rows of out.log_probs owned by each search
    if "encoder" in kinds:
        for i, s in enumerate(searches):
            s.encoder_attention = torch.stack([w[i, :, : s.src_len, : s.src_len] for w in out.encoder])
    while True:
        top_v, top_i = top_candidates(out.log_probs, k)
        step_slots, step_tokens, step_pos = [], [], []
        for i, s in enumerate(searches):
            if s.done:
                continue
            r = rows[i]
            parents, tokens = s.step(out.log_probs[r], [top_v[j] for j in r], [top_i[j] for j in r],
                                     _rows(out.cross, r) if "cross" in kinds else None,
                                     _rows(out.decoder, r) if "decoder" in kinds else None)
            if s.done:
                continue
            t = len(s.alive[0].tokens)  # every alive hypothesis has the same length
            cache.reorder(slots[i][: len(parents)], parents, length=t)
            step_slots += slots[i][: len(tokens)]
            step_tokens += tokens
            step_pos += [t] * len(tokens)
        if not step_slots:
            return
        start = 0
        for i, s in enumerate(searches):
            if not s.done:
                n = len(s.alive)
                rows[i] = list(range(start, start + n))
                start += n
        out = decode_step(model, cache, torch.tensor(step_slots, device=device),
                          torch.tensor(step_tokens, device=device), torch.tensor(step_pos, device=device), need)


def _rows(per_layer: list[Tensor], rows: list[int]) -> list[Tensor]:
    """Per row r, the [L, H, X] stack of that row's weights across layers."""
    stacked = torch.stack(per_layer, dim=1)  # [N, L, H, X]
    return [stacked[r] for r in rows]


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
