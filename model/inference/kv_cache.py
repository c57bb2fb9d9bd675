"""A preallocated, slot-indexed key/value cache for incremental decoding.

One slot holds one hypothesis: its decoder self-attention keys/values (one position written per step,
in place) and its encoder-decoder (cross) attention keys/values (written once at prefill). Slots are
independent, so sequences of different requests at different positions share one cache. Offline
decoding uses it (sized for its batch); the serving engine uses its paged subclass
(``model/inference/paged_cache.py``), whose memory follows the tokens actually held.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import kernels, settings
from .attention_plan import AttentionPlan, CacheAttention, packed_positions, shared_sources
from .slots import CacheFullError, SlotPool

__all__ = ["CacheFullError", "KVCache"]


class KVCache:
    """Self-attention K/V [L, N, T_max, H, Dh] and cross-attention K/V [L, N, S_max, H, Dh].

    L decoder layers, N slots, H heads, Dh = d_model / H. Memory is fixed at construction:
    4 · L · N · (T_max + S_max) · H · Dh elements. Positions come before heads, so that a slot's
    keys for positions 0..T-1 of all heads are one contiguous block: a decode step reads a few
    large blocks per row instead of one small block per head.
    Reads (``attention_plan.read_positions``) are in the attention layout [N, H, T, Dh] (a transposed view).
    With ``indirect=True`` a [N, T_max] table (``home``) says which slot holds each slot's K/V of
    each position, so that beam reorders copy slot ids instead of K/V; decode attention then always
    gathers keys (packed, see ``AttentionPlan``). Used on CPU by the engine and offline decoding.
    The slots themselves are handed out by ``slots`` (a ``SlotPool``); ``CacheFullError`` comes from there.
    ``cpu_kernels``: decode attention may run the compiled kernels (``kernel_ok``; default: the
    process's, ``settings.current()``).
    """

    def __init__(self, n_layers: int, n_heads: int, d_head: int, num_slots: int, max_tgt_len: int,
                 max_src_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 indirect: bool = False, cpu_kernels: Optional[bool] = None):
        shape_self = (n_layers, num_slots, max_tgt_len, n_heads, d_head)
        shape_cross = (n_layers, num_slots, max_src_len, n_heads, d_head)
        self.self_k = torch.zeros(shape_self, dtype=dtype, device=device)
        self.self_v = torch.zeros(shape_self, dtype=dtype, device=device)
        self.cross_k = torch.zeros(shape_cross, dtype=dtype, device=device)
        self.cross_v = torch.zeros(shape_cross, dtype=dtype, device=device)
        self.src_len = torch.zeros(num_slots, dtype=torch.long, device=device)  # valid cross positions
        # The slot holding each slot's cross K/V: every hypothesis of a beam attends to one source,
        # stored once in its first slot and read once per step for all of them.
        self.owner = torch.arange(num_slots, device=device)
        self.num_slots, self.max_tgt_len, self.max_src_len = num_slots, max_tgt_len, max_src_len
        # indirect: where each slot's self-attention K/V of each position lives ([N, T_max] slot ids),
        # so that a beam reorder copies these ids instead of the K/V themselves (see ``reorder``).
        self.home = (torch.arange(num_slots, device=device)[:, None].repeat(1, max_tgt_len) if indirect
                     else None)
        # slots whose history a reorder has redirected since their first position; while no row of a
        # step is, its keys are in its own slot and attention may read them in place (greedy never is)
        self.redirected = torch.zeros(num_slots, dtype=torch.bool, device=device) if indirect else None
        self.slots = SlotPool(num_slots)  # which slots are free: the one allocator (offline and engine)
        self.cpu_kernels: bool = settings.or_default("cpu_kernels", cpu_kernels)
        self._kernel: Optional[bool] = None  # compiled decode attention usable (see kernel_ok)
        self.num_layers = n_layers

    @classmethod
    def for_model(cls, model, num_slots: int, max_tgt_len: Optional[int] = None,
                  max_src_len: Optional[int] = None, indirect: bool = False,
                  cpu_kernels: Optional[bool] = None) -> "KVCache":
        """A cache shaped for ``model`` (a ``Transformer``), on its device and in its dtype."""
        cfg = model.cfg
        p = next(model.parameters())
        return cls(cfg.n_decoder_layers, cfg.n_heads, cfg.d_head, num_slots, max_tgt_len or cfg.max_len,
                   max_src_len or cfg.max_len, dtype=p.dtype, device=p.device, indirect=indirect,
                   cpu_kernels=cpu_kernels)

    @property
    def nbytes(self) -> int:
        """Bytes held by the four K/V buffers."""
        return sum(t.numel() * t.element_size() for t in (self.self_k, self.self_v, self.cross_k, self.cross_v))

    # ---- writes and reads ----------------------------------------------------------------------
    def write_cross(self, slots: Tensor, cross_kv: Sequence[tuple[Tensor, Tensor]], src_lengths: Tensor) -> None:
        """Store per-layer encoder-memory K/V, each [N, H, S, Dh], for slots [N]; S <= max_src_len.
        Each of these slots then owns its cross K/V (see ``share_cross``)."""
        S = cross_kv[0][0].size(2)
        if S > self.max_src_len:
            raise ValueError(f"source length {S} exceeds the cache's max_src_len {self.max_src_len}")
        for layer, (k, v) in enumerate(cross_kv):
            self.cross_k[layer, :, :S].index_copy_(0, slots, k.transpose(1, 2))
            self.cross_v[layer, :, :S].index_copy_(0, slots, v.transpose(1, 2))
        self._own_cross(slots, src_lengths)

    def write_cross_packed(self, slots: Tensor, cross_kv: Sequence[tuple[Tensor, Tensor]], src_lengths: Tensor) -> None:
        """``write_cross`` for a packed batch (``Transformer.encode_packed``): per-layer K/V [NT, H, 1, Dh]
        of the NT = sum(src_lengths) tokens of B sequences, one after another, for slots [B]."""
        if int(src_lengths.max()) > self.max_src_len:
            raise ValueError(f"source length {int(src_lengths.max())} exceeds the cache's max_src_len {self.max_src_len}")
        seq, pos = packed_positions(src_lengths)
        at = slots.index_select(0, seq) * self.max_src_len + pos          # each token's row in a layer's [N*S_max] view
        for layer, (k, v) in enumerate(cross_kv):
            K, V = self.cross_k[layer], self.cross_v[layer]
            K.view(-1, *K.shape[2:]).index_copy_(0, at, k[:, :, 0])
            V.view(-1, *V.shape[2:]).index_copy_(0, at, v[:, :, 0])
        self._own_cross(slots, src_lengths)

    def _own_cross(self, slots: Tensor, src_lengths: Tensor) -> None:
        """Slots [N] now hold their own cross K/V, src_lengths [N] positions of it."""
        self.src_len.index_copy_(0, slots, src_lengths.to(self.src_len.device))
        self.owner.index_copy_(0, slots, slots)

    def share_cross(self, slots: Tensor, owners: Tensor) -> None:
        """Let slots [N] attend to the cross K/V stored in owners [N] (the other hypotheses of a beam)."""
        owners = self.owner.index_select(0, owners)
        self.owner.index_copy_(0, slots, owners)
        self.src_len.index_copy_(0, slots, self.src_len.index_select(0, owners))

    def kernel_ok(self) -> bool:
        """Whether packed decode attention runs the compiled kernel (``model.inference.kernels``): a CPU cache
        in float32/float64 with ``cpu_kernels`` on, where the kernel could be built (decided once, at
        the first step)."""
        if self._kernel is None:
            self._kernel = self.cpu_kernels and kernels.applies(self.self_k.device, self.self_k.dtype)
        return self._kernel

    def plan_step(self, slots: Tensor, positions: Tensor, packed: bool = False
                  ) -> list[tuple[CacheAttention, CacheAttention]]:
        """Plan one decode step for rows ``slots`` [N] at ``positions`` [N]: per decoder layer, the
        attention hooks (self, cross) that write the step's K/V and read the cache (``CacheAttention``).
        With ``packed``, rows of different lengths are attended over their own keys only
        (``AttentionPlan``); otherwise in one padded call. On an indirect cache it also records, in
        ``home``, that each row's K/V of its position will be in its own slot (and a row at position 0
        starts a new history). Raises ValueError when a position reaches max_tgt_len."""
        if int(positions.max()) + 1 > self.max_tgt_len:
            raise ValueError(f"target length {int(positions.max()) + 1} exceeds the cache's max_tgt_len "
                             f"{self.max_tgt_len}")
        owners, share = shared_sources(self.owner.index_select(0, slots))
        write_at = self._write_rows(slots, positions)   # each row's own position in a layer's row view
        home = None
        if self.home is not None:  # this step's K/V are written in the rows' own slots
            self.home.view(-1).index_copy_(0, slots * self.max_tgt_len + positions, slots)
            self.redirected.index_fill_(0, slots[positions == 0], False)  # a new history starts
            if bool(self.redirected.index_select(0, slots).any()):
                home = self.home
        plans = self._plans(slots, positions + 1, owners, packed, home, packed and self.kernel_ok())
        return [(CacheAttention(self, layer, write_at=write_at, plan=plans[0]),
                 CacheAttention(self, layer, write_at=None, plan=plans[1], share=share))
                for layer in range(self.num_layers)]

    def _write_rows(self, slots: Tensor, positions: Tensor) -> Tensor:
        """[N] the row (in a layer's [N_slots * T_max, H, Dh] view) where each row's K/V of its position go."""
        return slots * self.max_tgt_len + positions

    def _plans(self, slots: Tensor, lengths: Tensor, owners: Tensor, packed: bool, home: Optional[Tensor],
               kernel: bool) -> tuple[AttentionPlan, AttentionPlan]:
        """The (self, cross) plans: rows ``slots`` over ``lengths`` target keys, sources ``owners``."""
        return (AttentionPlan(slots, lengths, self.max_tgt_len, packed, home, kernel),
                AttentionPlan(owners, self.src_len.index_select(0, owners), self.max_src_len, packed, kernel=kernel))

    def reorder(self, slots: Sequence[int], index: Sequence[int], length: Optional[int] = None) -> None:
        """Beam reorder: slot slots[i] takes the self-attention K/V that slot slots[index[i]] held.

        Only positions < length (default all) are copied. Cross-attention K/V are left alone:
        hypotheses of one sentence share the same source. An indirect cache copies only the slot ids
        of those positions (``home``): position p of every hypothesis is written once, at step p,
        in its own slot, and hypotheses that descend from it read it there. That is safe because all
        hypotheses of a beam are at the same position and a beam's slots are freed together.
        """
        moved = [i for i, j in enumerate(index) if i != j]  # rows that keep their own history stay put
        if not moved:
            return
        dev = self.self_k.device
        dst = torch.as_tensor([slots[i] for i in moved], device=dev)
        src = torch.as_tensor([slots[index[i]] for i in moved], device=dev)
        T = self.max_tgt_len if length is None else length
        if self.home is not None:
            view = self.home[:, :T]
            view.index_copy_(0, dst, view.index_select(0, src))
            self.redirected.index_fill_(0, dst, True)
            return
        for buf in (self.self_k, self.self_v):
            for layer in range(buf.size(0)):
                # Per layer along dim 0: gathering along dim 1 of the 5-d view is much slower on CPU.
                view = buf[layer, :, :T]  # [N, T, H, Dh]
                view.index_copy_(0, dst, view.index_select(0, src))  # sources are read before any write
