"""Scaled dot-product and multi-head attention (Vaswani et al., 2017, sections 3.2.1-3.2.2)."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Attention done by a hook instead of over a padded batch: an incremental decoding step read from a KV
# cache or a packed batch of sequences (both in ``model/inference/``):
# (q [B, H, 1, Dh], k_new, v_new [B, H, 1, Dh] or None, need_weights) -> (out [B, H, 1, Dh], weights or None).
# Its ``self_attention`` attribute says whether the new keys/values of x must be projected and passed.
CacheAttend = Callable[[Tensor, Optional[Tensor], Optional[Tensor], bool], tuple[Tensor, Optional[Tensor]]]


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
    dropout_p: float = 0.0, need_weights: bool = False, bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """softmax(Q Kᵀ / √d_k) V  (paper eq. 1); softmax(Q Kᵀ · scale + bias) V with ``scale`` / ``bias`` (T5).

    Args:
        q: [B, H, T_q, Dh] queries; k, v: [B, H, T_k, Dh] keys and values.
        mask: bool, broadcastable to [B, H, T_q, T_k]; True marks keys that may be attended to.
            Masked keys get exactly zero weight. Every query row must keep at least one key.
        dropout_p: dropout on the attention weights (training only).
        need_weights: also return the weights [B, H, T_q, T_k] (each row sums to 1). This takes the
            explicit path; otherwise PyTorch's fused kernel is used and None is returned.
        bias: float, broadcastable to [B, H, T_q, T_k], added to the logits (relative positions).
        scale: the logits' factor (default 1/√d_k; T5: 1.0).
    Returns:
        (out [B, H, T_q, Dh], weights or None)
    """
    if bias is not None:   # one float mask: the bias, -inf where masked
        mask = bias if mask is None else torch.where(mask, bias, float("-inf"))
    if not need_weights:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale), None
    scores = torch.matmul(q, k.transpose(-2, -1))                          # [B, H, T_q, T_k]
    scores = scores / math.sqrt(q.size(-1)) if scale is None else scores * scale
    if bias is not None:
        scores, mask = scores + mask, None
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    attn = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return torch.matmul(attn, v), weights


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O with head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i).

    The per-head projections W^Q_i are the row blocks of one [d_model, d_model] matrix; W^K and W^V
    are fused into one [2 d_model, d_model] matrix. Used for encoder self-attention, masked decoder
    self-attention and encoder-decoder (cross) attention (section 3.2.3).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, d_head: int = 0, bias: bool = True,
                 scale: Optional[float] = None):
        """``d_head``: head width (default d_model / n_heads; T5's d_kv, n_heads·d_head need not be
        d_model); ``bias``: biases in the projections; ``scale``: the logits' factor (None: 1/√d_head)."""
        super().__init__()
        if not d_head and d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_head or d_model // n_heads
        self.inner = n_heads * self.d_head
        self.dropout, self.scale = dropout, scale
        self.w_q = nn.Linear(d_model, self.inner, bias=bias)
        self.w_kv = nn.Linear(d_model, 2 * self.inner, bias=bias)
        self.w_o = nn.Linear(self.inner, d_model, bias=bias)

    def _heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # [B, H, T, Dh]

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [B, H, T, Dh] for the sequence x [B, T, d_model]."""
        k, v = self.w_kv(x).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def forward(
        self, x: Tensor, memory: Optional[Tensor] = None, mask: Optional[Tensor] = None,
        kv: Optional[tuple[Tensor, Tensor]] = None, cache_attend: Optional[CacheAttend] = None,
        need_weights: bool = False, bias: Optional[Tensor] = None,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Attend from x [B, T_q, d_model]; ``bias`` [B or 1, H, T_q, T_k] is added to the logits.

        Keys/values come from, in order of precedence: ``cache_attend`` (an incremental decoding
        step, T_q = 1: the cache stores this step's self-attention K/V and attends over each row's
        own keys; ``mask`` is unused); ``kv`` (precomputed K/V [B, H, T_k, Dh]); ``memory``
        [B, T_k, d_model]; or x itself (self-attention). mask: bool, broadcastable to
        [B, H, T_q, T_k], True = attend.
        Returns (out [B, T_q, d_model], weights [B, H, T_q, T_k] or None).
        """
        B, T, _ = x.shape
        q = self._heads(self.w_q(x))  # [B, H, T_q, Dh]
        if cache_attend is not None:
            k_new, v_new = self.project_kv(x) if cache_attend.self_attention else (None, None)
            extra = {} if bias is None and self.scale is None else {"bias": bias, "scale": self.scale}
            out, weights = cache_attend(q, k_new, v_new, need_weights, **extra)
        else:
            k, v = kv if kv is not None else self.project_kv(x if memory is None else memory)
            p = self.dropout if self.training else 0.0
            out, weights = scaled_dot_product_attention(q, k, v, mask, p, need_weights, bias, self.scale)
        out = out.transpose(1, 2).reshape(B, T, self.inner)  # [B, T_q, H·Dh]
        return self.w_o(out), weights


def relative_position_bucket(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucket of each relative position (key - query, long): exact buckets for small distances,
    logarithmic ones up to ``max_distance``, the last bucket beyond; bidirectional (encoder) uses
    half the buckets for keys after the query, causal (decoder) only keys at or before it."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)
    exact = num_buckets // 2
    large = exact + (torch.log(relative.float() / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(relative < exact, relative, large)


class RelativePositionBias(nn.Module):
    """Learned per-head biases of relative-position buckets (T5), computed once per stack and added to
    every layer's self-attention logits. ``table`` [num_buckets, n_heads]."""

    def __init__(self, num_buckets: int, max_distance: int, n_heads: int, bidirectional: bool):
        super().__init__()
        self.table = nn.Embedding(num_buckets, n_heads)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def forward(self, query_positions: Tensor, key_length: int) -> Tensor:
        """query_positions [B, T_q] (long) over keys at positions 0..key_length-1 -> bias [B, H, T_q, T_k]."""
        keys = torch.arange(key_length, device=query_positions.device)
        bucket = relative_position_bucket(keys[None, None, :] - query_positions[:, :, None], self.bidirectional,
                                          self.num_buckets, self.max_distance)      # [B, T_q, T_k]
        return self.table(bucket).permute(0, 3, 1, 2)
