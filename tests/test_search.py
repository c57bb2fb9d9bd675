"""Beam search (model/inference/beam.py) and the one search step (search.py): hand-built log-probabilities, a recording
cache, and a real tiny model stepped with mixed beam sizes in one forward."""
from __future__ import annotations

import copy

import pytest
import torch

from model.inference.step import StepOutput, decode_step
from model.inference.prefill import encode_into_cache
from model.inference.generate import generate, pad_batch
from model.inference import kernels
from model.inference.kv_cache import KVCache
from model.inference.beam import BeamSearch
from model.inference.search import ActiveSearch, decode_inputs, rank_candidates, search_step
from model.inference.topk import row_topk
from tiny_model import make_engine_model, rand_source

EOS, BOS = 3, 2


class RecordingCache:
    """Stands in for KVCache: records the reorders search_step asks for."""

    def __init__(self):
        self.calls = []

    def reorder(self, slots, index, length=None):
        self.calls.append((list(slots), list(index), length))


def random_log_probs(n: int, seed: int, vocab: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g, dtype=torch.float64).log_softmax(-1)


def state(s: ActiveSearch):
    return ([(b.tokens, b.log_prob) for b in s.search.alive], [(h.tokens, h.log_prob, h.score) for h in s.search.finished],
            s.search.done, s.tokens, s.position)


# ---- BeamSearch ---------------------------------------------------------------------------------

def test_beam_search_ranks_candidates_and_finishes_eos_within_the_top_k():
    search = BeamSearch(beam_size=2, eos_id=EOS, max_new_tokens=5)
    parents, tokens = search.step([[-0.1, -0.5, -1.0, -2.0]], [[7, EOS, 9, 5]])
    assert (parents, tokens) == ([0, 0], [7, 9])                     # EOS ranked 2nd (< k): finished
    assert [(h.tokens, h.log_prob, h.finish_reason) for h in search.finished] == [([], -0.5, "eos")]
    assert [(b.tokens, b.log_prob) for b in search.alive] == [((7,), -0.1), ((9,), -1.0)]
    parents, tokens = search.step([[-0.2, -0.3], [-0.01, -0.02]], [[EOS, 8], [4, 5]])
    assert (parents, tokens) == ([], []) and search.done and search.alive == []   # k finished
    best = search.results()
    assert len(best) == 1 and best[0].tokens == [7] and best[0].score == pytest.approx(-0.3 / 2)


def test_beam_search_stops_at_max_new_tokens_with_reason_length():
    search = BeamSearch(beam_size=1, eos_id=EOS, max_new_tokens=1, length_penalty=0.0)
    assert search.step([[-0.25, -1.0]], [[6, EOS]]) == ([], [])
    (h,) = search.results()
    assert (h.tokens, h.log_prob, h.score, h.finish_reason) == ([6], -0.25, -0.25, "length")
    assert BeamSearch(2, EOS, 0).done and BeamSearch(2, EOS, 0).results()[0].finish_reason == "length"
    for bad in ({"beam_size": 0}, {"n_best": 3}, {"max_new_tokens": -1}):
        with pytest.raises(ValueError):
            BeamSearch(**{"beam_size": 2, "eos_id": EOS, "max_new_tokens": 4, **bad})


def test_greedy_step_equals_the_ranking_step_with_k_1():
    """BeamSearch.step's k = 1 shortcut against the general ranking on the same candidates: ties in
    log-prob (the lower id wins), log-probs that tie only once added to the prefix's, -inf, EOS first
    and second, the length limit; with cross-attention rows kept."""
    big = 2.0 ** 52                       # prefix log-prob: -big + v rounds -0.75 and -1.0 to one value
    cases = [([-0.5, -0.5], [9, 4], 0.0), ([-0.5, -0.5], [4, 9], 0.0), ([-0.75, -1.0], [9, 4], -big),
             ([-0.1, -0.2], [EOS, 6], -1.0), ([-0.1, -0.2], [6, EOS], -1.0), ([-0.3, float("-inf")], [7, 8], 0.0),
             ([float("-inf"), float("-inf")], [8, EOS], 0.0), ([-0.2, -0.9], [5, 6], -2.0)]
    for tv, ti, prefix in cases:
        for max_new in (1, 2, 5):
            searches = [BeamSearch(1, EOS, max_new, attention_kinds=("cross",), src_len=3) for _ in range(2)]
            for b in searches:
                b.alive[0].log_prob = prefix
            cross = [torch.arange(2 * 4 * 5, dtype=torch.float32).view(2, 4, 5)]
            fast = searches[0].step([tv], [ti], cross)
            ranked = searches[1]._beam_step([tv], [ti], cross, None)
            assert fast == ranked, (tv, ti, prefix, max_new)
            a, b = searches
            assert a.done == b.done
            assert [(h.tokens, h.log_prob) for h in a.alive] == [(h.tokens, h.log_prob) for h in b.alive]
            assert [(h.tokens, h.log_prob, h.score, h.finish_reason) for h in a.finished] == \
                [(h.tokens, h.log_prob, h.score, h.finish_reason) for h in b.finished]
            for h, g in zip(a.alive + a.finished, b.alive + b.finished):
                assert all(torch.equal(x, y) for x, y in zip(h.cross, g.cross)) if hasattr(h, "cross") else \
                    torch.equal(h.attention["cross"], g.attention["cross"])


def _sentence_candidates(g: torch.Generator, n: int, width: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, width] candidate log-probs (best first) and distinct ids in 0..19, with many exact ties
    (values on a coarse grid, some -inf) and tied ids listed in either order, as a device's top-k may."""
    v = -(torch.randint(0, 4, (n, width), generator=g).to(dtype) / 4)
    v[torch.rand(n, width, generator=g) < 0.1] = float("-inf")
    v = v.sort(dim=1, descending=True).values
    ids = torch.stack([torch.randperm(20, generator=g)[:width] for _ in range(n)])
    return v, ids


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_ranking_all_sentences_at_once_equals_each_sentence_ranked_alone(dtype, compiled, monkeypatch):
    """rank_candidates + advance (the compiled ranking, and the tensor ops that serve other devices)
    against each BeamSearch's own step (its python sort) on the same candidates: mixed beam sizes (the widest 2k sets the columns; narrower beams read their first 2k),
    fewer alive rows than k, ties in value and in value + prefix (a prefix of -2**52 rounds the sums
    together), -inf, EOS among the best, columns fewer than 2k (a small vocabulary), many steps."""
    if compiled and kernels.rank_beams_op() is None:
        pytest.skip("compiled CPU kernels unavailable")
    if not compiled:
        monkeypatch.setitem(kernels._loaded, "rank_beams", None)
    g = torch.Generator().manual_seed(0)
    for case in range(60):
        width = [8, 6, 3, 2][case % 4]                      # columns: 2 * k_max, or fewer
        beams = [1 + int(x) for x in torch.randint(1, 5, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)]
        twins = [[BeamSearch(k, EOS, 5, n_best=1) for k in beams] for _ in range(2)]
        for a, b in zip(*twins):
            prefix = [0.0, -1.0, -(2.0 ** 52)][case % 3]
            a.alive[0].log_prob = b.alive[0].log_prob = prefix
        for step in range(5):
            alive = [(a, b) for a, b in zip(*twins) if not a.done]
            if not alive:
                break
            rows, first, per = [], 0, []
            for a, b in alive:
                n = len(a.alive)
                per.append(_sentence_candidates(g, n, width, dtype))
                rows.append((first, b))
                first += n + case % 2                       # odd cases: a greedy row between sentences
            if case % 2:
                per = [(torch.cat([v, torch.zeros(1, width, dtype=dtype)]), torch.cat([i, torch.zeros(1, width, dtype=torch.long)]))
                       for v, i in per]
            top_v, top_i = torch.cat([v for v, _ in per]), torch.cat([i for _, i in per])
            ranked = rank_candidates(top_v, top_i, rows)
            for (a, b), (v, i), cands in zip(alive, per, ranked):
                v, i = v[: len(a.alive)], i[: len(a.alive)]
                kk = 2 * a.beam_size
                expected = a.step(v[:, :kk].tolist(), i[:, :kk].tolist())
                assert b.advance(*cands) == expected, (case, step)
                assert [(h.tokens, h.log_prob) for h in a.alive] == [(h.tokens, h.log_prob) for h in b.alive]
                assert [(h.tokens, h.log_prob, h.score, h.finish_reason) for h in a.finished] == \
                    [(h.tokens, h.log_prob, h.score, h.finish_reason) for h in b.finished]
                assert a.done == b.done
    assert rank_candidates(torch.zeros(0, 8), torch.zeros(0, 8, dtype=torch.long), []) == []


def test_keep_encoder_attention_trims_to_the_source_length_only_when_tracked():
    enc = [torch.rand(2, 4, 6, 6) for _ in range(3)]                  # per layer [B, H, S, S]
    tracked = BeamSearch(1, EOS, 4, attention_kinds=("encoder",), src_len=3)
    tracked.keep_encoder_attention(enc, 1)
    assert torch.equal(tracked.encoder_attention, torch.stack([w[1, :, :3, :3] for w in enc]))
    untracked = BeamSearch(1, EOS, 4, attention_kinds=("cross",), src_len=3)
    untracked.keep_encoder_attention(enc, 1)
    assert untracked.encoder_attention is None


# ---- the one search step ------------------------------------------------------------------------

def test_one_step_over_mixed_beams_equals_each_search_stepped_alone():
    """One top-k for all rows (k = the largest beam) gives every search what its own top-k gives;
    one reorder call covers every beam whose hypotheses moved; decode_inputs lists the next rows."""
    searches = [ActiveSearch(BeamSearch(1, EOS, 6), [9], [BOS]),
                ActiveSearch(BeamSearch(3, EOS, 6, n_best=2), [0, 1, 2], [BOS]),
                ActiveSearch(BeamSearch(2, EOS, 6), [4, 5], [BOS])]
    twins = copy.deepcopy(searches)
    cache = RecordingCache()
    for step in range(6):
        lp = random_log_probs(sum(len(s.tokens) for s in searches), seed=step)
        slots, index, length, row = [], [], 0, 0
        for twin in twins:
            n = len(twin.tokens)
            v, i = (x.tolist() for x in row_topk(lp[row: row + n], min(2 * twin.search.beam_size, lp.size(-1))))
            parents, tokens = twin.search.step(v, i)
            row += n
            if twin.search.done:
                continue
            if parents != list(range(len(parents))):
                index += [len(slots) + p for p in parents]
                slots += twin.slots[: len(parents)]
                length = max(length, len(twin.search.alive[0].tokens))
            twin.tokens, twin.position = tokens, len(twin.search.alive[0].tokens)
        update = search_step(cache, [(StepOutput(lp.clone()), searches)])
        assert update.failed == {}
        assert [state(s) for s in searches] == [state(t) for t in twins]
        assert update.running == [s for s in searches if not s.search.done]
        assert cache.calls == ([(slots, index, length)] if slots else [])
        cache.calls.clear()
        searches = update.running
        twins = [t for t in twins if not t.search.done]
        inputs = decode_inputs(searches)
        assert inputs == ([x for s in searches for x in s.slots[: len(s.tokens)]],
                          [x for s in searches for x in s.tokens],
                          [s.position for s in searches for _ in s.tokens])
        if not searches:
            break
    assert step >= 2


def test_min_new_tokens_masks_eos_until_reached():
    s = ActiveSearch(BeamSearch(1, EOS, 8), [0], [BOS], min_new_tokens=2)
    eos_best = torch.full((1, 12), -5.0, dtype=torch.float64)
    eos_best[0, EOS], eos_best[0, 7] = -0.1, -2.0
    for position in (0, 1):
        assert search_step(RecordingCache(), [(StepOutput(eos_best.clone()), [s])]).running == [s]
        assert s.position == position + 1 and s.tokens == [7]
    assert search_step(RecordingCache(), [(StepOutput(eos_best.clone()), [s])]).running == []
    (h,) = s.search.results()
    assert h.tokens == [7, 7] and h.finish_reason == "eos" and h.log_prob == -2.0 + -2.0 + -0.1  # not renormalised


def test_search_step_from_logits_picks_what_log_probs_pick():
    """A step output holding CPU logits (what decode_step returns there) drives the searches exactly as
    its log-probabilities do: same candidates, scores within float rounding, EOS masked alike."""
    def run(from_logits: bool):
        searches = [ActiveSearch(BeamSearch(1, EOS, 5), [9], [BOS], min_new_tokens=2),
                    ActiveSearch(BeamSearch(3, EOS, 5, n_best=2), [0, 1, 2], [BOS]),
                    ActiveSearch(BeamSearch(2, EOS, 5), [4, 5], [BOS], min_new_tokens=3)]
        done, step = list(searches), 0
        while searches:
            g = torch.Generator().manual_seed(step)
            logits = torch.randn(sum(len(s.tokens) for s in searches), 40, generator=g) * 3
            logits[:, EOS] += 2.0                 # EOS often best: the masking matters
            out = StepOutput(logits=logits.clone()) if from_logits else StepOutput(logits.log_softmax(-1))
            searches = search_step(RecordingCache(), [(out, searches)]).running
            step += 1
        return [[(h.tokens, h.finish_reason) for h in s.search.results()] for s in done], \
            [[h.score for h in s.search.results()] for s in done]

    tokens_logits, scores_logits = run(True)
    tokens_lp, scores_lp = run(False)
    assert tokens_logits == tokens_lp
    assert all(len(t[0][0]) >= 2 for t in tokens_logits[:1])          # min_new_tokens held EOS back
    for a, b in zip(scores_logits, scores_lp):
        assert a == pytest.approx(b, abs=1e-5)


def test_step_output_takes_either_log_probs_or_logits():
    logits = torch.randn(2, 9)
    out = StepOutput(logits=logits)
    assert out.pending_logits is logits and out.num_rows == 2
    torch.testing.assert_close(out.log_probs, logits.log_softmax(-1))
    assert out.pending_logits is None                                  # computed once, then kept
    with pytest.raises(ValueError):
        StepOutput()
    with pytest.raises(ValueError):
        StepOutput(logits.log_softmax(-1), logits=logits)


def test_a_failing_search_fails_alone():
    class Faulty(BeamSearch):
        def step(self, *a, **kw):
            raise RuntimeError("injected fault")

        advance = step                  # search_step ranks beams at once, then calls advance

    good = [ActiveSearch(BeamSearch(2, EOS, 6), [0, 1], [BOS]), ActiveSearch(BeamSearch(1, EOS, 6), [5], [BOS])]
    twins = copy.deepcopy(good)
    bad = ActiveSearch(Faulty(2, EOS, 6), [2, 3], [BOS])
    lp = random_log_probs(3, seed=5)
    update = search_step(RecordingCache(), [(StepOutput(lp.clone()), [good[0], bad, good[1]])])
    assert list(update.failed) == [bad] and "injected fault" in str(update.failed[bad])
    assert update.running == good
    search_step(RecordingCache(), [(StepOutput(lp[[0, 2]].clone()), twins)])
    assert [state(s) for s in good] == [state(t) for t in twins]


def test_several_parts_step_like_one_concatenated_part_with_attention():
    """The engine's runner passes several decode outputs after a failing batch was split; the step
    is the same as over their concatenation, attention rows included."""
    L, H, S = 2, 2, 5

    def searches():
        return [ActiveSearch(BeamSearch(2, EOS, 4, 2, attention_kinds=("cross",), src_len=S - 1), [0, 1], [BOS]),
                ActiveSearch(BeamSearch(1, EOS, 4, attention_kinds=("cross",), src_len=S), [2], [BOS])]

    split, joined = searches(), searches()
    cache_split, cache_joined = RecordingCache(), RecordingCache()
    for step in range(4):
        rows = [len(s.tokens) for s in split]
        lp = random_log_probs(sum(rows), seed=10 + step)
        cross = [torch.rand(sum(rows), H, S, dtype=torch.float64) for _ in range(L)]
        parts, row = [], 0
        for s, n in zip(split, rows):
            if not s.search.done:
                parts.append((StepOutput(lp[row: row + n].clone(), cross=[c[row: row + n] for c in cross]), [s]))
            row += n
        running = [s for s in joined if not s.search.done]
        search_step(cache_split, parts)
        search_step(cache_joined, [(StepOutput(lp.clone(), cross=cross), running)])
        assert [state(s) for s in split] == [state(s) for s in joined]
        if all(s.search.done for s in split):
            break
    assert cache_split.calls == cache_joined.calls
    for a, b in zip(split, joined):
        for ha, hb in zip(a.search.results(), b.search.results()):
            assert ha.attention["cross"].shape == (L, H, len(ha.tokens), a.search.src_len)
            assert torch.equal(ha.attention["cross"], hb.attention["cross"])


def test_search_step_drives_mixed_beams_in_one_forward_like_generate():
    """What the engine's runner does, by hand: greedy and beam sentences share every decode_step."""
    model = make_engine_model()
    cfg = model.cfg
    cache = KVCache.for_model(model, num_slots=12, indirect=True)
    specs = [(rand_source(5, 1), 1), (rand_source(11, 2), 3), (rand_source(8, 3), 2), (rand_source(3, 4), 4)]
    running = [ActiveSearch(BeamSearch(k, cfg.eos_id, 12, k, 0.6, (), len(src)), cache.slots.allocate(k), [cfg.bos_id])
               for src, k in specs]
    searches = list(running)
    encode_into_cache(model, cache, [a.slots for a in running], pad_batch([s for s, _ in specs], cfg.pad_id),
                      torch.tensor([len(s) for s, _ in specs]))
    while running:
        slots, tokens, positions = decode_inputs(running)
        out = decode_step(model, cache, torch.tensor(slots), torch.tensor(tokens), torch.tensor(positions))
        running = search_step(cache, [(out, running)]).running
    for (src, k), a in zip(specs, searches):
        ref = generate(model, [src], k, k, 12, 0.6)[0]
        got = a.search.results()
        assert [h.tokens for h in got] == [h.tokens for h in ref]
        assert [h.log_prob for h in got] == pytest.approx([h.log_prob for h in ref], abs=1e-10)
