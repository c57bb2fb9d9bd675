"""Deadlines (service/api/deadline.py) over a real engine with a tiny random model: past the deadline
the request gets ServiceError 504 and its sentences leave the engine (waiting and running counts back
to zero, every slot free). Each engine step is slowed by a fixed sleep, so the requests cannot finish
before their deadline."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from tiny_model import make_engine_model, one_thread  # noqa: F401 (one_thread: autouse fixture)
from tiny_model import rand_source as source

from service.engine import Engine, EngineConfig, GenerationOptions
from service.protocol import ServiceError
from service.replica import run_within, stream_within

STEP_S = 0.01        # added to every engine step
LONG = GenerationOptions(beam_size=2, max_new_tokens=60, min_new_tokens=60)   # >= 60 steps = 0.6 s


@pytest.fixture
def engine(monkeypatch):
    e = Engine(make_engine_model(torch.float32), EngineConfig(max_num_seqs=4, max_waiting=16))
    real = e.runner.execute

    def slow(plan):
        time.sleep(STEP_S)
        return real(plan)
    monkeypatch.setattr(e.runner, "execute", slow)
    return e


def assert_empty(e: Engine) -> None:
    s = e.stats()
    assert (s.running_requests, s.waiting_requests, s.running_sequences) == (0, 0, 0)
    assert s.free_slots == s.num_slots and e._requests == {}


@pytest.mark.asyncio
async def test_translate_past_its_deadline_is_504_and_frees_the_engine(engine):
    async def all_sentences():   # 4 sentences of beam 2 on 4 slots: two run, two wait
        return await asyncio.gather(*(engine.translate(source(8, seed=i), LONG) for i in range(4)))
    t0 = time.perf_counter()
    with pytest.raises(ServiceError) as e:
        await run_within(all_sentences(), time.time() + 0.15, 0.15)
    assert time.perf_counter() - t0 < 0.5
    assert e.value.status == 504 and e.value.field == "timeout_s" and "0.15 s" in e.value.message
    await asyncio.sleep(3 * STEP_S)        # cancellations are applied between steps
    assert_empty(engine)
    # the engine still serves, and a deadline that is not reached changes nothing
    short = GenerationOptions(beam_size=1, max_new_tokens=3)
    out = await run_within(engine.translate(source(6, seed=9), short), time.time() + 30, 30)
    assert out.timings.status == "ok" and len(out.hypotheses[0].tokens) <= 3
    await engine.stop()


@pytest.mark.asyncio
async def test_stream_past_its_deadline_raises_504_after_its_first_tokens(engine):
    got = []
    with pytest.raises(ServiceError) as e:
        async for item in stream_within(engine.stream(source(8, seed=1),
                                                      GenerationOptions(beam_size=1, max_new_tokens=60,
                                                                        min_new_tokens=60)),
                                        time.time() + 0.2, 0.2):
            got.append(item)
    assert e.value.status == 504
    assert 0 < len(got) < 60 and all(isinstance(t, int) for t in got)
    await asyncio.sleep(3 * STEP_S)
    assert_empty(engine)
    await engine.stop()


@pytest.mark.asyncio
async def test_no_deadline_means_no_timeout(engine):
    short = GenerationOptions(beam_size=1, max_new_tokens=2)
    assert (await run_within(engine.translate(source(5, seed=3), short), None)).timings.status == "ok"
    items = [x async for x in stream_within(engine.stream(source(5, seed=3), short), None)]
    assert items[-1].timings.status == "ok"
    await engine.stop()
