"""The attention plan of one decode step: which cached keys each row attends to, and the per-layer
hooks that read them straight from the ``KVCache`` (``KVCache.plan_step`` builds both).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from ..attention import RelativePositionBias, relative_position_bucket, scaled_dot_product_attention
from . import kernels

if TYPE_CHECKING:
    from .kv_cache import KVCache


def packed_positions(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """For sequences of ``lengths`` [B] stored one after another (packed, N = sum(lengths) items):
    the sequence of each item [N] and its position within that sequence [N]."""
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    return seq, torch.arange(seq.numel(), device=lengths.device) - first.index_select(0, seq)


def relative_bias_rows(rel: RelativePositionBias, positions: Tensor, T: int) -> tuple[Tensor, Tensor]:
    """T5's relative position biases in the compiled kernel's form (``kernels.packed_decode_attention``)
    for rows whose queries are at ``positions`` [R] and whose keys are positions 0..T-1 (or fewer):
    (table [2T - 1, H], the bias of each relative position -(T-1)..T-1 (key - query); start [R]
    = T - 1 - position, where row r's key 0 reads). The values of ``rel(positions, T)``, computed
    once per distance instead of once per (row, key)."""
    relative = torch.arange(1 - T, T, device=positions.device)
    table = rel.table(relative_position_bucket(relative, rel.bidirectional, rel.num_buckets, rel.max_distance))
    return table, (T - 1) - positions


def dense_bias_rows(bias: Tensor) -> tuple[Tensor, Tensor]:
    """A bias [R, H, 1, T] (one query per row, ``Transformer.self_bias``) in the compiled kernel's
    form: (table [R·T, H], start [R] = r·T)."""
    R, H, _, T = bias.shape
    table = bias[:, :, 0].transpose(1, 2).contiguous().view(R * T, H)                  # [R·T, H]
    return table, torch.arange(R, device=bias.device) * T


def contiguous_rows(slots: Tensor) -> Tensor | slice:
    """``slots`` [N] as a slice when they are consecutive ascending ids (as in a static batch, or a
    running batch without holes), so that reads are views of the cache instead of copies;
    otherwise ``slots`` itself. Either form is accepted by ``read_positions``."""
    n = slots.numel()
    if n == 0:
        return slots
    first = int(slots[0])
    if int(slots[-1]) - first != n - 1 or (n > 2 and not bool((slots.diff() == 1).all())):
        return slots
    return slice(first, first + n)


def read_positions(buf: Tensor, rows: Tensor | slice, T: int) -> Tensor:
    """Positions 0..T-1 of ``rows`` (ids [N] or a slice) of one layer's buffer [N_slots, T_max, H, Dh],
    as [N, H, T, Dh]: a view for a slice, a copy of just those positions otherwise."""
    x = buf[rows, :T] if isinstance(rows, slice) else buf[:, :T].index_select(0, rows)
    return x.transpose(1, 2)


def shared_sources(owners: Tensor) -> tuple[Tensor, Optional[tuple[int, int, Tensor]]]:
    """Cross-attention reads each source once: for rows whose cross K/V are held by ``owners`` [N]
    (the hypotheses of a beam share one), returns (the distinct owners [U], None) when all differ,
    else (owners [U], share = (U, most rows per owner k, flat index [N] of each row in [U x k]))."""
    uniq, inverse = torch.unique(owners, return_inverse=True)
    if uniq.numel() == owners.numel():
        return owners, None
    seen: dict[int, int] = {}
    within = []
    for u in inverse.tolist():
        within.append(seen.get(u, 0))
        seen[u] = within[-1] + 1
    k_max = max(seen.values())
    flat = inverse * k_max + torch.as_tensor(within, device=owners.device)
    return uniq, (uniq.numel(), k_max, flat)


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
    With ``kernel`` the compiled kernel (``model.inference.kernels``) reads the keys in place; otherwise they are
    gathered into one [NK, H, Dh] block and ``row_of_key`` [NK] and ``pad_index`` [NK]
    (= row * T + position) map each key to its row and to a padded [R, T] score grid.
    A paged cache (``PagedKVCache``) passes ``table`` [N_slots, blocks per slot] and ``block_size``:
    the key of position p of slot s is row table[s, p // block_size] * block_size + p % block_size of
    a layer's block pool viewed as rows; its plans are always packed.
    """

    def __init__(self, slots: Tensor, lengths: Tensor, stride: int, packed: bool = False,
                 home: Optional[Tensor] = None, kernel: bool = False, table: Optional[Tensor] = None,
                 block_size: int = 0):
        self.max_len = T = int(lengths.max())
        self.kernel = kernel
        self.packed = kernel or home is not None or table is not None or (packed and int(lengths.min()) < T)
        if self.packed:
            self._lengths = lengths
            self._row_of_key: Optional[Tensor] = None
            self._pos: Optional[Tensor] = None
            self._pad_index: Optional[Tensor] = None
            op = kernels.paged_key_index_op() if kernel and table is not None and home is None else None
            if (op is not None and slots.device.type == "cpu"    # one compiled pass (what the kernel reads)
                    and slots.dtype == lengths.dtype == table.dtype == torch.long):
                self.key_index, self.starts = op(slots, lengths, table, block_size)
                return
            self._row_of_key, self._pos = packed_positions(lengths)           # [NK] row of each key, its position
            pos = self._pos
            self.starts = torch.zeros(slots.numel() + 1, dtype=torch.long, device=slots.device)
            torch.cumsum(lengths, 0, out=self.starts[1:])
            slot = slots.index_select(0, self._row_of_key)
            if home is not None:  # the slot that holds each key (an indirect cache)
                slot = home.view(-1).index_select(0, slot * stride + pos)
            if table is None:
                self.key_index = slot * stride + pos
            else:  # a paged cache: the block of each key, then its place in the block
                block = table.view(-1).index_select(0, slot * table.size(1) + torch.div(pos, block_size,
                                                                                          rounding_mode="floor"))
                self.key_index = block * block_size + pos.remainder(block_size)
        else:
            self.rows = contiguous_rows(slots)
            self.mask = None if int(lengths.min()) == T else (
                torch.arange(T, device=slots.device)[None, :] < lengths[:, None])[:, None, None, :]

    @property
    def row_of_key(self) -> Tensor:
        """[NK] the row of each key (packed plans; computed on first use where the compiled pass
        made ``key_index``)."""
        if self._row_of_key is None:
            self._row_of_key, self._pos = packed_positions(self._lengths)
        return self._row_of_key

    @property
    def pad_index(self) -> Tensor:
        """[NK] each key's place (row * T + position) in a padded [R, T] score grid; only the eager
        packed path needs it (computed once, shared by every layer)."""
        if self._pad_index is None:
            self._pad_index = self.row_of_key * self.max_len + self._pos
        return self._pad_index

    def attend(self, K: Tensor, V: Tensor, q: Tensor, need_weights: bool, bias: Optional[Tensor] = None,
               scale: Optional[float] = None) -> tuple[Tensor, Optional[Tensor]]:
        """Attention of the plan's R rows over their keys in one layer's buffers K, V [N_slots, stride, H, Dh]
        (or a paged pool viewed so): q [R, Q, H, Dh] -> (out [R, Q, H, Dh], weights [R, H, Q, T] or None).
        ``bias`` [R, H, Q, T] added to the logits and ``scale`` their factor (T5; default 1/√Dh); the
        compiled kernel takes a bias of one query per row (Q = 1, self-attention) and raises ValueError
        for more."""
        R, Q, H, Dh = q.shape
        if not self.packed:
            k, v = read_positions(K, self.rows, self.max_len), read_positions(V, self.rows, self.max_len)
            out, w = scaled_dot_product_attention(q.transpose(1, 2), k, v, self.mask, 0.0, need_weights, bias, scale)
            return out.transpose(1, 2), w
        if self.kernel and not (torch.is_grad_enabled() and q.requires_grad):
            if bias is not None and Q != 1:
                raise ValueError(f"the compiled decode attention takes a relative position bias for one query "
                                 f"per row, got {Q}")
            table, start = dense_bias_rows(bias) if bias is not None else (None, None)
            out, w = kernels.packed_decode_attention(q, K.view(-1, H, Dh), V.view(-1, H, Dh), self.key_index,
                                                     self.starts, self.max_len, need_weights, scale=scale,
                                                     bias=table, bias_start=start)
            return out, (w.transpose(1, 2) if w is not None else None)
        T = self.max_len
        k = K.view(-1, H, Dh).index_select(0, self.key_index)[:, None]                 # [NK, 1, H, Dh]
        v = V.view(-1, H, Dh).index_select(0, self.key_index)[:, None]
        qs = (q * (Dh ** -0.5 if scale is None else scale)).index_select(0, self.row_of_key)  # [NK, Q, H, Dh]
        scores = q.new_full((R * T, Q, H), float("-inf"))
        dots = (k * qs).sum(-1)                                                        # [NK, Q, H]
        if bias is not None:   # each key's bias: [R, H, Q, T] -> [R*T, Q, H] rows at pad_index
            dots = dots + bias.permute(0, 3, 2, 1).reshape(R * T, Q, H).index_select(0, self.pad_index)
        scores.index_copy_(0, self.pad_index, dots)                                    # [R*T, Q, H]
        w = torch.softmax(scores.view(R, T, Q, H), dim=1)                              # eq. 1, per row over its keys
        wk = w.view(R * T, Q, H).index_select(0, self.pad_index)[..., None]            # [NK, Q, H, 1]
        out = q.new_zeros(R, Q, H, Dh).index_add_(0, self.row_of_key, wk * v)          # [R, Q, H, Dh]
        return out, (w.permute(0, 3, 2, 1) if need_weights else None)


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

    def __init__(self, cache: "KVCache", layer: int, write_at: Optional[Tensor], plan: AttentionPlan,
                 share: Optional[tuple[int, int, Tensor]] = None):
        self.cache, self.layer, self.write_at, self.plan = cache, layer, write_at, plan
        self.share = share
        self.self_attention = write_at is not None    # MultiHeadAttention projects new K/V only then

    def __call__(self, q: Tensor, k_new: Optional[Tensor], v_new: Optional[Tensor],
                 need_weights: bool = False, bias: Optional[Tensor] = None,
                 scale: Optional[float] = None) -> tuple[Tensor, Optional[Tensor]]:
        """``bias`` [N, H, 1, T_k] (self-attention; T5's relative positions) and ``scale``: see ``AttentionPlan.attend``."""
        c, layer = self.cache, self.layer
        if self.self_attention:
            K, V = c.self_k[layer], c.self_v[layer]                    # [N_slots, T_max, H, Dh]
            K.view(-1, *K.shape[2:]).index_copy_(0, self.write_at, k_new[:, :, 0])
            V.view(-1, *V.shape[2:]).index_copy_(0, self.write_at, v_new[:, :, 0])
        else:
            K, V = c.cross_k[layer], c.cross_v[layer]
        if self.share is None:
            out, w = self.plan.attend(K, V, q.transpose(1, 2), need_weights, bias, scale)   # [N, 1, H, Dh]
            return out.transpose(1, 2), w
        if bias is not None:
            raise ValueError("a shared-source (cross-attention) plan takes no position bias")
        U, k, flat = self.share
        N, H, _, Dh = q.shape
        qg = q.new_zeros(U * k, H, Dh).index_copy_(0, flat, q[:, :, 0])       # rows -> [source, hypothesis]
        out, w = self.plan.attend(K, V, qg.view(U, k, H, Dh), need_weights, None, scale)   # [U, k, H, Dh]
        out = out.reshape(U * k, H, Dh).index_select(0, flat)[:, :, None]
        if w is not None:
            w = w.transpose(1, 2).reshape(U * k, H, -1).index_select(0, flat)[:, :, None]
        return out, w
