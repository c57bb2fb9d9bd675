"""The one decoder step of inference: ``decode_step`` advances any set of cache slots by one token.

Behind this one entry the variants are chosen in one place: the dense fixed-shape step for GPUs
(``dense_step.py``, CUDA graphs in the engine), each decoder layer in one compiled call on CPU
(``fused_step.py``), and the eager step through the network's own layers with the cache's attention
hooks (``kv_cache.py``, ``attention_plan.py``), the reference the others are tested against.
``prefill.py`` (encoder + first step), ``generate.py`` (offline greedy / beam search) and the serving
engine are built on it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..transformer import Transformer
from . import fused_step
from .dense_step import dense_forward, plan_dense, step_logits
from .kv_cache import KVCache
from .linear import output_logits
from .paged_cache import PagedKVCache

__all__ = ["StepOutput", "decode_step"]


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
    and attended with the fused ``scaled_dot_product_attention`` (``dense_step.py``).

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
    if dense and not need_weights:  # fixed shapes, fused attention (dense_step.py)
        return StepOutput(dense_forward(model, cache, plan_dense(cache, slots, tokens, positions)))
    attend = cache.plan_step(slots, positions, packed=slots.device.type == "cpu")
    if not (need_weights and self_weights):  # each decoder layer in one compiled call where it applies
        fused = fused_step.decode_logits(model, attend, tokens, positions, cross_weights=need_weights)
        if fused is not None:                  # (fused_step.py)
            return StepOutput(logits=step_logits(model, fused[0]), cross=fused[1])
    states, w = model.decode(tokens[:, None], None, None, None, positions[:, None], attend, need_weights, project=False)
    logits = step_logits(model, output_logits(model, states[:, -1]))
    if not need_weights:
        return StepOutput(logits=logits)
    return StepOutput(logits=logits, cross=[x[:, :, 0] for x in w["cross"]], decoder=[x[:, :, 0] for x in w["self"]])
