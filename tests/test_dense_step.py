"""The GPU path's pieces that run anywhere: the fixed-shape decode step (model/inference/dense_step.py) against
the packed one, the variant choice (model/inference/step.py), the CUDA-graph bucket and fallback rules
(model/inference/cuda_graphs.py) and the
engine's dtype setting (a bfloat16 engine on CPU against float32 on the shipped model)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import DATA, ROOT
from model.inference import generate as generate_mod, prefill as prefill_mod, step as step_mod
from model.inference.generate import generate
from model.inference.dense_step import dense_forward, key_capacity, pad_rows, plan_dense
from model.inference.paged_cache import PagedKVCache, allocate_blocks
from service.engine import Engine, EngineConfig, EngineValidationError, GenerationOptions
from service.engine.config import resolve_dtype
from model.inference.cuda_graphs import DecodeGraphs, bucket_for, row_buckets, use_graph
from tiny_model import make_engine_model, one_thread, rand_source  # noqa: F401 (one_thread: autouse fixture)

SHIPPED = ROOT / "model" / "checkpoints" / "de-en"
EAGER_STEP = step_mod.decode_step


@pytest.fixture(scope="module")
def model():
    return make_engine_model(torch.float64)


def dense_step(model, cache, slots, tokens, positions, need_weights=False):
    """The dense variant (what ``decode_step`` runs on CUDA), here on CPU."""
    if need_weights:
        return EAGER_STEP(model, cache, slots, tokens, positions, need_weights=True)
    return step_mod.StepOutput(dense_forward(model, cache, plan_dense(cache, slots, tokens, positions)))


def graph_like_step(model, cache, slots, tokens, positions, need_weights=False):
    """What a replayed graph computes: rows padded to a bucket, keys to power-of-two capacities."""
    if need_weights:
        return EAGER_STEP(model, cache, slots, tokens, positions, need_weights=True)
    n = slots.numel()
    t = key_capacity(int(positions.max()) + 1, cache.max_tgt_len)
    s = key_capacity(int(cache.src_len[cache.owner[slots]].max()), cache.max_src_len)
    x = pad_rows(plan_dense(cache, slots, tokens, positions, t_cap=t, s_cap=s), bucket_for(n, row_buckets(64)))
    return step_mod.StepOutput(dense_forward(model, cache, x)[:n])


@pytest.mark.parametrize("step", ["dense", "graph_like"])
@pytest.mark.parametrize("beam", [1, 3])
def test_fixed_shape_step_equals_the_packed_step(model, monkeypatch, step, beam):
    sources = [rand_source(n, 5 * n) for n in (2, 9, 23, 40)]
    budgets = [4, 30, 12, 45]
    ref_cache = PagedKVCache.for_model(model, 4 * beam, num_blocks=300, block_size=4)
    ref = generate(model, sources, beam, beam, budgets, cache=ref_cache)
    fn = dense_step if step == "dense" else graph_like_step
    monkeypatch.setattr(generate_mod, "decode_step", fn)
    cache = PagedKVCache.for_model(model, 4 * beam, num_blocks=300, block_size=4)
    got = generate(model, sources, beam, beam, budgets, cache=cache)
    assert [[h.tokens for h in r] for r in got] == [[h.tokens for h in r] for r in ref]
    for a, b in zip(got, ref):
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-10)
    assert cache.slots.num_free_blocks == 300


def test_padding_rows_repeat_row_zero_and_keys_pad_to_powers_of_two(model):
    cache = PagedKVCache.for_model(model, 8, num_blocks=64, block_size=4)
    slots = cache.slots.allocate(3)
    allocate_blocks(cache, [[s] for s in slots], 1, [3, 6, 9])
    prefill_mod.prefill(model, cache, torch.tensor(slots), generate_mod.pad_batch([rand_source(n, n) for n in (3, 6, 9)], 0))
    x = plan_dense(cache, torch.tensor(slots), torch.tensor([5, 6, 7]), torch.tensor([1, 1, 1]), 32, 32)
    assert (x.self_index.size(1), x.cross_index.size(1)) == (32, 32)
    assert x.self_mask.sum(1).tolist() == [2, 2, 2] and x.cross_mask.sum(1).tolist() == [3, 6, 9]
    p = pad_rows(x, 8)
    assert p.rows == 8 and torch.equal(p.tokens, torch.tensor([5, 6, 7, 5, 5, 5, 5, 5]))
    assert torch.equal(p.cross_index[5], x.cross_index[0]) and torch.equal(p.write_at[7], x.write_at[0])
    with pytest.raises(ValueError, match="pad 3 rows to 2"):
        pad_rows(x, 2)
    with pytest.raises(ValueError, match="exceed the capacity"):
        plan_dense(cache, torch.tensor(slots), torch.tensor([5, 6, 7]), torch.tensor([2, 2, 2]), 32, 8)


def test_bucket_and_capacity_choice():
    assert row_buckets(256) == [8, 16, 32, 64, 128, 256]
    assert row_buckets(100) == [8, 16, 32, 64, 100] and row_buckets(5) == [5]
    assert [bucket_for(n, [8, 16, 100]) for n in (1, 8, 9, 16, 17, 100, 101)] == [8, 8, 16, 16, 100, 100, None]
    assert [key_capacity(n, 256) for n in (1, 32, 33, 64, 65, 200, 256)] == [32, 32, 64, 64, 128, 256, 256]
    assert key_capacity(90, 100) == 100
    with pytest.raises(ValueError, match="exceed the capacity limit 100"):
        key_capacity(101, 100)
    with pytest.raises(ValueError):
        bucket_for(0, [8])


def test_the_variant_choice():
    choose = step_mod.choose_variant
    V = step_mod.Variant
    gpu = dict(device="cuda", paged=True, kernels=False, fused_step=True, graphs=True, need_weights=False,
               self_weights=True, need_logits=False)
    assert choose(**gpu) is V.GRAPH and choose(**{**gpu, "graphs": False}) is V.DENSE
    for change in ({"paged": False}, {"need_weights": True}, {"need_logits": True}):   # the packed step's
        assert choose(**{**gpu, **change}) is V.EAGER
    cpu = {**gpu, "device": "cpu", "kernels": True, "graphs": False}
    assert choose(**cpu) is V.FUSED and choose(**{**cpu, "paged": False}) is V.FUSED
    assert choose(**{**cpu, "need_weights": True, "self_weights": False}) is V.FUSED   # cross rows: fused too
    assert choose(**{**cpu, "need_logits": True}) is V.FUSED
    for change in ({"kernels": False}, {"fused_step": False}, {"need_weights": True}):
        assert choose(**{**cpu, **change}) is V.EAGER


def test_graph_fallback_rules():
    ok = dict(device_type="cuda", bucket=16, captured=False, num_graphs=3, max_graphs=4, failed=False)
    assert use_graph(**ok)
    assert not use_graph(**{**ok, "device_type": "cpu"})
    assert not use_graph(**{**ok, "bucket": None})              # more rows than the largest bucket
    assert not use_graph(**{**ok, "failed": True})              # a capture failed: eager for good
    assert not use_graph(**{**ok, "num_graphs": 4})             # budget spent, not captured yet ...
    assert use_graph(**{**ok, "num_graphs": 4, "captured": True})  # ... but existing graphs still replay


def test_graphs_on_cpu_fall_back_without_touching_the_cache(model):
    cache = PagedKVCache.for_model(model, 4, num_blocks=32, block_size=4)
    slots = cache.slots.allocate(2)
    free = cache.slots.num_free_blocks
    g = DecodeGraphs(model, cache, 4)
    assert g.step(torch.tensor(slots), torch.tensor([1, 1]), torch.tensor([0, 0]), max_target=1, max_source=5) is None
    assert cache.slots.num_free_blocks == free and g.graphs == {}


def test_dtype_selection():
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32" and resolve_dtype("auto", "cpu", "float64") == "float64"
    assert resolve_dtype("float16", "cuda") == "float16" and resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_dtype("float32", "cuda") == "float32"
    with pytest.raises(EngineValidationError, match="float16 needs a CUDA device") as e:
        resolve_dtype("float16", "cpu")
    assert e.value.field == "dtype"
    with pytest.raises(EngineValidationError, match="dtype"):
        EngineConfig(dtype="fp8")
    with pytest.raises(EngineValidationError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    assert EngineConfig.from_dict({"dtype": "bfloat16"}).dtype == "bfloat16"


async def test_engine_refuses_float16_on_cpu_and_a_dtype_change():
    m = make_engine_model(torch.float32)
    with pytest.raises(EngineValidationError, match="float16 needs a CUDA device"):
        Engine(m, EngineConfig(dtype="float16"))
    engine = Engine(m, EngineConfig(max_num_seqs=8))
    assert engine.dtype == "float32"
    with pytest.raises(EngineValidationError, match="a new dtype needs a new engine"):
        await engine.reconfigure(EngineConfig(max_num_seqs=8, dtype="bfloat16"))
    assert next(m.parameters()).dtype == torch.float32


def _engine_tokens(model, sources, dtype):
    async def run():
        engine = Engine(model, EngineConfig(max_num_seqs=32, dtype=dtype))
        await engine.start()
        try:
            res = await asyncio.gather(*(engine.translate(s, GenerationOptions(beam_size=1)) for s in sources))
        finally:
            await engine.stop()
        return [r.hypotheses[0].tokens for r in res]
    return asyncio.run(run())


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="the shipped model is not in this checkout")
def test_bfloat16_engine_matches_float32_on_most_sentences():
    from model.load import load_model
    from model.tokenizer import read_lines
    lines = read_lines(DATA / "test_2016_flickr.de.gz")[:8]
    model, tok, _ = load_model(SHIPPED, pack=False)
    sources = [tok.encode(s) + [tok.eos_id] for s in lines]
    ref = _engine_tokens(model, sources, "float32")
    got = _engine_tokens(model, sources, "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16   # the engine cast the weights it was given
    same = sum(a == b for a, b in zip(got, ref))
    assert same >= 5, (same, [tok.decode(t) for t in got], [tok.decode(t) for t in ref])
    # where they differ, a bf16 translation is still close to the float32 one (shared prefix)
    for a, b in zip(got, ref):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert prefix >= min(len(a), len(b)) // 3, (tok.decode(a), tok.decode(b))
