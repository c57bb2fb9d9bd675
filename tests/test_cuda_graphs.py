"""The CUDA path on a GPU (skipped without one; ``deploy/gpu_check.sh`` runs these): decode steps
replayed from CUDA graphs equal the eager steps and offline ``generate``, and the shipped model in
bfloat16 / float16 scores within 0.3 BLEU of float32 on test_2016_flickr through the engine."""
from __future__ import annotations

import asyncio

import pytest
import sacrebleu
import torch

from conftest import DATA, ROOT
from model.inference.prefill import encode_into_cache
from model.inference.generate import generate
from model.inference.dense_step import dense_forward, plan_dense
from model.inference.paged_cache import PagedKVCache, allocate_blocks
from service.engine import Engine, EngineConfig, GenerationOptions
from model.inference.cuda_graphs import DecodeGraphs
from tiny_model import make_engine_model, rand_source

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SHIPPED = ROOT / "model" / "checkpoints" / "de-en"


def run_engine(model, sources, config, beam=1, max_new_tokens=None):
    async def run():
        engine = Engine(model, config)
        await engine.start()
        try:
            res = await asyncio.gather(*(engine.translate(s, GenerationOptions(beam_size=beam, max_new_tokens=max_new_tokens)) for s in sources))
        finally:
            await engine.stop()
        return [r.hypotheses[0].tokens for r in res], engine.runner.graphs
    return asyncio.run(run())


def test_graph_step_equals_the_eager_step():
    model = make_engine_model(torch.float32).cuda()
    caches = [PagedKVCache.for_model(model, 16, num_blocks=200, block_size=16) for _ in range(2)]
    graphs = DecodeGraphs(model, caches[1], 16)
    lengths = [3, 7, 12, 20, 31]
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(rand_source(n, n)) for n in lengths], batch_first=True)
    for c in caches:
        slots = torch.tensor(c.slots.allocate(len(lengths)), device="cuda")
        allocate_blocks(c, slots[:, None], 11, lengths)   # positions 0..11 below
        encode_into_cache(model, c, slots[:, None].tolist(), src.cuda(), torch.tensor(lengths, device="cuda"))
    tokens = torch.tensor([1] * len(lengths), device="cuda")
    for pos in range(12):
        positions = torch.full((len(lengths),), pos, device="cuda")
        ref = dense_forward(model, caches[0], plan_dense(caches[0], slots, tokens, positions))
        got = graphs.step(slots, tokens, positions, max_target=pos + 1, max_source=max(lengths))
        assert got is not None and got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        tokens = ref.argmax(-1)
    assert graphs.replays == 12 and not graphs.failed and len(graphs.graphs) == 1


@pytest.mark.parametrize("beam", [1, 4])
def test_engine_with_graphs_equals_without_and_offline_generate(beam):
    model = make_engine_model(torch.float32).cuda()
    sources = [rand_source(n, 3 * n) for n in (2, 5, 9, 14, 22, 31, 40, 47)]
    ref = [r[0].tokens for r in generate(model, sources, beam, 1, 30)]
    eager, none = run_engine(model, sources, EngineConfig(max_num_seqs=64, dtype="float32", cuda_graphs=False), beam, 30)
    graphed, graphs = run_engine(model, sources, EngineConfig(max_num_seqs=64, dtype="float32"), beam, 30)
    assert none is None and graphs.replays > 0 and not graphs.failed
    assert graphed == eager
    assert sum(a == b for a, b in zip(graphed, ref)) >= len(ref) - 1   # fp32 GPU sums may flip a near tie


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="the shipped model is not in this checkout")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_bleu_within_0_3_of_float32(dtype):
    from model.load import load_model
    from model.tokenizer import read_lines
    src = read_lines(DATA / "test_2016_flickr.de.gz")
    refs = read_lines(DATA / "test_2016_flickr.en.gz")
    scores = {}
    for name in ("float32", dtype):
        model, tok, _ = load_model(SHIPPED, device="cuda", pack=False)
        ids = [tok.encode(s) + [tok.eos_id] for s in src]
        out, _ = run_engine(model, ids, EngineConfig(max_num_seqs=1024, dtype=name), beam=4)
        scores[name] = sacrebleu.corpus_bleu([tok.decode(t) for t in out], [refs]).score
    print(f"BLEU test_2016_flickr beam 4: {scores}")
    assert scores["float32"] > 30
    assert abs(scores[dtype] - scores["float32"]) <= 0.3, scores
