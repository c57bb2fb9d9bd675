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
    dropout_p: float = 0.0, need_weights: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """softmax(Q Kᵀ / √d_k) V  (paper eq. 1).

    Args:
        q: [B, H, T_q, Dh] queries; k, v: [B, H, T_k, Dh] keys and values.
        mask: bool, broadcastable to [B, H, T_q, T_k]; True marks keys that may be attended to.
            Masked keys get exactly zero weight. Every query row must keep at least one key.
        dropout_p: dropout on the attention weights (training only).
        need_weights: also return the weights [B, H, T_q, T_k] (each row sums to 1). This takes the
            explicit path; otherwise PyTorch's fused kernel is used and None is returned.
    Returns:
        (out [B, H, T_q, Dh], weights or None)
    """
    if not need_weights:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p), None
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # [B, H, T_q, T_k]
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

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.dropout = dropout
        self.w_q = nn.Linear(d_model, d_model)
        self.w_kv = nn.Linear(d_model, 2 * d_model)
        self.w_o = nn.Linear(d_model, d_model)

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
        need_weights: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Attend from x [B, T_q, d_model].

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
            out, weights = cache_attend(q, k_new, v_new, need_weights)
        else:
            k, v = kv if kv is not None else self.project_kv(x if memory is None else memory)
            p = self.dropout if self.training else 0.0
            out, weights = scaled_dot_product_attention(q, k, v, mask, p, need_weights)
        out = out.transpose(1, 2).reshape(B, T, self.d_model)  # [B, T_q, d_model]
        return self.w_o(out), weights
