"""Lexically constrained beam search (model/inference/constraints.py) and glossary terms through the
engine on tiny random models: constrained outputs contain their terms (beam and greedy, streaming),
and unconstrained sentences sharing their steps get exactly the results they get alone."""
from __future__ import annotations

import asyncio

import pytest
import torch

from model.inference.constraints import (MIN_CONSTRAINED_BEAM, ConstrainedBeamSearch, ConstraintState, bank_sizes,
                                         contains)
from service.engine import Engine, EngineConfig, EngineValidationError, GenerationOptions
from tiny_model import make_engine_model, one_thread  # noqa: F401 (one_thread: autouse fixture)
from tiny_model import rand_source as source


@pytest.fixture(scope="module")
def model32():
    return make_engine_model(torch.float32, seed=0)


def test_state_follows_a_phrase_and_resets_when_left():
    cons = ((7, 8, 9), (5,))
    s = ConstraintState((False, False))
    assert sorted(s.allowed(cons)) == [5, 7]
    s = s.advance(cons, 7)
    assert (s.current, s.done, s.met_tokens(cons)) == (0, 1, 1) and s.allowed(cons) == [8]
    left = s.advance(cons, 4)                      # left the phrase midway: progress lost
    assert (left.current, left.done, left.met_tokens(cons)) == (-1, 0, 0)
    s = s.advance(cons, 8).advance(cons, 9)
    assert s.met == (True, False) and s.met_tokens(cons) == 3 and s.allowed(cons) == [5]
    s = s.advance(cons, 5)
    assert s.all_met() and s.met_tokens(cons) == 4 and s.allowed(cons) == []
    restart = ConstraintState((False, False)).advance(cons, 7).advance(cons, 7)   # 7 again: starts over
    assert (restart.current, restart.done) == (0, 1)


def test_bank_sizes_pass_spare_slots_down():
    assert bank_sizes(4, [10, 10]) == [2, 2]
    assert bank_sizes(5, [10, 10, 10]) == [1, 1, 3]
    assert bank_sizes(4, [10, 0, 1]) == [3, 0, 1]      # empty banks give their slots to the bank below
    assert bank_sizes(4, [1, 0, 0]) == [1, 0, 0]       # the rest is unassigned (the caller fills it)
    assert contains([1, 2, 3, 4], [2, 3]) and not contains([1, 2, 4, 3], [2, 3])


def test_constrained_search_needs_a_beam_and_tokens():
    with pytest.raises(ValueError, match="beam_size"):
        ConstrainedBeamSearch(1, 3, 10, constraints=((5,),))
    with pytest.raises(ValueError, match="non-empty"):
        ConstrainedBeamSearch(4, 3, 10, constraints=((),))
    with pytest.raises(ValueError, match="EOS"):
        ConstrainedBeamSearch(4, 3, 10, constraints=((5, 3),))


def _requests():
    """(source, options, constraints) of a mixed batch: greedy and beam, with and without terms."""
    out = []
    for i in range(10):
        beam = (1, 4, 2, 1, 3)[i % 5]
        cons = ((10 + i, 20 + i), (40 + i % 7,)) if i % 3 == 0 else ((30 + i,),) if i % 3 == 1 else ()
        out.append((source(3 + (i * 5) % 11, 100 + i), GenerationOptions(beam_size=beam, max_new_tokens=12 + i),
                    cons))
    return out


def test_mixed_batch_constrained_contain_terms_unconstrained_unchanged(model32):
    reqs = _requests()

    async def alone():
        engine = Engine(model32, EngineConfig(max_num_seqs=64))
        out = []
        for src, o, cons in reqs:
            if not cons:
                out.append(await engine.translate(src, o))
        await engine.stop()
        return out

    async def together():
        engine = Engine(model32, EngineConfig(max_num_seqs=64))
        tasks = [engine.translate(src, GenerationOptions(o.beam_size, max_new_tokens=o.max_new_tokens,
                                                         constraints=cons)) for src, o, cons in reqs]
        out = await asyncio.gather(*tasks)
        assert engine.stats().free_slots == 64    # nothing leaked
        await engine.stop()
        return out

    ref = iter(asyncio.run(alone()))
    got = asyncio.run(together())
    n_constrained = 0
    for (src, o, cons), res in zip(reqs, got):
        best = res.hypotheses[0]
        if cons:
            n_constrained += 1
            assert all(contains(best.tokens, c) for c in cons), (cons, best.tokens)
        else:
            r = next(ref).hypotheses[0]
            # the same tokens; scores to fp32 rounding (matmuls of other batch shapes, as test_engine.py)
            assert best.tokens == r.tokens and best.finish_reason == r.finish_reason
            assert abs(best.score - r.score) <= 1e-4 and abs(best.log_prob - r.log_prob) <= 1e-4
    assert n_constrained == 7


def test_greedy_request_with_terms_gets_the_minimum_beam(model32):
    engine = Engine(model32, EngineConfig(max_num_seqs=8))
    opts = engine._resolve(source(5, 1), GenerationOptions(beam_size=1, constraints=((9,),)))
    assert opts.beam_size == MIN_CONSTRAINED_BEAM and opts.n_best == 1
    # a default budget grows by the terms' tokens; an explicit one that cannot hold them is a 422
    long = tuple(range(10, 40))
    assert engine._resolve(source(3, 1), GenerationOptions(constraints=(long,))).max_new_tokens >= 31
    with pytest.raises(EngineValidationError, match="max_new_tokens"):
        engine._resolve(source(3, 1), GenerationOptions(max_new_tokens=5, constraints=((10, 11, 12, 13, 14),)))
    with pytest.raises(EngineValidationError, match="constraints"):
        engine._resolve(source(3, 1), GenerationOptions(constraints=((10, 10_000),)))


def test_streaming_a_constrained_request(model32):
    async def main():
        engine = Engine(model32, EngineConfig(max_num_seqs=16))
        plain = engine.stream(source(6, 7), GenerationOptions(beam_size=1, max_new_tokens=15))
        cons = engine.stream(source(6, 8), GenerationOptions(beam_size=1, max_new_tokens=15, constraints=((11, 12),)))
        a = [x async for x in plain]
        b = [x async for x in cons]
        alone = await engine.translate(source(6, 7), GenerationOptions(beam_size=1, max_new_tokens=15))
        await engine.stop()
        return a, b, alone
    a, b, alone = asyncio.run(main())
    assert a[:-1] == a[-1].hypotheses[0].tokens == alone.hypotheses[0].tokens
    assert b[:-1] == b[-1].hypotheses[0].tokens and contains(b[-1].hypotheses[0].tokens, (11, 12))


def test_token_log_probs_from_logits_equal_log_softmax():
    from model.inference.constraints import _token_log_probs
    from model.inference.step import StepOutput
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    ref = torch.log_softmax(logits, dim=-1)
    top_v, top_i = ref[2:5].topk(4, dim=-1)
    wanted = [(0, 7), (1, 49), (2, 0), (2, 13)]              # rows 2..4 of the step: first = 2
    got = _token_log_probs(StepOutput(logits=logits), 2, top_v.tolist(), top_i.tolist(), wanted)
    want = [float(ref[2 + b, t]) for b, t in wanted]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    assert _token_log_probs(StepOutput(ref.double()), 2, top_v.tolist(), top_i.tolist(), wanted) == want
