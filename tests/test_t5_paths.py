"""Every decode path runs the T5 flags (RMSNorm, d_kv heads, unscaled attention, relative position
buckets, gated-GELU, no biases): the incremental step (its decoder relative bias from each row's own
position) equals the full forward, on the contiguous, indirect and paged caches, with rows at
different positions in one step; batched equals alone; the compiled CPU attention (both of its
loops), the fused layer step (encoder and decoder, int8 and float32) and the GPU fixed-shape step
(run here on CPU) equal the eager step, greedy and beam 4; int8 runs the compiled int8 layers."""
from __future__ import annotations

import pytest
import torch
from tiny_model import make_model, one_thread, rand_source, uncached_greedy  # noqa: F401 (autouse fixture)

from model.attention import relative_position_bucket
from model.inference import kernels
from model.inference.attention_plan import AttentionPlan
from model.inference.generate import generate
from model.inference.kv_cache import KVCache
from model.inference.linear import PackedLinear, linear_dtype, pack_for_inference
from model.inference.paged_cache import PagedKVCache
from model.inference.prefill import prefill
from model.inference.step import decode_step
from model.transformer import padding_mask

T5_FLAGS = dict(norm="rmsnorm", d_kv=16, scale_attention=False, relative_buckets=8, relative_max_distance=12,
                gated_ffn=True, activation="gelu_new", linear_bias=False, positional="none", scale_embedding=False,
                norm_first=True, share_embeddings=True, separate_output=True, layer_norm_eps=1e-6)
SOURCES = [rand_source(n, seed=n) for n in (3, 9, 17, 25, 6, 30)]   # beyond max_distance: logarithmic buckets


def t5_model(dtype=torch.float64, seed=0, **overrides):
    model = make_model(dtype, seed, **{**T5_FLAGS, **overrides})
    with torch.no_grad():                      # wider than the init, so outputs depend on the source
        model.enc_rel.table.weight.normal_(0.0, 1.0)
        model.dec_rel.table.weight.normal_(0.0, 1.0)
        model.src_embed.tok.weight.mul_(4.0)
    return model


def test_bucket_equals_transformers():
    """The bucket of every relative position in -300..300 equals transformers' T5 (both directions)."""
    T5Attention = pytest.importorskip("transformers.models.t5.modeling_t5").T5Attention
    rel = torch.arange(-300, 301)
    for bidirectional in (True, False):
        want = T5Attention._relative_position_bucket(rel, bidirectional, 32, 128)
        assert torch.equal(relative_position_bucket(rel, bidirectional, 32, 128), want)


def test_incremental_equals_full_forward():
    """Greedy over the KV cache (the compiled attention where it builds: float64, its generic loop)
    gives the tokens and log-probability of re-running the whole decoder at each step."""
    model = t5_model()
    outs = set()
    for src in SOURCES:
        want, lp = uncached_greedy(model, src, 20)
        got = generate(model, [src], max_new_tokens=20)[0][0]
        assert got.tokens == want
        assert got.log_prob == pytest.approx(lp, abs=1e-9)
        outs.add(tuple(want))
    assert len(outs) == len(SOURCES)


@pytest.mark.parametrize("beam", [1, 4])
def test_batched_equals_alone_on_every_cache(beam):
    """One batch of six sources of different lengths equals each alone, on the contiguous, indirect
    (beam reorders copy slot ids; packed eager attention) and paged caches."""
    model = t5_model()
    alone = [generate(model, [s], beam_size=beam, n_best=beam, max_new_tokens=16)[0] for s in SOURCES]
    n = len(SOURCES) * beam
    caches = {"contiguous": None, "indirect": KVCache.for_model(model, n, 17, 30, indirect=True),
              "paged": PagedKVCache.for_model(model, n, max_tgt_len=17, max_src_len=30, block_size=4)}
    for name, cache in caches.items():
        got = generate(model, SOURCES, beam_size=beam, n_best=beam, max_new_tokens=16, cache=cache)
        for a, g in zip(alone, got):
            assert [h.tokens for h in g] == [h.tokens for h in a], name
            assert [h.score for h in g] == pytest.approx([h.score for h in a], abs=1e-9), name


@pytest.mark.parametrize("paged", [False, True])
def test_rows_at_different_positions(paged):
    """One decode step of two rows at positions 5 and 1 (packed over each row's own keys, each with
    its own relative bias) gives the full forward's log-probabilities of each."""
    model = t5_model()
    cache = (PagedKVCache.for_model(model, 2, max_tgt_len=16, max_src_len=32, block_size=4) if paged
             else KVCache.for_model(model, 2, 16, 32))
    srcs = [SOURCES[2], SOURCES[3]]
    bos = model.cfg.bos_id
    targets = [[bos, 7, 9, 11, 13, 15, 17], [bos, 21]]
    for slot, src in enumerate(srcs):
        slots = cache.slots.allocate(1)
        if paged:
            from model.inference.paged_cache import allocate_blocks
            allocate_blocks(cache, [slots], 15, [len(src)])
        prefill(model, cache, torch.tensor(slots), torch.tensor([src]))
    for p in range(1, 5):                        # row 0 alone up to position 4
        decode_step(model, cache, torch.tensor([0]), torch.tensor([targets[0][p]]), torch.tensor([p]))
    out = decode_step(model, cache, torch.tensor([0, 1]), torch.tensor([targets[0][5], targets[1][1]]),
                      torch.tensor([5, 1]), fused_step=True)
    for row, (src, tgt, last) in enumerate(zip(srcs, targets, (5, 1))):
        s = torch.tensor([src])
        mask = padding_mask(s, model.cfg.pad_id)
        logits, _ = model.decode(torch.tensor([tgt[: last + 1]]), model.cross_kv(model.encode(s, mask)[0]), mask)
        want = logits[0, -1].clone()
        want[[model.cfg.pad_id, bos]] = float("-inf")     # never generated
        assert torch.allclose(out.log_probs[row], torch.log_softmax(want, -1), atol=1e-9)


def test_attention_weights():
    """Attention weights come back as for the paper's model, with the same tokens."""
    model = t5_model()
    plain = generate(model, SOURCES[:2], beam_size=2, max_new_tokens=8)
    kinds = ("cross", "decoder", "encoder")
    weighted = generate(model, SOURCES[:2], beam_size=2, max_new_tokens=8, attention_kinds=kinds)
    assert [h[0].tokens for h in weighted] == [h[0].tokens for h in plain]
    assert weighted[1][0].attention["cross"].shape[-1] == len(SOURCES[1])
    assert weighted[1][0].attention["decoder"][0].shape[-1] >= 1


@pytest.mark.skipif(kernels.decode_attention() is None, reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("heads, dtype", [(4, torch.float64), (8, torch.float32)], ids=["generic", "eight-heads"])
def test_compiled_attention_takes_bias_and_scale(heads, dtype):
    """The compiled decode attention with a relative bias and scale 1 over ragged rows gives the eager
    plan's output and weights (its generic loop, and eight float32 heads at a time); bias rows
    outside its table are refused, naming them."""
    g = torch.Generator().manual_seed(0)
    slots, lengths = torch.tensor([0, 2, 1]), torch.tensor([3, 7, 1])
    K, V = (torch.randn(3, 8, heads, 16, generator=g, dtype=dtype) for _ in range(2))
    q = torch.randn(3, 1, heads, 16, generator=g, dtype=dtype)
    bias = torch.randn(3, heads, 1, 7, generator=g, dtype=dtype) * 3
    plans = [AttentionPlan(slots, lengths, 8, packed=True, kernel=k) for k in (False, True)]
    (out, w), (k_out, k_w) = (p.attend(K, V, q, True, bias=bias, scale=1.0) for p in plans)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert k_out.shape == out.shape == (3, 1, heads, 16) and k_w.shape == w.shape == (3, heads, 1, 7)
    assert torch.allclose(k_out, out, atol=tol) and torch.allclose(k_w, w, atol=tol)
    assert not torch.allclose(plans[0].attend(K, V, q, False, scale=1.0)[0], out, atol=1e-3)   # the bias counts
    with pytest.raises(RuntimeError, match="row 1's bias rows 0..6 are outside 0..4"):
        kernels.packed_decode_attention(q, K.view(-1, heads, 16), V.view(-1, heads, 16), plans[1].key_index,
                                        plans[1].starts, 7, scale=1.0, bias=torch.zeros(5, heads, dtype=dtype),
                                        bias_start=torch.zeros(3, dtype=torch.long))


def test_int8_runs():
    """int8 linear layers (the CPU default) run the flags: next-token log-probabilities close to float32's."""
    model = t5_model(torch.float32)
    src = torch.tensor([SOURCES[3]])
    cache = KVCache.for_model(model, 1, 4, 32)
    want = prefill(model, cache, torch.tensor([0]), src).log_probs
    assert pack_for_inference(model, "int8") and linear_dtype(model) == "int8"
    if kernels.int8_linear_kernel() is not None:   # every layer in one compiled call, as for other models
        assert all(m.packed.small is not None for m in model.modules() if isinstance(m, PackedLinear))
    cache = KVCache.for_model(model, 1, 4, 32)
    got = prefill(model, cache, torch.tensor([0]), src).log_probs
    diff = (got.exp() - want.exp()).abs().max().item()
    assert 0 < diff < 0.01                        # int8 rounds, and only that much
    assert len(generate(model, SOURCES, max_new_tokens=8)) == len(SOURCES)


def run(model, sources, beam, cache_kind, cpu_kernels=None):
    """generate on a fresh cache of ``cache_kind``: per source its (tokens, score) hypotheses."""
    n = len(sources) * beam
    cache = (PagedKVCache.for_model(model, n, num_blocks=40 * n, block_size=4, cpu_kernels=cpu_kernels)
             if cache_kind == "paged" else KVCache.for_model(model, n, indirect=beam > 1 and cpu_kernels is not False,
                                                             cpu_kernels=cpu_kernels))
    out = generate(model, sources, beam, beam, 16, cache=cache)
    return [[(h.tokens, h.score) for h in r] for r in out]


def same(got, want, tol):
    """Tokens equal, scores within ``tol``."""
    assert [[h[0] for h in r] for r in got] == [[h[0] for h in r] for r in want]
    assert [h[1] for r in got for h in r] == pytest.approx([h[1] for r in want for h in r], abs=tol)


@pytest.mark.skipif(kernels.decode_attention() is None, reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_compiled_attention_step_equals_the_eager_step(beam, cache_kind):
    """The decode step with the compiled attention (float64: the generic loop; float32 with eight
    heads: the vectorised one) gives the eager step's tokens and scores."""
    for model, tol in ((t5_model(), 1e-10), (t5_model(torch.float32, n_heads=8, d_kv=8), 1e-4)):
        want = run(model, SOURCES, beam, cache_kind, cpu_kernels=False)
        same(run(model, SOURCES, beam, cache_kind, cpu_kernels=True), want, tol)


@pytest.mark.skipif(kernels.decoder_step_op() is None, reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("dtype", [torch.int8, torch.float32], ids=["int8", "float32"])
@pytest.mark.parametrize("beam", [1, 4])
def test_fused_step_equals_the_module_path(dtype, beam, monkeypatch):
    """The compiled layer steps (prefill's encoder and every decoder step) give the module path's
    tokens and scores bit for bit, on the contiguous and paged caches, and the eager step's tokens
    (scores within float rounding); each sentence alone equals the batch."""
    model = t5_model(torch.float32, n_heads=8, d_kv=8)
    assert pack_for_inference(model, dtype=dtype)
    eager = run(model, SOURCES, beam, "contiguous", cpu_kernels=False)
    ops, calls = {"decoder_step": kernels.decoder_step_op(), "encoder_step": kernels.encoder_step_op()}, []
    monkeypatch.setitem(kernels._loaded, "decoder_step", None)        # both compiled layer steps off
    ref = run(model, SOURCES, beam, "contiguous")
    for name, op in ops.items():                                      # on, counting their calls
        monkeypatch.setitem(kernels._loaded, name, lambda *a, op=op, name=name: calls.append(name) or op(*a))
    for cache_kind in ("contiguous", "paged"):
        assert run(model, SOURCES, beam, cache_kind) == ref, cache_kind
    assert calls.count("decoder_step") >= 2 * 4 * model.cfg.n_decoder_layers and "encoder_step" in calls
    same(ref, eager, 1e-3 if dtype == torch.int8 else 1e-4)   # int8: inputs round to other levels
    assert [run(model, [s], beam, "paged")[0] for s in SOURCES] == ref
    assert len({tuple(r[0][0]) for r in ref}) >= 4                    # outputs depend on the source


@pytest.mark.parametrize("beam", [1, 4])
def test_gpu_fixed_shape_step_equals_the_packed_step(beam, monkeypatch):
    """The GPU path's fixed-shape step and a CUDA graph's padded replay (run here on CPU, as
    tests/test_dense_step.py does): relative biases over the key capacity, unscaled logits; the
    packed step's tokens and scores."""
    from test_dense_step import dense_step, graph_like_step

    from model.inference import generate as generate_mod
    model = t5_model(seed=3)
    ref = run(model, SOURCES, beam, "paged")
    for fn in (dense_step, graph_like_step):
        monkeypatch.setattr(generate_mod, "decode_step", fn)
        same(run(model, SOURCES, beam, "paged"), ref, 1e-10)
