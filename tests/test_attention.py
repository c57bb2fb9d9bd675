"""Scaled dot-product and multi-head attention (model/attention.py)."""
from __future__ import annotations

import torch

from model.attention import MultiHeadAttention, scaled_dot_product_attention
from model.transformer import causal_mask


def test_attention_rows_sum_to_one_and_ignore_padding():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([5, 2])
    mask = (torch.arange(5)[None] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, T_k]
    out, w = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert w.shape == (2, 3, 5, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))
    assert torch.all(w[1, :, :, 2:] == 0.0)  # exactly zero on padding keys
    # the fused path (no weights) gives the same output
    fused, none = scaled_dot_product_attention(q, k, v, mask)
    assert none is None
    torch.testing.assert_close(fused, out)


def test_multi_head_attention_returns_per_head_weights():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = causal_mask(6)
    out, w = mha(x, mask=mask, need_weights=True)
    assert out.shape == (2, 6, 16) and w.shape == (2, 4, 6, 6)
    assert torch.all(w.triu(1) == 0)  # causal: no weight on future positions
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6, dtype=torch.float64))


def test_self_attention_without_positions_is_permutation_equivariant():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).double()
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    perm = torch.randperm(7)
    out, _ = mha(x)
    out_perm, _ = mha(x[:, perm])
    torch.testing.assert_close(out_perm, out[:, perm])
