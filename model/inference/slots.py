"""The one slot allocator: cache slot ids handed out and taken back.

A slot is one row of the KV cache and holds one hypothesis. ``KVCache`` owns a ``SlotPool``
(``cache.slots``); offline ``generate`` allocates a beam's slots from it, and the serving engine hands
it to its scheduler, which allocates at admission and frees when a request finishes.
``BlockPool`` adds the fixed-size blocks of a paged cache (``model/inference/paged_cache.py``): the serving
engine's scheduler admits by free blocks and preempts when they run out.
Plain Python (no torch), so the scheduler and its tests can use it without a model.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence


class CacheFullError(RuntimeError):
    """Raised when more slots are requested than are free."""


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


class BlockPool(SlotPool):
    """Slots plus the fixed-size blocks of KV-cache positions they hold (a paged cache, as in vLLM).

    ``num_blocks`` blocks of ``block_size`` positions each; a slot takes blocks one at a time as its
    sequence grows (``take``), for its target (decoder self-attention) or its source (cross-attention)
    positions, and gives all of them back when it is freed. Slots are cheap (a row of a block table),
    so there can be many more of them than the memory could hold at full length.
    Invariant: every block id is free or held by exactly one allocated slot.
    ``on_free``, when set, is called with the slots just freed (the cache resets their tables).
    """

    def __init__(self, num_slots: int, num_blocks: int, block_size: int):
        super().__init__(num_slots)
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free_blocks = list(range(num_blocks - 1, -1, -1))   # a stack: lowest id on top
        self.held: dict[int, list[int]] = {}                      # slot -> its blocks, in order taken
        self.on_free: Optional[Callable[[Sequence[int]], None]] = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def block_usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._free_blocks) / self.num_blocks if self.num_blocks else 0.0

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions: ceil(positions / block_size)."""
        return -(-positions // self.block_size)

    def take(self, slots: Sequence[int]) -> list[int]:
        """One more block for each of ``slots`` (allocated; repeats take several), in order. Raises
        CacheFullError, taking nothing, when fewer blocks are free, ValueError for a free slot."""
        if len(slots) > len(self._free_blocks):
            raise CacheFullError(f"asked for {len(slots)} KV blocks, {len(self._free_blocks)} free of "
                                 f"{self.num_blocks}")
        free = set(self._free)
        if any(s in free or not 0 <= s < self.num_slots for s in slots):
            raise ValueError(f"slots {list(slots)} are not all allocated")
        out = []
        for s in slots:
            b = self._free_blocks.pop()
            self.held.setdefault(s, []).append(b)
            out.append(b)
        return out

    def free(self, slots: Sequence[int]) -> None:
        """Free slots and every block they hold (ValueError, freeing nothing, as ``SlotPool.free``)."""
        super().free(slots)
        for s in slots:
            self._free_blocks.extend(self.held.pop(s, ()))
        self._free_blocks.sort(reverse=True)
        if self.on_free is not None and slots:
            self.on_free(slots)
