"""The one slot allocator and the one KV-block manager: cache slots and KV blocks handed out and
taken back. Plain Python (no torch), so the scheduler and its tests use them without a model.

A slot is one row of the KV cache and holds one hypothesis. ``KVCache`` owns a ``SlotPool``
(``cache.slots``); offline ``generate`` allocates a beam's slots from it, and the serving engine hands
it to its scheduler, which allocates at admission and frees when a request finishes.
``BlockPool`` adds the fixed-size blocks of a paged cache (``model/inference/paged_cache.py``) and the
rule of which blocks a slot holds (as vLLM's KV-cache manager). It has one owner per use: the serving
engine's scheduler (the engine hands it ``cache.slots``), or offline decoding
(``paged_cache.allocate_blocks``). The cache never allocates: it applies the ``BlockUpdate`` the
owner hands it (``PagedKVCache.assign_blocks``) and only writes where its tables point.
"""
from __future__ import annotations

from typing import Sequence


class CacheFullError(RuntimeError):
    """Raised when more slots (or KV blocks) are requested than are free."""


class SlotPool:
    """Slot ids 0..num_slots-1, the lowest free ids handed out first.

    Invariant: every id is either in the free list or held by exactly one caller.
    """

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack, sorted descending: lowest id on top

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of slots in use, 0..1."""
        return 1.0 - len(self._free) / self.num_slots if self.num_slots else 0.0

    def allocate(self, n: int) -> list[int]:
        """Take the n lowest free slot ids, ascending. Raises CacheFullError if fewer than n are free."""
        if n > len(self._free):
            raise CacheFullError(f"asked for {n} slots, {len(self._free)} free of {self.num_slots}")
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: Sequence[int]) -> None:
        """Give slots back for reuse (their cache contents are simply overwritten by the next owner).
        Raises ValueError, freeing nothing, for a duplicate, an unknown id or a slot that is not allocated."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {list(slots)} contain duplicates")
        free = set(self._free)
        for s in slots:
            if not 0 <= s < self.num_slots or s in free:
                raise ValueError(f"slot {s} is not allocated")
        self._free.extend(slots)
        self._free.sort(reverse=True)


Entry = tuple[int, int, int]    # (slot, index in its block table, block id)


class BlockUpdate:
    """What a paged cache's block tables must change to mirror its ``BlockPool`` again, since the
    previous update (``BlockPool.pop_update``); ``PagedKVCache.assign_blocks`` applies it in this
    order: the tables of freed slots are emptied, then every new block is put in its place."""
    __slots__ = ("freed", "source", "target")

    def __init__(self, freed: Sequence[int] = (), source: Sequence[Entry] = (), target: Sequence[Entry] = ()):
        self.freed = list(freed)     # slots freed: every entry of their tables unset
        self.source = list(source)   # (slot, index, block): src_table[slot, index] = block (cross-attention K/V)
        self.target = list(target)   # (slot, index, block): table[slot, index] = block (self-attention K/V)

    def __bool__(self) -> bool:
        return bool(self.freed or self.source or self.target)

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockUpdate) and (self.freed, self.source, self.target) == (
            other.freed, other.source, other.target)

    def __repr__(self) -> str:
        return f"BlockUpdate(freed={self.freed}, source={self.source}, target={self.target})"


class BlockPool(SlotPool):
    """Slots plus the fixed-size blocks of KV-cache positions they hold (a paged cache, as in vLLM):
    the one place that allocates and frees blocks, and that states how many a slot needs.

    The rule: a sentence's source of S positions takes ``blocks_for(S)`` = ceil(S / B) blocks, held by
    its first slot (the beam's other hypotheses read them there); a hypothesis that writes target
    position p holds ``target_blocks(p)`` = ceil((p + 1) / B) target blocks, so it takes one as p
    reaches a new block (``allocate_target``; every hypothesis of a sentence from position 0, the
    prefill step, on). Slots are cheap (a row of a block table), so there can be many more of them
    than the memory could hold at full length. Freeing a slot gives back all of its blocks.
    Every change is recorded for the cache's block tables (``pop_update``).
    Invariant: every block id is free or held by exactly one allocated slot, once.
    """

    def __init__(self, num_slots: int, num_blocks: int, block_size: int):
        super().__init__(num_slots)
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free_blocks = list(range(num_blocks - 1, -1, -1))   # a stack: lowest id on top
        self.source: dict[int, list[int]] = {}                    # slot -> its source blocks, in order
        self.target: dict[int, list[int]] = {}                    # allocated slot -> its target blocks, in order
        self._update = BlockUpdate()

    # ---- the rule ------------------------------------------------------------------------------
    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions: ceil(positions / block_size)."""
        return -(-positions // self.block_size)

    def target_blocks(self, position: int) -> int:
        """Target blocks a hypothesis holds once it writes ``position``: ceil((position + 1) / B)."""
        return self.blocks_for(position + 1)

    def new_target_blocks(self, num_slots: int, position: int) -> int:
        """Blocks ``num_slots`` hypotheses take to write ``position``, having written position - 1."""
        return num_slots * (self.target_blocks(position) - self.target_blocks(position - 1))

    # ---- figures -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def block_usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._free_blocks) / self.num_blocks if self.num_blocks else 0.0

    @property
    def held(self) -> dict[int, list[int]]:
        """Slot -> every block it holds (source first), for the slots that hold any."""
        out = {s: list(b) for s, b in self.source.items() if b}
        for s, b in self.target.items():
            if b:
                out[s] = out.get(s, []) + b
        return out

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        slots = super().allocate(n)
        for s in slots:
            self.target[s] = []
        return slots

    def allocate_source(self, slot: int, src_len: int) -> None:
        """The source blocks of a sentence of ``src_len`` positions, for ``slot`` (its first).
        Raises CacheFullError, taking nothing, when fewer are free, ValueError for a free slot."""
        self._target_of(slot)
        first = len(self.source.get(slot, ()))
        ids = self._take(self.blocks_for(src_len) - first)
        self.source.setdefault(slot, []).extend(ids)
        self._update.source += [(slot, first + i, b) for i, b in enumerate(ids)]

    def allocate_target(self, slots: Sequence[int], position: int) -> None:
        """Each of ``slots`` holds the target blocks of positions 0..position afterwards
        (``target_blocks``): a new block for each that reaches one. Raises CacheFullError, taking
        nothing, when fewer are free, ValueError for a free or repeated slot."""
        need = self.target_blocks(position)
        held = [self._target_of(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {list(slots)} contain duplicates")
        ids = iter(self._take(sum(max(need - len(h), 0) for h in held)))
        out = self._update.target
        for s, h in zip(slots, held):
            while len(h) < need:
                b = next(ids)
                out.append((s, len(h), b))
                h.append(b)

    def free(self, slots: Sequence[int]) -> None:
        """Free slots and every block they hold (ValueError, freeing nothing, as ``SlotPool.free``)."""
        super().free(slots)
        for s in slots:
            self._free_blocks.extend(self.source.pop(s, ()))
            self._free_blocks.extend(self.target.pop(s, ()))
        self._free_blocks.sort(reverse=True)
        u = self._update
        if u.source or u.target:      # entries not handed over yet: the tables never see them
            gone = set(slots)
            u.source = [e for e in u.source if e[0] not in gone]
            u.target = [e for e in u.target if e[0] not in gone]
        u.freed.extend(slots)

    def pop_update(self) -> BlockUpdate:
        """The changes since the previous call, for the cache's tables (``PagedKVCache.assign_blocks``)."""
        u, self._update = self._update, BlockUpdate()
        return u

    def _target_of(self, slot: int) -> list[int]:
        held = self.target.get(slot)
        if held is None:
            raise ValueError(f"slot {slot} is not allocated")
        return held

    def _take(self, n: int) -> list[int]:
        if n > len(self._free_blocks):
            raise CacheFullError(f"asked for {n} KV blocks, {len(self._free_blocks)} free of {self.num_blocks}")
        return [self._free_blocks.pop() for _ in range(n)]
