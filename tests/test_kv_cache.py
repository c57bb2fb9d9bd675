"""The KV cache's storage (model/inference/kv_cache.py): its slots, beam reorders (direct and indirect)."""
from __future__ import annotations

import pytest
import torch

from model.inference.generate import generate
from model.inference.kv_cache import CacheFullError, KVCache
from tiny_model import make_model, rand_source


def test_kv_cache_slots_allocate_free_reuse():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=4, max_tgt_len=8, max_src_len=8)
    a = cache.slots.allocate(3)
    assert cache.slots.num_free == 1 and cache.slots.usage == pytest.approx(0.75)
    with pytest.raises(CacheFullError):
        cache.slots.allocate(2)
    cache.slots.free(a[:2])
    b = cache.slots.allocate(2)
    assert sorted(b) == sorted(a[:2])  # freed slots are reused
    with pytest.raises(ValueError):
        cache.slots.free([b[0], b[0]])


def test_kv_cache_reorder_copies_self_attention_rows():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=3, max_tgt_len=4, max_src_len=4)
    for s in range(3):
        cache.self_k[:, s] = s
        cache.cross_k[:, s] = 10 + s
    cache.reorder([0, 1, 2], [2, 2, 0], length=3)
    assert torch.all(cache.self_k[:, 0, :3] == 2) and torch.all(cache.self_k[:, 1, :3] == 2)  # [L, N, T, H, Dh]
    assert torch.all(cache.self_k[:, 2, :3] == 0)
    assert torch.all(cache.self_k[:, 2, 3] == 2)  # beyond length: untouched
    assert torch.all(cache.cross_k[:, 1] == 11)      # cross K/V are shared by a beam, not moved


def test_indirect_cache_reorder_moves_slot_ids_and_decodes_the_same():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=3, max_tgt_len=4, max_src_len=4, indirect=True)
    cache.self_k.normal_()
    before = cache.self_k.clone()
    cache.reorder([0, 1, 2], [2, 2, 0], length=3)
    assert torch.equal(cache.self_k, before)                     # no K/V copied ...
    assert cache.home[:, :3].tolist() == [[2] * 3, [2] * 3, [0] * 3] and cache.home[:, 3].tolist() == [0, 1, 2]
    assert cache.redirected.tolist() == [True, True, True]   # ... so attention follows the table
    sources = [rand_source(n, n) for n in (3, 9, 14)]
    direct = generate(model, sources, beam_size=4, n_best=4, max_new_tokens=12,
                      cache=KVCache.for_model(model, num_slots=12))
    indirect = generate(model, sources, beam_size=4, n_best=4, max_new_tokens=12,
                        cache=KVCache.for_model(model, num_slots=12, indirect=True))
    assert [[h.tokens for h in x] for x in direct] == [[h.tokens for h in x] for x in indirect]
    for a, b in zip(direct, indirect):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-10)


def test_plan_step_writes_the_indirection_table_and_checks_lengths():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=3, max_tgt_len=4, max_src_len=4, indirect=True)
    cache.reorder([0, 1, 2], [2, 2, 0], length=3)            # every history now read from another slot
    hooks = cache.plan_step(torch.tensor([0, 1]), torch.tensor([0, 2]), packed=True)
    assert len(hooks) == model.cfg.n_decoder_layers
    assert all(s.self_attention and not c.self_attention for s, c in hooks)
    # each row's K/V of its own position will be written in its own slot ...
    assert cache.home.tolist() == [[0, 2, 2, 0], [2, 2, 1, 1], [0, 0, 0, 2]]
    assert cache.redirected.tolist() == [False, True, True]  # ... and a row at position 0 starts a new history
    with pytest.raises(ValueError, match="max_tgt_len"):
        cache.plan_step(torch.tensor([0]), torch.tensor([4]))
    direct = KVCache.for_model(model, num_slots=2, max_tgt_len=4, max_src_len=4)
    assert len(direct.plan_step(torch.tensor([1]), torch.tensor([3]))) == model.cfg.n_decoder_layers
    assert direct.home is None
