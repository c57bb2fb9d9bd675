"""The paged KV cache (model/inference/paged_cache.py) against the contiguous one, and the engine on it:
same outputs for mixed lengths, beams, preemption and cancellations, and no block leaked."""
from __future__ import annotations

import asyncio

import pytest
import torch

from model.inference.generate import generate
from model.inference.kv_cache import CacheFullError, KVCache
from model.inference.paged_cache import PagedKVCache, allocate_blocks, default_num_blocks
from model.inference.slots import BlockUpdate
from service.engine import Engine, EngineConfig, EngineValidationError, GenerationOptions
from service.engine.records import ScheduledRequest
from service.engine.scheduler import Scheduler
from tiny_model import make_engine_model, one_thread, rand_source  # noqa: F401 (one_thread: autouse fixture)


@pytest.fixture(scope="module")
def model():
    return make_engine_model(torch.float64)


def tokens(results):
    return [[h.tokens for h in r] for r in results]


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_paged_generate_equals_contiguous_and_frees_every_block(model, beam, block_size):
    sources = [rand_source(n, 7 * n) for n in (2, 5, 11, 17, 30)]
    budgets = [3, 25, 9, 40, 17]
    ref = generate(model, sources, beam, beam, budgets, cache=KVCache.for_model(model, 5 * beam, indirect=beam > 1))
    cache = PagedKVCache.for_model(model, 5 * beam, num_blocks=400, block_size=block_size)
    got = generate(model, sources, beam, beam, budgets, cache=cache)
    assert tokens(got) == tokens(ref)
    for a, b in zip(got, ref):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-12)
    assert cache.slots.num_free_blocks == cache.slots.num_blocks == 400   # every block back
    assert cache.slots.num_free == cache.slots.num_slots and cache.slots.held == {}


def test_paged_equals_contiguous_on_the_eager_path_too(model, monkeypatch):
    from model.inference import kernels
    monkeypatch.setitem(kernels._loaded, "decode_attention", None)   # no compiled kernel: eager attention
    sources = [rand_source(n, 3 * n) for n in (4, 13, 21)]
    ref = generate(model, sources, 2, 2, 20, cache=KVCache.for_model(model, 6))
    cache = PagedKVCache.for_model(model, 6, num_blocks=100, block_size=3)
    assert not cache.kernel_ok()
    got = generate(model, sources, 2, 2, 20, cache=cache)
    assert tokens(got) == tokens(ref)
    for a, b in zip(got, ref):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-10)
    assert cache.slots.num_free_blocks == 100


def test_blocks_follow_lengths_and_a_beam_shares_its_source_blocks(model):
    B, S = 4, 10
    cache = PagedKVCache.for_model(model, num_slots=8, num_blocks=64, block_size=B)
    slots = cache.slots.allocate(4)                        # one beam-4 sentence
    src = torch.tensor([rand_source(S, 1)])
    from model.inference.prefill import prefill
    with pytest.raises(ValueError, match="no KV block assigned for source"):
        prefill(model, cache, torch.tensor([slots]), src)  # the cache never allocates
    assert cache.slots.num_free_blocks == 64
    allocate_blocks(cache, [slots], 0, [S])                # the source, and position 0 of every hypothesis
    prefill(model, cache, torch.tensor([slots]), src)      # source + the first (BOS) step of slot 0
    assert 64 - cache.slots.num_free_blocks == cache.slots.blocks_for(S) + len(slots) == 7
    assert set(cache.slots.source) == {slots[0]} and cache.slots.held[slots[0]]   # source held once
    assert (cache.src_table[slots[1:]] == -1).all() and (cache.table[slots, 0] >= 0).all()
    before = cache.k.clone()
    cache.reorder(slots, [0, 0, 0, 0], length=1)           # every hypothesis descends from slot 0
    assert torch.equal(cache.k, before)                    # a reorder moves slot ids, never K/V
    for pos in range(1, 9):                                # 8 more positions, all 4 hypotheses
        if pos % B == 0:
            with pytest.raises(ValueError, match=f"no KV block assigned for target positions \\[{pos}, {pos}"):
                cache.plan_step(torch.tensor(slots), torch.full((4,), pos))
        allocate_blocks(cache, [slots], pos)
        cache.plan_step(torch.tensor(slots), torch.full((4,), pos))
        # every hypothesis: ceil((pos + 1) / B) blocks
        expect = 3 + sum(cache.slots.blocks_for(pos + 1) for _ in slots)
        assert 64 - cache.slots.num_free_blocks == expect
    with pytest.raises(CacheFullError):
        cache.slots.allocate_target([slots[0]], 400)
    cache.slots.free(slots)
    cache.assign_blocks(cache.slots.pop_update())
    assert cache.slots.num_free_blocks == 64 and (cache.table == -1).all() and (cache.src_table == -1).all()


def test_the_tables_mirror_the_schedulers_blocks_without_a_model():
    """A scheduler over a paged cache's pool, its updates applied as the runner applies them: every
    table row is exactly its slot's blocks (-1 beyond), through admissions, growth, cancellations
    and preemptions; the cache's own pool is never asked for anything but by the scheduler."""
    B = 2
    cache = PagedKVCache(1, 1, 2, num_slots=12, num_blocks=30, block_size=B, max_tgt_len=20, max_src_len=8)
    sched = Scheduler(EngineConfig(max_num_seqs=12, policy="prefill_first"), cache.slots)
    length = {}
    for rid in range(8):
        sched.add(ScheduledRequest(rid, 2 + rid % 5, 1 + rid % 3, max_new_tokens=6 + 2 * (rid % 4)))
        length[rid] = 6 + 2 * (rid % 4)
    preempted = 0
    for _ in range(200):
        if not (sched.running or sched.waiting):
            break
        plan = sched.schedule()
        preempted += len(plan.preempted)
        cache.assign_blocks(plan.blocks)
        for s in range(12):
            target, source = cache.slots.target.get(s, []), cache.slots.source.get(s, [])
            assert cache.table[s].tolist() == target + [-1] * (cache.table.size(1) - len(target))
            assert cache.src_table[s].tolist() == source + [-1] * (cache.src_table.size(1) - len(source))
        for r in plan.prefill + plan.decode:
            p = sched.position(r)
            cache._write_rows(torch.tensor(r.slots), torch.full((r.num_slots,), p))   # raises where unassigned
            if p + 1 >= length[r.request_id] or (p == 3 and r.request_id == 5):       # finished / cancelled
                sched.finish(r.request_id)
    assert not sched.running and not sched.waiting and preempted > 0
    cache.assign_blocks(cache.slots.pop_update())
    assert (cache.table == -1).all() and (cache.src_table == -1).all() and cache.slots.num_free_blocks == 30


def test_assign_blocks_and_the_missing_block_error():
    cache = PagedKVCache(1, 1, 2, num_slots=4, num_blocks=8, block_size=2, max_tgt_len=6, max_src_len=4)
    cache.assign_blocks(BlockUpdate(source=[(1, 0, 5), (1, 1, 6)], target=[(1, 0, 2), (3, 0, 7)]))
    assert cache.src_table[1].tolist() == [5, 6] and cache.table[:, 0].tolist() == [-1, 2, -1, 7]
    assert cache._write_rows(torch.tensor([1, 3]), torch.tensor([1, 0])).tolist() == [2 * 2 + 1, 7 * 2]
    with pytest.raises(ValueError, match=r"no KV block assigned for target positions \[2\] of slots \[1\]"):
        cache._write_rows(torch.tensor([3, 1]), torch.tensor([1, 2]))
    cache.assign_blocks(BlockUpdate(freed=[1], target=[(1, 0, 3)]))   # freed, then a new owner's block
    assert cache.src_table[1].tolist() == [-1, -1] and cache.table[1].tolist() == [3, -1, -1]


def test_default_blocks_and_bytes_are_a_fraction_of_the_contiguous_cache(model):
    cfg = model.cfg
    n = default_num_blocks(256, 16, cfg.max_len, cfg.max_len)
    assert n == max(256 * 4, -(-cfg.max_len // 16) * 17)
    assert default_num_blocks(4, 16, cfg.max_len, cfg.max_len) == -(-cfg.max_len // 16) * 5   # one full beam of 4
    paged = PagedKVCache.for_model(model, 256, num_blocks=n, block_size=16)
    contiguous_per_slot = 4 * cfg.n_decoder_layers * 2 * cfg.max_len * cfg.d_model * 8
    assert paged.nbytes == 2 * cfg.n_decoder_layers * n * 16 * cfg.d_model * 8
    assert paged.nbytes <= 0.25 * 256 * contiguous_per_slot


def run(engine, requests, cancel=()):
    async def main():
        await engine.start()
        tasks = [asyncio.ensure_future(engine.translate(s, o)) for s, o in requests]
        for _ in range(6):
            await asyncio.sleep(0)
        for i in cancel:
            tasks[i].cancel()
        out = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)
        stats = engine.stats()
        await engine.stop()
        return out, stats
    return asyncio.run(main())


def mixed(n, seed=0):
    return [(rand_source(3 + (i * 7) % 19, seed + i),
             GenerationOptions(beam_size=(1, 4, 2)[i % 3], n_best=1, max_new_tokens=6 + (i * 5) % 30))
            for i in range(n)]


def test_engine_preempts_when_blocks_run_out_and_outputs_stay_the_same(model):
    reqs = mixed(12)
    cfg = EngineConfig(max_num_seqs=64, kv_blocks=60, kv_block_size=4, policy="prefill_first")
    engine = Engine(model, cfg)
    steps = []
    engine.on_step = steps.append
    out, stats = run(engine, reqs)
    for (src, o), r in zip(reqs, out):
        ref = generate(model, [src], o.beam_size, o.n_best, o.max_new_tokens)[0]
        assert [h.tokens for h in r.hypotheses] == [h.tokens for h in ref]
        assert [h.score for h in r.hypotheses] == pytest.approx([h.score for h in ref], abs=1e-10)
    assert stats.preemptions > 0 and sum(s.num_preempted for s in steps) == stats.preemptions
    assert max(s.kv_cache_usage for s in steps) <= 1.0
    assert stats.free_kv_blocks == stats.kv_blocks == 60 and stats.free_slots == 64


def test_engine_cancellations_leak_no_block(model):
    reqs = mixed(10, seed=50)
    engine = Engine(model, EngineConfig(max_num_seqs=32, kv_blocks=80, kv_block_size=4))
    out, stats = run(engine, reqs, cancel=(1, 4, 7))
    assert all(isinstance(out[i], asyncio.CancelledError) for i in (1, 4, 7))
    assert sum(not isinstance(r, BaseException) for r in out) == 7
    assert stats.free_kv_blocks == stats.kv_blocks and stats.running_sequences == 0


def test_engine_streams_each_token_once_across_a_preemption(model):
    reqs = [(rand_source(5 + i, 300 + i), GenerationOptions(beam_size=1, max_new_tokens=30, min_new_tokens=30))
            for i in range(6)]

    async def main():
        engine = Engine(model, EngineConfig(max_num_seqs=16, kv_blocks=40, kv_block_size=4, policy="prefill_first"))
        await engine.start()

        async def consume(src, o):
            got = [item async for item in engine.stream(src, o)]
            return got[:-1], got[-1]
        out = await asyncio.gather(*(consume(s, o) for s, o in reqs))
        stats = engine.stats()
        await engine.stop()
        return out, stats
    out, stats = asyncio.run(main())
    assert stats.preemptions > 0
    for streamed, result in out:
        assert streamed == result.hypotheses[0].tokens and len(streamed) == 30


def test_a_request_that_can_never_fit_the_blocks_is_refused(model):
    engine = Engine(model, EngineConfig(max_num_seqs=16, kv_blocks=10, kv_block_size=4))
    with pytest.raises(EngineValidationError, match="kv_blocks") as e:
        engine.validate(rand_source(8, 1), GenerationOptions(beam_size=4, max_new_tokens=20))
    assert e.value.field == "beam_size"
    engine.validate(rand_source(8, 1), GenerationOptions(beam_size=1, max_new_tokens=20))   # 2 + 5 blocks fit
