"""Every decode path runs the T5 flags (RMSNorm, d_kv heads, unscaled attention, relative position
buckets, gated-GELU, no biases) or refuses them by name: the incremental step (its decoder relative
bias from each row's own position) equals the full forward, on the contiguous, indirect and paged
caches, with rows at different positions in one step; batched equals alone; the compiled CPU
kernels, the fused step and the CUDA dense step are not chosen (the eager step runs); int8 runs."""
from __future__ import annotations

import pytest
import torch
from tiny_model import make_model, one_thread, rand_source, uncached_greedy  # noqa: F401 (autouse fixture)

from model.attention import relative_position_bucket
from model.inference.attention_plan import AttentionPlan
from model.inference.generate import generate
from model.inference.kv_cache import KVCache
from model.inference.linear import linear_dtype, pack_for_inference
from model.inference.paged_cache import PagedKVCache
from model.inference.prefill import prefill
from model.inference.step import Variant, choose_variant, decode_step
from model.transformer import padding_mask

T5_FLAGS = dict(norm="rmsnorm", d_kv=16, scale_attention=False, relative_buckets=8, relative_max_distance=12,
                gated_ffn=True, activation="gelu_new", linear_bias=False, positional="none", scale_embedding=False,
                norm_first=True, share_embeddings=True, separate_output=True, layer_norm_eps=1e-6)
SOURCES = [rand_source(n, seed=n) for n in (3, 9, 17, 25, 6, 30)]   # beyond max_distance: logarithmic buckets


def t5_model(dtype=torch.float64, seed=0):
    model = make_model(dtype, seed, **T5_FLAGS)
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
    """Greedy over the KV cache (compiled kernels switched on for the process: not used) gives the
    tokens and log-probability of re-running the whole decoder at each step."""
    model = t5_model()
    assert not model.cfg.compiled_ok
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


def test_attention_weights_and_variants():
    """Attention weights come back as for the paper's model; the compiled, fused and CUDA dense
    variants are never chosen for the flags, and the compiled attention refuses them by name."""
    model = t5_model()
    plain = generate(model, SOURCES[:2], beam_size=2, max_new_tokens=8)
    kinds = ("cross", "decoder", "encoder")
    weighted = generate(model, SOURCES[:2], beam_size=2, max_new_tokens=8, attention_kinds=kinds)
    assert [h[0].tokens for h in weighted] == [h[0].tokens for h in plain]
    assert weighted[1][0].attention["cross"].shape[-1] == len(SOURCES[1])
    for device, paged, kernels in (("cuda", True, False), ("cpu", False, True)):
        v = choose_variant(device=device, paged=paged, kernels=kernels, fused_step=True, graphs=True,
                           need_weights=False, self_weights=False, need_logits=False, compiled_ok=False)
        assert v is Variant.EAGER
    plan = AttentionPlan(torch.tensor([0]), torch.tensor([3]), 8, packed=True, kernel=True)
    K = torch.zeros(1, 8, 4, 16)
    with pytest.raises(ValueError, match="relative position bias"):
        plan.attend(K, K, torch.zeros(1, 1, 4, 16), False, bias=torch.zeros(1, 4, 1, 3), scale=1.0)


def test_int8_runs():
    """int8 linear layers (the CPU default) run the flags: next-token log-probabilities close to float32's."""
    model = t5_model(torch.float32)
    src = torch.tensor([SOURCES[3]])
    cache = KVCache.for_model(model, 1, 4, 32)
    want = prefill(model, cache, torch.tensor([0]), src).log_probs
    assert pack_for_inference(model, "int8") and linear_dtype(model) == "int8"
    cache = KVCache.for_model(model, 1, 4, 32)
    got = prefill(model, cache, torch.tensor([0]), src).log_probs
    diff = (got.exp() - want.exp()).abs().max().item()
    assert 0 < diff < 0.01                        # int8 rounds, and only that much
    assert len(generate(model, SOURCES, max_new_tokens=8)) == len(SOURCES)
