"""The one slot allocator (model/inference/slots.py): lowest ids first, errors, and no torch."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from model.inference.slots import CacheFullError, SlotPool


def test_lowest_free_ids_are_handed_out_first_and_reused():
    pool = SlotPool(6)
    assert (pool.num_slots, pool.num_free, pool.usage) == (6, 6, 0.0)
    a, b = pool.allocate(2), pool.allocate(3)
    assert a == [0, 1] and b == [2, 3, 4]
    assert pool.num_free == 1 and pool.usage == pytest.approx(5 / 6)
    pool.free([3, 0])
    assert pool.num_free == 3
    assert pool.allocate(2) == [0, 3]      # the lowest free ids, ascending
    assert pool.allocate(1) == [5]
    assert pool.allocate(0) == []


def test_full_pool_raises_cache_full_error_and_keeps_its_slots():
    pool = SlotPool(3)
    pool.allocate(2)
    with pytest.raises(CacheFullError, match="asked for 2 slots, 1 free of 3"):
        pool.allocate(2)
    assert issubclass(CacheFullError, RuntimeError)
    assert pool.num_free == 1 and pool.allocate(1) == [2]


@pytest.mark.parametrize("bad", [[1], [0, 0], [5], [-1], [0, 1]])
def test_freeing_a_slot_that_is_not_held_raises_and_frees_nothing(bad):
    pool = SlotPool(5)
    pool.allocate(1)                        # slot 0 held, 1..4 free
    with pytest.raises(ValueError):
        pool.free(bad)
    assert pool.num_free == 4               # nothing was freed, not even slot 0 of [0, 1]
    pool.free([0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0])                      # double free


def test_empty_pool():
    pool = SlotPool(0)
    assert pool.num_free == 0 and pool.usage == 0.0
    with pytest.raises(CacheFullError):
        pool.allocate(1)
    with pytest.raises(ValueError):
        SlotPool(-1)


def test_the_kv_cache_owns_one_pool_and_reexports_its_error():
    import model.inference.kv_cache as kv_cache
    from tiny_model import make_model
    cache = kv_cache.KVCache.for_model(make_model(), num_slots=4, max_tgt_len=4, max_src_len=4)
    assert isinstance(cache.slots, SlotPool) and cache.slots.num_slots == 4 and cache.slots.num_free == 4
    assert kv_cache.CacheFullError is CacheFullError


def test_slots_module_imports_no_torch():
    tree = ast.parse(Path(__file__).resolve().parents[1].joinpath("model", "inference", "slots.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or "").split(".")[0])
    assert names <= {"__future__", "typing"}, names
