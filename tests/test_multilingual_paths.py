"""The one network's flags for the multilingual families (NLLB-200 / M2M100: pre-LN with a final
LayerNorm per stack, fairseq sinusoid at offset pad_id + 1, decoder start = EOS; mBART-50: learned
positions at offset 2 per stack, layernorm_embedding, GELU, final_logits_bias; an untied output
layer) in every CPU decode path: the compiled layer step equals the module path (tokens and scores,
exactly), a paged KV cache equals the contiguous one, int8 and float32, and a sentence decodes the
same alone and in a batch, with a per-sentence forced first token at log-prob 0."""
from __future__ import annotations

import pytest
import torch

from model.inference import kernels
from model.inference.beam import BeamSearch
from model.inference.generate import generate
from model.inference.kv_cache import KVCache
from model.inference.linear import pack_for_inference
from model.inference.paged_cache import PagedKVCache
from model.layers import Embeddings
from tiny_model import make_model, one_thread, rand_source  # noqa: F401 (one_thread: autouse fixture)

# the tiny preset (pad 0, eos 3) with the decoder starting at EOS as in these families; an untied
# output layer keeps a random model from repeating its input token (tied, each token predicts itself)
FLAGS = {
    "nllb": dict(norm_first=True, sinusoid_layout="fairseq", position_offset=1, bos_id=3, separate_output=True),
    "mbart50": dict(norm_first=True, positional="learned", position_offset=2, layernorm_embedding=True,
                    share_positions=False, activation="gelu", final_logits_bias=True, bos_id=3,
                    separate_output=True),
    "tied": dict(norm_first=True, sinusoid_layout="fairseq", position_offset=1),
}
SOURCES = [rand_source(n, 5 * n) for n in (2, 7, 13, 30, 4)]
BUDGETS = [9, 30, 4, 22, 15]
PREFIXES = [(10,), (11,), (10,), (12,), (11,)]     # a "language token" per sentence


def model_of(flags: str, dtype: torch.dtype, seed: int = 0):
    model = make_model(torch.float32, seed, **FLAGS[flags])
    with torch.no_grad():                      # random embedding LayerNorms / bias: not the identity
        for name, p in model.named_parameters():
            if "embed.norm" in name or name == "logits_bias":
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    assert pack_for_inference(model, dtype=dtype)
    return model


def run(model, sources, beam, cache_kind, budgets=BUDGETS, prefixes=PREFIXES):
    n = len(sources) * beam
    cache = (PagedKVCache.for_model(model, n, num_blocks=60 * n, block_size=4) if cache_kind == "paged"
             else KVCache.for_model(model, n, indirect=beam > 1))
    out = generate(model, sources, beam, beam, budgets, cache=cache, target_prefix=prefixes, free_prefix=1)
    return [[(h.tokens, h.score) for h in r] for r in out]


def test_structure():
    """The flags build what they say: mBART's stacks share the token embedding, not the positions
    or embedding LayerNorm; NLLB's share all; the untied model has its own output matrix."""
    m = make_model(torch.float32, **FLAGS["mbart50"])
    assert m.src_embed is not m.tgt_embed and m.src_embed.tok is m.tgt_embed.tok
    assert m.src_embed.pos.weight.shape == (m.cfg.max_len + 2, m.cfg.d_model) and m.src_embed.norm is not None
    n = make_model(torch.float32, **FLAGS["tied"])
    assert n.src_embed is n.tgt_embed and n.out_proj is None and isinstance(n.enc_norm, torch.nn.LayerNorm)
    assert make_model(torch.float32, **FLAGS["nllb"]).out_proj is not None


def test_fairseq_sinusoid_equals_transformers():
    """The fairseq table, offset and padding row: transformers' M2M100 positions, bit for bit."""
    m2m = pytest.importorskip("transformers.models.m2m_100.modeling_m2m_100")
    ref = m2m.M2M100SinusoidalPositionalEmbedding.get_embedding(40 + 2, 32, padding_idx=1)
    emb = Embeddings(50, 32, 40, "sinusoidal", 0.0, 1, layout="fairseq", offset=2)
    assert torch.equal(emb.pe, ref) and not emb.pe[1].any()


@pytest.mark.skipif(kernels.decoder_step_op() is None, reason="compiled CPU kernels unavailable")
@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("dtype", [torch.int8, torch.float32], ids=["int8", "float32"])
@pytest.mark.parametrize("beam", [1, 3])
def test_compiled_step_and_paged_cache_equal_the_module_path(flags, dtype, beam, monkeypatch):
    model = model_of(flags, dtype)
    op, calls = kernels.decoder_step_op(), []
    monkeypatch.setitem(kernels._loaded, "decoder_step", None)
    ref = run(model, SOURCES, beam, "contiguous")
    monkeypatch.setitem(kernels._loaded, "decoder_step", lambda *a: calls.append(1) or op(*a))
    for cache_kind in ("contiguous", "paged"):
        assert run(model, SOURCES, beam, cache_kind) == ref, cache_kind
    assert len(calls) >= 2 * model.cfg.n_decoder_layers * 4           # the compiled step ran
    assert all(h[0][0][0] == p[0] for h, p in zip(ref, PREFIXES))     # each starts with its own token
    assert flags == "tied" or len({t for h in ref for t in h[0][0][1:]}) >= 5   # outputs depend on the source


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("beam", [1, 3])
def test_alone_equals_batched(flags, beam):
    """int8 (the CPU default), paged cache: each sentence alone gives the tokens and scores it gets
    in the batch of five with other targets."""
    model = model_of(flags, torch.int8, seed=1)
    batched = run(model, SOURCES, beam, "paged")
    alone = [run(model, [s], beam, "paged", [b], [p])[0] for s, b, p in zip(SOURCES, BUDGETS, PREFIXES)]
    assert alone == batched


def test_forced_first_token_scores_zero():
    """``free_prefix``: the forced language token adds 0 to the log-prob (transformers'
    forced_bos_token_id) but counts in the length; later prefix tokens add the model's log-prob."""
    s = BeamSearch(1, eos_id=3, max_new_tokens=5, prefix=(10, 11), free_prefix=1)
    s.force(-2.5)
    assert s.alive[0].log_prob == 0.0
    s.force(-1.0)
    assert s.alive[0].log_prob == -1.0 and s.alive[0].tokens == (10, 11)
    s.step([[-0.5, -3.0]], [[3, 12]])
    (h,) = s.results()
    assert h.tokens == [10, 11] and h.log_prob == -1.5 and h.score == pytest.approx(-1.5 / 3)


@pytest.mark.parametrize("flags", ["nllb", "mbart50"])
async def test_engine_mixes_target_languages_in_one_batch(flags):
    """The serving engine: requests for different target tokens (``target_prefix`` + ``free_prefix``)
    share its steps and each equals offline ``generate`` alone (tokens and scores)."""
    from service.engine import Engine, EngineConfig, GenerationOptions
    model = make_model(torch.float64, 2, **FLAGS[flags])
    reqs = [(s, GenerationOptions(beam_size=(1, 3)[i % 2], max_new_tokens=b - 1, target_prefix=p, free_prefix=1))
            for i, (s, b, p) in enumerate(zip(SOURCES * 2, BUDGETS * 2, PREFIXES[::-1] + PREFIXES))]
    engine = Engine(model, EngineConfig(max_num_seqs=64))
    await engine.start()
    try:
        import asyncio
        got = await asyncio.gather(*[engine.translate(s, o) for s, o in reqs])
    finally:
        await engine.stop()
    for (s, o), r in zip(reqs, got):
        (ref,) = generate(model, [s], o.beam_size, 1, [o.max_new_tokens + 1], target_prefix=[o.target_prefix],
                          free_prefix=1)
        assert [h.tokens for h in r.hypotheses] == [h.tokens for h in ref]
        assert r.hypotheses[0].score == pytest.approx(ref[0].score, abs=1e-10)
        assert r.hypotheses[0].tokens[0] == o.target_prefix[0]


@pytest.mark.parametrize("flags", ["nllb", "mbart50"])
@pytest.mark.parametrize("beam", [1, 3])
def test_gpu_fixed_shape_step_equals_the_packed_step(flags, beam, monkeypatch):
    """The GPU path's fixed-shape step and a CUDA graph's padded replay (run here on CPU, as
    tests/test_dense_step.py does) give the packed step's tokens for the new flags."""
    from model.inference import generate as generate_mod
    from test_dense_step import dense_step, graph_like_step
    model = make_model(torch.float64, 3, **FLAGS[flags])
    ref = run(model, SOURCES, beam, "paged")
    for fn in (dense_step, graph_like_step):
        monkeypatch.setattr(generate_mod, "decode_step", fn)
        got = run(model, SOURCES, beam, "paged")
        assert [[h[0] for h in r] for r in got] == [[h[0] for h in r] for r in ref], fn.__name__
        assert [r[0][1] for r in got] == pytest.approx([r[0][1] for r in ref], abs=1e-10)


def test_free_prefix_checked_by_the_engine():
    """``free_prefix`` beyond the target prefix: the engine's validation error names the field."""
    from service.engine import EngineConfig, EngineValidationError, GenerationOptions
    from service.engine.validation import resolve_options
    model = make_model(torch.float32, **FLAGS["nllb"])
    ok = resolve_options([5, 3], GenerationOptions(target_prefix=(10,), free_prefix=1), model.cfg, EngineConfig(), 64, 64)
    assert ok.free_prefix == 1
    for bad in (2, -1, "1"):
        with pytest.raises(EngineValidationError, match="free_prefix: must be an integer in 0..1"):
            resolve_options([5, 3], GenerationOptions(target_prefix=(10,), free_prefix=bad), model.cfg,
                            EngineConfig(), 64, 64)


@pytest.mark.parametrize("field, value", [("sinusoid_layout", "fairseq"), ("position_offset", 2),
                                          ("layernorm_embedding", True), ("separate_output", True)])
def test_marian_export_refuses_the_new_flags_by_name(field, value):
    """A post-LN model with one of the families' flags has no MarianMT equivalent: refused, named."""
    from model.interop.marian_export import MarianExportError, check_exportable
    from model.config import ModelConfig
    with pytest.raises(MarianExportError, match=f"config.json: {field}: "):
        check_exportable(ModelConfig.from_name("tiny", **{field: value}))
