"""Engine tests with tiny random models: outputs equal offline decoding whatever shares a step,
one decode forward per step over all running hypotheses, cancellation, no leaks, backpressure,
bad inputs, attention, streaming. Nothing here depends on timing."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from model.inference.beam import BeamSearch
from model.inference import prefill, step
from model.inference.generate import generate
from service.engine import runner as runner_mod
from service.engine import (Engine, EngineConfig, EngineError, EngineStoppedError, EngineValidationError,
                            GenerationOptions, QueueFullError, TranslationResult)
from tiny_model import VOCAB, make_engine_model, one_thread  # noqa: F401 (one_thread: autouse fixture)
from tiny_model import rand_source as source


@pytest.fixture(scope="module")
def model64():
    return make_engine_model(torch.float64)


@pytest.fixture(scope="module")
def model32():
    return make_engine_model(torch.float32, seed=0)


def mixed_requests(n: int, seed: int = 0) -> list[tuple[list[int], GenerationOptions]]:
    """n requests with mixed source lengths, output budgets, beam sizes and n_best."""
    out = []
    for i in range(n):
        beam = (1, 4, 1, 2, 3)[i % 5]
        out.append((source(2 + (i * 7) % 17, seed * 1000 + i),
                    GenerationOptions(beam_size=beam, n_best=min(beam, 1 + i % 2), max_new_tokens=3 + (i * 5) % 23,
                                      length_penalty=(1.0, 0.6)[i % 2])))
    return out


def offline(model, src, o: GenerationOptions):
    return generate(model, [src], o.beam_size, o.n_best, o.max_new_tokens, o.length_penalty,
                    o.attention_kinds)[0]


def assert_same(got: TranslationResult, ref, tol: float):
    assert [h.tokens for h in got.hypotheses] == [h.tokens for h in ref]
    assert [h.finish_reason for h in got.hypotheses] == [h.finish_reason for h in ref]
    for h, r in zip(got.hypotheses, ref):
        assert abs(h.score - r.score) <= tol and abs(h.log_prob - r.log_prob) <= tol


def assert_no_leak(engine: Engine):
    s = engine.stats()
    assert s.running_requests == 0 and s.waiting_requests == 0 and s.running_sequences == 0
    assert s.free_slots == s.num_slots == engine.runner.cache.slots.num_free
    assert s.free_kv_blocks == s.kv_blocks and s.kv_cache_usage == 0.0   # no block leaked
    assert engine.runner.seqs == {} and engine._requests == {}


class Trace:
    """Records every encoder call of prefill (``encode_into_cache``: its sentences' slot lists) and
    every ``decode_step`` call (slots, positions), grouped by engine step."""

    def __init__(self, monkeypatch, engine: Engine):
        self.engine = engine
        self.calls, self.steps, self.running_after = [], {}, {}
        real_decode, real_encode = step.decode_step, prefill.encode_into_cache

        def decode_step(model, cache, slots, tokens, positions, need_weights=False, **kw):
            self.calls.append(("decode", slots.tolist(), positions.tolist()))
            return real_decode(model, cache, slots, tokens, positions, need_weights, **kw)

        def encode_into_cache(model, cache, slots, *a, **kw):
            self.calls.append(("encode", [list(r) for r in slots], None))
            return real_encode(model, cache, slots, *a, **kw)

        monkeypatch.setattr(step, "decode_step", decode_step)
        monkeypatch.setattr(prefill, "encode_into_cache", encode_into_cache)

    def on_step(self, stats):
        self.steps[stats.step] = (stats, self.calls[:])
        self.calls.clear()
        self.running_after[stats.step] = {rid: (list(r.slots), r.num_slots)
                                          for rid, r in self.engine.scheduler.running.items()}


# ---- equivalence with offline decoding ----------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
async def test_batched_mixed_requests_equal_offline_and_alone(dtype, tol, model64, model32):
    model = model64 if dtype == torch.float64 else model32
    reqs = mixed_requests(32, seed=1)
    engine = Engine(model, EngineConfig(max_num_seqs=64, prefill_every=2))
    await engine.start()
    together = await asyncio.gather(*[engine.translate(s, o) for s, o in reqs])
    alone = [await engine.translate(s, o) for s, o in reqs[:8]]  # one at a time through the same engine
    assert_no_leak(engine)
    await engine.stop()
    assert engine.stats().steps > 0
    for (s, o), got in zip(reqs, together):
        assert_same(got, offline(model, s, o), tol)
    for got, ref in zip(alone, together[:8]):
        assert_same(got, ref.hypotheses, tol)
    assert any(len(r.hypotheses) == 2 for r in together)  # n_best > 1 exercised
    assert {r.hypotheses[0].finish_reason for r in together} == {"eos", "length"}


async def test_requests_arriving_midway_equal_offline_and_are_prefilled_within_k_steps(model64, monkeypatch):
    k = 3
    engine = Engine(model64, EngineConfig(max_num_seqs=64, prefill_every=k, waiting_ratio=1e9))
    trace = Trace(monkeypatch, engine)
    first = [(source(9, 100 + i), GenerationOptions(beam_size=(1, 4)[i % 2], max_new_tokens=40, min_new_tokens=40))
             for i in range(6)]
    late = mixed_requests(10, seed=7)
    late_streams, submitted_at = [], {}

    def on_step(stats):
        trace.on_step(stats)
        if stats.step == 5:  # submitted between steps 5 and 6, while the first six decode
            for s, o in late:
                late_streams.append(engine.stream(s, o))
            submitted_at["step"] = stats.step

    engine.on_step = on_step
    await engine.start()
    first_results = await asyncio.gather(*[engine.translate(s, o) for s, o in first])
    late_results = []
    for st in late_streams:
        items = [x async for x in st]
        late_results.append(items[-1])
    assert_no_leak(engine)
    await engine.stop()

    for (s, o), got in zip(late, late_results):
        assert_same(got, offline(model64, s, o), 1e-10)
    assert all(len(r.hypotheses[0].tokens) == 40 for r in first_results)
    s0 = submitted_at["step"]
    prefill_steps = [n for n, (st, _) in trace.steps.items() if n > s0 and st.num_prefill_requests]
    assert prefill_steps and prefill_steps[0] - s0 <= k
    step = prefill_steps[0]
    assert trace.steps[step][0].num_decode_requests == 6  # the first six kept decoding
    # ... and in the next step the newcomers decode in the same forward as the first six.
    nxt, calls = trace.steps[step + 1]
    decode_calls = [c for c in calls if c[0] == "decode"]
    assert len(decode_calls) == 1 and nxt.num_decode_requests > 6


async def test_one_decoder_forward_per_step_over_all_running_hypotheses(model64, monkeypatch):
    engine = Engine(model64, EngineConfig(max_num_seqs=32, prefill_every=2))
    trace = Trace(monkeypatch, engine)
    reqs = mixed_requests(12, seed=3)
    waves = [reqs[:6], reqs[6:]]  # the second wave arrives while the first decodes
    streams = []

    def on_step(stats):
        trace.on_step(stats)
        if stats.step == 3:
            streams.extend(engine.stream(s, o) for s, o in waves[1])

    engine.on_step = on_step
    await engine.start()
    first = await asyncio.gather(*[engine.translate(s, o) for s, o in waves[0]])
    second = [[x async for x in st][-1] for st in streams]
    await engine.stop()
    for (s, o), got in zip(reqs, first + second):
        assert_same(got, offline(model64, s, o), 1e-10)
    mixed_steps = 0
    prev_running = {}
    for n in sorted(trace.steps):
        stats, calls = trace.steps[n]
        decode_calls = [c for c in calls if c[0] == "decode"]
        encode_calls = [c for c in calls if c[0] == "encode"]
        # prefill: encoder calls (one per length group) cover exactly the admitted sentences, each
        # writing its cross K/V into all of its slots (one per hypothesis)
        admitted = [slots for c in encode_calls for slots in c[1]]
        assert len(admitted) == stats.num_prefill_requests
        new_rids = set(trace.running_after[n]) - set(prev_running)
        assert sorted(map(sorted, admitted)) == sorted(sorted(trace.running_after[n][r][0]) for r in new_rids)
        # ONE decoder forward: every hypothesis running after the previous step, plus the first
        # (BOS, position 0) step of each sentence admitted now
        expected = sorted(s for slots, _ in prev_running.values() for s in slots) + sorted(a[0] for a in admitted)
        if expected:
            assert len(decode_calls) == 1
            slots, positions = decode_calls[0][1], decode_calls[0][2]
            assert sorted(slots) == sorted(expected) and len(slots) == stats.num_decode_seqs
            assert sorted(p for s, p in zip(slots, positions) if s in {a[0] for a in admitted}) == [0] * len(admitted)
            beams = {b for _, b in prev_running.values()}
            if 1 in beams and len(beams) > 1 and len(set(positions)) > 1:
                mixed_steps += 1  # greedy and beam rows, at different positions, in one forward
        else:
            assert decode_calls == []
        prev_running = trace.running_after[n]
    assert mixed_steps >= 3  # greedy and beam hypotheses shared forwards


async def test_short_request_sent_after_a_long_one_finishes_first(model64):
    order = []
    engine = Engine(model64, EngineConfig(max_num_seqs=8), on_finish=lambda st: order.append(st.request_id))
    await engine.start()
    long = asyncio.ensure_future(engine.translate(source(10, 1), GenerationOptions(beam_size=4, max_new_tokens=50,
                                                                                   min_new_tokens=50)))
    while engine.stats().running_requests == 0:
        await asyncio.sleep(0)
    short = await engine.translate(source(5, 2), GenerationOptions(beam_size=1, max_new_tokens=3, min_new_tokens=3))
    assert not long.done()
    long_res = await long
    assert order == [short.timings.request_id, long_res.timings.request_id]
    assert len(short.hypotheses[0].tokens) == 3 and len(long_res.hypotheses[0].tokens) == 50
    await engine.stop()


async def test_max_running_requests_one_is_sequential_and_equal(model64, monkeypatch):
    engine = Engine(model64, EngineConfig(max_num_seqs=16, max_running_requests=1))
    trace = Trace(monkeypatch, engine)
    engine.on_step = trace.on_step
    reqs = mixed_requests(5, seed=4)
    res = await asyncio.gather(*[engine.translate(s, o) for s, o in reqs])
    await engine.stop()
    for stats, _ in trace.steps.values():
        assert stats.num_prefill_requests + stats.num_decode_requests == 1
    for (s, o), got in zip(reqs, res):
        assert_same(got, offline(model64, s, o), 1e-10)


# ---- cancellation, errors, backpressure ---------------------------------------------------------

async def test_cancel_one_of_eight_mid_decode(model64):
    engine = Engine(model64, EngineConfig(max_num_seqs=32))
    steps = []
    tasks = []

    def on_step(stats):
        steps.append(stats)
        if stats.step == 4:
            tasks[3].cancel()

    engine.on_step = on_step
    await engine.start()
    opts = [GenerationOptions(beam_size=(1, 4)[i % 2], max_new_tokens=30, min_new_tokens=30) for i in range(8)]
    tasks += [asyncio.ensure_future(engine.translate(source(6 + i, i), o)) for i, o in enumerate(opts)]
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[3], asyncio.CancelledError)
    assert all(isinstance(r, TranslationResult) and len(r.hypotheses[0].tokens) == 30
               for i, r in enumerate(done) if i != 3)
    # the cancelled request (beam 4) left at the next step: its 4 slots were free from step 5 on
    by_step = {s.step: s for s in steps}
    assert by_step[4].running_sequences == 4 * 1 + 4 * 4
    assert by_step[5].running_sequences == 4 * 1 + 3 * 4
    later = await engine.translate(source(7, 50), GenerationOptions(beam_size=2, max_new_tokens=5))
    assert_same(later, offline(model64, source(7, 50), GenerationOptions(beam_size=2, max_new_tokens=5)), 1e-10)
    assert_no_leak(engine)
    await engine.stop()


async def test_cancel_while_waiting_and_stream_close_free_everything(model64):
    finished = []
    engine = Engine(model64, EngineConfig(max_num_seqs=4), on_finish=finished.append)
    await engine.start()
    hog = asyncio.ensure_future(engine.translate(source(8, 1), GenerationOptions(beam_size=4, max_new_tokens=20,
                                                                                 min_new_tokens=20)))
    waiting = asyncio.ensure_future(engine.translate(source(8, 2), GenerationOptions(beam_size=1, max_new_tokens=5)))
    await asyncio.sleep(0)
    assert engine.stats().waiting_requests >= 1
    waiting.cancel()
    stream = engine.stream(source(6, 3), GenerationOptions(beam_size=1, max_new_tokens=30, min_new_tokens=30))
    await hog
    got = [await stream.__anext__() for _ in range(2)]
    assert all(isinstance(t, int) for t in got)
    await stream.aclose()
    after = await engine.translate(source(5, 4), GenerationOptions(beam_size=1, max_new_tokens=4))
    assert after.hypotheses
    assert_no_leak(engine)
    assert sorted(st.status for st in finished) == ["cancelled", "cancelled", "ok", "ok"]
    await engine.stop()


async def test_a_failing_request_fails_alone(model64, monkeypatch):
    class Faulty(BeamSearch):
        def advance(self, *a, **kw):    # the step of beams (search_step ranks them all at once)
            if self.src_len == 13 and len(self.alive[0].tokens) == 2:
                raise RuntimeError("injected fault")
            return super().advance(*a, **kw)

    monkeypatch.setattr(runner_mod, "BeamSearch", Faulty)
    engine = Engine(model64, EngineConfig(max_num_seqs=32))
    reqs = [(source(n, n), GenerationOptions(beam_size=2, max_new_tokens=10)) for n in (5, 13, 7, 9)]
    res = await asyncio.gather(*[engine.translate(s, o) for s, o in reqs], return_exceptions=True)
    assert isinstance(res[1], EngineError) and "injected fault" in str(res[1])
    for (s, o), r in zip(reqs[::2] + reqs[3:], [res[0], res[2], res[3]]):
        assert_same(r, offline(model64, s, o), 1e-10)
    assert (await engine.translate(source(6, 6), GenerationOptions(beam_size=1, max_new_tokens=3))).hypotheses
    assert_no_leak(engine)
    await engine.stop()


async def test_queue_full_raises_at_once(model64):
    engine = Engine(model64, EngineConfig(max_num_seqs=4, max_waiting=3))
    await engine.start()
    opts = GenerationOptions(beam_size=4, max_new_tokens=20)
    tasks = [asyncio.ensure_future(engine.translate(source(6, i), opts)) for i in range(5)]
    await asyncio.sleep(0)  # every task ran up to its enqueue before the loop could admit any
    assert isinstance(tasks[3].exception(), QueueFullError) and isinstance(tasks[4].exception(), QueueFullError)
    with pytest.raises(QueueFullError):
        engine.stream(source(6, 9), opts)
    assert all(isinstance(r, TranslationResult) for r in await asyncio.gather(*tasks[:3]))
    assert_no_leak(engine)
    await engine.stop()


async def test_stop_fails_outstanding_requests_and_refuses_new_ones(model64):
    engine = Engine(model64, EngineConfig(max_num_seqs=4))
    await engine.start()
    tasks = [asyncio.ensure_future(engine.translate(source(6, i), GenerationOptions(beam_size=4, max_new_tokens=40,
                                                                                    min_new_tokens=40)))
             for i in range(3)]
    await asyncio.sleep(0)
    await engine.stop()
    res = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, EngineStoppedError) for r in res)
    with pytest.raises(EngineStoppedError):
        await engine.translate(source(5, 1), GenerationOptions(beam_size=1))
    assert engine.stats().running_requests == 0 and engine.stats().free_slots == 4


# ---- inputs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("src, opts, field", [
    ([], GenerationOptions(), "src_ids"),
    ([5, 0, 3], GenerationOptions(), "src_ids"),
    ([5, VOCAB, 3], GenerationOptions(), "src_ids"),
    ("abc", GenerationOptions(), "src_ids"),
    ([5] * 65, GenerationOptions(), "src_ids"),
    ([5, 3], GenerationOptions(beam_size=0), "beam_size"),
    ([5, 3], GenerationOptions(beam_size=33), "beam_size"),       # larger than half the vocabulary
    ([5, 3], GenerationOptions(beam_size=20), "beam_size"),       # more than the engine's 16 slots
    ([5, 3], GenerationOptions(beam_size=2, n_best=3), "n_best"),
    ([5, 3], GenerationOptions(max_new_tokens=-1), "max_new_tokens"),
    ([5, 3], GenerationOptions(max_new_tokens=64), "max_new_tokens"),
    ([5, 3], GenerationOptions(max_new_tokens=4, min_new_tokens=5), "min_new_tokens"),
    ([5, 3], GenerationOptions(length_penalty=float("nan")), "length_penalty"),
    ([5, 3], GenerationOptions(attention_kinds=("self",)), "attention_kinds"),
    ([5, 3], GenerationOptions(beam_size=True), "beam_size"),
])
async def test_bad_inputs_raise_typed_validation_errors(model64, src, opts, field):
    engine = Engine(model64, EngineConfig(max_num_seqs=16))
    with pytest.raises(EngineValidationError) as e:
        engine.validate(src, opts)
    assert e.value.field == field
    with pytest.raises(EngineValidationError):
        await engine.translate(src, opts)
    assert_no_leak(engine)
    await engine.stop()


async def test_min_new_tokens_above_the_default_budget_raises_it_up_to_the_window(model64):
    """A sentence's default budget (2 x source + 10 = 14 here) grows to min_new_tokens; past the
    model's window (max_len - 1) min_new_tokens is a 422 naming it, as is one above a max_new_tokens sent."""
    engine = Engine(model64, EngineConfig(max_num_seqs=16))
    window = model64.cfg.max_len - 1
    assert engine.validate([5, 3], GenerationOptions()).max_new_tokens == 14
    assert engine.validate([5, 3], GenerationOptions(min_new_tokens=20)).max_new_tokens == 20
    res = await engine.translate([5, 3], GenerationOptions(beam_size=1, min_new_tokens=20))
    assert len(res.hypotheses[0].tokens) >= 20
    with pytest.raises(EngineValidationError, match=rf"min_new_tokens: must be an integer in 0..{window}, got 1000"):
        engine.validate([5, 3], GenerationOptions(min_new_tokens=1000))
    with pytest.raises(EngineValidationError, match=r"max_new_tokens \(4\), got 5"):
        engine.validate([5, 3], GenerationOptions(max_new_tokens=4, min_new_tokens=5))
    await engine.stop()


@pytest.mark.parametrize("max_new", [0, 1])
async def test_tiny_budgets_and_an_eos_only_source_are_served(model64, max_new):
    engine = Engine(model64, EngineConfig(max_num_seqs=16))
    eos_only = [3]  # what an empty or whitespace-only text encodes to
    for beam in (1, 4):
        o = GenerationOptions(beam_size=beam, n_best=beam, max_new_tokens=max_new)
        for src in (eos_only, source(7, 1)):
            got = await engine.translate(src, o)
            ref = offline(model64, src, o)
            assert_same(got, ref, 1e-10)
            assert all(len(h.tokens) <= max_new for h in got.hypotheses)
    default = await engine.translate(eos_only, GenerationOptions(beam_size=2))  # default budget: 2·1+10
    assert len(default.hypotheses[0].tokens) <= 12
    assert_no_leak(engine)
    await engine.stop()


async def test_attention_is_trimmed_to_each_requests_own_lengths(model64):
    engine = Engine(model64, EngineConfig(max_num_seqs=32))
    kinds = ("cross", "encoder", "decoder")
    reqs = [(source(n, n), GenerationOptions(beam_size=b, max_new_tokens=m, attention_kinds=kinds if n != 11 else ()))
            for n, b, m in ((4, 1, 9), (11, 4, 14), (17, 2, 5), (8, 4, 12))]
    res = await asyncio.gather(*[engine.translate(s, o) for s, o in reqs])
    L, H = model64.cfg.n_decoder_layers, model64.cfg.n_heads
    for (s, o), r in zip(reqs, res):
        ref = offline(model64, s, o)
        assert_same(r, ref, 1e-10)
        h = r.hypotheses[0]
        if not o.attention_kinds:
            assert h.attention is None
            continue
        S, T = len(s), len(h.tokens)
        att = h.attention
        assert att["cross"].shape == (L, H, T, S)
        assert att["encoder"].shape == (model64.cfg.n_encoder_layers, H, S, S)
        assert att["decoder"].shape == (L, H, T, T)
        for kind in kinds:
            w = att[kind]
            assert torch.allclose(w.sum(-1), torch.ones((), dtype=w.dtype), atol=1e-9)
            assert torch.allclose(w, ref[0].attention[kind], atol=1e-9)
        assert torch.all(att["decoder"].triu(1) == 0)  # causal
    assert_no_leak(engine)
    await engine.stop()


# ---- streaming, timings, reconfiguration -------------------------------------------------------

async def test_stream_yields_tokens_then_the_result(model64):
    engine = Engine(model64, EngineConfig(max_num_seqs=16))
    greedy_src, beam_src = source(9, 1), source(9, 2)
    async with engine.stream(greedy_src, GenerationOptions(beam_size=1, max_new_tokens=12)) as st:
        greedy = [x async for x in st]
    beam_items = [x async for x in engine.stream(beam_src, GenerationOptions(beam_size=3, max_new_tokens=12))]
    for items, src, beam in ((greedy, greedy_src, 1), (beam_items, beam_src, 3)):
        result = items[-1]
        assert isinstance(result, TranslationResult)
        assert items[:-1] == result.hypotheses[0].tokens
        assert_same(result, offline(model64, src, GenerationOptions(beam_size=beam, max_new_tokens=12)), 1e-10)
    assert_no_leak(engine)
    await engine.stop()


async def test_timings_and_step_stats_add_up(model64):
    steps, finished = [], []
    engine = Engine(model64, EngineConfig(max_num_seqs=32), on_step=steps.append, on_finish=finished.append)
    reqs = [(source(3 + i, i), GenerationOptions(beam_size=1, max_new_tokens=4 + i)) for i in range(10)]
    res = await asyncio.gather(*[engine.translate(s, o) for s, o in reqs])
    await engine.stop()
    assert sum(s.num_prefill_tokens for s in steps) == sum(len(s) for s, _ in reqs)
    assert sum(s.num_prefill_requests for s in steps) == 10 and sum(s.num_finished for s in steps) == 10
    assert sum(s.num_scored_rows for s in steps) == sum(r.timings.generated_tokens for r in res)
    assert sorted(f.request_id for f in finished) == sorted(r.timings.request_id for r in res)
    for r in res:
        t = r.timings
        h = r.hypotheses[0]
        assert t.status == "ok" and t.finish_reason == h.finish_reason
        assert t.generated_tokens == len(h.tokens) + (h.finish_reason == "eos") == t.num_steps
        assert 0 <= t.queue_wait_s <= t.time_to_first_token_s <= t.total_s
        assert t.prefill_s > 0 and math.isclose(t.time_to_first_token_s + t.decode_s, t.total_s, rel_tol=1e-6)
    for s in steps:
        assert s.duration_s >= s.prefill_s + s.decode_s + s.update_s - 1e-6
        assert 0.0 <= s.kv_cache_usage <= 1.0


async def test_reconfigure_changes_the_cache_after_running_requests_finish(model64):
    engine = Engine(model64, EngineConfig(max_num_seqs=4))
    await engine.start()
    running = asyncio.ensure_future(engine.translate(source(6, 1), GenerationOptions(beam_size=4, max_new_tokens=15,
                                                                                     min_new_tokens=15)))
    await asyncio.sleep(0)
    await engine.reconfigure(EngineConfig(max_num_seqs=8, policy="prefill_first"))
    assert len((await running).hypotheses[0].tokens) == 15
    assert engine.stats().num_slots == 8 and engine.stats().policy == "prefill_first"
    res = await asyncio.gather(*[engine.translate(source(5, i), GenerationOptions(beam_size=4, max_new_tokens=6))
                                 for i in range(2)])
    assert all(r.hypotheses for r in res)
    assert_no_leak(engine)
    await engine.stop()


async def test_shortest_first_admission_gives_every_request_its_offline_result(model64):
    """admission="shortest_first" reorders admissions only: with more requests than slots, of mixed
    lengths and beams, every result is the offline one and no slot or block leaks."""
    engine = Engine(model64, EngineConfig(max_num_seqs=6, admission="shortest_first", max_wait_steps=3))
    reqs = [(source(n, 40 + n), GenerationOptions(beam_size=b, max_new_tokens=8))
            for n, b in ((12, 2), (3, 1), (9, 3), (4, 1), (15, 1), (5, 2), (7, 1))]
    res = await asyncio.gather(*[engine.translate(s, o) for s, o in reqs])
    for (s, o), r in zip(reqs, res):
        assert_same(r, offline(model64, s, o), 1e-10)
    assert_no_leak(engine)
    await engine.stop()
