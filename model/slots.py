"""The one slot allocator: cache slot ids handed out and taken back.

A slot is one row of the KV cache and holds one hypothesis. ``KVCache`` owns a ``SlotPool``
(``cache.slots``); offline ``generate`` allocates a beam's slots from it, and the serving engine hands
it to its scheduler, which allocates at admission and frees when a request finishes.
Plain Python (no torch), so the scheduler and its tests can use it without a model.
"""
from __future__ import annotations

from typing import Sequence


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
