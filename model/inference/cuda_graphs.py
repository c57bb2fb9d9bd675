"""The graph variant of the decode step (``step.Variant.GRAPH``): on a GPU a small model's decode step
is bound by kernel launches, so the step's device work (``dense_step.dense_forward``: every layer,
attention through the block tables, the log-softmax) is captured once per shape and replayed as one
launch. ``step.choose_variant`` picks it (CUDA, a paged cache, no attention weights, no logits asked
for, ``EngineConfig.cuda_graphs``); the engine's runner holds the ``DecodeGraphs`` of its model.

Shapes: the rows are padded to the next of a few row-count buckets (``row_buckets``; the copies
repeat row 0 and change nothing, ``dense_step.pad_rows``) and the keys to a power-of-two capacity
(``dense_step.key_capacity``), so a handful of graphs cover every step. A graph is captured the first
time its shape is needed (at most ``max_graphs``) and replayed after. The dense step without a graph
is the fallback: it runs when a step does not fit (more rows than the largest bucket), when the graph
budget is spent, or for good once a capture has failed (``use_graph``). The bucket and fallback rules
are plain functions, tested without a GPU; the capture itself by the ``cuda``-marked tests
(``tests/test_cuda_graphs.py``).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import Tensor

from .dense_step import DenseInputs, dense_forward, key_capacity, pad_rows, plan_dense

logger = logging.getLogger(__name__)

__all__ = ["DecodeGraphs", "bucket_for", "row_buckets", "use_graph"]


def row_buckets(max_rows: int, smallest: int = 8) -> list[int]:
    """Row-count buckets for an engine of ``max_rows`` slots: powers of two from ``smallest`` up to the
    first >= max_rows (capped at max_rows): 256 slots -> [8, 16, 32, 64, 128, 256]."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    out, b = [], smallest
    while b < max_rows:
        out.append(b)
        b *= 2
    return out + [max_rows]


def bucket_for(rows: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest bucket >= rows, or None when rows exceed every bucket (the step runs without a graph)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return next((b for b in sorted(buckets) if b >= rows), None)


def use_graph(device_type: str, bucket: Optional[int], captured: bool, num_graphs: int, max_graphs: int,
              failed: bool) -> bool:
    """Whether a step replays a graph (capturing it first if ``captured`` is False) instead of running
    the dense step without one: only on CUDA (where graphs exist), when its rows fit a bucket, while no
    capture has failed, and when its graph exists or the budget of ``max_graphs`` allows one more."""
    if device_type != "cuda" or bucket is None or failed:
        return False
    return captured or num_graphs < max_graphs


class _Graph:
    """One captured step: static input tensors (copied into before each replay) and its output."""

    def __init__(self, model, cache, example: DenseInputs, pool):
        self.inputs = DenseInputs(*(t.clone() for t in example.tensors()))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (allocator, lazy init): writes the same K/V as the replay will
            dense_forward(model, cache, self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):  # the engine's worker thread
            self.output = dense_forward(model, cache, self.inputs)

    def run(self, x: DenseInputs) -> Tensor:
        for dst, src in zip(self.inputs.tensors(), x.tensors()):
            dst.copy_(src)
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """Captured decode steps of one model and one ``PagedKVCache``, keyed by (row bucket, target key
    capacity, source key capacity). ``step`` returns the log-probabilities [N, V] of the rows, or None
    when the caller must run the dense step without a graph (nothing was planned then)."""

    def __init__(self, model, cache, max_rows: int, max_graphs: int = 48):
        self.model, self.cache = model, cache
        self.buckets = row_buckets(max_rows)
        self.max_graphs = max_graphs
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.failed = False
        self.replays = 0
        self._pool = torch.cuda.graph_pool_handle() if torch.cuda.is_available() else None

    def step(self, slots: Tensor, tokens: Tensor, positions: Tensor, *, max_target: int,
             max_source: int) -> Optional[Tensor]:
        """``max_target`` / ``max_source``: the step's longest target (position + 1) and source (host
        values the caller already has, so choosing a graph costs no synchronisation)."""
        c = self.cache
        bucket = bucket_for(slots.numel(), self.buckets)
        key = (bucket, key_capacity(max_target, c.max_tgt_len), key_capacity(max_source, c.max_src_len))
        if not use_graph(slots.device.type, bucket, key in self.graphs, len(self.graphs), self.max_graphs,
                         self.failed):
            return None
        n = slots.numel()
        x = pad_rows(plan_dense(c, slots, tokens, positions, t_cap=key[1], s_cap=key[2]), bucket)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self.graphs[key] = _Graph(self.model, c, x, self._pool)
            except Exception:  # noqa: BLE001 - the dense step without a graph redoes the step
                logger.exception("CUDA graph capture failed for %s; decoding without graphs from now on", key)
                self.failed = True
                return dense_forward(self.model, c, x)[:n]
        self.replays += 1
        return graph.run(x)[:n].clone()
