"""Incremental decoding (model/inference/step.py): cached equals uncached, alone equals inside a padded
batch, greedy equals beam 1, options, attention weights, cache reuse, packed prefill, prefill groups."""
from __future__ import annotations

import pytest
import torch

from model.inference.generate import generate, length_groups, pad_batch
from model.inference.prefill import encode_into_cache, encode_packed
from model.inference.kv_cache import KVCache
from model.transformer import padding_mask
from tiny_model import make_model, rand_source, uncached_greedy


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_cached_equals_uncached_decoding(dtype, tol):
    model = make_model(dtype)
    for seed in range(3):
        src = rand_source(5 + 3 * seed, seed)
        ref_tokens, ref_lp = uncached_greedy(model, src, 12)
        hyp = generate(model, [src], max_new_tokens=12)[0][0]
        assert hyp.tokens == ref_tokens
        assert abs(hyp.log_prob - ref_lp) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_alone_equals_inside_padded_batch(dtype, tol, beam_size):
    model = make_model(dtype)
    short, long = rand_source(4, 1), rand_source(40, 2)
    alone = generate(model, [short], beam_size=beam_size, n_best=beam_size, max_new_tokens=15)[0]
    batched = generate(model, [long, short, rand_source(9, 3)], beam_size=beam_size, n_best=beam_size,
                       max_new_tokens=15)[1]
    assert [h.tokens for h in alone] == [h.tokens for h in batched]
    for a, b in zip(alone, batched):
        assert abs(a.log_prob - b.log_prob) < tol and abs(a.score - b.score) < tol


def test_beam_size_one_equals_greedy():
    model = make_model()
    sources = [rand_source(n, n) for n in (3, 8, 13)]
    beam1 = generate(model, sources, beam_size=1, max_new_tokens=10)
    for src, b in zip(sources, beam1):
        tokens, log_prob = uncached_greedy(model, src, 10)
        assert tokens == b[0].tokens and log_prob == pytest.approx(b[0].log_prob, abs=1e-9)


def test_n_best_sorted_by_score_and_beam_not_worse_than_greedy():
    model = make_model()
    src = rand_source(7, 5)
    hyps = generate(model, [src], beam_size=5, n_best=5, max_new_tokens=8, length_penalty=0.0)[0]
    assert len(hyps) == 5
    scores = [h.score for h in hyps]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(h.tokens) for h in hyps}) == 5  # distinct hypotheses
    greedy = generate(model, [src], max_new_tokens=8)[0][0]
    assert hyps[0].log_prob >= greedy.log_prob - 1e-12  # with no length penalty, score = log-prob


def test_max_new_tokens_zero_and_one():
    model = make_model()
    src = rand_source(6, 4)
    zero = generate(model, [src], max_new_tokens=0)[0][0]
    assert zero.tokens == [] and zero.finish_reason == "length" and zero.log_prob == 0.0
    one = generate(model, [src], beam_size=2, max_new_tokens=1)[0][0]
    assert len(one.tokens) <= 1
    assert one.finish_reason == ("eos" if not one.tokens else "length")
    ref_tokens, _ = uncached_greedy(model, src, 1)
    assert generate(model, [src], max_new_tokens=1)[0][0].tokens == ref_tokens


def test_bad_search_options_raise():
    model = make_model()
    with pytest.raises(ValueError, match="n_best"):
        generate(model, [rand_source(4, 0)], beam_size=2, n_best=3, max_new_tokens=5)
    with pytest.raises(ValueError, match="beam_size"):
        generate(model, [rand_source(4, 0)], beam_size=40, max_new_tokens=5)  # vocabulary of 64
    with pytest.raises(ValueError, match="source length"):
        generate(model, [[]], max_new_tokens=5)
    with pytest.raises(ValueError, match="attention kind"):
        generate(model, [rand_source(4, 0)], max_new_tokens=5, attention_kinds=("bogus",))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [rand_source(4, 0)], max_new_tokens=64)


def test_attention_weights_have_own_lengths_and_rows_sum_to_one():
    model = make_model()
    sources = [rand_source(5, 1), rand_source(17, 2)]
    hyps = generate(model, sources, beam_size=2, max_new_tokens=6, attention_kinds=("cross", "encoder", "decoder"))
    cfg = model.cfg
    for src, (h,) in zip(sources, [x[:1] for x in hyps]):
        T, S = len(h.tokens), len(src)
        assert h.attention["cross"].shape == (cfg.n_decoder_layers, cfg.n_heads, T, S)
        assert h.attention["encoder"].shape == (cfg.n_encoder_layers, cfg.n_heads, S, S)
        assert h.attention["decoder"].shape == (cfg.n_decoder_layers, cfg.n_heads, T, T)
        for kind in ("cross", "encoder", "decoder"):
            torch.testing.assert_close(h.attention[kind].sum(-1), torch.ones(h.attention[kind].shape[:-1], dtype=torch.float64))


def test_shared_cache_gives_same_result_as_fresh_cache():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=16)
    sources = [rand_source(n, n) for n in (4, 11)]
    first = generate(model, sources, beam_size=3, max_new_tokens=9, cache=cache)
    again = generate(model, sources, beam_size=3, max_new_tokens=9, cache=cache)  # dirty slots reused
    fresh = generate(model, sources, beam_size=3, max_new_tokens=9)
    assert [[h.tokens for h in x] for x in first] == [[h.tokens for h in x] for x in again] == \
           [[h.tokens for h in x] for x in fresh]
    assert cache.slots.num_free == 16


def test_packed_encoder_prefill_equals_padded():
    """encode_into_cache through the packed encoder (no padding, compiled kernel) stores the same
    cross-attention K/V as the padded encoder, and encode_packed equals encode on real tokens."""
    from model.inference import kernels
    if kernels.decode_attention() is None:
        pytest.skip("compiled kernel unavailable here: prefill always takes the padded path")
    model = make_model()
    sources = [rand_source(n, n) for n in (3, 12, 1, 7)]
    src = pad_batch(sources, model.cfg.pad_id)
    lengths = torch.tensor([len(s) for s in sources])
    keep = torch.arange(src.size(1))[None, :] < lengths[:, None]
    memory, _ = model.encode(src, padding_mask(src, model.cfg.pad_id))
    with torch.no_grad():
        torch.testing.assert_close(encode_packed(model, src[keep], lengths), memory[keep])
    caches = [KVCache.for_model(model, num_slots=8), KVCache.for_model(model, num_slots=8)]
    caches[1]._kernel = False                      # the padded path
    slots = [[1, 2], [0], [5, 6, 7], [3]]
    for cache in caches:
        assert encode_into_cache(model, cache, slots, src, lengths) is None
    packed, padded = caches
    assert packed.src_len.tolist() == padded.src_len.tolist()
    assert packed.owner.tolist() == padded.owner.tolist()
    for (first, *_), n in zip(slots, lengths.tolist()):
        torch.testing.assert_close(packed.cross_k[:, first, :n], padded.cross_k[:, first, :n])
        torch.testing.assert_close(packed.cross_v[:, first, :n], padded.cross_v[:, first, :n])


def test_length_groups_cut_padding_and_cover_every_sentence():
    """The grouping of prefill batches (and of attention rows and beam reorders)."""
    lengths = [7, 39, 11, 35, 13, 37, 14, 31, 18, 36, 21, 30, 24, 29, 23, 21, 24, 27, 37, 13]
    groups = length_groups(lengths, call_cost=48)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    cost = 48 * len(groups) + padded
    assert cost < 48 + len(lengths) * max(lengths)  # better than one padded batch
    assert 1 < len(groups) < len(lengths)
    for a, b in zip(groups, groups[1:]):
        assert max(lengths[i] for i in a) <= min(lengths[i] for i in b)  # sorted, contiguous
    assert length_groups([5, 5, 5], call_cost=48) == [[0, 1, 2]]  # no padding: one call
    assert length_groups([], call_cost=48) == []
