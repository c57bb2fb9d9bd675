"""Translation controls inside the shared batch, on tiny random models: target prefix (greedy, beam,
streaming), repetition_penalty and no_repeat_ngram_size against a straightforward reference
implementation (no KV cache, CTranslate2's rules written out), and mixed batches in which plain
sentences get bit-identical results to running alone."""
from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from model.inference.generate import generate
from model.inference.logits import RepetitionControls, apply_repetition_controls, banned_tokens
from model.inference.beam import BeamSearch
from model.inference.search import ActiveSearch, search_step
from model.inference.step import StepOutput
from model.transformer import padding_mask
from service.engine import Engine, EngineConfig, EngineValidationError, GenerationOptions, TranslationResult
from tiny_model import make_engine_model, one_thread  # noqa: F401 (one_thread: autouse fixture)
from tiny_model import rand_source as source


@pytest.fixture(scope="module")
def model():
    return make_engine_model(torch.float64)


class RecordingCache:
    """Stands in for a KV cache in search_step (reorders are not needed here)."""

    def reorder(self, slots, index, length=None):
        pass


# ---- a reference implementation ------------------------------------------------------------------

def ref_banned(tokens: list[int], n: int) -> set[int]:
    """Every token t such that tokens + [t] ends with an n-gram already in tokens (brute force)."""
    if n < 1 or len(tokens) < n:
        return set()
    grams = {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}
    tail = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
    return {g[-1] for g in grams if g[:-1] == tail}


@torch.no_grad()
def ref_log_probs(model, src: list[int], prefix: list[int], c: RepetitionControls) -> torch.Tensor:
    """Next-token log-probs after BOS + prefix, decoding the whole prefix again (no KV cache), with the
    controls applied element by element as CTranslate2 states them."""
    cfg = model.cfg
    s = torch.tensor([src])
    mask = padding_mask(s, cfg.pad_id)
    memory, _ = model.encode(s, mask)
    logits, _ = model.decode(torch.tensor([[cfg.bos_id] + prefix]), model.cross_kv(memory), mask)
    z = logits[0, -1].clone()
    z[[cfg.pad_id, cfg.bos_id]] = float("-inf")
    for t in set(prefix):
        if c.repetition_penalty != 1.0:
            z[t] = z[t] * c.repetition_penalty if z[t] < 0 else z[t] / c.repetition_penalty
    for t in ref_banned(prefix, c.no_repeat_ngram_size):
        z[t] = float("-inf")
    return torch.log_softmax(z, -1)


def ref_beam(model, src, beam: int, max_new: int, c: RepetitionControls, prefix=()) -> list[tuple[list[int], float, str]]:
    """Beam search written out (the recipe of model/inference/beam.py: top 2k candidates ranked by
    log-prob, ties by parent then id; EOS within the top k finishes; done at k finished or the budget),
    with the prefix forced first. Returns every finished (tokens, log_prob, reason), best score first."""
    eos = model.cfg.eos_id
    alive, finished = [(list(prefix[:0]), 0.0)], []
    for t in prefix:                          # forced: one hypothesis, the model's log-prob of each token
        toks, lp = alive[0]
        alive = [(toks + [t], lp + float(ref_log_probs(model, src, toks, c)[t]))]
    while alive and len(alive[0][0]) < max_new:
        cands = []
        for b, (toks, lp) in enumerate(alive):
            row = ref_log_probs(model, src, toks, c)
            v, i = row.topk(2 * beam)
            cands += [(-(lp + float(x)), b, int(j)) for x, j in zip(v, i)]
        cands.sort()
        new = []
        for rank, (neg, b, j) in enumerate(cands[:2 * beam]):
            if j == eos:
                if rank < beam:
                    finished.append((alive[b][0], -neg, "eos"))
                continue
            new.append((alive[b][0] + [j], -neg))
            if len(new) == beam:
                break
        alive = new
        if len(finished) >= beam:
            alive = []
    finished += [(toks, lp, "length") for toks, lp in alive]
    return sorted(finished, key=lambda h: -h[1] / (len(h[0]) + (h[2] == "eos")))


# ---- the rules -------------------------------------------------------------------------------------

def test_banned_tokens_equal_the_brute_force_rule():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        tokens = torch.randint(4, 8, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        for n in range(0, 5):
            assert set(banned_tokens(tokens, n)) == ref_banned(tokens, n), (tokens, n)
    assert banned_tokens([5, 6, 5], 2) == [6] and banned_tokens([5, 6, 7], 1) == [5, 6, 7]
    assert banned_tokens([5, 6], 3) == []


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens_only():
    z = torch.tensor([[2.0, -2.0, 1.0, -1.0, float("-inf")], [2.0, -2.0, 1.0, -1.0, 0.5]])
    apply_repetition_controls(z, [(0, [0, 1, 1, 4], RepetitionControls(repetition_penalty=2.0))])
    assert z[0].tolist() == [1.0, -4.0, 1.0, -1.0, float("-inf")]     # 1 penalised once, -inf stays
    assert z[1].tolist() == [2.0, -2.0, 1.0, -1.0, 0.5]                # another row: untouched
    apply_repetition_controls(z, [(1, [0, 2, 0], RepetitionControls(no_repeat_ngram_size=2))])
    assert z[1].tolist() == [2.0, -2.0, float("-inf"), -1.0, 0.5]     # "0 2" seen: 2 after 0 banned


# ---- offline decoding against the reference ----------------------------------------------------------

CONTROLS = [RepetitionControls(repetition_penalty=1.8), RepetitionControls(repetition_penalty=0.6),
            RepetitionControls(no_repeat_ngram_size=1), RepetitionControls(no_repeat_ngram_size=2),
            RepetitionControls(1.3, 3)]


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("c", CONTROLS, ids=str)
def test_controls_equal_the_reference_implementation(model, beam, c):
    srcs = [source(n, seed) for n, seed in ((9, 1), (5, 2), (12, 3))]
    got = generate(model, srcs, beam, beam, 14, controls=c)
    for src, hyps in zip(srcs, got):
        ref = ref_beam(model, src, beam, 14, c)[:beam]
        assert [h.tokens for h in hyps] == [r[0] for r in ref]
        assert [h.finish_reason for h in hyps] == [r[2] for r in ref]
        for h, r in zip(hyps, ref):
            assert abs(h.log_prob - r[1]) < 1e-9
        if c.no_repeat_ngram_size:
            n = c.no_repeat_ngram_size
            for h in hyps:
                grams = [tuple(h.tokens[i:i + n]) for i in range(len(h.tokens) - n + 1)]
                assert len(grams) == len(set(grams))
    plain = generate(model, srcs, beam, 1, 14)
    assert any(h[0].tokens != p[0].tokens for h, p in zip(got, plain))   # the controls changed something


@pytest.mark.parametrize("beam", [1, 4])
def test_target_prefix_is_forced_then_decoding_is_free(model, beam):
    src = source(10, 4)
    free = generate(model, [src], beam, 1, 14)[0][0].tokens
    prefix = [t for t in range(5, 64) if t not in free[:2]][:3]      # tokens the model did not choose
    hyps = generate(model, [src], beam, beam, 14, target_prefix=[prefix])[0]
    ref = ref_beam(model, src, beam, 14, RepetitionControls(), prefix)[:beam]
    assert all(h.tokens[:3] == prefix for h in hyps)                 # every beam starts with the prefix
    assert [h.tokens for h in hyps] == [r[0] for r in ref]
    for h, r in zip(hyps, ref):
        assert abs(h.log_prob - r[1]) < 1e-9                          # the prefix's log-probs counted
    whole = generate(model, [src], beam, 1, 3, target_prefix=[prefix])[0][0]
    assert whole.tokens == prefix and whole.finish_reason == "length"   # a prefix as long as the budget
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [src], beam, 1, 2, target_prefix=[prefix])


# ---- inside the engine's shared batch ------------------------------------------------------------------

def _requests():
    """Plain and controlled sentences, greedy and beam, mixed."""
    plain, controlled = [], []
    for i in range(8):
        beam = (1, 3)[i % 2]
        plain.append((source(4 + i, 100 + i), GenerationOptions(beam_size=beam, n_best=beam, max_new_tokens=12)))
        extra = [dict(repetition_penalty=1.7), dict(no_repeat_ngram_size=2), dict(target_prefix=(7, 9)),
                 dict(target_prefix=(11,), repetition_penalty=0.7, no_repeat_ngram_size=1)][i % 4]
        controlled.append((source(6 + i, 200 + i),
                           GenerationOptions(beam_size=beam, n_best=beam, max_new_tokens=12, **extra)))
    return plain, controlled


def test_search_step_leaves_plain_rows_bit_identical_next_to_controlled_ones():
    """The same logits per sentence each step: plain searches (greedy, beam) stepped next to searches
    with a prefix and repetition controls end bit for bit as stepped without them."""
    def plain():
        return [ActiveSearch(BeamSearch(1, 3, 10), [0], [2]), ActiveSearch(BeamSearch(3, 3, 10, n_best=3), [1, 2, 3], [2])]

    def run(searches, seeds):
        step = 0
        while searches:
            rows = []
            for s in searches:      # each sentence's logits depend on (step, sentence) only
                x = torch.randn(len(s.tokens), 40, generator=torch.Generator().manual_seed(1000 * step + seeds[id(s)]))
                x[:, 3] += 1.0      # EOS often near the top
                rows.append(x * 3)
            searches = search_step(RecordingCache(), [(StepOutput(logits=torch.cat(rows)), searches)]).running
            step += 1

    alone = plain()
    run(list(alone), {id(s): k for k, s in enumerate(alone)})
    shared = plain()
    ctl = [ActiveSearch(BeamSearch(1, 3, 10, prefix=(7, 8)), [4], [2], controls=RepetitionControls(1.5, 2)),
           ActiveSearch(BeamSearch(2, 3, 10, prefix=(9,)), [5, 6], [2], controls=RepetitionControls(0.5, 1))]
    run([shared[0], ctl[0], shared[1], ctl[1]], {id(s): k for k, s in enumerate(shared + ctl)})
    for a, b in zip(alone, shared):
        assert [(h.tokens, h.log_prob, h.score) for h in a.search.results()] == \
               [(h.tokens, h.log_prob, h.score) for h in b.search.results()]
    for s in ctl:
        assert all(h.tokens[:len(s.search.prefix)] == list(s.search.prefix) for h in s.search.results())
    assert len(set(ctl[1].search.results()[0].tokens)) == len(ctl[1].search.results()[0].tokens)   # n = 1


async def test_mixed_batch_plain_sentences_equal_alone_and_controlled_equal_offline(model):
    plain, controlled = _requests()
    engine = Engine(model, EngineConfig(max_num_seqs=64))
    await engine.start()
    try:
        alone = [await engine.translate(s, o) for s, o in plain]
        mixed = list(itertools.chain(*zip(plain, controlled)))
        together = await asyncio.gather(*[engine.translate(s, o) for s, o in mixed])
    finally:
        await engine.stop()
    for a, t in zip(alone, together[0::2]):   # tokens equal; scores within the rounding a different batch
        assert [h.tokens for h in a.hypotheses] == [h.tokens for h in t.hypotheses]   # shape gives any sentence
        assert all(abs(x.log_prob - y.log_prob) < 1e-10 for x, y in zip(a.hypotheses, t.hypotheses))
    for (src, o), got in zip(controlled, together[1::2]):
        ref = generate(model, [src], o.beam_size, o.n_best, len(o.target_prefix) + o.max_new_tokens,
                       target_prefix=[o.target_prefix],
                       controls=RepetitionControls(o.repetition_penalty, o.no_repeat_ngram_size))[0]
        assert [h.tokens for h in got.hypotheses] == [h.tokens for h in ref]
        assert all(abs(h.log_prob - r.log_prob) < 1e-9 for h, r in zip(got.hypotheses, ref))
        assert all(tuple(h.tokens[:len(o.target_prefix)]) == o.target_prefix for h in got.hypotheses)


@pytest.mark.parametrize("beam", [1, 3])
async def test_streaming_starts_with_the_prefix_tokens(model, beam):
    engine = Engine(model, EngineConfig(max_num_seqs=16))
    o = GenerationOptions(beam_size=beam, max_new_tokens=12, target_prefix=(7, 9, 13))
    items = [x async for x in engine.stream(source(8, 5), o)]
    await engine.stop()
    result = items[-1]
    assert isinstance(result, TranslationResult)
    assert items[:-1] == result.hypotheses[0].tokens and items[:3] == [7, 9, 13]


@pytest.mark.parametrize("beam", [1, 3])
async def test_max_new_tokens_counts_after_the_prefix_and_a_prefix_that_fills_the_window_is_the_answer(model, beam):
    """max_new_tokens and min_new_tokens count the tokens after target_prefix; the two together are
    cut to the model's window (max_len - 1 target tokens), so a prefix longer than the window is the
    answer itself ("length", no model run), as is any prefix with max_new_tokens 0."""
    engine = Engine(model, EngineConfig(max_num_seqs=16))
    window = model.cfg.max_len - 1
    prefix = (7, 9, 13)
    try:
        exact = await engine.translate(source(8, 5), GenerationOptions(beam_size=beam, max_new_tokens=5,
                                                                       min_new_tokens=5, target_prefix=prefix))
        assert all(len(h.tokens) == 8 and tuple(h.tokens[:3]) == prefix for h in exact.hypotheses)
        assert exact.hypotheses[0].finish_reason == "length" and exact.timings.num_steps == 8
        near = tuple(4 + i % 50 for i in range(window - 2))       # room for 2 more tokens
        cut = await engine.translate(source(8, 5), GenerationOptions(beam_size=beam, max_new_tokens=10,
                                                                     min_new_tokens=10, target_prefix=near))
        assert [len(h.tokens) for h in cut.hypotheses] == [window] and tuple(cut.hypotheses[0].tokens[:-2]) == near
        for long, max_new in [(tuple(4 + i % 50 for i in range(window + 9)), None), (prefix, 0)]:
            res = await engine.translate(source(8, 5), GenerationOptions(beam_size=beam, max_new_tokens=max_new,
                                                                         target_prefix=long))
            assert [(h.tokens, h.finish_reason) for h in res.hypotheses] == [(list(long), "length")]
            assert res.timings.num_steps == 0
    finally:
        await engine.stop()


@pytest.mark.parametrize("opts, field", [
    (dict(target_prefix=(3,)), "target_prefix"),                       # EOS
    (dict(target_prefix=(64,)), "target_prefix"),                      # outside the vocabulary
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    (dict(no_repeat_ngram_size=33), "no_repeat_ngram_size"),
])
def test_bad_controls_raise_naming_the_field(model, opts, field):
    engine = Engine(model, EngineConfig(max_num_seqs=8))
    with pytest.raises(EngineValidationError) as e:
        engine.validate(source(6, 1), GenerationOptions(**opts))
    assert e.value.field == field
