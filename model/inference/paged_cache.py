"""A paged KV cache: keys and values in fixed-size blocks (as in vLLM), so that memory follows the
tokens actually held instead of every slot's maximum length.

The cache never allocates a block: whoever owns its ``BlockPool`` (``cache.slots``: the serving
engine's scheduler, or ``allocate_blocks`` for offline decoding) decides which blocks each slot
holds, and the cache applies those decisions to its block tables (``assign_blocks``) and writes only
where they point. Offline ``generate`` keeps the contiguous ``KVCache`` (sized for its batch) unless
given one of these. Both compute the same attention over the same keys, in the same order, so their
outputs are identical.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import settings
from .attention_plan import AttentionPlan, packed_positions
from .kv_cache import KVCache
from .slots import BlockPool, BlockUpdate

__all__ = ["PagedKVCache", "allocate_blocks", "default_num_blocks"]


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

    A slot (one hypothesis) reads and writes its target positions through ``table``
    [N, ceil(T_max / B)] and its source through ``src_table`` [N, ceil(S_max / B)] (a sentence's
    source is stored in its first slot only; the other hypotheses of a beam read it there,
    ``owner``). The tables are set by ``assign_blocks`` from the ``BlockUpdate``s of ``slots`` (a
    ``model.inference.slots.BlockPool``, which alone allocates and frees blocks); an entry no block
    was assigned to is -1, and a write there raises ValueError (a bug of the block owner: nothing is
    ever allocated here). Beam reorders copy slot ids in ``home`` (as an indirect ``KVCache``), never
    K/V: position p of every hypothesis is written once, at step p, in its own block, and hypotheses
    that descend from it read it there (a beam's slots are freed together). Memory:
    2 · L · num_blocks · B · H · Dh elements, whatever the number of slots. Decode attention is always
    packed (through the tables).
    """

    def __init__(self, n_layers: int, n_heads: int, d_head: int, num_slots: int, num_blocks: int, block_size: int,
                 max_tgt_len: int, max_src_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", cpu_kernels: Optional[bool] = None):
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {block_size}")
        shape = (n_layers, num_blocks, block_size, n_heads, d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = B = block_size
        self.num_slots, self.max_tgt_len, self.max_src_len = num_slots, max_tgt_len, max_src_len
        self.num_layers = n_layers
        self.table = torch.full((num_slots, -(-max_tgt_len // B)), -1, dtype=torch.long, device=device)
        self.src_table = torch.full((num_slots, -(-max_src_len // B)), -1, dtype=torch.long, device=device)
        self.src_len = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.owner = torch.arange(num_slots, device=device)
        self.home = torch.arange(num_slots, device=device)[:, None].repeat(1, max_tgt_len)
        self.redirected = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.slots = BlockPool(num_slots, num_blocks, block_size)   # for the one block owner; never used here
        self.cpu_kernels: bool = settings.or_default("cpu_kernels", cpu_kernels)   # as KVCache's
        self._kernel: Optional[bool] = None

    @classmethod
    def for_model(cls, model, num_slots: int, max_tgt_len: Optional[int] = None, max_src_len: Optional[int] = None,
                  num_blocks: Optional[int] = None, block_size: int = 16,
                  cpu_kernels: Optional[bool] = None) -> "PagedKVCache":
        """A paged cache shaped for ``model`` (a ``Transformer``), on its device and in its dtype;
        ``num_blocks`` defaults to ``default_num_blocks``."""
        cfg = model.cfg
        p = next(model.parameters())
        T, S = max_tgt_len or cfg.max_len, max_src_len or cfg.max_len
        if num_blocks is None:
            num_blocks = default_num_blocks(num_slots, block_size, S, T)
        return cls(cfg.n_decoder_layers, cfg.n_heads, cfg.d_head, num_slots, num_blocks, block_size, T, S,
                   dtype=p.dtype, device=p.device, cpu_kernels=cpu_kernels)

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

    # ---- block tables ----------------------------------------------------------------------------
    def assign_blocks(self, update: BlockUpdate) -> None:
        """Apply the block owner's decisions (``BlockPool.pop_update``): unset the tables of freed slots,
        then put each new block at its place. At most three small copies and index writes."""
        dev = self.table.device
        if update.freed:
            freed = torch.tensor(update.freed, device=dev)
            self.table.index_fill_(0, freed, -1)
            self.src_table.index_fill_(0, freed, -1)
        for table, entries in ((self.src_table, update.source), (self.table, update.target)):
            if entries:
                slot, index, block = torch.tensor(entries, dtype=torch.long, device=dev).unbind(1)
                table[slot, index] = block

    @staticmethod
    def _check_assigned(block: Tensor, what: str, slots: Tensor, positions: Tensor) -> None:
        """Raise ValueError when a position to be written has no block assigned (entry -1)."""
        if bool((block < 0).any()):
            bad = (block < 0).nonzero()[:, 0]
            raise ValueError(f"no KV block assigned for {what} positions {positions[bad].tolist()} of slots "
                             f"{slots[bad].tolist()}: the block owner (the engine's scheduler, or "
                             "allocate_blocks offline) assigns blocks before they are written")

    # ---- writes --------------------------------------------------------------------------------
    def write_cross(self, slots: Tensor, cross_kv: Sequence[tuple[Tensor, Tensor]], src_lengths: Tensor) -> None:
        """Store per-layer encoder-memory K/V, each [N, H, S, Dh] (right-padded), for slots [N]: only
        the src_lengths [N] real positions, in the source blocks assigned to each slot."""
        S = cross_kv[0][0].size(2)
        keep = torch.arange(S, device=src_lengths.device)[None, :] < src_lengths[:, None]     # [N, S]
        packed = [(k.transpose(1, 2)[keep][:, :, None], v.transpose(1, 2)[keep][:, :, None]) for k, v in cross_kv]
        self.write_cross_packed(slots, packed, src_lengths)

    def write_cross_packed(self, slots: Tensor, cross_kv: Sequence[tuple[Tensor, Tensor]], src_lengths: Tensor) -> None:
        """``KVCache.write_cross_packed``: per-layer K/V [NT, H, 1, Dh] of NT = sum(src_lengths) tokens
        of B sequences, one after another, for slots [B], into the source blocks assigned to them.
        Raises ValueError beyond max_src_len or where no block is assigned."""
        if int(src_lengths.max()) > self.max_src_len:
            raise ValueError(f"source length {int(src_lengths.max())} exceeds the cache's max_src_len {self.max_src_len}")
        B = self.block_size
        seq, pos = packed_positions(src_lengths)
        rows = slots.index_select(0, seq)
        block = self.src_table[rows, torch.div(pos, B, rounding_mode="floor")]
        self._check_assigned(block, "source", rows, pos)
        at = block * B + pos.remainder(B)                     # each token's row in a layer's [NB * B] view
        for layer, (k, v) in enumerate(cross_kv):
            self.k[layer].view(-1, *self.k.shape[3:]).index_copy_(0, at, k[:, :, 0])
            self.v[layer].view(-1, *self.v.shape[3:]).index_copy_(0, at, v[:, :, 0])
        self._own_cross(slots, src_lengths)

    def _write_rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """Each row's row in a layer's [NB * B] view, in the block assigned to its position (ValueError
        where none is)."""
        B = self.block_size
        block = self.table[slots, torch.div(positions, B, rounding_mode="floor")]
        self._check_assigned(block, "target", slots, positions)
        return block * B + positions.remainder(B)

    def _plans(self, slots: Tensor, lengths: Tensor, owners: Tensor, packed: bool, home: Optional[Tensor],
               kernel: bool) -> tuple[AttentionPlan, AttentionPlan]:
        B = self.block_size
        return (AttentionPlan(slots, lengths, self.max_tgt_len, True, home, kernel, self.table, B),
                AttentionPlan(owners, self.src_len.index_select(0, owners), self.max_src_len, True,
                              kernel=kernel, table=self.src_table, block_size=B))


def allocate_blocks(cache: KVCache, slots: Sequence[Sequence[int]] | Tensor, positions: int | Sequence[int],
                    src_lengths: Optional[Sequence[int] | Tensor] = None) -> None:
    """Offline decoding's block owner (the serving engine's is its scheduler): for each sentence (its
    slots, one per hypothesis), the target blocks its hypotheses write up to ``positions`` (one for
    all, or one per sentence) and, with ``src_lengths``, its source blocks, taken from ``cache.slots``
    by the ``BlockPool`` rule and assigned in the cache's tables. Nothing on a contiguous cache.
    Raises CacheFullError when the blocks are not free."""
    if not isinstance(cache, PagedKVCache):
        return
    rows = slots.tolist() if isinstance(slots, Tensor) else [list(map(int, r)) for r in slots]
    if isinstance(positions, int):
        positions = [positions] * len(rows)
    if isinstance(src_lengths, Tensor):
        src_lengths = src_lengths.tolist()
    pool = cache.slots
    if src_lengths is not None:
        for sentence, n in zip(rows, src_lengths):
            pool.allocate_source(sentence[0], int(n))
    for sentence, position in zip(rows, positions):
        pool.allocate_target(sentence, position)
    cache.assign_blocks(pool.pop_update())
