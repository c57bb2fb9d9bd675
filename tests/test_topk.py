"""Per-row top-k of candidates (model/inference/topk.py)."""
from __future__ import annotations

import pytest
import torch

from model.inference.topk import row_topk


@pytest.mark.parametrize("vocab", [8000, 7999, 8001, 300])
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("compiled", [True, False])
def test_row_topk_equals_torch_topk(vocab, k, compiled):
    from model.inference import kernels
    if compiled and kernels.topk_op() is None:
        pytest.skip("no compiled CPU kernels here")
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(37, vocab, generator=g).log_softmax(-1)
    x[:, :3] = float("-inf")                       # masked ids (pad, BOS, EOS)
    x[0, -1] = 5.0                                 # the best id in the (shorter) last chunk
    x[1, -k:] = torch.arange(k, dtype=x.dtype) + 3  # all of the top k at the very end
    x[2, 100:100 + k] = 4.0 + torch.arange(k, dtype=x.dtype)  # all in one chunk
    v, i = row_topk(x, k, cpu_kernels=compiled)
    ref_v, ref_i = x.topk(k, dim=-1)
    assert torch.equal(v, ref_v) and torch.equal(i, ref_i)
    assert torch.equal(x.gather(1, i), v)
