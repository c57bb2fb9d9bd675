"""The decode step's attention plan (model/inference/attention_plan.py): padded, packed and compiled attention agree."""
from __future__ import annotations

import pytest
import torch

from model.inference.attention_plan import AttentionPlan


@pytest.mark.parametrize("n_queries", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_attention_equals_padded_and_ignores_other_rows_keys(n_queries, dtype):
    """Padded SDPA, eager packed and (where it builds) the compiled kernel give the same attention."""
    from model.inference import kernels
    torch.manual_seed(0)
    H, Dh, stride = 2, 4, 9
    K, V = torch.randn(6, stride, H, Dh, dtype=dtype), torch.randn(6, stride, H, Dh, dtype=dtype)
    slots, lengths = torch.tensor([4, 0, 5]), torch.tensor([2, 9, 5])
    q = torch.randn(3, n_queries, H, Dh, dtype=dtype)
    plans = {"padded": AttentionPlan(slots, lengths, stride), "packed": AttentionPlan(slots, lengths, stride, True)}
    assert not plans["padded"].packed and plans["packed"].packed and not plans["packed"].kernel
    if kernels.decode_attention() is not None:
        plans["kernel"] = AttentionPlan(slots, lengths, stride, True, kernel=True)
    results = {}
    for name, plan in plans.items():
        results[name] = plan.attend(K, V, q, need_weights=True)
    out_d, w_d = results.pop("padded")
    for name, (out, w) in results.items():
        torch.testing.assert_close(out, out_d, msg=name)
        torch.testing.assert_close(w, w_d, msg=name)
        assert w.shape == (3, H, n_queries, 9)
        torch.testing.assert_close(w.sum(-1), torch.ones(3, H, n_queries, dtype=dtype))
        assert torch.all(w[0, ..., 2:] == 0) and torch.all(w[2, ..., 5:] == 0)  # nobody reads past its length
    K[4, 2:] = 1e6                                                             # garbage past row 0's keys
    for name, (out, _) in results.items():
        torch.testing.assert_close(plans[name].attend(K, V, q, False)[0], out, msg=name)


def test_paged_plan_compiled_index_equals_the_tensor_ops(monkeypatch):
    """A paged cache's plan (block table) built by the compiled ``paged_key_index`` has the key rows
    and starts of the tensor-op construction, for ragged lengths (a zero-length row, rows ending on and
    inside a block boundary); row_of_key and pad_index, computed on demand, agree too; bad slots and
    lengths that overrun a table row are refused."""
    from model.inference import kernels
    if kernels.paged_key_index_op() is None:
        pytest.skip("compiled kernels unavailable here")
    g = torch.Generator().manual_seed(3)
    B, per_slot = 4, 5
    table = torch.randperm(40, generator=g)[: 6 * per_slot].view(6, per_slot)
    slots, lengths = torch.tensor([5, 0, 3, 2, 4]), torch.tensor([4, 0, 17, 1, 8])
    fast = AttentionPlan(slots, lengths, 0, True, kernel=True, table=table, block_size=B)
    monkeypatch.setitem(kernels._loaded, "paged_key_index", None)
    ref = AttentionPlan(slots, lengths, 0, True, kernel=True, table=table, block_size=B)
    assert torch.equal(fast.key_index, ref.key_index) and torch.equal(fast.starts, ref.starts)
    assert fast.starts.tolist() == [0, 4, 4, 21, 22, 30] and fast.max_len == 17
    assert fast.key_index[4 + 16].item() == table[3, 4].item() * B + 0       # row 2, position 16
    assert torch.equal(fast.row_of_key, ref.row_of_key) and torch.equal(fast.pad_index, ref.pad_index)
    op = kernels._module().paged_key_index
    with pytest.raises(RuntimeError, match="outside"):
        op(torch.tensor([6]), torch.tensor([1]), table, B)
    with pytest.raises(RuntimeError, match="at most 20"):
        op(torch.tensor([1]), torch.tensor([21]), table, B)
