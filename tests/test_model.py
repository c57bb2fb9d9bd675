"""Model tests: attention, positions, equivalence of cached / batched decoding, search, overfitting."""
from __future__ import annotations

import math

import pytest
import torch

from model.attention import MultiHeadAttention, scaled_dot_product_attention
from model.config import ModelConfig
from model.decoding import beam_search, generate, greedy_search
from model.kv_cache import CacheFullError, KVCache
from model.layers import sinusoidal_table
from model.transformer import Transformer, causal_mask, padding_mask


def make_model(dtype=torch.float64, seed=0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_name("tiny", **overrides)
    return Transformer(cfg).to(dtype).eval()


def rand_source(n: int, seed: int, vocab: int = 64) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n - 1,), generator=g).tolist() + [3]


@torch.no_grad()
def uncached_greedy(model: Transformer, src: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """Reference: re-run the whole decoder on the growing prefix, no KV cache."""
    cfg = model.cfg
    s = torch.tensor([src])
    mask = padding_mask(s, cfg.pad_id)
    memory, _ = model.encode(s, mask)
    kv = model.cross_kv(memory)
    tgt, lp = [cfg.bos_id], 0.0
    for _ in range(max_new_tokens):
        logits, _ = model.decode(torch.tensor([tgt]), kv, mask)
        logits = logits[0, -1].clone()
        logits[[cfg.pad_id, cfg.bos_id]] = float("-inf")
        log_probs = torch.log_softmax(logits, -1)
        t = int(log_probs.argmax())
        lp += float(log_probs[t])
        if t == cfg.eos_id:
            break
        tgt.append(t)
    return tgt[1:], lp


# ---- positional encoding and attention ----------------------------------------------------------

def test_sinusoidal_encoding_values():
    pe = sinusoidal_table(50, 16)
    assert pe.shape == (50, 16)
    assert pe[1, 0].item() == pytest.approx(math.sin(1.0), abs=1e-7)
    assert pe[1, 1].item() == pytest.approx(math.cos(1.0), abs=1e-7)
    # dims 2i use frequency 1 / 10000^(2i / d_model)
    assert pe[7, 4].item() == pytest.approx(math.sin(7 / 10000 ** (4 / 16)), abs=1e-6)
    assert pe[7, 5].item() == pytest.approx(math.cos(7 / 10000 ** (4 / 16)), abs=1e-6)
    assert torch.all(pe[0, 0::2] == 0) and torch.all(pe[0, 1::2] == 1)


def test_attention_rows_sum_to_one_and_ignore_padding():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([5, 2])
    mask = (torch.arange(5)[None] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, T_k]
    out, w = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert w.shape == (2, 3, 5, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))
    assert torch.all(w[1, :, :, 2:] == 0.0)  # exactly zero on padding keys
    # the fused path (no weights) gives the same output
    fused, none = scaled_dot_product_attention(q, k, v, mask)
    assert none is None
    torch.testing.assert_close(fused, out)


def test_multi_head_attention_returns_per_head_weights():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = causal_mask(6)
    out, w = mha(x, mask=mask, need_weights=True)
    assert out.shape == (2, 6, 16) and w.shape == (2, 4, 6, 6)
    assert torch.all(w.triu(1) == 0)  # causal: no weight on future positions
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6, dtype=torch.float64))


def test_self_attention_without_positions_is_permutation_equivariant():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).double()
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    perm = torch.randperm(7)
    out, _ = mha(x)
    out_perm, _ = mha(x[:, perm])
    torch.testing.assert_close(out_perm, out[:, perm])


def test_post_ln_and_pre_ln_and_learned_positions_build_and_run():
    for overrides in ({"norm_first": True}, {"positional": "learned"}, {"activation": "gelu"},
                      {"share_embeddings": False}):
        m = make_model(**overrides)
        src = torch.tensor([rand_source(6, 1)])
        logits = m(src, torch.tensor([[2, 5, 6]]))
        assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()


def test_presets_match_the_paper():
    base, big = ModelConfig.from_name("base"), ModelConfig.from_name("big")
    assert (base.d_model, base.n_heads, base.d_ff, base.n_encoder_layers, base.dropout) == (512, 8, 2048, 6, 0.1)
    assert (big.d_model, big.n_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=100, n_heads=8)


# ---- equivalence -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_cached_equals_uncached_decoding(dtype, tol):
    model = make_model(dtype)
    for seed in range(3):
        src = rand_source(5 + 3 * seed, seed)
        ref_tokens, ref_lp = uncached_greedy(model, src, 12)
        hyp = greedy_search(model, [src], max_new_tokens=12)[0]
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
    greedy = greedy_search(model, sources, max_new_tokens=10)
    beam1 = beam_search(model, sources, beam_size=1, max_new_tokens=10)
    for g, b in zip(greedy, beam1):
        assert g.tokens == b[0].tokens and g.log_prob == pytest.approx(b[0].log_prob, abs=1e-12)


def test_n_best_sorted_by_score_and_beam_not_worse_than_greedy():
    model = make_model()
    src = rand_source(7, 5)
    hyps = beam_search(model, [src], beam_size=5, n_best=5, max_new_tokens=8, length_penalty=0.0)[0]
    assert len(hyps) == 5
    scores = [h.score for h in hyps]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(h.tokens) for h in hyps}) == 5  # distinct hypotheses
    greedy = greedy_search(model, [src], max_new_tokens=8)[0]
    assert hyps[0].log_prob >= greedy.log_prob - 1e-12  # with no length penalty, score = log-prob


def test_max_new_tokens_zero_and_one():
    model = make_model()
    src = rand_source(6, 4)
    zero = greedy_search(model, [src], max_new_tokens=0)[0]
    assert zero.tokens == [] and zero.finish_reason == "length" and zero.log_prob == 0.0
    one = generate(model, [src], beam_size=2, max_new_tokens=1)[0][0]
    assert len(one.tokens) <= 1
    assert one.finish_reason == ("eos" if not one.tokens else "length")
    ref_tokens, _ = uncached_greedy(model, src, 1)
    assert greedy_search(model, [src], max_new_tokens=1)[0].tokens == ref_tokens


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


# ---- KV cache ----------------------------------------------------------------------------------

def test_kv_cache_slots_allocate_free_reuse():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=4, max_tgt_len=8, max_src_len=8)
    a = cache.allocate(3)
    assert cache.num_free == 1 and cache.usage == pytest.approx(0.75)
    with pytest.raises(CacheFullError):
        cache.allocate(2)
    cache.free(a[:2])
    b = cache.allocate(2)
    assert sorted(b) == sorted(a[:2])  # freed slots are reused
    with pytest.raises(ValueError):
        cache.free([b[0], b[0]])


def test_kv_cache_reorder_copies_self_attention_rows():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=3, max_tgt_len=4, max_src_len=4)
    for s in range(3):
        cache.self_k[:, s] = s
        cache.cross_k[:, s] = 10 + s
    cache.reorder([0, 1, 2], [2, 2, 0], length=3)
    assert torch.all(cache.self_k[:, 0, :3] == 2) and torch.all(cache.self_k[:, 1, :3] == 2)  # [L, N, T, H, Dh]
    assert torch.all(cache.self_k[:, 2, :3] == 0)
    assert torch.all(cache.self_k[:, 2, 3] == 2)  # beyond length: untouched
    assert torch.all(cache.cross_k[:, 1] == 11)      # cross K/V are shared by a beam, not moved


def test_indirect_cache_reorder_moves_slot_ids_and_decodes_the_same():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=3, max_tgt_len=4, max_src_len=4, indirect=True)
    cache.self_k.normal_()
    before = cache.self_k.clone()
    cache.reorder([0, 1, 2], [2, 2, 0], length=3)
    assert torch.equal(cache.self_k, before)                     # no K/V copied ...
    assert cache.home[:, :3].tolist() == [[2] * 3, [2] * 3, [0] * 3] and cache.home[:, 3].tolist() == [0, 1, 2]
    assert cache.redirected.tolist() == [True, True, True]   # ... so attention follows the table
    sources = [rand_source(n, n) for n in (3, 9, 14)]
    direct = generate(model, sources, beam_size=4, n_best=4, max_new_tokens=12,
                      cache=KVCache.for_model(model, num_slots=12))
    indirect = generate(model, sources, beam_size=4, n_best=4, max_new_tokens=12,
                        cache=KVCache.for_model(model, num_slots=12, indirect=True))
    assert [[h.tokens for h in x] for x in direct] == [[h.tokens for h in x] for x in indirect]
    for a, b in zip(direct, indirect):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-10)


@pytest.mark.parametrize("n_queries", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_attention_equals_padded_and_ignores_other_rows_keys(n_queries, dtype):
    """Padded SDPA, eager packed and (where it builds) the compiled kernel give the same attention."""
    from model import kernels
    from model.kv_cache import AttentionPlan, CacheAttention
    torch.manual_seed(0)
    H, Dh, stride = 2, 4, 9
    K, V = torch.randn(6, stride, H, Dh, dtype=dtype), torch.randn(6, stride, H, Dh, dtype=dtype)
    slots, lengths = torch.tensor([4, 0, 5]), torch.tensor([2, 9, 5])
    q = torch.randn(3, n_queries, H, Dh, dtype=dtype)
    hook = CacheAttention.__new__(CacheAttention)
    plans = {"padded": AttentionPlan(slots, lengths, stride), "packed": AttentionPlan(slots, lengths, stride, True)}
    assert not plans["padded"].packed and plans["packed"].packed and not plans["packed"].kernel
    if kernels.decode_attention() is not None:
        plans["kernel"] = AttentionPlan(slots, lengths, stride, True, kernel=True)
    results = {}
    for name, plan in plans.items():
        hook.plan = plan
        results[name] = hook._attend(K, V, q, need_weights=True)
    out_d, w_d = results.pop("padded")
    for name, (out, w) in results.items():
        torch.testing.assert_close(out, out_d, msg=name)
        torch.testing.assert_close(w, w_d, msg=name)
        assert w.shape == (3, H, n_queries, 9)
        torch.testing.assert_close(w.sum(-1), torch.ones(3, H, n_queries, dtype=dtype))
        assert torch.all(w[0, ..., 2:] == 0) and torch.all(w[2, ..., 5:] == 0)  # nobody reads past its length
    K[4, 2:] = 1e6                                                             # garbage past row 0's keys
    for name, (out, _) in results.items():
        hook.plan = plans[name]
        torch.testing.assert_close(hook._attend(K, V, q, False)[0], out, msg=name)


def test_compiled_decode_attention_rejects_bad_indices():
    from model import kernels
    if kernels.decode_attention() is None:
        pytest.skip("compiled kernel unavailable here (no C++ compiler); eager attention is used")
    q, k = torch.randn(2, 1, 2, 4), torch.randn(10, 2, 4)
    with pytest.raises(RuntimeError, match="outside"):
        kernels.packed_decode_attention(q, k, k, torch.tensor([0, 10]), torch.tensor([0, 1, 2]), 1)
    with pytest.raises(RuntimeError, match="max_len"):
        kernels.packed_decode_attention(q, k, k, torch.tensor([0, 1, 2]), torch.tensor([0, 3, 3]), 2)
    with pytest.raises(RuntimeError, match="R \\+ 1"):
        kernels.packed_decode_attention(q, k, k, torch.tensor([0]), torch.tensor([0, 1]), 1)


def test_shared_cache_gives_same_result_as_fresh_cache():
    model = make_model()
    cache = KVCache.for_model(model, num_slots=16)
    sources = [rand_source(n, n) for n in (4, 11)]
    first = generate(model, sources, beam_size=3, max_new_tokens=9, cache=cache)
    again = generate(model, sources, beam_size=3, max_new_tokens=9, cache=cache)  # dirty slots reused
    fresh = generate(model, sources, beam_size=3, max_new_tokens=9)
    assert [[h.tokens for h in x] for x in first] == [[h.tokens for h in x] for x in again] == \
           [[h.tokens for h in x] for x in fresh]
    assert cache.num_free == 16


# ---- training ----------------------------------------------------------------------------------

def test_tiny_model_overfits_a_few_pairs():
    from model.train import batch_loss, inverse_sqrt_lr
    from model.decoding import pad_batch
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny", dropout=0.0))
    pairs = [([5, 6, 7, 3], [2, 10, 11, 12, 3]), ([8, 9, 3], [2, 13, 14, 3]),
             ([20, 21, 22, 23, 3], [2, 30, 31, 3]), ([40, 3], [2, 41, 42, 43, 44, 3])]
    src = pad_batch([p[0] for p in pairs], 0)
    tgt = pad_batch([p[1] for p in pairs], 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    for step in range(1, 301):
        for g in opt.param_groups:
            g["lr"] = inverse_sqrt_lr(step, 3e-3, 30)
        model.train()
        loss, n, _ = batch_loss(model, src, tgt, 0.0)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
    assert float(loss / n) < 0.05
    hyps = greedy_search(model.eval(), [p[0] for p in pairs], max_new_tokens=8)
    assert [h.tokens for h in hyps] == [p[1][1:-1] for p in pairs]
    assert all(h.finish_reason == "eos" for h in hyps)


def test_token_batches_respect_budget_and_cover_everything():
    import random
    from model.train import token_batches
    rng = random.Random(0)
    src = [rng.randint(1, 40) for _ in range(500)]
    tgt = [rng.randint(1, 40) for _ in range(500)]
    batches = token_batches(src, tgt, 300, rng)
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        assert len(b) == 1 or max(max(src[i], tgt[i]) for i in b) * len(b) <= 300


def test_learning_rate_schedule():
    from model.train import inverse_sqrt_lr
    assert inverse_sqrt_lr(50, 1e-3, 100) == pytest.approx(5e-4)
    assert inverse_sqrt_lr(100, 1e-3, 100) == pytest.approx(1e-3)
    assert inverse_sqrt_lr(400, 1e-3, 100) == pytest.approx(5e-4)


@pytest.mark.parametrize("vocab", [8000, 7999, 8001, 300])
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("compiled", [True, False])
def test_row_topk_equals_torch_topk(vocab, k, compiled, monkeypatch):
    from model import kernels
    from model.decoding import row_topk
    if compiled and kernels.topk_op() is None:
        pytest.skip("no compiled CPU kernels here")
    if not compiled:
        monkeypatch.setitem(kernels._loaded, "topk", None)
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(37, vocab, generator=g).log_softmax(-1)
    x[:, :3] = float("-inf")                       # masked ids (pad, BOS, EOS)
    x[0, -1] = 5.0                                 # the best id in the (shorter) last chunk
    x[1, -k:] = torch.arange(k, dtype=x.dtype) + 3  # all of the top k at the very end
    x[2, 100:100 + k] = 4.0 + torch.arange(k, dtype=x.dtype)  # all in one chunk
    v, i = row_topk(x, k)
    ref_v, ref_i = x.topk(k, dim=-1)
    assert torch.equal(v, ref_v) and torch.equal(i, ref_i)
    assert torch.equal(x.gather(1, i), v)


def test_eager_fallback_decodes_like_the_compiled_kernel(monkeypatch):
    """Where the kernel cannot be built, decoding takes the eager paths and gives the same results."""
    from model import kernels
    if kernels.decode_attention() is None:
        pytest.skip("compiled kernel unavailable here: every other test already runs the eager paths")
    model = make_model()
    sources = [rand_source(n, n) for n in (3, 9, 14)]
    kinds = ("cross", "decoder")
    fast = generate(model, sources, beam_size=3, n_best=2, max_new_tokens=10, attention_kinds=kinds)
    monkeypatch.setitem(kernels._loaded, "decode_attention", None)
    eager = generate(model, sources, beam_size=3, n_best=2, max_new_tokens=10, attention_kinds=kinds)
    assert [[h.tokens for h in x] for x in fast] == [[h.tokens for h in x] for x in eager]
    for a, b in zip(fast, eager):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-10)
        for ha, hb in zip(a, b):
            for kind in kinds:
                torch.testing.assert_close(ha.attention[kind], hb.attention[kind])


def test_packed_encoder_prefill_equals_padded():
    """encode_into_cache through the packed encoder (no padding, compiled kernel) stores the same
    cross-attention K/V as the padded encoder, and encode_packed equals encode on real tokens."""
    from model import kernels
    from model.decoding import encode_into_cache, pad_batch
    if kernels.decode_attention() is None:
        pytest.skip("compiled kernel unavailable here: prefill always takes the padded path")
    model = make_model()
    sources = [rand_source(n, n) for n in (3, 12, 1, 7)]
    src = pad_batch(sources, model.cfg.pad_id)
    lengths = torch.tensor([len(s) for s in sources])
    keep = torch.arange(src.size(1))[None, :] < lengths[:, None]
    memory, _ = model.encode(src, padding_mask(src, model.cfg.pad_id))
    with torch.no_grad():
        torch.testing.assert_close(model.encode_packed(src[keep], lengths), memory[keep])
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


def test_bf16_packed_linears_are_close_to_fp32_and_optional(monkeypatch):
    from model.linear import default_dtype, onednn_available
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    model = make_model(dtype=torch.float32)
    src = torch.tensor([rand_source(9, 1), rand_source(9, 2)])
    tgt = torch.tensor([[2, 5, 6, 7], [2, 8, 9, 10]])
    with torch.no_grad():
        mask = padding_mask(src, 0)
        memory, _ = model.encode(src, mask)
        plain, _ = model.decode(tgt, model.cross_kv(memory), mask)
        assert model.pack_for_inference(dtype=torch.bfloat16)
        assert model._packed_out.dtype == torch.bfloat16
        memory, _ = model.encode(src, mask)
        bf16, _ = model.decode(tgt, model.cross_kv(memory), mask)
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, plain)
    torch.testing.assert_close(bf16, plain, rtol=0.05, atol=0.05 * float(plain.abs().max()))
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        model.pack_for_inference(dtype=torch.float16)
    monkeypatch.setenv("MT_LINEAR_DTYPE", "bfloat16")
    assert default_dtype() == torch.bfloat16
    monkeypatch.setenv("MT_LINEAR_DTYPE", "int8")
    assert default_dtype() == torch.int8
    monkeypatch.setenv("MT_LINEAR_DTYPE", "int4")
    with pytest.raises(ValueError, match="MT_LINEAR_DTYPE"):
        default_dtype()
    monkeypatch.setenv("MT_LINEAR_DTYPE", "float32")
    assert default_dtype() == torch.float32
    monkeypatch.delenv("MT_LINEAR_DTYPE")
    assert default_dtype() == torch.int8


def test_int8_linear_quantizes_per_row_and_per_output_feature():
    from model.linear import PackedWeight, onednn_available
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    w[3] = 0.0                                        # an all-zero output feature: scale 1, output = bias
    b = torch.randn(40, generator=g)
    x = torch.randn(2, 5, 24, generator=g) * torch.logspace(-3, 2, 5)[None, :, None]   # rows of very different size
    x[1, 2] = 0.0                                     # an all-zero input row
    p = PackedWeight(w, torch.int8)
    out = p(x, b)
    assert out.shape == (2, 5, 40) and out.dtype == torch.float32
    # reference: the same quantization written out row by row in float64
    wq = torch.round(w.double() / p.scale.double()[:, None]).clamp(-127, 127)
    for r in x.reshape(-1, 24):
        s = float(r.abs().max()) / 127 or 1.0
        ref = (torch.round(r.double() / s) @ wq.t()) * s * p.scale.double() + b.double()
        got = p(r[None], b)[0]
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, 2], b)
    torch.testing.assert_close(out[:, :, 3], b[3].expand(2, 5))
    # per-row scales: each row is within ~1% of float32, however small or large it is
    exact = x @ w.t() + b
    err = (out - exact).norm(dim=-1) / (exact - b).norm(dim=-1).clamp(min=1e-12)
    assert float(err[~(x.abs().sum(-1) == 0)].max()) < 0.03
    # a row's result does not depend on the rows batched with it, bit for bit
    assert torch.equal(p(x[0, 1:3], b), out[0, 1:3])


def test_int8_compiled_and_eager_halves_agree(monkeypatch):
    from model import kernels
    from model.linear import PackedWeight, onednn_available
    if not onednn_available() or kernels.int8_ops() is None:
        pytest.skip("no compiled CPU kernels here")
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    x = torch.randn(7, 64, generator=g) * torch.logspace(-2, 2, 7)[:, None]
    x[4] = 0.0
    p = PackedWeight(w, torch.int8)
    q, scale = kernels.int8_ops().quantize_rows(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and not q[4].any() and float(scale[4]) == 1.0
    compiled = (p(x, b), p(x, None))
    monkeypatch.setitem(kernels._loaded, "int8", None)
    eager = (p(x, b), p(x, None))
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-5)
    with pytest.raises(RuntimeError):
        kernels._module().dequantize(torch.zeros(2, 3, dtype=torch.int32), torch.ones(2), torch.ones(4), None)


def test_int8_model_decodes_each_sentence_as_alone_bit_for_bit():
    from model.linear import onednn_available
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    model = make_model(dtype=torch.float32)
    assert model.linear_dtype == "float32"
    assert model.pack_for_inference(dtype=torch.int8)
    assert model._packed_out.dtype == torch.int8 and model.linear_dtype == "int8"
    sources = [rand_source(n, seed) for seed, n in enumerate((5, 12, 3, 9, 7, 14))]
    for beam in (1, 3):
        batched = generate(model, sources, beam, 2 if beam > 1 else 1, 12)
        for src, hyps in zip(sources, batched):
            alone = generate(model, [src], beam, 2 if beam > 1 else 1, 12)[0]
            assert [h.tokens for h in hyps] == [h.tokens for h in alone]
            assert [h.log_prob for h in hyps] == [h.log_prob for h in alone]
    model.pack_for_inference(enabled=False)


def test_packing_falls_back_to_float32_where_int8_is_unavailable(monkeypatch):
    from model import linear
    if not linear.onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    model = make_model(dtype=torch.float32)
    src = torch.tensor([rand_source(7, 3)])
    with torch.no_grad():
        mask = padding_mask(src, 0)
        memory, _ = model.encode(src, mask)
        plain = model.cross_kv(memory)[0][0]

    def no_int8(self, x, bias):
        raise RuntimeError("no int8 matrix product in this build")
    monkeypatch.setattr(linear.PackedWeight, "_int8", no_int8)
    assert model.pack_for_inference(dtype=torch.int8) and model.linear_dtype == "float32"
    with torch.no_grad():
        memory, _ = model.encode(src, mask)
        torch.testing.assert_close(model.cross_kv(memory)[0][0], plain, rtol=1e-5, atol=1e-5)
    model.pack_for_inference(enabled=False)
