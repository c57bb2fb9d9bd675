"""A paged KV cache: keys and values in fixed-size blocks handed out as a sequence grows (as in vLLM),
so that memory follows the tokens actually held instead of every slot's maximum length.

The serving engine uses it; offline ``generate`` keeps the contiguous ``KVCache`` (sized for its
batch) unless given one of these. Both compute the same attention over the same keys, in the same
order, so their outputs are identical.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .attention_plan import AttentionPlan, packed_positions
from .kv_cache import KVCache
from .slots import BlockPool

__all__ = ["PagedKVCache", "default_num_blocks"]


def default_num_blocks(num_slots: int, block_size: int, max_src_len: int, max_tgt_len: int,
                       positions_per_slot: int = 64, full_beam: int = 16) -> int:
    """Blocks for ``num_slots`` hypotheses of ``positions_per_slot`` positions each (source and
    target together), and at least enough for one sentence of min(num_slots, full_beam) hypotheses
    at full source and target length (the HTTP API's largest beam is 16), so that a request the slots
    admit is not refused for blocks."""
    per = -(-positions_per_slot // block_size)
    one = -(-max_src_len // block_size) + min(num_slots, full_beam) * -(-max_tgt_len // block_size)
    return max(num_slots * per, one)


class PagedKVCache(KVCache):
    """One block pool per layer, K and V [L, num_blocks, block_size, H, Dh], shared by the target
    (decoder self-attention) and the source (cross-attention) positions of every slot.

    A slot (one hypothesis; ``slots`` is a ``model.inference.slots.BlockPool``) holds blocks for the positions
    it has written: its target blocks are listed in ``table`` [N, ceil(T_max / B)] and taken one at a
    time as it reaches a new block (``plan_step``); a sentence's source blocks in ``src_table``
    [N, ceil(S_max / B)] of its first slot only (the other hypotheses of a beam read them there,
    ``owner``). Beam reorders copy slot ids in ``home`` (as an indirect ``KVCache``), never K/V:
    position p of every hypothesis is written once, at step p, in its own block, and hypotheses that
    descend from it read it there. Freeing a slot (``slots.free``) gives back all of its blocks.
    Memory: 2 · L · num_blocks · B · H · Dh elements, whatever the number of slots. Decode attention
    is always packed (through the tables). Raises ``CacheFullError`` when a step needs more blocks
    than are free (the engine's scheduler preempts before that happens).
    """

    def __init__(self, n_layers: int, n_heads: int, d_head: int, num_slots: int, num_blocks: int, block_size: int,
                 max_tgt_len: int, max_src_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if block_size < 2:  # a beam's other hypotheses start at position 1: block 0 is never skipped
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        shape = (n_layers, num_blocks, block_size, n_heads, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = B = block_size
        self.num_slots, self.max_tgt_len, self.max_src_len = num_slots, max_tgt_len, max_src_len
        self.num_layers = n_layers
        self.table = torch.zeros(num_slots, -(-max_tgt_len // B), dtype=torch.long, device=device)
        self.src_table = torch.zeros(num_slots, -(-max_src_len // B), dtype=torch.long, device=device)
        self.num_tgt_blocks = torch.zeros(num_slots, dtype=torch.long, device=device)  # own target blocks
        self.src_len = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.owner = torch.arange(num_slots, device=device)
        self.home = torch.arange(num_slots, device=device)[:, None].repeat(1, max_tgt_len)
        self.redirected = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.slots = BlockPool(num_slots, num_blocks, block_size)
        self.slots.on_free = self._on_free
        self._kernel: Optional[bool] = None

    @classmethod
    def for_model(cls, model, num_slots: int, max_tgt_len: Optional[int] = None, max_src_len: Optional[int] = None,
                  num_blocks: Optional[int] = None, block_size: int = 16) -> "PagedKVCache":
        """A paged cache shaped for ``model`` (a ``Transformer``), on its device and in its dtype;
        ``num_blocks`` defaults to ``default_num_blocks``."""
        cfg = model.cfg
        p = next(model.parameters())
        T, S = max_tgt_len or cfg.max_len, max_src_len or cfg.max_len
        if num_blocks is None:
            num_blocks = default_num_blocks(num_slots, block_size, S, T)
        return cls(cfg.n_decoder_layers, cfg.n_heads, cfg.d_head, num_slots, num_blocks, block_size, T, S,
                   dtype=p.dtype, device=p.device)

    # the one block pool serves both kinds of attention (``CacheAttention`` reads these)
    self_k = cross_k = property(lambda self: self.k)
    self_v = cross_v = property(lambda self: self.v)

    @property
    def nbytes(self) -> int:
        """Bytes held by the K/V block pools (the tables are not counted: a few ints per slot)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // max(self.slots.num_blocks, 1)

    def _on_free(self, slots: Sequence[int]) -> None:
        self.num_tgt_blocks.index_fill_(0, torch.as_tensor(list(slots), device=self.num_tgt_blocks.device), 0)

    # ---- writes --------------------------------------------------------------------------------
    def write_cross(self, slots: Tensor, cross_kv: Sequence[tuple[Tensor, Tensor]], src_lengths: Tensor) -> None:
        """Store per-layer encoder-memory K/V, each [N, H, S, Dh] (right-padded), for slots [N]: only
        the src_lengths [N] real positions, in blocks taken for each slot."""
        S = cross_kv[0][0].size(2)
        keep = torch.arange(S, device=src_lengths.device)[None, :] < src_lengths[:, None]     # [N, S]
        packed = [(k.transpose(1, 2)[keep][:, :, None], v.transpose(1, 2)[keep][:, :, None]) for k, v in cross_kv]
        self.write_cross_packed(slots, packed, src_lengths)

    def write_cross_packed(self, slots: Tensor, cross_kv: Sequence[tuple[Tensor, Tensor]], src_lengths: Tensor) -> None:
        """``KVCache.write_cross_packed``: per-layer K/V [NT, H, 1, Dh] of NT = sum(src_lengths) tokens
        of B sequences, one after another, for slots [B]; each slot takes its source blocks here.
        Raises ValueError beyond max_src_len, CacheFullError when the blocks are not free."""
        if int(src_lengths.max()) > self.max_src_len:
            raise ValueError(f"source length {int(src_lengths.max())} exceeds the cache's max_src_len {self.max_src_len}")
        B = self.block_size
        counts = [self.slots.blocks_for(int(n)) for n in src_lengths.tolist()]
        ids = self.slots.take([s for s, c in zip(slots.tolist(), counts) for _ in range(c)])
        dev = self.src_table.device
        seq, idx = packed_positions(torch.as_tensor(counts, device=dev))
        self.src_table[slots.to(dev).index_select(0, seq), idx] = torch.as_tensor(ids, dtype=torch.long, device=dev)
        seq, pos = packed_positions(src_lengths)
        block = self.src_table[slots.index_select(0, seq), torch.div(pos, B, rounding_mode="floor")]
        at = block * B + pos.remainder(B)                     # each token's row in a layer's [NB * B] view
        for layer, (k, v) in enumerate(cross_kv):
            self.k[layer].view(-1, *self.k.shape[3:]).index_copy_(0, at, k[:, :, 0])
            self.v[layer].view(-1, *self.v.shape[3:]).index_copy_(0, at, v[:, :, 0])
        self._own_cross(slots, src_lengths)

    def _write_rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """Take a block for each row that starts a new one, then each row's row in a layer's [NB * B] view."""
        B = self.block_size
        block = torch.div(positions, B, rounding_mode="floor")
        held = self.num_tgt_blocks.index_select(0, slots)
        if bool((held < block).any()):
            raise ValueError("a slot skipped a KV block: positions must be written in order from 0 (or 1 after "
                             "a beam's first step)")
        new = held == block
        if bool(new.any()):
            rows = slots[new]
            ids = self.slots.take(rows.tolist())
            self.table[rows, block[new]] = torch.as_tensor(ids, dtype=torch.long, device=self.table.device)
            self.num_tgt_blocks.index_add_(0, rows, torch.ones_like(rows))
        return self.table[slots, block] * B + positions.remainder(B)

    def _plans(self, slots: Tensor, lengths: Tensor, owners: Tensor, packed: bool, home: Optional[Tensor],
               kernel: bool) -> tuple[AttentionPlan, AttentionPlan]:
        B = self.block_size
        return (AttentionPlan(slots, lengths, self.max_tgt_len, True, home, kernel, self.table, B),
                AttentionPlan(owners, self.src_len.index_select(0, owners), self.max_src_len, True,
                              kernel=kernel, table=self.src_table, block_size=B))
