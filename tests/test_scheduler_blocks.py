"""The scheduler's KV-block accounting without a model (model.inference.slots.BlockPool): admission by free
blocks, growth block by block, preemption of the newest requests and requeueing at the head, refusal
of a request that could never fit, and no block leaked."""
from __future__ import annotations

import pytest

from model.inference.slots import BlockPool, CacheFullError
from service.engine.scheduler import EngineConfig, EngineValidationError, ScheduledRequest, Scheduler


class PagedSim:
    """Drives a Scheduler like the engine and applies each step's block changes (``plan.blocks``) to a
    copy of the cache's block tables, as the runner does; then checks, independently of the
    scheduler's own count, that every position written has its block and no more are held: a
    request's source ceil(S / B) blocks in its first slot from its prefill on, each hypothesis
    position p (0 at the prefill) in entry p // B of its own table, p // B + 1 entries in all; that
    the tables hold exactly the blocks the pool does, each once; and that held + free = all.
    A request finishes after ``length`` positions."""

    def __init__(self, num_blocks, block_size=4, num_slots=64, **cfg):
        self.pool = BlockPool(num_slots, num_blocks, block_size)
        self.sched = Scheduler(EngineConfig(max_num_seqs=num_slots, **cfg), self.pool)
        self.length, self.pos = {}, {}
        self.table, self.src = {}, {}         # slot -> its block ids (the runner's copy)
        self.done: list[int] = []
        self.plans = []

    def add(self, rid, src=6, beam=1, length=10, group=None):
        self.sched.add(ScheduledRequest(rid, src, beam, max_new_tokens=length, group=group))
        self.length[rid] = length

    def apply(self, update):
        """What ``PagedKVCache.assign_blocks`` does, on lists: unset freed slots, then set entries."""
        if update is None:
            return
        for s in update.freed:
            self.table.pop(s, None)
            self.src.pop(s, None)
        for tables, entries in ((self.src, update.source), (self.table, update.target)):
            for s, i, b in entries:
                row = tables.setdefault(s, [])
                row += [-1] * (i + 1 - len(row))
                row[i] = b

    def write(self, req, pos):
        """Every hypothesis writes position pos: its block is there, and it holds no block beyond it."""
        B = self.pool.block_size
        for slot in req.slots:
            row = self.table.get(slot, [])
            assert len(row) == pos // B + 1 and -1 not in row, (req.request_id, slot, pos, row)
        assert len(self.src.get(req.slots[0], [])) == -(-req.num_src_tokens // B)
        assert all(s not in self.src for s in req.slots[1:])      # a beam's source is held once

    def step(self):
        plan = self.sched.schedule()
        self.plans.append(plan)
        self.apply(plan.blocks)
        mirrored = [b for rows in (self.table, self.src) for row in rows.values() for b in row]
        assert sorted(mirrored) == sorted(b for row in self.pool.held.values() for b in row)
        assert len(set(mirrored)) == len(mirrored)
        for r in plan.prefill:
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
    pool.allocate_source(a[0], 3)                  # ceil(3 / 2) = 2 blocks
    pool.allocate_target([a[1]], 0)                # position 0: its first block
    assert pool.held == {a[0]: [0, 1], a[1]: [2]} and pool.block_usage == pytest.approx(0.75)
    with pytest.raises(CacheFullError, match="asked for 2 KV blocks, 1 free of 4"):
        pool.allocate_target([a[0]], 2)            # positions 0..2: 2 blocks
    assert pool.num_free_blocks == 1 and pool.target[a[0]] == []   # nothing taken
    with pytest.raises(ValueError):
        pool.allocate_target([2], 0)               # slot 2 is not allocated
    with pytest.raises(ValueError):
        pool.allocate_source(2, 1)
    with pytest.raises(ValueError, match="duplicates"):
        pool.allocate_target([a[1], a[1]], 2)
    pool.pop_update()
    pool.free([a[0]])
    assert pool.num_free_blocks == 3 and pool.pop_update().freed == [a[0]] and pool.blocks_for(5) == 3
    with pytest.raises(ValueError):
        BlockPool(2, 4, 0)


def test_the_block_rule_and_its_updates():
    """target_blocks(p) = ceil((p + 1) / B) per hypothesis, taken as p reaches a new block; the
    source ceil(S / B) once; every change handed over once, in table order."""
    pool = BlockPool(num_slots=4, num_blocks=20, block_size=4)
    assert [pool.target_blocks(p) for p in range(10)] == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]
    assert [pool.new_target_blocks(3, p) for p in range(10)] == [3, 0, 0, 0, 3, 0, 0, 0, 3, 0]
    beam = pool.allocate(3)
    pool.allocate_source(beam[0], 6)
    pool.allocate_target(beam, 0)
    u = pool.pop_update()
    assert u.source == [(beam[0], 0, 0), (beam[0], 1, 1)] and u.freed == []
    assert u.target == [(beam[0], 0, 2), (beam[1], 0, 3), (beam[2], 0, 4)]
    assert not pool.pop_update()                   # handed over once
    for p in (1, 2, 3):
        pool.allocate_target(beam, p)              # block 0 holds positions 0..3: nothing new
        assert not pool.pop_update()
    pool.allocate_target(beam, 4)
    assert pool.pop_update().target == [(s, 1, b) for s, b in zip(beam, (5, 6, 7))]
    pool.allocate_target(beam, 9)                  # a jump takes every block up to the position
    assert [i for _, i, _ in pool.pop_update().target] == [2, 2, 2]
    assert {s: len(b) for s, b in pool.target.items()} == dict.fromkeys(beam, 3)
    other = pool.allocate(1)
    pool.allocate_target(other, 0)
    pool.free(other)                               # freed before the hand-over: never in a table
    pool.free(beam)
    u = pool.pop_update()
    assert u.target == [] and u.freed == other + beam
    assert pool.num_free_blocks == 20 and pool.held == {} and pool.num_free == 4


def test_the_scheduler_hands_the_runner_each_steps_blocks():
    """One beam-2 request: its source and both first blocks at its prefill, nothing until position 4,
    a block each at 4 and 8; its slots and blocks freed at finish, said in the next step's update."""
    sim = PagedSim(num_blocks=20, block_size=4)
    sim.add(0, src=6, beam=2, length=10)
    first = sim.step()
    slots = first.prefill[0].slots
    assert first.blocks.source == [(slots[0], 0, 0), (slots[0], 1, 1)]
    assert first.blocks.target == [(slots[0], 0, 2), (slots[1], 0, 3)]
    news = []
    while sim.sched.running:
        plan = sim.step()
        news.append([(s, i) for s, i, _ in plan.blocks.target])
        assert not plan.blocks.source and not plan.blocks.freed
    assert news == [[], [], [], [(s, 1) for s in slots], [], [], [], [(s, 2) for s in slots], []]
    assert sim.pool.num_free_blocks == 20 and sim.done == [0]
    sim.add(1, src=2, beam=1, length=2)
    plan = sim.step()
    assert plan.blocks.freed == slots                     # slot 0 and blocks 0, 1 again: the lowest ids
    assert plan.blocks.source == [(0, 0, 0)] and plan.blocks.target == [(0, 0, 1)]


def test_cancelled_waiting_and_running_requests_and_an_empty_step():
    sim = PagedSim(num_blocks=12, block_size=4, num_slots=8, policy="prefill_first")
    sim.add(0, src=4, beam=2, length=12)
    sim.step()
    sim.add(1, src=4, beam=1, length=12)
    sim.sched.finish(1)                            # cancelled while waiting: held nothing
    sim.sched.admitting = False                    # (the engine pausing for a reconfiguration)
    slots = sim.sched.running[0].slots
    sim.sched.finish(0)                            # cancelled while running
    assert sim.pool.num_free_blocks == 12 and sim.pool.held == {}
    plan = sim.sched.schedule()
    assert plan.is_empty and plan.blocks is None   # not executed: the frees wait for the next step
    sim.sched.admitting = True
    sim.add(2, src=4, beam=1, length=3)
    plan = sim.step()
    assert plan.blocks.freed == slots and sim.table == {slots[0]: [1]} and sim.src == {slots[0]: [0]}
    sim.run()
    assert sim.pool.num_free_blocks == 12 and sim.pool.held == {}


def test_preempted_requests_free_their_blocks_in_the_same_update():
    sim = PagedSim(num_blocks=24, block_size=4, policy="prefill_first")
    for rid in range(3):
        sim.add(rid, src=4, beam=2, length=20)
    seen = 0
    while sim.sched.running or sim.sched.waiting:
        plan = sim.step()
        for r in plan.preempted:
            seen += 1
            assert r.slots == [] and r.request_id in {q.request_id for q in sim.sched.waiting}
        if plan.preempted:
            assert plan.blocks.freed and not plan.prefill
            assert not set(plan.blocks.freed) & {s for s, _, _ in plan.blocks.target}
    assert seen and sim.sched.num_preemptions == seen and sorted(sim.done) == [0, 1, 2]
    assert sim.pool.num_free_blocks == 24 and sim.pool.held == {}


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
