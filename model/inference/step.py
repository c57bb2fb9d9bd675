"""The one decoder step of inference: ``decode_step`` advances any set of cache slots by one token.

Four variants compute it, and ``choose_variant`` alone picks one, from explicit inputs (the device,
the cache's kind, whether its compiled kernels are on, the ``fused_step`` and CUDA-graph switches,
what the caller asks back):

    GRAPH  the dense step replayed from a captured CUDA graph (``cuda_graphs.py``); DENSE where no graph fits
    DENSE  a paged cache on CUDA: keys gathered into fixed shapes, fused attention (``dense_step.py``)
    FUSED  CPU: each decoder layer in one compiled call (``fused_step.py``); EAGER where the model does not qualify
    EAGER  the network's own layers with the cache's attention hooks (``kv_cache.py``,
           ``attention_plan.py``): the reference the others are tested against

``prefill.py`` (encoder + first step), ``generate.py`` (offline greedy / beam search) and the serving
engine's runner are built on it.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from ..transformer import Transformer
from . import settings
from .dense_step import dense_forward, plan_dense, step_logits
from .fused_step import decode_logits as fused_decode_logits
from .kv_cache import KVCache
from .linear import output_logits
from .paged_cache import PagedKVCache

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs

__all__ = ["StepOutput", "Variant", "choose_variant", "decode_step"]


class StepOutput:
    """One decoder step's result: next-token log-probabilities ``log_probs`` [N, V] and, when asked for,
    per-layer attention rows: ``cross`` [N, H, S], ``decoder`` [N, H, T], ``encoder`` [B, H, S, S] (prefill).

    Built from ``log_probs``, or from ``logits`` [N, V] float32 with padding and BOS at -inf (what
    ``decode_step`` returns on CPU): then ``log_probs`` is computed on first use, and ``search_step``,
    which needs only each row's top candidates, takes them from the logits in one compiled pass
    (``kernels.log_softmax_topk``) without ever writing the [N, V] log-probabilities.
    ``cpu_kernels``: whether ``search_step`` may rank these rows with the compiled kernels (the
    switch of the cache the step ran on; default: the process's).
    Raises ValueError unless exactly one of log_probs and logits is given.
    """

    __slots__ = ("_log_probs", "logits", "cross", "decoder", "encoder", "cpu_kernels")

    def __init__(self, log_probs: Optional[Tensor] = None, cross: Optional[list[Tensor]] = None,
                 decoder: Optional[list[Tensor]] = None, encoder: Optional[list[Tensor]] = None, *,
                 logits: Optional[Tensor] = None, cpu_kernels: Optional[bool] = None):
        if (log_probs is None) == (logits is None):
            raise ValueError("StepOutput takes either log_probs or logits")
        self._log_probs, self.logits = log_probs, logits
        self.cross, self.decoder, self.encoder = cross, decoder, encoder
        self.cpu_kernels: bool = settings.or_default("cpu_kernels", cpu_kernels)

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


class Variant(enum.Enum):
    """How a decode step is computed (the module docstring)."""
    GRAPH = "graph"
    DENSE = "dense"
    FUSED = "fused"
    EAGER = "eager"


def choose_variant(*, device: str, paged: bool, kernels: bool, fused_step: bool, graphs: bool,
                   need_weights: bool, self_weights: bool, need_logits: bool) -> Variant:
    """The variant of one decode step, the only place it is chosen.

    Args:
        device: the cache's device type ("cpu", "cuda", ...); paged: a ``PagedKVCache``.
        kernels: the cache's attention runs the compiled CPU kernels (``KVCache.kernel_ok``).
        fused_step: one compiled call per decoder layer is switched on (``InferenceSettings.fused_step``).
        graphs: CUDA graphs are captured for this cache (the engine's ``DecodeGraphs``).
        need_weights / self_weights: attention rows asked for (cross, and decoder self-attention's).
        need_logits: logits asked for instead of log-probabilities (repetition controls act on them).
    GRAPH and DENSE give log-probabilities and no attention rows; FUSED gives cross-attention rows
    but not self-attention's; EAGER gives everything. Every variant runs every ``ModelConfig`` (the
    T5 family's flags included), so the model plays no part in the choice.
    """
    if device == "cuda" and paged and not (need_weights or need_logits):
        return Variant.GRAPH if graphs else Variant.DENSE
    if device == "cpu" and kernels and fused_step and not (need_weights and self_weights):
        return Variant.FUSED
    return Variant.EAGER


@torch.no_grad()
def decode_step(model: Transformer, cache: KVCache, slots: Tensor, tokens: Tensor, positions: Tensor,
                need_weights: bool = False, *, self_weights: bool = True, need_logits: bool = False,
                fused_step: Optional[bool] = None, graphs: Optional["DecodeGraphs"] = None,
                max_target: Optional[int] = None, max_source: Optional[int] = None) -> StepOutput:
    """One incremental decoder step for any set of slots, each at its own position, in the variant
    ``choose_variant`` picks.

    Every row attends to its own cached keys only (its own target history and its own source), so
    a row's result does not depend on the other rows. On CPU, rows of different lengths are
    attended packed, each over its own keys only (see ``AttentionPlan``); on CUDA in one padded call
    (except on a paged cache, which is always read packed, through its block tables, or gathered
    into fixed shapes by the dense step).

    Args:
        slots: [N] cache slots; tokens: [N] input token of each (the last generated, or BOS);
        positions: [N] target position of that token (0 for BOS).
        need_weights: attention rows: cross [N, H, S] and, unless ``self_weights`` is False,
            decoder [N, H, T] per layer, zero-padded to the longest row.
        need_logits: the step's logits kept as such (no variant that gives log-probabilities only).
        fused_step: the compiled layer step switched on (default: the process's, ``settings.current()``).
        graphs: the engine's CUDA graphs of this model and cache, or None; with them ``max_target`` /
            ``max_source``, the step's longest target (position + 1) and source, host values the
            caller already has (choosing a graph then costs no synchronisation).
    Returns a ``StepOutput``: its log-probabilities [N, V] (held as logits on CPU, computed when read)
    and the attention rows asked for, with the cache's ``cpu_kernels`` for the search step.
    Raises ValueError when a position reaches the cache's max_tgt_len.
    """
    variant = choose_variant(device=slots.device.type, paged=isinstance(cache, PagedKVCache),
                             kernels=cache.kernel_ok(), fused_step=settings.or_default("fused_step", fused_step),
                             graphs=graphs is not None, need_weights=need_weights, self_weights=self_weights,
                             need_logits=need_logits)
    if variant is Variant.GRAPH:
        log_probs = graphs.step(slots, tokens, positions, max_target=max_target, max_source=max_source)
        if log_probs is not None:
            return StepOutput(log_probs, cpu_kernels=cache.cpu_kernels)
        variant = Variant.DENSE                # no graph fits this step (cuda_graphs.use_graph)
    if variant is Variant.DENSE:
        return StepOutput(dense_forward(model, cache, plan_dense(cache, slots, tokens, positions)),
                          cpu_kernels=cache.cpu_kernels)
    attend = cache.plan_step(slots, positions, packed=slots.device.type == "cpu")
    if variant is Variant.FUSED:
        fused = fused_decode_logits(model, attend, tokens, positions, cross_weights=need_weights)
        if fused is not None:                  # else the model does not qualify (fused_step.py): EAGER
            return StepOutput(logits=step_logits(model, fused[0]), cross=fused[1], cpu_kernels=cache.cpu_kernels)
    states, w = model.decode(tokens[:, None], cross_kv=None, src_mask=None, positions=positions[:, None],
                             cache_attend=attend, need_weights=need_weights, project=False)
    logits = step_logits(model, output_logits(model, states[:, -1]))
    if not need_weights:
        return StepOutput(logits=logits, cpu_kernels=cache.cpu_kernels)
    return StepOutput(logits=logits, cross=[x[:, :, 0] for x in w["cross"]], decoder=[x[:, :, 0] for x in w["self"]],
                      cpu_kernels=cache.cpu_kernels)
