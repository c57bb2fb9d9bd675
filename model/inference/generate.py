"""Offline decoding of a static batch: ``generate`` (greedy and beam search over an explicit KV cache),
``translate_lines`` for text, and the target-length budget both it and the serving engine use.

The search itself is in ``beam.py`` (``BeamSearch``) and ``search.py`` (the one ``search_step`` offline
decoding and the engine share); the model math in ``prefill.py`` and ``step.py``. The compute
switches are the process's (``settings.current()``) unless ``cache`` brings its own ``cpu_kernels``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..tokenizer import Tokenizer, check_target_lang, encode_source
from ..transformer import Transformer
from . import kernels, settings
from .beam import ATTENTION_KINDS, BeamSearch, Hypothesis, max_beam_size
from .kv_cache import KVCache
from .logits import RepetitionControls
from .paged_cache import allocate_blocks
from .prefill import prefill
from .search import ActiveSearch, decode_inputs, search_step
from .step import decode_step

__all__ = ["default_max_new_tokens", "generate", "length_groups", "pad_batch", "translate_lines"]


def default_max_new_tokens(src_len: int, max_len: int) -> int:
    """A generous target budget for a source of src_len ids: 2·src_len + 10, capped by the model."""
    return min(max_len - 1, 2 * src_len + 10)


@torch.no_grad()
def generate(model: Transformer, sources: Sequence[Sequence[int]], beam_size: int = 1, n_best: int = 1,
             max_new_tokens: int | Sequence[int] = 128, length_penalty: float = 1.0, attention_kinds: Sequence[str] = (),
             cache: Optional[KVCache] = None, target_prefix: Optional[Sequence[Sequence[int]]] = None,
             controls: Optional[RepetitionControls] = None, free_prefix: int = 0) -> list[list[Hypothesis]]:
    """Translate a static batch: every sentence is prefilled together and decoded until the last ends.

    Args:
        sources: token ids per sentence, EOS included (see ``encode_source``).
        beam_size / n_best / max_new_tokens / length_penalty: see ``BeamSearch``; max_new_tokens
            may also be a list with one budget per sentence.
        attention_kinds: any of "cross", "encoder", "decoder" to return per-head weights.
        target_prefix: per sentence, target ids every hypothesis starts with (``BeamSearch.prefix``).
        controls: repetition controls of every sentence (``logits.RepetitionControls``).
        free_prefix: the first this many ids of each target prefix are forced at log-prob 0 (a
            multilingual model's target-language token: ``BeamSearch.free_prefix``).
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
    if beam_size > max_beam_size(cfg.target_vocab_size):
        raise ValueError(f"beam_size must be <= {max_beam_size(cfg.target_vocab_size)} (half the vocabulary), "
                         f"got {beam_size}")
    for s in sources:
        if not 0 < len(s) <= cfg.max_len:
            raise ValueError(f"source length must be in 1..{cfg.max_len}, got {len(s)}")
    B = len(sources)
    prefixes = [()] * B if target_prefix is None else [tuple(p) for p in target_prefix]
    if len(prefixes) != B:
        raise ValueError(f"got {len(prefixes)} target prefixes for {B} sources")
    searches = [BeamSearch(beam_size, cfg.eos_id, m, n_best, length_penalty, kinds, len(s),
                           forced_eos=cfg.forced_eos, early_stopping=cfg.early_stopping, prefix=p,
                           free_prefix=min(free_prefix, len(p)))
                for s, m, p in zip(sources, budgets, prefixes)]
    todo = [b for b in range(B) if not searches[b].done]
    if todo:
        device = next(model.parameters()).device
        if cache is None:
            # Beam reorders copy slot ids instead of K/V (an indirect cache) where the compiled decode
            # attention reads keys through an index anyway; eager attention would have to gather them,
            # which costs more than the copies at the small batches offline decoding often runs.
            p = next(model.parameters())
            cpu_kernels = settings.current().cpu_kernels
            indirect = beam_size > 1 and cpu_kernels and kernels.applies(p.device, p.dtype)
            cache = KVCache.for_model(model, len(todo) * beam_size, max(budgets) + 1, max(len(s) for s in sources),
                                      indirect=indirect, cpu_kernels=cpu_kernels)
        slots: list[list[int]] = []
        try:
            for _ in todo:
                slots.append(cache.slots.allocate(beam_size))
            _run(model, cache, [sources[b] for b in todo], [searches[b] for b in todo], slots, device, controls)
        finally:
            for s in slots:
                cache.slots.free(s)
    return [s.results() for s in searches]


def _run(model: Transformer, cache: KVCache, sources: Sequence[Sequence[int]], searches: list[BeamSearch],
         slots: list[list[int]], device, controls: Optional[RepetitionControls] = None) -> None:
    """Prefill all sentences, then step all alive hypotheses together until every search is done
    (on a paged cache, ``allocate_blocks`` first gives each step the blocks it writes).
    Raises what a search's step raised."""
    cfg = model.cfg
    need = any(s.attention_kinds for s in searches)
    src = pad_batch(sources, cfg.pad_id, device)
    allocate_blocks(cache, slots, 0, [len(s) for s in sources])
    out = prefill(model, cache, torch.tensor(slots, device=device), src, need_weights=need)
    running = [ActiveSearch(s, sl, [cfg.bos_id], controls=controls) for s, sl in zip(searches, slots)]
    for i, s in enumerate(searches):
        s.keep_encoder_attention(out.encoder, i)
    while running:
        update = search_step(cache, [(out, running)])
        if update.failed:
            raise next(iter(update.failed.values()))
        running = update.running
        if running:
            allocate_blocks(cache, [s.slots for s in running], [s.position for s in running])
            step_slots, tokens, positions = decode_inputs(running)
            out = decode_step(model, cache, torch.tensor(step_slots, device=device),
                              torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
                              need_weights=need)


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, device=None) -> Tensor:
    """Right-pad id lists into a [B, max_len] long tensor."""
    T = max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out.to(device) if device is not None else out


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


def translate_lines(model: Transformer, tok: Tokenizer, lines: Sequence[str], beam_size: int = 1,
                    batch_size: int = 64, length_penalty: float = 1.0, progress=None,
                    max_new_tokens: Optional[int] = None, target_lang: Optional[str] = None,
                    source_lang: Optional[str] = None) -> list[str]:
    """Translate lines in length-sorted batches; returns one string per line, in order.
    ``max_new_tokens``: one target budget for every line (EOS included, a forced language token
    too), default ``default_max_new_tokens`` of each source. ``target_lang``: see
    ``check_target_lang`` (raises ValueError); with a multilingual family's tokenizer
    (``lang_tokenizer.LangTokenizer``: NLLB-200, M2M100, mBART-50) its target-language token is
    forced first and ``source_lang`` starts the source (both required)."""
    cfg = model.cfg
    check_target_lang(tok, target_lang)
    family = hasattr(tok, "forced_token")
    prefix = [(tok.forced_token(target_lang),)] if family else None
    out = [""] * len(lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    encoded = {i: tok.source_ids(lines[i], source_lang, cfg.max_len) if family
               else encode_source(tok, lines[i], cfg.max_len, target_lang) for i in todo}
    todo.sort(key=lambda i: len(encoded[i]))
    for start in range(0, len(todo), batch_size):
        idx = todo[start: start + batch_size]
        srcs = [encoded[i] for i in idx]
        max_new = [default_max_new_tokens(len(s), cfg.max_len) if max_new_tokens is None else max_new_tokens
                   for s in srcs]
        hyps = generate(model, srcs, beam_size=beam_size, max_new_tokens=max_new, length_penalty=length_penalty,
                        target_prefix=None if prefix is None else prefix * len(srcs), free_prefix=1)
        for i, h in zip(idx, hyps):
            out[i] = tok.decode(h[0].tokens)
        if progress is not None:
            progress(len(idx))
    return out
