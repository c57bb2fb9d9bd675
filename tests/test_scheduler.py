"""Scheduler tests without a model: continuous admission, slot reuse, FIFO fairness, budgets, policy."""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from model.inference.slots import SlotPool
from service.engine.scheduler import EngineConfig, EngineValidationError, QueueFullError, ScheduledRequest, Scheduler


class Sim:
    """Drives a Scheduler like the engine does; a request finishes after ``length`` generated tokens
    (its prefill produces the first one, every decode step one more)."""

    def __init__(self, num_slots=8, **cfg):
        self.sched = Scheduler(EngineConfig(max_num_seqs=num_slots, **cfg), SlotPool(num_slots))
        self.length: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        self.finished: list[int] = []
        self.plans = []
        self._next = 0

    def add(self, length=5, beam=1, src=6, group=None) -> int:
        rid = self._next
        self._next += 1
        self.sched.add(ScheduledRequest(rid, src, beam, group=group))
        self.length[rid] = length
        return rid

    def step(self):
        plan = self.sched.schedule()
        self.plans.append(plan)
        for r in plan.prefill:
            self.generated[r.request_id] = 1
        for r in plan.decode:
            self.generated[r.request_id] += 1
        for r in plan.prefill + plan.decode:
            if self.generated[r.request_id] >= self.length[r.request_id]:
                self.sched.finish(r.request_id)
                self.finished.append(r.request_id)
        self.check_invariant()
        return plan

    def check_invariant(self):
        s = self.sched
        held = [slot for r in s.running.values() for slot in r.slots]
        assert len(held) == len(set(held)), "a slot is held twice"
        assert len(held) + s.slots.num_free == s.slots.num_slots, "a slot leaked"
        assert not set(s.running) & {r.request_id for r in s.waiting}


def ids(reqs):
    return [r.request_id for r in reqs]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_arrival_while_decoding_is_prefilled_within_k_steps_then_decodes_with_the_others(k):
    sim = Sim(num_slots=8, prefill_every=k, waiting_ratio=1e9)
    long = [sim.add(length=100) for _ in range(4)]
    first = sim.step()
    assert ids(first.prefill) == long and first.decode == []
    for _ in range(3):
        assert ids(sim.step().decode) == long
    new = sim.add(length=100)
    waited = 0
    while True:
        plan = sim.step()
        waited += 1
        assert ids(plan.decode)[:4] == long  # the others keep decoding every step
        if plan.prefill:
            assert ids(plan.prefill) == [new]
            break
    assert waited <= k
    if k > 1:
        assert waited == k  # decode-first: the prefill is not taken earlier than the policy says
    plan = sim.step()
    assert ids(plan.decode) == long + [new] and plan.num_decode_seqs == 5 and not plan.prefill


def test_waiting_ratio_forces_an_early_prefill():
    sim = Sim(num_slots=16, prefill_every=100, waiting_ratio=0.5)
    for _ in range(4):
        sim.add(length=50)
    sim.step()
    sim.add(length=50)
    sim.add(length=50)
    assert not sim.step().prefill  # 2 waiting / 4 running = 0.5, not above the ratio
    sim.add(length=50)
    assert len(sim.step().prefill) == 3  # 3 / 4 > 0.5


def test_waiting_ratio_counts_only_what_fits_so_a_full_batch_is_not_refilled_in_slivers():
    sim = Sim(num_slots=8, prefill_every=4, waiting_ratio=1.0)
    for _ in range(8):
        sim.add(length=100)
    sim.step()
    for _ in range(20):
        sim.add(length=2)  # a long queue behind a full batch
    sim.sched.abort(0)  # one slot frees up: 1 fits / 7 running, not above the ratio
    prefills = [len(sim.step().prefill) for _ in range(4)]
    assert prefills == [0, 0, 0, 1]  # the k-th step takes it, not the first
    for rid in range(1, 7):
        sim.sched.abort(rid)  # the batch drains: 6 fit / 1 running > 1.0
    assert len(sim.step().prefill) == 6


def test_freed_slot_is_reused_while_the_others_continue():
    sim = Sim(num_slots=3, prefill_every=1)
    a, b, c = sim.add(length=2), sim.add(length=10), sim.add(length=10)
    d = sim.add(length=10)
    plan = sim.step()
    assert ids(plan.prefill) == [a, b, c] and sim.sched.num_waiting == 1
    slot_a = sim.sched.running[a].slots
    plan = sim.step()  # a generates its 2nd token and finishes; d has no slot yet
    assert ids(plan.decode) == [a, b, c] and not plan.prefill and a in sim.finished
    plan = sim.step()
    assert ids(plan.prefill) == [d] and ids(plan.decode) == [b, c]
    assert sim.sched.running[d].slots == slot_a
    assert ids(sim.step().decode) == [b, c, d]


def test_fifo_admission_does_not_starve_a_large_beam():
    sim = Sim(num_slots=4, prefill_every=1)
    g = [sim.add(length=3 + i) for i in range(3)]  # three greedy requests, 3 slots
    sim.step()
    beam = sim.add(length=4, beam=4)
    later = sim.add(length=2)
    order = []
    for _ in range(30):
        plan = sim.step()
        order += ids(plan.prefill)
        if later in order:
            break
    # One slot stays free meanwhile, but the greedy request behind the beam does not jump the queue.
    assert order == [beam, later]
    assert set(g) <= set(sim.finished)


def test_random_arrivals_are_admitted_in_order_and_everyone_finishes():
    rng = random.Random(0)
    sim = Sim(num_slots=12, prefill_every=3, waiting_ratio=2.0, max_prefill_tokens=64)
    arrivals, admitted = [], []
    for step in range(600):
        if step < 300 and rng.random() < 0.3:
            arrivals.append(sim.add(length=rng.randint(1, 30), beam=rng.choice([1, 1, 2, 4]), src=rng.randint(2, 40)))
        plan = sim.step()
        admitted += ids(plan.prefill)
    assert admitted == arrivals  # FIFO
    assert sorted(sim.finished) == sorted(arrivals)
    assert sim.sched.num_running == 0 and sim.sched.num_waiting == 0
    assert sim.sched.slots.num_free == 12
    # Continuous: admissions happened while others were decoding, not only into an empty batch.
    assert any(p.prefill and p.decode for p in sim.plans)


def test_prefill_token_budget_counts_padded_tokens_and_never_blocks_a_long_request():
    sim = Sim(num_slots=16, max_prefill_tokens=20)
    for _ in range(3):
        sim.add(length=10, src=8)
    plan = sim.step()
    assert len(plan.prefill) == 2 and plan.num_prefill_padded == 16 and plan.num_prefill_tokens == 16
    sim2 = Sim(num_slots=16, max_prefill_tokens=20, policy="prefill_first")
    big = sim2.add(length=3, src=50)
    small = sim2.add(length=3, src=4)
    plan = sim2.step()
    assert ids(plan.prefill) == [big]  # alone, although longer than the budget
    assert ids(sim2.step().prefill) == [small]


def test_max_running_requests_one_means_no_batching():
    sim = Sim(num_slots=8, max_running_requests=1)
    reqs = [sim.add(length=3) for _ in range(4)]
    for _ in range(20):
        plan = sim.step()
        assert len(plan.prefill) + len(plan.decode) <= 1
    assert sim.finished == reqs


def test_prefill_first_admits_every_step_and_static_waits_for_an_empty_batch():
    sim = Sim(num_slots=8, policy="prefill_first", prefill_every=100, waiting_ratio=1e9)
    sim.add(length=10)
    sim.step()
    new = sim.add(length=10)
    assert ids(sim.step().prefill) == [new]

    sim = Sim(num_slots=8, policy="static")
    a, b = sim.add(length=3), sim.add(length=5)
    sim.step()
    c = sim.add(length=2)
    steps_to_c = 0
    while True:
        plan = sim.step()
        steps_to_c += 1
        if plan.prefill:
            break
    assert ids(plan.prefill) == [c] and plan.decode == [] and {a, b} <= set(sim.finished)
    assert steps_to_c == 5  # b needed 4 more steps after the first; c starts on the next


def test_abort_frees_slots_from_running_and_removes_from_waiting():
    sim = Sim(num_slots=2)
    a, b = sim.add(length=50), sim.add(length=50)
    c = sim.add(length=50)
    sim.step()
    assert sim.sched.slots.num_free == 0
    sim.sched.abort(a)
    sim.check_invariant()
    assert sim.sched.slots.num_free == 1 and a not in sim.sched.running
    sim.sched.abort(c)
    assert sim.sched.num_waiting == 0
    assert sim.sched.abort(12345) is None  # unknown ids are ignored
    plan = sim.step()
    assert ids(plan.decode) == [b] and not plan.prefill


def test_queue_full_raises_at_once_and_frees_up_after_admission():
    sim = Sim(num_slots=1, max_waiting=2)
    sim.add(length=100)
    sim.add(length=100)
    with pytest.raises(QueueFullError):
        sim.add()
    sim.step()  # one is admitted
    sim.add()
    with pytest.raises(QueueFullError):
        sim.add()


def test_beam_larger_than_the_cache_is_rejected_at_submit():
    sim = Sim(num_slots=4)
    with pytest.raises(EngineValidationError) as e:
        sim.add(beam=5)
    assert e.value.field == "beam_size"
    assert sim.sched.num_waiting == 0


@pytest.mark.parametrize("bad, field", [({"policy": "fastest"}, "policy"), ({"max_num_seqs": 0}, "max_num_seqs"),
                                         ({"prefill_every": 0}, "prefill_every"),
                                         ({"max_running_requests": 0}, "max_running_requests"),
                                         ({"waiting_ratio": -1}, "waiting_ratio"), ({"bogus": 1}, "bogus")])
def test_engine_config_rejects_bad_values(bad, field):
    with pytest.raises(EngineValidationError) as e:
        EngineConfig.from_dict(bad)
    assert e.value.field == field


def test_scheduler_module_does_not_import_torch():
    tree = ast.parse(Path(__file__).resolve().parents[1].joinpath("service", "engine", "scheduler.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert "torch" not in names and "model" not in names



def test_shortest_first_admits_the_smallest_jobs_first_in_arrival_order_among_equals():
    """admission="shortest_first": with 2 slots free and five waiting, the two smallest jobs (source
    tokens x beam) go first; equal sizes keep arrival order; fifo admits in arrival order."""
    order = {}
    for admission in ("fifo", "shortest_first"):
        sim = Sim(num_slots=2, admission=admission, policy="prefill_first")
        for src, beam in ((9, 1), (3, 2), (4, 1), (4, 1), (2, 1)):
            sim.add(length=3, beam=beam, src=src)
        admitted = []
        for _ in range(40):
            admitted += ids(sim.step().prefill)
            if len(admitted) == 5:
                break
        order[admission] = admitted
    assert order["fifo"] == [0, 1, 2, 3, 4]
    assert order["shortest_first"] == [4, 2, 3, 1, 0]      # sizes 2, 4, 4, 6 (3 x beam 2), 9


def test_shortest_first_lets_no_request_wait_past_max_wait_steps():
    """A long sentence behind a stream of short ones: once it has waited max_wait_steps steps it goes
    before every smaller one (it is not starved), and the head-of-line rule holds in that order."""
    sim = Sim(num_slots=1, admission="shortest_first", max_wait_steps=6, policy="prefill_first")
    long_id = sim.add(length=2, src=50)
    admitted_at = None
    for step in range(1, 30):
        sim.add(length=2, src=3)                          # one new short request every step
        plan = sim.step()
        if long_id in ids(plan.prefill):
            admitted_at = step
            break
    assert admitted_at is not None and 6 <= admitted_at <= 8, admitted_at


def test_admission_settings_are_validated():
    with pytest.raises(EngineValidationError) as e:
        EngineConfig(admission="random")
    assert e.value.field == "admission" and "shortest_first" in str(e.value)
    with pytest.raises(EngineValidationError) as e:
        EngineConfig(max_wait_steps=0)
    assert e.value.field == "max_wait_steps"


def admitted_in_order(sim, steps=200) -> list[int]:
    order = []
    for _ in range(steps):
        if not (sim.sched.running or sim.sched.waiting):
            break
        order += ids(sim.step().prefill)
    return order


def test_fifo_takes_turns_between_the_groups_of_api_requests():
    """Sentences of one API request share a group: a request of 6 sentences puts one of them, not
    six, ahead of a one-sentence request that arrives after it; two multi-sentence requests
    alternate; a request arriving mid-way goes in the current turn; without groups, pure FIFO."""
    sim = Sim(num_slots=1, policy="prefill_first")
    a = [sim.add(length=2, group="a") for _ in range(6)]
    b = sim.add(length=2, group="b")
    c = [sim.add(length=2, group="c") for _ in range(2)]
    order = []
    for _ in range(7):                  # a0, b, c0, a1 admitted (one slot, 2 steps each)
        order += ids(sim.step().prefill)
    assert order == [a[0], b, c[0], a[1]]
    d = sim.add(length=2)               # no group, arrives in turn 1: after c1 (turn 1), before a2
    order += admitted_in_order(sim)
    assert order == [a[0], b, c[0], a[1], c[1], d, a[2], a[3], a[4], a[5]]
    assert sorted(sim.finished) == sorted(order) and sim.sched._groups == {} and sim.sched.slots.num_free == 1

    sim = Sim(num_slots=2, policy="prefill_first")
    e = [sim.add(length=3, group="e") for _ in range(4)]
    f = [sim.add(length=3, group=("f", 1)) for _ in range(4)]   # any hashable
    assert admitted_in_order(sim) == [x for pair in zip(e, f) for x in pair]

    sim = Sim(num_slots=1, policy="prefill_first")
    plain = [sim.add(length=2) for _ in range(5)]
    assert admitted_in_order(sim) == plain


def test_turns_keep_the_head_of_line_rule_and_survive_cancellation():
    """A large beam at the head of the turns is not passed by smaller requests behind it (the FIFO
    rule, in turn order), and cancelling waiting sentences of a group leaves no bookkeeping behind."""
    sim = Sim(num_slots=4, policy="prefill_first")
    g = [sim.add(length=4, group="g") for _ in range(3)]   # three greedy sentences take 3 slots
    sim.step()
    big = sim.add(length=2, beam=4, group="big")
    small = sim.add(length=2, group="small")
    order = admitted_in_order(sim)
    assert order.index(big) < order.index(small)
    assert set(g) <= set(sim.finished)

    sim = Sim(num_slots=1, policy="prefill_first")
    many = [sim.add(length=3, group="m") for _ in range(5)]
    other = sim.add(length=3, group="o")
    sim.step()
    for rid in many[2:]:
        sim.sched.finish(rid)           # the client went away: its waiting sentences are dropped
    assert admitted_in_order(sim) == [other, many[1]]
    assert sim.sched._groups == {} and not sim.sched.waiting and sim.sched.slots.num_free == 1
