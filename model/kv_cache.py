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

from . import kernels
from .attention import packed_positions, scaled_dot_product_attention


class CacheFullError(RuntimeError):
    """Raised when more slots are requested than are free."""


class KVCache:
    """Self-attention K/V [L, N, T_max, H, Dh] and cross-attention K/V [L, N, S_max, H, Dh].

    L decoder layers, N slots, H heads, Dh = d_model / H. Memory is fixed at construction:
    4 · L · N · (T_max + S_max) · H · Dh elements. Positions come before heads, so that a slot's
    keys for positions 0..T-1 of all heads are one contiguous block: a decode step reads a few
    large blocks per row instead of one small block per head (3x faster attention on CPU).
    Reads are returned in the attention layout [N, H, T, Dh] (a transposed view).
    With ``indirect=True`` a [N, T_max] table (``home``) says which slot holds each slot's K/V of
    each position, so that beam reorders copy slot ids instead of K/V; decode attention then always
    gathers keys (packed, see ``AttentionPlan``). Used on CPU by the engine and offline decoding.
    """

    def __init__(self, n_layers: int, n_heads: int, d_head: int, num_slots: int, max_tgt_len: int,
                 max_src_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 indirect: bool = False):
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
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: lowest slot ids are handed out first
        self._kernel: Optional[bool] = None  # compiled decode attention usable (see kernel_ok)

    @classmethod
    def for_model(cls, model, num_slots: int, max_tgt_len: Optional[int] = None,
                  max_src_len: Optional[int] = None, indirect: bool = False) -> "KVCache":
        """A cache shaped for ``model`` (a ``Transformer``), on its device and in its dtype."""
        cfg = model.cfg
        p = next(model.parameters())
        return cls(cfg.n_decoder_layers, cfg.n_heads, cfg.d_head, num_slots, max_tgt_len or cfg.max_len,
                   max_src_len or cfg.max_len, dtype=p.dtype, device=p.device, indirect=indirect)

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
        """Whether packed decode attention runs the compiled kernel (``model.kernels``): a CPU cache
        in float32/float64 where the kernel could be built (decided once, at the first step)."""
        if self._kernel is None:
            self._kernel = kernels.applies(self.self_k.device, self.self_k.dtype)
        return self._kernel

    @staticmethod
    def rows(slots: Tensor) -> Tensor | slice:
        """``slots`` as a slice when they are consecutive ascending ids (as in a static batch, or a
        running batch without holes), so that reads are views of the cache instead of copies;
        otherwise ``slots`` itself. Either form is accepted by ``read``."""
        n = slots.numel()
        if n == 0:
            return slots
        first = int(slots[0])
        if int(slots[-1]) - first != n - 1 or (n > 2 and not bool((slots.diff() == 1).all())):
            return slots
        return slice(first, first + n)

    @staticmethod
    def read(buf: Tensor, rows: Tensor | slice, T: int) -> Tensor:
        """Positions 0..T-1 of ``rows`` (ids [N] or a slice) of one layer's buffer [N_slots, T_max, H, Dh],
        as [N, H, T, Dh]: a view for a slice, a copy of just those positions otherwise."""
        x = buf[rows, :T] if isinstance(rows, slice) else buf[:, :T].index_select(0, rows)
        return x.transpose(1, 2)

    def attention(self, slots: Tensor, positions: Tensor, packed: bool = False
                  ) -> list[tuple["CacheAttention", "CacheAttention"]]:
        """Per decoder layer, the decode-step attention hooks (self, cross) for rows ``slots`` [N] at
        ``positions`` [N] (see ``CacheAttention``). With ``packed``, rows of different lengths are
        attended over their own keys only (``AttentionPlan``); otherwise in one padded call.
        Raises ValueError when a position reaches max_tgt_len."""
        if int(positions.max()) + 1 > self.max_tgt_len:
            raise ValueError(f"target length {int(positions.max()) + 1} exceeds the cache's max_tgt_len "
                             f"{self.max_tgt_len}")
        # cross-attention: one query row per hypothesis, one read of K/V per source (owner)
        owners = self.owner.index_select(0, slots)
        uniq, inverse = torch.unique(owners, return_inverse=True)
        share = None
        if uniq.numel() < owners.numel():
            seen: dict[int, int] = {}
            within = []
            for u in inverse.tolist():
                within.append(seen.get(u, 0))
                seen[u] = within[-1] + 1
            k_max = max(seen.values())
            flat = inverse * k_max + torch.as_tensor(within, device=slots.device)
            share = (uniq.numel(), k_max, flat)
            owners = uniq
        write_at = slots * self.max_tgt_len + positions   # each row's own position in a layer's [N*T_max] view
        home = None
        if self.home is not None:  # this step's K/V are written in the rows' own slots
            self.home.view(-1).index_copy_(0, write_at, slots)
            self.redirected.index_fill_(0, slots[positions == 0], False)  # a new history starts
            if bool(self.redirected.index_select(0, slots).any()):
                home = self.home
        kernel = packed and self.kernel_ok()
        plans = (AttentionPlan(slots, positions + 1, self.max_tgt_len, packed, home, kernel),
                 AttentionPlan(owners, self.src_len.index_select(0, owners), self.max_src_len, packed, kernel=kernel))
        return [(CacheAttention(self, layer, slots, write_at, plans[0]),
                 CacheAttention(self, layer, slots, None, plans[1], share)) for layer in range(self.self_k.size(0))]

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
                # Per layer along dim 0: gathering along dim 1 of the 5-d view is ~50x slower on CPU.
                view = buf[layer, :, :T]  # [N, T, H, Dh]
                view.index_copy_(0, dst, view.index_select(0, src))  # sources are read before any write


def length_groups(lengths: Sequence[int], call_cost: int) -> list[list[int]]:
    """Split rows into groups of similar length, each computed by its own call.

    Work on a padded batch grows with batch size x longest row; each extra call costs a fixed
    overhead instead. Sorting by length and choosing contiguous groups that minimise
    sum(call_cost + size x longest) (dynamic programming, O(n^2) over distinct lengths) balances
    the two. ``call_cost`` is in units of length (tokens). Returns lists of indices into
    ``lengths``, shortest group first; every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if len(order) <= 1:
        return [order] if order else []
    # rows of equal length never need to be split: run the DP over runs of equal lengths
    runs: list[list[int]] = []
    for i in order:
        if runs and lengths[runs[-1][0]] == lengths[i]:
            runs[-1].append(i)
        else:
            runs.append([i])
    n = len(runs)
    size = [0] * (n + 1)
    for j, r in enumerate(runs):
        size[j + 1] = size[j] + len(r)
    best = [0.0] + [float("inf")] * n      # best[j]: cost of the first j runs
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[runs[j - 1][0]]
        for i in range(j):
            c = best[i] + call_cost + (size[j] - size[i]) * longest
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append([x for r in runs[cut[j]: j] for x in r])
        j = cut[j]
    return groups[::-1]


class AttentionPlan:
    """Which cached keys each row of a decode step attends to, shared by every layer.

    Rows ``slots`` [R] (cache rows) have ``lengths`` [R] keys each (positions 0..length-1 of a buffer
    whose rows are ``stride`` positions apart). When all lengths are equal, or ``packed`` is False,
    attention is one padded call over the longest row (``rows`` is a slice when the slots are
    consecutive, so reads are views; ``mask`` [R, 1, 1, T] hides keys beyond a row's length, None when
    there are none). Otherwise (or when ``home`` [N_slots, stride] says which slot holds each
    position, for an indirect cache, or with ``kernel``) it is packed: row r attends over the cache rows
    ``key_index[starts[r]:starts[r + 1]]`` (NK = sum(lengths) keys in all), so a row at position 3
    batched with one at position 40 costs 3 keys, not 41, and no call is spent per group of lengths.
    With ``kernel`` the compiled kernel (``model.kernels``) reads the keys in place; otherwise they are
    gathered into one [NK, H, Dh] block and ``row_of_key`` [NK] and ``pad_index`` [NK]
    (= row * T + position) map each key to its row and to a padded [R, T] score grid.
    """

    def __init__(self, slots: Tensor, lengths: Tensor, stride: int, packed: bool = False,
                 home: Optional[Tensor] = None, kernel: bool = False):
        self.max_len = T = int(lengths.max())
        self.kernel = kernel
        self.packed = kernel or home is not None or (packed and int(lengths.min()) < T)
        if self.packed:
            self.row_of_key, pos = packed_positions(lengths)                   # [NK] row of each key, its position
            self.starts = torch.zeros(slots.numel() + 1, dtype=torch.long, device=slots.device)
            torch.cumsum(lengths, 0, out=self.starts[1:])
            slot = slots.index_select(0, self.row_of_key)
            if home is not None:  # the slot that holds each key (an indirect cache)
                slot = home.view(-1).index_select(0, slot * stride + pos)
            self.key_index = slot * stride + pos
            self._pos = pos
            self._pad_index: Optional[Tensor] = None
        else:
            self.rows = KVCache.rows(slots)
            self.mask = None if int(lengths.min()) == T else (
                torch.arange(T, device=slots.device)[None, :] < lengths[:, None])[:, None, None, :]

    @property
    def pad_index(self) -> Tensor:
        """[NK] each key's place (row * T + position) in a padded [R, T] score grid; only the eager
        packed path needs it (computed once, shared by every layer)."""
        if self._pad_index is None:
            self._pad_index = self.row_of_key * self.max_len + self._pos
        return self._pad_index


class CacheAttention:
    """Attention of one decode step (q_len = 1) for one layer, read straight from the cache.

    Called by ``MultiHeadAttention`` with the step's queries q [N, H, 1, Dh] and, for
    self-attention, the new keys/values [N, H, 1, Dh], which are first written at each row's own
    position. Each row attends to its own keys only, as the plan says (padded or packed; keys beyond
    a row's own length get zero weight). Cross-attention reads each source once: the hypotheses of
    one beam (``share`` = (sources U, most rows per source k, flat index of each row in [U x k]))
    become k queries against it. Returns (out [N, H, 1, Dh], weights [N, H, 1, T_k] zero-padded to
    the longest row, or None).
    """

    def __init__(self, cache: KVCache, layer: int, slots: Tensor, write_at: Optional[Tensor], plan: AttentionPlan,
                 share: Optional[tuple[int, int, Tensor]] = None):
        self.cache, self.layer, self.write_at, self.plan = cache, layer, write_at, plan
        self.share = share
        self.self_attention = write_at is not None    # MultiHeadAttention projects new K/V only then

    def __call__(self, q: Tensor, k_new: Optional[Tensor], v_new: Optional[Tensor],
                 need_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        c, layer = self.cache, self.layer
        if self.self_attention:
            K, V = c.self_k[layer], c.self_v[layer]                    # [N_slots, T_max, H, Dh]
            K.view(-1, *K.shape[2:]).index_copy_(0, self.write_at, k_new[:, :, 0])
            V.view(-1, *V.shape[2:]).index_copy_(0, self.write_at, v_new[:, :, 0])
        else:
            K, V = c.cross_k[layer], c.cross_v[layer]
        if self.share is None:
            out, w = self._attend(K, V, q.transpose(1, 2), need_weights)       # [N, 1, H, Dh]
            return out.transpose(1, 2), w
        U, k, flat = self.share
        N, H, _, Dh = q.shape
        qg = q.new_zeros(U * k, H, Dh).index_copy_(0, flat, q[:, :, 0])       # rows -> [source, hypothesis]
        out, w = self._attend(K, V, qg.view(U, k, H, Dh), need_weights)       # [U, k, H, Dh]
        out = out.reshape(U * k, H, Dh).index_select(0, flat)[:, :, None]
        if w is not None:
            w = w.transpose(1, 2).reshape(U * k, H, -1).index_select(0, flat)[:, :, None]
        return out, w

    def _attend(self, K: Tensor, V: Tensor, q: Tensor, need_weights: bool) -> tuple[Tensor, Optional[Tensor]]:
        """q [R, Q, H, Dh] for the plan's R rows -> (out [R, Q, H, Dh], weights [R, H, Q, T] or None)."""
        p = self.plan
        R, Q, H, Dh = q.shape
        if not p.packed:
            k, v = KVCache.read(K, p.rows, p.max_len), KVCache.read(V, p.rows, p.max_len)
            out, w = scaled_dot_product_attention(q.transpose(1, 2), k, v, p.mask, 0.0, need_weights)
            return out.transpose(1, 2), w
        if p.kernel and not (torch.is_grad_enabled() and q.requires_grad):
            out, w = kernels.packed_decode_attention(q, K.view(-1, H, Dh), V.view(-1, H, Dh), p.key_index,
                                                     p.starts, p.max_len, need_weights)
            return out, (w.transpose(1, 2) if w is not None else None)
        T = p.max_len
        k = K.view(-1, H, Dh).index_select(0, p.key_index)[:, None]            # [NK, 1, H, Dh]
        v = V.view(-1, H, Dh).index_select(0, p.key_index)[:, None]
        qs = (q * Dh ** -0.5).index_select(0, p.row_of_key)                     # [NK, Q, H, Dh]
        scores = q.new_full((R * T, Q, H), float("-inf"))
        scores.index_copy_(0, p.pad_index, (k * qs).sum(-1))                  # [R*T, Q, H]
        w = torch.softmax(scores.view(R, T, Q, H), dim=1)                      # eq. 1, per row over its keys
        wk = w.view(R * T, Q, H).index_select(0, p.pad_index)[..., None]       # [NK, Q, H, 1]
        out = q.new_zeros(R, Q, H, Dh).index_add_(0, p.row_of_key, wk * v)    # [R, Q, H, Dh]
        return out, (w.permute(0, 3, 2, 1) if need_weights else None)
