"""Linear layers prepared for CPU inference (model/inference/linear.py): bf16 and int8, per-row independence, fallbacks."""
from __future__ import annotations

import pytest
import torch

from model.inference import kernels

from model.inference.generate import generate
from model.transformer import padding_mask
from model.inference.linear import linear_dtype, pack_for_inference, packed_output
from tiny_model import make_model, rand_source


def test_bf16_packed_linears_are_close_to_fp32_and_optional(monkeypatch):
    from model.inference.linear import default_dtype, onednn_available
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    model = make_model(dtype=torch.float32)
    src = torch.tensor([rand_source(9, 1), rand_source(9, 2)])
    tgt = torch.tensor([[2, 5, 6, 7], [2, 8, 9, 10]])
    with torch.no_grad():
        mask = padding_mask(src, 0)
        memory, _ = model.encode(src, mask)
        plain, _ = model.decode(tgt, model.cross_kv(memory), mask)
        assert pack_for_inference(model, dtype=torch.bfloat16)
        memory, _ = model.encode(src, mask)
        bf16, _ = model.decode(tgt, model.cross_kv(memory), mask)
    if linear_dtype(model) == "bfloat16":
        assert packed_output(model).dtype == torch.bfloat16
        assert bf16.dtype == torch.float32 and not torch.equal(bf16, plain)
        torch.testing.assert_close(bf16, plain, rtol=0.05, atol=0.05 * float(plain.abs().max()))
    else:   # a CPU or torch build without oneDNN's bf16 linear: the documented fallback, prepacked float32
        assert linear_dtype(model) == "float32" and packed_output(model).dtype == torch.float32
        torch.testing.assert_close(bf16, plain, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="float32, bfloat16 or int8"):
        pack_for_inference(model, dtype=torch.float16)
    # the default when none is named: the process's settings (MT_LINEAR_DTYPE, else int8; tests/test_settings.py)
    from model.inference import settings
    for name in ("bfloat16", "int8", "float32"):
        monkeypatch.setattr(settings, "_current", settings.InferenceSettings(linear_dtype=name))
        assert default_dtype() == getattr(torch, name)


def test_int8_linear_quantizes_per_row_and_per_output_feature():
    from model.inference.linear import PackedWeight, onednn_available
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
    levels = kernels.int8_weight_levels()
    wq = torch.round(w.double() / p.scale.double()[:, None]).clamp(-levels, levels)
    for r, batched in zip(x.reshape(-1, 24), out.reshape(-1, 40)):
        s = float(r.abs().max()) / 127 or 1.0
        ref = (torch.round(r.double() / s) @ wq.t()) * s * p.scale.double() + b.double()
        got = p(r[None], b)[0]
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, batched)          # one row (the column-major layout) = the same row batched
    torch.testing.assert_close(out[1, 2], b)
    torch.testing.assert_close(out[:, :, 3], b[3].expand(2, 5))
    # per-row scales: each row is within ~1% of float32, however small or large it is
    exact = x @ w.t() + b
    err = (out - exact).norm(dim=-1) / (exact - b).norm(dim=-1).clamp(min=1e-12)
    assert float(err[~(x.abs().sum(-1) == 0)].max()) < 0.03
    # a row's result does not depend on the rows batched with it, bit for bit
    assert torch.equal(p(x[0, 1:3], b), out[0, 1:3])


def test_weights_of_fewer_levels_take_the_clip_of_least_squared_error():
    """quantize_weight: at 127 levels each feature's absmax / 127; at 63 (AVX2 without VNNI) each
    feature's scale is absmax x c / 63 for the c in 1.00 .. 0.70 whose rounding has the least squared
    error, never more than absmax's, every value within -63..63; an all-zero feature keeps scale 1."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(50, 4000, generator=g)             # wide features: clipping their few largest values pays
    w[7] = 0.0
    q, scale = kernels.quantize_weight(w, 127)
    ref_q, ref_scale = kernels.quantize_rows_eager(w)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
    q, scale = kernels.quantize_weight(w, 63)
    absmax = w.abs().amax(1) / 63
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 63 and float(scale[7]) == 1.0 and not q[7].any()
    ratio = (scale / absmax)[torch.arange(50) != 7]
    assert all(min(abs(r - (1.0 - 0.02 * i)) for i in range(16)) < 1e-5 for r in ratio.tolist())   # a clip tried
    err = (q.float() * scale[:, None] - w).square().sum(1)
    for c in [1.0 - 0.02 * i for i in range(16)]:
        s = torch.where(absmax > 0, absmax * c, torch.ones_like(absmax))
        e = (torch.round(w / s[:, None]).clamp(-63, 63) * s[:, None] - w).square().sum(1)
        assert bool((err <= e * (1 + 1e-6)).all()), c    # the least error of every clip tried
    assert bool((ratio < 0.99).all())                    # and on these features a clip below absmax wins


@pytest.mark.parametrize("levels", [127, 63])
def test_weights_are_quantized_in_row_chunks_with_the_same_result(monkeypatch, levels):
    """quantize_weight takes QUANTIZE_ROWS features at a time (bounded temporaries for a 256k-row
    output projection): the same q and scales as in one pass, a chunk boundary inside the weight."""
    w = torch.randn(1000, 300, generator=torch.Generator().manual_seed(5))
    whole = kernels.quantize_weight(w, levels)
    monkeypatch.setattr(kernels, "QUANTIZE_ROWS", 128)                   # 7 full chunks and a short one
    q, scale = kernels.quantize_weight(w, levels)
    assert q.shape == (1000, 300) and scale.shape == (1000,)
    assert torch.equal(q, whole[0]) and torch.equal(scale, whole[1])


def test_int8_row_major_copy_only_where_int_mm_serves_many_rows(monkeypatch):
    """The row-major int8 copy exists only where torch._int_mm multiplies 2+ rows (no compiled layer);
    with one (AVX-512 VNNI or AVX2) the kernel takes every row count and the layer keeps one int8 copy
    fewer. Whatever the layout, the same bits: the kernel, the three-call path with the
    row-major copy, and the three-call path with the column-major view."""
    from model.inference import kernels
    from model.inference.linear import PackedWeight, onednn_available
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(48, 40, generator=g), torch.randn(48, generator=g)
    x = torch.randn(7, 40, generator=g)
    kernel = kernels.int8_linear_kernel()
    p = PackedWeight(w, torch.int8)
    assert (p.packed_rows is None) == (kernel is not None)
    assert p.packed_rows is None or (p.packed_rows.is_contiguous() and torch.equal(p.packed_rows, p.packed))
    out = p(x, b)
    monkeypatch.setitem(kernels._loaded, "int8_layer", None)      # no compiled layer: a row-major copy
    plain = PackedWeight(w, torch.int8)
    assert plain.packed_rows is not None and torch.equal(plain(x, b), out)
    p.packed_rows = None                                           # the column-major view, 7 rows
    assert torch.equal(p(x, b), out)


def test_int8_model_decodes_each_sentence_as_alone_bit_for_bit():
    from model.inference.linear import onednn_available
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN prepacked linears")
    model = make_model(dtype=torch.float32)
    assert linear_dtype(model) == "float32"
    assert pack_for_inference(model, dtype=torch.int8)
    assert packed_output(model).dtype == torch.int8 and linear_dtype(model) == "int8"
    sources = [rand_source(n, seed) for seed, n in enumerate((5, 12, 3, 9, 7, 14))]
    for beam in (1, 3):
        batched = generate(model, sources, beam, 2 if beam > 1 else 1, 12)
        for src, hyps in zip(sources, batched):
            alone = generate(model, [src], beam, 2 if beam > 1 else 1, 12)[0]
            assert [h.tokens for h in hyps] == [h.tokens for h in alone]
            assert [h.log_prob for h in hyps] == [h.log_prob for h in alone]
    pack_for_inference(model, enabled=False)


def test_packing_falls_back_to_float32_where_int8_is_unavailable(monkeypatch):
    from model.inference import linear
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
    assert pack_for_inference(model, dtype=torch.int8) and linear_dtype(model) == "float32"
    with torch.no_grad():
        memory, _ = model.encode(src, mask)
        torch.testing.assert_close(model.cross_kv(memory)[0][0], plain, rtol=1e-5, atol=1e-5)
    pack_for_inference(model, enabled=False)
