"""ModelRunner unit tests (service/engine/runner.py): ``execute`` driven by hand-built
SchedulerOutput / ScheduledRequest records on a tiny random model, no Engine and no scheduler."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from model.inference.generate import generate
from model.inference.beam import BeamSearch
from service.engine import runner as runner_mod
from service.engine.records import GenerationOptions, ScheduledRequest, SchedulerOutput, StepResult
from service.engine.runner import ModelRunner
from tiny_model import make_engine_model, one_thread, rand_source  # noqa: F401 (one_thread: autouse fixture)


@pytest.fixture(scope="module")
def model():
    return make_engine_model(torch.float64)


class Driver:
    """Plays the engine and scheduler around a runner: admits requests into the runner's own slot
    pool, decodes every running one each step, with the KV blocks each step writes (the pool's rule,
    handed over in ``SchedulerOutput.blocks``), frees the slots of those that finished. Checks that
    the runner never touches the pool."""

    def __init__(self, model, num_slots: int = 16):
        self.runner = ModelRunner(model, num_slots)
        self.pool = self.runner.cache.slots
        self.running: dict[int, ScheduledRequest] = {}
        self.outputs = defaultdict(list)            # request id -> its SequenceOutputs, step by step
        self.steps: list[StepResult] = []

    @staticmethod
    def request(rid: int, src: list[int], stream: bool = False, **options) -> ScheduledRequest:
        o = GenerationOptions(**options)
        return ScheduledRequest(rid, len(src), o.beam_size, tuple(src), o, stream)

    def step(self, admit=(), blocks: bool = True) -> StepResult:
        n = len(self.steps) + 1
        for r in self.running.values():
            self.pool.allocate_target(r.slots, n - r.admitted_step)
        for r in admit:
            r.slots, r.admitted_step = self.pool.allocate(r.num_slots), n
            if blocks:
                self.pool.allocate_source(r.slots[0], r.num_src_tokens)
                self.pool.allocate_target(r.slots, 0)
        plan = SchedulerOutput(n, list(admit), list(self.running.values()), blocks=self.pool.pop_update())
        self.running.update((r.request_id, r) for r in admit)
        before = (self.pool.num_free, self.pool.held)
        result = self.runner.execute(plan)
        assert (self.pool.num_free, self.pool.held) == before and not self.pool.pop_update()   # never touched
        self.steps.append(result)
        for o in result.outputs:
            self.outputs[o.request_id].append(o)
            if o.finished:
                self.pool.free(self.running.pop(o.request_id).slots)
        return result

    def run(self, arrivals: dict[int, list[ScheduledRequest]]) -> dict:
        """Admit arrivals[n] at step n (0-based) and step until nothing runs; the final output per id."""
        n = 0
        while self.running or any(k >= n for k in arrivals):
            self.step(arrivals.get(n, ()))
            n += 1
        assert self.pool.num_free == self.pool.num_slots and self.runner.seqs == {}
        return {rid: outs[-1] for rid, outs in self.outputs.items()}


def offline(model, r: ScheduledRequest):
    o = r.options
    return generate(model, [list(r.src_ids)], o.beam_size, o.n_best, o.max_new_tokens, o.length_penalty,
                    o.attention_kinds)[0]


def assert_same(got, ref, tol=1e-10):
    assert [h.tokens for h in got] == [h.tokens for h in ref]
    assert [h.finish_reason for h in got] == [h.finish_reason for h in ref]
    assert [h.log_prob for h in got] == pytest.approx([h.log_prob for h in ref], abs=tol)
    assert [h.score for h in got] == pytest.approx([h.score for h in ref], abs=tol)


def mixed(first_id: int, n: int, seed: int) -> list[ScheduledRequest]:
    return [Driver.request(first_id + i, rand_source(2 + (i * 5) % 13, seed + i), beam_size=(1, 3, 2, 4)[i % 4],
                           n_best=1 + (i % 4 == 1), max_new_tokens=4 + (i * 3) % 11, length_penalty=(1.0, 0.6)[i % 2])
            for i in range(n)]


def test_greedy_and_beam_hypotheses_equal_offline_generate(model):
    """Requests admitted at different steps share decode forwards and still equal offline decoding."""
    early, late = mixed(0, 6, seed=0), mixed(100, 5, seed=50)
    driver = Driver(model, num_slots=40)
    final = driver.run({0: early, 3: late})
    for r in early + late:
        out = final[r.request_id]
        assert out.error is None and out.finished
        assert_same(out.hypotheses, offline(model, r))
    first = driver.steps[0]
    assert first.num_decode_seqs == len(early)  # the first (BOS) step of each
    assert driver.steps[3].num_decode_seqs > len(late)                     # the late ones joined running rows
    assert {h.finish_reason for r in early + late for h in final[r.request_id].hypotheses} == {"eos", "length"}


def test_a_failing_request_fails_alone(model, monkeypatch):
    class Faulty(BeamSearch):
        def advance(self, *a, **kw):    # the step of beams (search_step ranks them all at once)
            if self.src_len == 9 and len(self.alive[0].tokens) == 2:
                raise RuntimeError("injected fault")
            return super().advance(*a, **kw)

    def requests():
        return [Driver.request(i, rand_source(n, n), beam_size=b, max_new_tokens=8)
                for i, (n, b) in enumerate(((5, 2), (9, 2), (7, 1), (12, 3)))]

    clean = Driver(model).run({0: requests()})
    monkeypatch.setattr(runner_mod, "BeamSearch", Faulty)
    bad_options = Driver.request(9, rand_source(6, 9), beam_size=2, n_best=3, max_new_tokens=8)
    driver = Driver(model)
    final = driver.run({0: requests() + [bad_options]})
    assert isinstance(final[1].error, RuntimeError) and "injected fault" in str(final[1].error)
    assert final[1].hypotheses is None and len(driver.outputs[1]) == 1   # failed at its third step, once
    assert isinstance(final[9].error, ValueError) and "n_best" in str(final[9].error)   # failed at prefill
    for rid in (0, 2, 3):
        assert final[rid].error is None
        assert [(h.tokens, h.log_prob, h.score) for h in final[rid].hypotheses] == \
               [(h.tokens, h.log_prob, h.score) for h in clean[rid].hypotheses]


def test_streamed_tokens_concatenate_to_the_final_tokens(model):
    greedy = Driver.request(0, rand_source(9, 1), stream=True, beam_size=1, max_new_tokens=12)
    beam = Driver.request(1, rand_source(9, 2), stream=True, beam_size=3, max_new_tokens=12)
    quiet = Driver.request(2, rand_source(9, 1), beam_size=1, max_new_tokens=12)
    driver = Driver(model)
    final = driver.run({0: [greedy, beam, quiet]})
    outs = driver.outputs[0]
    assert len(outs) == len(final[0].hypotheses[0].tokens) + (final[0].hypotheses[0].finish_reason == "eos")
    assert all(len(o.new_tokens) <= 1 for o in outs)                      # greedy: one final token per step
    assert [t for o in outs for t in o.new_tokens] == final[0].hypotheses[0].tokens
    assert [o.new_tokens for o in driver.outputs[1]] == [final[1].hypotheses[0].tokens]   # beam: at the end
    assert [len(o.new_tokens) for o in driver.outputs[2]] == [0]          # not streaming: only the result
    assert final[2].hypotheses[0].tokens == final[0].hypotheses[0].tokens
    for r in (greedy, beam):
        assert_same(final[r.request_id].hypotheses, offline(model, r))


def test_min_new_tokens_masks_eos_until_reached(model):
    sources = [rand_source(3, 1), rand_source(4, 3), rand_source(8, 28), rand_source(10, 30), rand_source(5, 0)]
    greedy = [h[0] for h in generate(model, sources, 1, 1, 20)]
    early = [i for i, h in enumerate(greedy) if h.finish_reason == "eos" and len(h.tokens) < 6]
    assert len(early) >= 2, "few sources end early: the test would prove little"
    reqs = [Driver.request(i, s, beam_size=1, max_new_tokens=20, min_new_tokens=6) for i, s in enumerate(sources)]
    reqs += [Driver.request(10 + i, s, beam_size=3, max_new_tokens=7, min_new_tokens=7) for i, s in enumerate(sources)]
    final = Driver(model, num_slots=24).run({0: reqs})
    for i, s in enumerate(sources):
        got, ref = final[i].hypotheses[0], greedy[i]
        assert len(got.tokens) >= 6
        if i in early:                          # the same greedy choices up to where EOS was masked
            assert got.tokens[: len(ref.tokens)] == ref.tokens and len(got.tokens) > len(ref.tokens)
        else:
            assert got.tokens == ref.tokens
        beam = final[10 + i].hypotheses[0]
        assert len(beam.tokens) == 7 and beam.finish_reason == "length"


def test_slots_are_released_and_reused_with_the_same_results(model):
    driver = Driver(model, num_slots=4)
    first = Driver.request(0, rand_source(7, 1), beam_size=4, max_new_tokens=9)
    ref = driver.run({0: [first]})[0].hypotheses
    assert driver.pool.num_free == 4 and 0 not in driver.runner.seqs
    again = Driver.request(1, rand_source(7, 1), beam_size=4, max_new_tokens=9)
    assert driver.run({0: [again]})[1].hypotheses == ref                  # dirty slots, same result
    assert Driver(model, num_slots=4).run({0: [Driver.request(2, rand_source(7, 1), beam_size=4,
                                                              max_new_tokens=9)]})[2].hypotheses == ref
    # a cancelled request: the engine releases it between steps and frees its slots
    driver.step([Driver.request(3, rand_source(5, 3), beam_size=2, max_new_tokens=9)])
    assert set(driver.runner.seqs) == {3}
    driver.runner.release(3)
    driver.pool.free(driver.running.pop(3).slots)
    assert driver.runner.seqs == {} and driver.pool.num_free == 4
    follow = Driver.request(4, rand_source(7, 1), beam_size=4, max_new_tokens=9)
    assert driver.run({0: [follow]})[4].hypotheses == ref
    assert driver.pool.num_free_blocks == driver.pool.num_blocks


def test_the_runner_writes_only_where_it_is_told(model):
    """A request admitted without its blocks fails alone with a clear error, and nothing is allocated
    for it; one admitted with them in the same step is served."""
    driver = Driver(model)
    bad = Driver.request(0, rand_source(6, 1), beam_size=2, max_new_tokens=5)
    driver.step([bad], blocks=False)
    assert driver.pool.num_free_blocks == driver.pool.num_blocks
    out = driver.outputs[0][-1]
    assert isinstance(out.error, ValueError) and "no KV block assigned for source" in str(out.error)
    assert driver.running == {} and driver.pool.num_free == driver.pool.num_slots   # freed as failed
    good = Driver.request(1, rand_source(6, 1), beam_size=2, max_new_tokens=5)
    assert_same(driver.run({0: [good]})[1].hypotheses, offline(model, good))
    assert driver.pool.num_free_blocks == driver.pool.num_blocks
