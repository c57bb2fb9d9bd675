"""A decode step on a paged KV cache in fixed shapes, for GPUs: each row's keys are gathered through
the block tables into a padded [R, T, H, Dh] block and attended with PyTorch's fused
``scaled_dot_product_attention`` (a boolean mask hides the padding).

The step is split in two: ``plan_dense`` does the host-side bookkeeping (each row's write in its
assigned block, the beam ``home`` table, the key indices, the capacity check) and ``dense_forward`` is pure device work on
tensors whose shapes depend only on (rows, key capacity), so it can be captured in a CUDA graph and
replayed (``cuda_graphs.py``). It computes the same attention over the same keys as
the packed path of ``decode_step`` (``tests/test_dense_step.py`` compares them), T5's relative position
biases and attention scale included (the biases over the key capacity, from the rows' positions on the device).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .paged_cache import PagedKVCache

__all__ = ["DenseInputs", "GatherAttention", "dense_forward", "key_capacity", "plan_dense", "pad_rows",
           "step_log_probs", "step_logits"]


def key_capacity(n: int, limit: int, smallest: int = 32) -> int:
    """The padded key length for ``n`` keys: the next power of two >= n, at least ``smallest``, at most
    ``limit`` (a few capacities, so that few graphs cover every step). Raises ValueError when n > limit."""
    if n > limit:
        raise ValueError(f"{n} keys exceed the capacity limit {limit}")
    cap = smallest
    while cap < n:
        cap *= 2
    return min(cap, limit)


@dataclass
class DenseInputs:
    """Every tensor ``dense_forward`` reads, for R rows: tokens, positions and write_at [R] (long);
    self_index / self_mask [R, T] and cross_index / cross_mask [R, S] (key rows of a layer's block pool
    viewed as [NB * block_size, H, Dh]; True = attend)."""
    tokens: Tensor
    positions: Tensor
    write_at: Tensor
    self_index: Tensor
    self_mask: Tensor
    cross_index: Tensor
    cross_mask: Tensor

    @property
    def rows(self) -> int:
        return self.tokens.size(0)

    def tensors(self) -> list[Tensor]:
        return [self.tokens, self.positions, self.write_at, self.self_index, self.self_mask,
                self.cross_index, self.cross_mask]


def _gather_index(table: Tensor, slot_of_pos: Tensor, pos: Tensor, block_size: int) -> Tensor:
    """[R, T] rows of a block pool: table[slot, pos // B] * B + pos % B."""
    block = table.view(-1).index_select(0, (slot_of_pos * table.size(1)
                                            + torch.div(pos, block_size, rounding_mode="floor")).view(-1))
    return block.view(pos.shape) * block_size + pos.remainder(block_size)


def plan_dense(cache: PagedKVCache, slots: Tensor, tokens: Tensor, positions: Tensor,
               t_cap: Optional[int] = None, s_cap: Optional[int] = None) -> DenseInputs:
    """Bookkeeping of one decode step for rows ``slots`` [N] at ``positions`` [N] (as
    ``KVCache.plan_step``: where each row writes, in the block assigned to its position; records each
    row's position in ``home``), and the padded key indices: ``t_cap`` >= the longest target (default:
    that length), ``s_cap`` >= the longest source. Padding points at a row's last real key, masked off.
    Raises ValueError when a position reaches max_tgt_len, has no block assigned, or a capacity is
    too small."""
    T = int(positions.max()) + 1
    if T > cache.max_tgt_len:
        raise ValueError(f"target length {T} exceeds the cache's max_tgt_len {cache.max_tgt_len}")
    owners = cache.owner.index_select(0, slots)
    src_len = cache.src_len.index_select(0, owners)
    S = int(src_len.max())
    t_cap, s_cap = t_cap or T, s_cap or S
    if T > t_cap or S > s_cap:
        raise ValueError(f"keys ({T} target, {S} source) exceed the capacity ({t_cap}, {s_cap})")
    write_at = cache._write_rows(slots, positions)
    cache.home.view(-1).index_copy_(0, slots * cache.max_tgt_len + positions, slots)
    cache.redirected.index_fill_(0, slots[positions == 0], False)   # as plan_step: a new history starts
    B, dev = cache.block_size, slots.device
    lengths = positions + 1
    pos = torch.arange(t_cap, device=dev)[None, :]
    self_mask = pos < lengths[:, None]                                            # [N, T]
    p = torch.minimum(pos, positions[:, None])
    home = cache.home.view(-1).index_select(0, (slots[:, None] * cache.max_tgt_len + p).view(-1)).view(p.shape)
    self_index = _gather_index(cache.table, home, p, B)
    pos = torch.arange(s_cap, device=dev)[None, :]
    cross_mask = pos < src_len[:, None]
    p = torch.minimum(pos, (src_len - 1)[:, None])
    cross_index = _gather_index(cache.src_table, owners[:, None].expand_as(p), p, B)
    return DenseInputs(tokens, positions, write_at, self_index, self_mask, cross_index, cross_mask)


def pad_rows(inputs: DenseInputs, rows: int) -> DenseInputs:
    """``inputs`` padded to ``rows`` rows by repeating row 0: the copies compute the same K/V as row 0
    and write them at the same place, so they change nothing; their outputs are dropped."""
    n = inputs.rows
    if rows < n:
        raise ValueError(f"cannot pad {n} rows to {rows}")
    if rows == n:
        return inputs
    index = torch.cat([torch.arange(n, device=inputs.tokens.device),
                       torch.zeros(rows - n, dtype=torch.long, device=inputs.tokens.device)])
    return DenseInputs(*(t.index_select(0, index) for t in inputs.tensors()))


class GatherAttention:
    """The ``cache_attend`` hook of one layer for ``dense_forward``: writes this step's K/V at
    ``write_at`` [R] (self-attention only), gathers the keys ``index`` [R, T] from the block pool and
    attends with ``F.scaled_dot_product_attention`` under ``mask`` [R, T], with ``bias`` [R, H, 1, T]
    added to the logits and their ``scale`` where given (T5). Returns (out [R, H, 1, Dh], None): no
    weights (the packed path gives them)."""

    def __init__(self, cache: PagedKVCache, layer: int, write_at: Optional[Tensor], index: Tensor, mask: Tensor):
        self.cache, self.layer, self.write_at, self.index = cache, layer, write_at, index
        self.mask = mask[:, None, None, :]
        self.self_attention = write_at is not None

    def __call__(self, q: Tensor, k_new: Optional[Tensor], v_new: Optional[Tensor],
                 need_weights: bool = False, bias: Optional[Tensor] = None,
                 scale: Optional[float] = None) -> tuple[Tensor, Optional[Tensor]]:
        if need_weights:
            raise ValueError("GatherAttention returns no weights; use decode_step's packed path for them")
        R, H, _, Dh = q.shape
        K = self.cache.k[self.layer].view(-1, H, Dh)
        V = self.cache.v[self.layer].view(-1, H, Dh)
        if self.self_attention:
            K.index_copy_(0, self.write_at, k_new[:, :, 0])
            V.index_copy_(0, self.write_at, v_new[:, :, 0])
        flat = self.index.reshape(-1)
        k = K.index_select(0, flat).view(R, -1, H, Dh).transpose(1, 2)         # [R, H, T, Dh]
        v = V.index_select(0, flat).view(R, -1, H, Dh).transpose(1, 2)
        mask = self.mask if bias is None else torch.where(self.mask, bias, float("-inf"))   # [R, H, 1, T]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale), None


def dense_forward(model, cache: PagedKVCache, x: DenseInputs) -> Tensor:
    """The decoder step of ``x`` (from ``plan_dense``): log-probabilities [R, V] (float32), padding
    and BOS never generated. No host synchronisation: capturable in a CUDA graph."""
    hooks = [(GatherAttention(cache, i, write_at=x.write_at, index=x.self_index, mask=x.self_mask),
              GatherAttention(cache, i, write_at=None, index=x.cross_index, mask=x.cross_mask))
             for i in range(cache.num_layers)]
    # T5: relative biases over the key capacity, from positions on the device (no host read)
    bias = None if model.dec_rel is None else model.dec_rel(x.positions[:, None], x.self_index.size(1))
    logits, _ = model.decode(x.tokens[:, None], cross_kv=None, src_mask=None, positions=x.positions[:, None],
                             cache_attend=hooks, rel_bias=bias)
    return step_log_probs(model, logits[:, -1])


def step_logits(model, logits: Tensor) -> Tensor:
    """A step's logits [N, V] as its log-probabilities are computed from: float32 (half precision is
    upcast first: beam scores add these up), padding and BOS at -inf (never generated; a BOS that is
    the EOS token, as NLLB's and mBART's decoder start ``</s>``, stays). In place where already float32."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    logits[:, model.cfg.pad_id] = float("-inf")
    if model.cfg.bos_id != model.cfg.eos_id:
        logits[:, model.cfg.bos_id] = float("-inf")
    return logits


def step_log_probs(model, logits: Tensor) -> Tensor:
    """Next-token log-probabilities [N, V] from a step's logits [N, V] (``step_logits``, then log-softmax)."""
    return torch.log_softmax(step_logits(model, logits), dim=-1)
