"""The compiled decoder-layer step (model/inference/fused_step.py, csrc/decoder_step.cpp) against the module
path it replaces: the same bits for greedy and beam search, contiguous and paged caches, mixed
lengths, few and many rows, post-LN and pre-LN, ReLU and SiLU, int8 and float32 weights; and the
cases where it must step aside."""
from __future__ import annotations

import pytest
import torch

from model.inference import fused_step, kernels, settings
from model.inference.step import decode_step
from model.inference.prefill import encode_into_cache, encode_packed
from model.inference.generate import generate, pad_batch
from model.inference.kv_cache import KVCache
from model.inference.paged_cache import PagedKVCache, allocate_blocks
from model.inference.linear import linear_dtype, pack_for_inference
from tiny_model import make_model, one_thread, rand_source  # noqa: F401 (one_thread: autouse fixture)

pytestmark = pytest.mark.skipif(kernels.decoder_step_op() is None, reason="compiled CPU kernels unavailable")

CONFIGS = {
    "post-LN, ReLU, shared embeddings": {},
    "pre-LN, SiLU, separate embeddings": {"norm_first": True, "activation": "swish", "share_embeddings": False},
}


def packed_model(config: str, dtype: torch.dtype, seed: int = 0):
    model = make_model(torch.float32, seed, **CONFIGS[config])
    assert pack_for_inference(model, dtype=dtype)
    return model


class Counter:
    """Wraps the compiled op to count its calls (so a test knows which path ran)."""

    def __init__(self):
        self.op, self.calls = kernels.decoder_step_op(), 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def run(model, sources, beam, budgets, cache_kind, monkeypatch, fused: bool):
    n = len(sources) * beam
    cache = (PagedKVCache.for_model(model, n, num_blocks=60 * n, block_size=4) if cache_kind == "paged"
             else KVCache.for_model(model, n, indirect=beam > 1))
    counter = Counter()
    monkeypatch.setitem(kernels._loaded, "decoder_step", counter if fused else None)
    out = generate(model, sources, beam, beam, budgets, cache=cache)
    monkeypatch.delitem(kernels._loaded, "decoder_step")
    return [[(h.tokens, h.score) for h in r] for r in out], counter.calls


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.int8, torch.float32], ids=["int8", "float32"])
@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_fused_step_translates_exactly_as_the_module_path(config, dtype, beam, cache_kind, monkeypatch):
    model = packed_model(config, dtype)
    sources = [rand_source(n, 5 * n) for n in (2, 7, 13, 30, 4)]
    budgets = [9, 30, 4, 22, 15]                 # rows leave the batch at different steps
    ref, calls = run(model, sources, beam, budgets, cache_kind, monkeypatch, fused=False)
    assert calls == 0
    got, calls = run(model, sources, beam, budgets, cache_kind, monkeypatch, fused=True)
    assert calls >= model.cfg.n_decoder_layers * 4  # the compiled step ran, layer by layer
    assert got == ref                                # tokens and float scores, exactly


@pytest.mark.parametrize("dtype, layer_kernel", [(torch.int8, True), (torch.int8, False), (torch.float32, True)],
                         ids=["int8", "int8-no-layer-kernel", "float32"])
def test_one_step_over_many_rows_gives_the_module_path_bits(dtype, layer_kernel, monkeypatch):
    """40 rows (int8: the compiled layer kernel, AVX-512 VNNI or AVX2, inside the compiled layer step;
    with the layer kernel off after packing, torch._int_mm on whichever layout the weight kept), every
    row at its own position: log-probabilities and the cache's new keys
    equal the module path's."""
    model = packed_model("post-LN, ReLU, shared embeddings", dtype, seed=3)
    if not layer_kernel:
        monkeypatch.setitem(kernels._loaded, "int8_layer", None)
    n = 40
    sources = [rand_source(2 + i % 11, i) for i in range(n)]
    outs, caches = [], []
    for fused in (False, True):
        monkeypatch.setitem(kernels._loaded, "decoder_step", Counter() if fused else None)
        cache = PagedKVCache.for_model(model, n, num_blocks=40 * n, block_size=4)
        slots = torch.tensor(cache.slots.allocate(n))
        lengths = torch.tensor([len(s) for s in sources])
        allocate_blocks(cache, slots[:, None], 4, lengths)   # every position these 5 steps write
        with torch.no_grad():
            encode_into_cache(model, cache, slots[:, None], pad_batch(sources, model.cfg.pad_id), lengths)
            g = torch.Generator().manual_seed(1)
            for t in range(5):   # row i starts at step i % 5: the last step has rows at positions 0..4
                rows = torch.tensor([i for i in range(n) if i % 5 <= t])
                tokens = torch.randint(4, model.cfg.vocab_size, (rows.numel(),), generator=g)
                out = decode_step(model, cache, slots[rows], tokens, t - rows % 5)
            if fused:
                assert kernels._loaded["decoder_step"].calls == 5 * model.cfg.n_decoder_layers
        outs.append(out.log_probs)
        caches.append(cache.k.clone())
        monkeypatch.delitem(kernels._loaded, "decoder_step")
    assert outs[0].shape == (n, model.cfg.vocab_size)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1])


def test_the_compiled_step_steps_aside_where_it_does_not_apply(monkeypatch):
    """Attention weights asked for, a bfloat16 model, a weight changed after packing, fused_step off:
    the module path runs (and gives its own results)."""
    model = packed_model("post-LN, ReLU, shared embeddings", torch.int8)
    counter = Counter()
    monkeypatch.setitem(kernels._loaded, "decoder_step", counter)
    sources = [rand_source(6, 1), rand_source(9, 2)]
    out = generate(model, sources, 2, 1, 6, attention_kinds=("cross",))
    assert counter.calls == 0 and out[0][0].attention["cross"] is not None
    generate(model, sources, 1, 1, 6)
    assert counter.calls > 0
    # a weight changed in place: its packed copy is stale, the whole step goes back to the modules
    counter.calls = 0
    with torch.no_grad():
        model.decoder[0].ffn.w1.weight.mul_(2.0)
    assert fused_step.layer_params(model.decoder[0]) is None
    monkeypatch.setitem(kernels._loaded, "decoder_step", None)
    ref = generate(model, sources, 1, 1, 6)
    monkeypatch.setitem(kernels._loaded, "decoder_step", counter)
    assert generate(model, sources, 1, 1, 6)[0][0].tokens == ref[0][0].tokens and counter.calls == 0
    # bfloat16 prepacked weights are not served by the compiled step
    bf = make_model(torch.float32, 0)
    if pack_for_inference(bf, dtype=torch.bfloat16) and linear_dtype(bf) == "bfloat16":
        generate(bf, sources, 1, 1, 6)
        assert counter.calls == 0
    # fused_step off (EngineConfig.fused_step, MT_FUSED_STEP=0) turns it off alone
    monkeypatch.setattr(settings, "_current", settings.InferenceSettings(fused_step=False))
    generate(packed_model("post-LN, ReLU, shared embeddings", torch.int8), sources, 1, 1, 6)
    assert counter.calls == 0


def test_the_engine_on_the_compiled_step_gives_offline_results(monkeypatch):
    """The serving engine (paged cache, continuous batching, preemption when blocks run out, greedy and
    beams mixed) on an int8 model with the compiled step: each request's hypotheses equal offline
    ``generate`` on the module path, and no block is left behind."""
    import asyncio

    from service.engine import Engine, EngineConfig, GenerationOptions
    model = packed_model("pre-LN, SiLU, separate embeddings", torch.int8, seed=2)
    reqs = [(rand_source(3 + (i * 7) % 19, 40 + i),
             GenerationOptions(beam_size=(1, 4, 2)[i % 3], n_best=1, max_new_tokens=6 + (i * 5) % 30))
            for i in range(12)]
    counter = Counter()
    monkeypatch.setitem(kernels._loaded, "decoder_step", None)
    ref = [generate(model, [s], o.beam_size, o.n_best, o.max_new_tokens)[0] for s, o in reqs]
    monkeypatch.setitem(kernels._loaded, "decoder_step", counter)
    engine = Engine(model, EngineConfig(max_num_seqs=64, kv_blocks=60, kv_block_size=4, policy="prefill_first"))

    async def main():
        await engine.start()
        try:
            out = await asyncio.gather(*(engine.translate(s, o) for s, o in reqs))
            return out, engine.stats()
        finally:
            await engine.stop()

    out, stats = asyncio.run(main())
    assert counter.calls > 0
    for r, want in zip(out, ref):
        assert [(h.tokens, h.score) for h in r.hypotheses] == [(h.tokens, h.score) for h in want]
    assert stats.preemptions > 0
    assert stats.free_kv_blocks == stats.kv_blocks == 60


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.int8, torch.float32], ids=["int8", "float32"])
def test_the_compiled_encoder_layers_give_the_module_path_bits(config, dtype, monkeypatch):
    """``Transformer.encode_packed`` (prefill's encoder) with each layer one compiled call against the
    module path: the same memory, bit for bit, for a packed batch of 1 to 50 sentences of mixed lengths."""
    model = packed_model(config, dtype, seed=4)
    for n in (1, 3, 50):
        lengths = torch.tensor([1 + (7 * i) % 23 for i in range(n)])
        tokens = torch.cat([torch.tensor(rand_source(int(k), 100 + i)) for i, k in enumerate(lengths)])
        with torch.no_grad():
            monkeypatch.setitem(kernels._loaded, "decoder_step", None)
            ref = encode_packed(model, tokens, lengths)
            monkeypatch.delitem(kernels._loaded, "decoder_step")
            assert fused_step.encode_packed(model, model.src_embed(tokens[:, None])[:, 0], _attend(lengths)) is not None
            got = encode_packed(model, tokens, lengths)
        assert got.shape == ref.shape == (int(lengths.sum()), model.cfg.d_model)
        assert torch.equal(got, ref)


def _attend(lengths):
    from model.inference.prefill import PackedSelfAttention
    return PackedSelfAttention(lengths)


def test_repacking_in_another_dtype_is_followed(monkeypatch):
    """int8, then float32, then int8 again: each time the compiled step uses the weights now packed
    (its results equal the module path's in that dtype), never a cached copy of earlier ones."""
    model = packed_model("post-LN, ReLU, shared embeddings", torch.int8, seed=5)
    sources = [rand_source(5, 1), rand_source(12, 2), rand_source(8, 3)]
    for dtype in (torch.int8, torch.float32, torch.int8):
        assert pack_for_inference(model, dtype=dtype)
        monkeypatch.setitem(kernels._loaded, "decoder_step", None)
        ref = generate(model, sources, 2, 2, 12)
        monkeypatch.delitem(kernels._loaded, "decoder_step")
        got = generate(model, sources, 2, 2, 12)
        assert [[(h.tokens, h.score) for h in r] for r in got] == [[(h.tokens, h.score) for h in r] for r in ref]


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_cross_attention_weights_alone_keep_the_compiled_step(beam, cache_kind, monkeypatch):
    """Asking only for cross-attention rows (the service does, to place protected spans) takes the
    compiled step: the log-probs and the rows equal the module path's bit for bit, beams included
    (their hypotheses share the source's keys)."""
    model = packed_model("post-LN, ReLU, shared embeddings", torch.int8, seed=5)
    sources = [rand_source(n, 3 * n) for n in (3, 11, 6, 17)]
    B = len(sources)
    results = []
    for fused in (False, True):
        counter = Counter()
        monkeypatch.setitem(kernels._loaded, "decoder_step", counter)
        cache = (PagedKVCache.for_model(model, B * beam, num_blocks=40 * B * beam, block_size=4)
                 if cache_kind == "paged" else KVCache.for_model(model, B * beam, indirect=beam > 1))
        slots = torch.tensor(cache.slots.allocate(B * beam)).view(B, beam)
        lengths = torch.tensor([len(s) for s in sources])
        g = torch.Generator().manual_seed(2)
        steps = []
        allocate_blocks(cache, slots, 3, lengths)   # nothing on the contiguous cache
        with torch.no_grad():
            encode_into_cache(model, cache, slots, pad_batch(sources, model.cfg.pad_id), lengths)
            for t in range(4):
                tokens = torch.randint(4, model.cfg.vocab_size, (B * beam,), generator=g)
                out = decode_step(model, cache, slots.reshape(-1), tokens, torch.full((B * beam,), t),
                                  need_weights=True, self_weights=not fused)
                assert (out.decoder is None) == fused and len(out.cross) == model.cfg.n_decoder_layers
                steps.append((out.log_probs, out.cross))
        assert (counter.calls == 4 * model.cfg.n_decoder_layers) if fused else counter.calls == 0
        results.append(steps)
        monkeypatch.delitem(kernels._loaded, "decoder_step")
    for (lp_ref, cross_ref), (lp, cross) in zip(*results):
        assert torch.equal(lp, lp_ref)
        assert all(torch.equal(a, b) for a, b in zip(cross, cross_ref))
        assert cross[0].shape == (B * beam, model.cfg.n_heads, max(len(s) for s in sources))
        torch.testing.assert_close(cross[0].sum(-1), torch.ones(B * beam, model.cfg.n_heads))
