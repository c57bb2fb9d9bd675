"""A preallocated, slot-indexed key/value cache for incremental decoding.

One slot holds one hypothesis: its decoder self-attention keys/values (one position written per step,
in place) and its encoder-decoder (cross) attention keys/values (written once at prefill). Slots are
independent, so sequences of different requests at different positions share one cache; the serving
engine and offline decoding both use it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


class CacheFullError(RuntimeError):
    """Raised when more slots are requested than are free."""


class KVCache:
    """Self-attention K/V [L, N, H, T_max, Dh] and cross-attention K/V [L, N, H, S_max, Dh].

    L decoder layers, N slots, H heads, Dh = d_model / H. Memory is fixed at construction:
    4 · L · N · H · (T_max + S_max) · Dh elements.
    """

    def __init__(self, n_layers: int, n_heads: int, d_head: int, num_slots: int, max_tgt_len: int,
                 max_src_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape_self = (n_layers, num_slots, n_heads, max_tgt_len, d_head)
        shape_cross = (n_layers, num_slots, n_heads, max_src_len, d_head)
        self.self_k = torch.zeros(shape_self, dtype=dtype, device=device)
        self.self_v = torch.zeros(shape_self, dtype=dtype, device=device)
        self.cross_k = torch.zeros(shape_cross, dtype=dtype, device=device)
        self.cross_v = torch.zeros(shape_cross, dtype=dtype, device=device)
        self.src_len = torch.zeros(num_slots, dtype=torch.long, device=device)  # valid cross positions
        self.num_slots, self.max_tgt_len, self.max_src_len = num_slots, max_tgt_len, max_src_len
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: lowest slot ids are handed out first

    @classmethod
    def for_model(cls, model, num_slots: int, max_tgt_len: Optional[int] = None,
                  max_src_len: Optional[int] = None) -> "KVCache":
        """A cache shaped for ``model`` (a ``Transformer``), on its device and in its dtype."""
        cfg = model.cfg
        p = next(model.parameters())
        return cls(cfg.n_decoder_layers, cfg.n_heads, cfg.d_head, num_slots, max_tgt_len or cfg.max_len,
                   max_src_len or cfg.max_len, dtype=p.dtype, device=p.device)

    # ---- slot accounting ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of slots in use, 0..1."""
        return 1.0 - len(self._free) / self.num_slots

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.self_k, self.self_v, self.cross_k, self.cross_v))

    def allocate(self, n: int) -> list[int]:
        """Take n free slots. Raises CacheFullError if fewer than n are free."""
        if n > len(self._free):
            raise CacheFullError(f"asked for {n} slots, {len(self._free)} free of {self.num_slots}")
        return [self._free.pop() for _ in range(n)]

    def free(self, slots: Sequence[int]) -> None:
        """Return slots for reuse. Their contents are simply overwritten by the next owner."""
        free = set(self._free)
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {list(slots)} contain duplicates")
        for s in slots:
            if not 0 <= s < self.num_slots or s in free:
                raise ValueError(f"slot {s} is not allocated")
        self._free.extend(sorted(slots, reverse=True))
        self._free.sort(reverse=True)

    # ---- writes and reads ----------------------------------------------------------------------
    def write_cross(self, slots: Tensor, cross_kv: Sequence[tuple[Tensor, Tensor]], src_lengths: Tensor) -> None:
        """Store per-layer encoder-memory K/V, each [N, H, S, Dh], for slots [N]; S <= max_src_len."""
        S = cross_kv[0][0].size(2)
        if S > self.max_src_len:
            raise ValueError(f"source length {S} exceeds the cache's max_src_len {self.max_src_len}")
        for layer, (k, v) in enumerate(cross_kv):
            self.cross_k[layer, :, :, :S].index_copy_(0, slots, k)
            self.cross_v[layer, :, :, :S].index_copy_(0, slots, v)
        self.src_len.index_copy_(0, slots, src_lengths.to(self.src_len.device))

    @staticmethod
    def rows(slots: Tensor) -> Tensor | slice:
        """``slots`` as a slice when they are consecutive ascending ids (as in a static batch, or a
        running batch without holes), so that reads are views of the cache instead of copies;
        otherwise ``slots`` itself. Either form is accepted by ``cross`` and ``self_update``."""
        n = slots.numel()
        if n == 0:
            return slots
        first = int(slots[0])
        if int(slots[-1]) - first != n - 1 or (n > 2 and not bool((slots.diff() == 1).all())):
            return slots
        return slice(first, first + n)

    def cross(self, layer: int, slots: Tensor | slice, S: int) -> tuple[Tensor, Tensor]:
        """Cross-attention K/V [N, H, S, Dh] of slots (ids [N], or a slice: see ``rows``), over the
        first S source positions."""
        if isinstance(slots, slice):
            return self.cross_k[layer, slots, :, :S], self.cross_v[layer, slots, :, :S]
        return (self.cross_k[layer, :, :, :S].index_select(0, slots),
                self.cross_v[layer, :, :, :S].index_select(0, slots))

    def self_update(self, layer: int, slots: Tensor, positions: Tensor, T: int, rows: Tensor | slice | None = None):
        """A hook for ``Transformer.decode``: writes the step's K/V [N, H, 1, Dh] of each slot at its
        own position (in place), then returns K/V [N, H, T, Dh] of positions 0..T-1 (views of the
        cache when ``rows``, from ``rows(slots)``, is a slice; copies otherwise)."""
        if T > self.max_tgt_len:
            raise ValueError(f"target length {T} exceeds the cache's max_tgt_len {self.max_tgt_len}")
        rows = slots if rows is None else rows

        def update(k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
            self.self_k[layer][slots, :, positions] = k_new[:, :, 0]
            self.self_v[layer][slots, :, positions] = v_new[:, :, 0]
            if isinstance(rows, slice):
                return self.self_k[layer, rows, :, :T], self.self_v[layer, rows, :, :T]
            return (self.self_k[layer, :, :, :T].index_select(0, rows),
                    self.self_v[layer, :, :, :T].index_select(0, rows))
        return update

    def reorder(self, slots: Sequence[int], index: Sequence[int], length: Optional[int] = None) -> None:
        """Beam reorder: slot slots[i] takes the self-attention K/V that slot slots[index[i]] held.

        Only positions < length (default all) are copied. Cross-attention K/V are left alone:
        hypotheses of one sentence share the same source.
        """
        moved = [i for i, j in enumerate(index) if i != j]  # rows that keep their own history stay put
        if not moved:
            return
        dev = self.self_k.device
        dst = torch.as_tensor([slots[i] for i in moved], device=dev)
        src = torch.as_tensor([slots[index[i]] for i in moved], device=dev)
        T = self.max_tgt_len if length is None else length
        for buf in (self.self_k, self.self_v):
            for layer in range(buf.size(0)):
                # Per layer along dim 0: gathering along dim 1 of the 5-d view is ~50x slower on CPU.
                view = buf[layer, :, :, :T]  # [N, H, T, Dh]
                view.index_copy_(0, dst, view.index_select(0, src))  # sources are read before any write
