"""The scheduler's KV-block accounting without a model (model.inference.slots.BlockPool): admission by free
blocks, growth block by block, preemption of the newest requests and requeueing at the head, refusal
of a request that could never fit, and no block leaked."""
from __future__ import annotations

import pytest

from model.inference.slots import BlockPool, CacheFullError
from service.engine.scheduler import EngineConfig, EngineValidationError, ScheduledRequest, Scheduler


class PagedSim:
    """Drives a Scheduler like the engine and takes blocks like the paged cache does (independently
    of the scheduler's own count): a request's source takes ceil(S / B) blocks at its prefill, its
    first hypothesis writes position 0 there too, the others from position 1, each hypothesis one
    block per B positions. A request finishes after ``length`` positions."""

    def __init__(self, num_blocks, block_size=4, num_slots=64, **cfg):
        self.pool = BlockPool(num_slots, num_blocks, block_size)
        self.sched = Scheduler(EngineConfig(max_num_seqs=num_slots, **cfg), self.pool)
        self.length, self.pos, self.own = {}, {}, {}
        self.done: list[int] = []
        self.plans = []

    def add(self, rid, src=6, beam=1, length=10, group=None):
        self.sched.add(ScheduledRequest(rid, src, beam, max_new_tokens=length, group=group))
        self.length[rid] = length

    def write(self, req, pos):
        """Each hypothesis that writes position pos takes a block when pos starts a new one."""
        B = self.pool.block_size
        for i, slot in enumerate(req.slots):
            if pos == 0 and i > 0:
                continue
            if self.own.get(slot, 0) <= pos // B:
                self.pool.take([slot])          # raises CacheFullError if the scheduler miscounted
                self.own[slot] = self.own.get(slot, 0) + 1

    def step(self):
        plan = self.sched.schedule()
        self.plans.append(plan)
        for r in plan.preempted:
            for s in r.slots:
                self.own.pop(s, None)
        for r in plan.prefill:
            for s in r.slots:
                self.own[s] = 0
            self.pool.take([r.slots[0]] * self.pool.blocks_for(r.num_src_tokens))
            self.pos[r.request_id] = 0
            self.write(r, 0)
        for r in plan.decode:
            self.pos[r.request_id] += 1
            self.write(r, self.pos[r.request_id])
        for r in plan.prefill + plan.decode:
            if self.pos[r.request_id] + 1 >= self.length[r.request_id]:
                self.sched.finish(r.request_id)
                self.done.append(r.request_id)
        held = sum(len(b) for b in self.pool.held.values())
        assert held + self.pool.num_free_blocks == self.pool.num_blocks
        return plan

    def run(self, limit=500):
        for _ in range(limit):
            if not (self.sched.running or self.sched.waiting):
                return
            self.step()
        raise AssertionError("did not finish")


def test_admission_is_by_free_blocks_not_free_slots():
    sim = PagedSim(num_blocks=30, block_size=4, num_slots=64, policy="prefill_first")
    for rid in range(10):
        sim.add(rid, src=8, beam=1, length=3)      # 2 source blocks + 1 target block each
    plan = sim.step()
    # 64 slots would admit all 10; 30 blocks less the 1-block reserve admit 9 (3 blocks each)
    assert len(plan.prefill) == 9 and sim.sched.num_waiting == 1
    assert sim.pool.num_free_blocks == 30 - 27
    sim.run()
    assert sorted(sim.done) == list(range(10))
    assert sim.pool.num_free_blocks == 30 and sim.pool.num_free == 64 and sim.pool.held == {}


def test_growth_preempts_the_newest_and_requeues_it_at_the_head():
    sim = PagedSim(num_blocks=24, block_size=4, policy="prefill_first")
    for rid in range(3):
        sim.add(rid, src=4, beam=2, length=20)     # 1 + 2 blocks at admission, 1 + 2 * 5 at the end
    sim.add(3, src=4, beam=1, length=2)
    first = sim.step()
    assert [r.request_id for r in first.prefill] == [0, 1, 2, 3]
    preempted = []
    while sim.sched.running or sim.sched.waiting:
        plan = sim.step()
        if plan.preempted:
            preempted += [r.request_id for r in plan.preempted]
            # the newest running requests go, to the head of the queue, oldest first
            assert [r.request_id for r in list(sim.sched.waiting)[:len(plan.preempted)]] == \
                sorted(r.request_id for r in plan.preempted)
            assert 0 not in preempted                # the oldest is never preempted
    assert preempted and sorted(sim.done) == [0, 1, 2, 3]
    assert sim.sched.num_preemptions == len(preempted)
    assert sim.pool.num_free_blocks == 24 and sim.pool.held == {}


def test_a_request_that_could_never_fit_is_refused_and_cancellation_frees_blocks():
    sim = PagedSim(num_blocks=12, block_size=4)
    with pytest.raises(EngineValidationError, match="needs up to 14 KV-cache blocks, the engine has 12"):
        sim.add(0, src=8, beam=4, length=12)       # 2 + 4 * 3 = 14 blocks > 12
    sim.add(1, src=8, beam=2, length=12)           # 2 + 2 * 3 = 8 fit
    sim.add(2, src=4, beam=1, length=12)
    sim.step()
    sim.step()
    assert sim.pool.num_free_blocks < 12
    for rid in (1, 2):
        sim.sched.finish(rid)                      # cancelled mid-decode
    assert sim.pool.num_free_blocks == 12 and sim.pool.num_free == sim.pool.num_slots


def test_block_pool_errors_and_usage():
    pool = BlockPool(num_slots=3, num_blocks=4, block_size=2)
    a = pool.allocate(2)
    assert pool.take([a[0], a[0], a[1]]) == [0, 1, 2] and pool.block_usage == pytest.approx(0.75)
    with pytest.raises(CacheFullError, match="asked for 2 KV blocks, 1 free of 4"):
        pool.take(a)
    with pytest.raises(ValueError):
        pool.take([2])                             # slot 2 is not allocated
    freed = []
    pool.on_free = freed.append
    pool.free([a[0]])
    assert pool.num_free_blocks == 3 and freed == [[a[0]]] and pool.blocks_for(5) == 3
    with pytest.raises(ValueError):
        BlockPool(2, 4, 0)


def test_preemption_with_groups_requeues_at_the_head_and_leaves_no_bookkeeping():
    """The sentences of two API requests (groups) under block pressure: preempted ones go back to
    the head whatever their group's turn, everyone finishes, no block and no group entry is left."""
    sim = PagedSim(num_blocks=24, block_size=4, policy="prefill_first")
    for rid in range(4):
        sim.add(rid, src=4, beam=2, length=20, group="long")
    for rid in range(4, 7):
        sim.add(rid, src=4, beam=1, length=3, group="short")
    preempted = []
    while sim.sched.running or sim.sched.waiting:
        plan = sim.step()
        if plan.preempted:
            preempted += [r.request_id for r in plan.preempted]
            head = [r.request_id for r in list(sim.sched.waiting)[:len(plan.preempted)]]
            assert head == sorted(r.request_id for r in plan.preempted)
        assert len(sim.plans) < 500
    assert preempted and sorted(sim.done) == list(range(7))
    assert sim.sched._groups == {} and sim.pool.num_free_blocks == 24 and sim.pool.held == {}
