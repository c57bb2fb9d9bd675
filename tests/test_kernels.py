"""The compiled CPU kernels (model/inference/kernels.py): input checks, and the eager fallbacks give the same results."""
from __future__ import annotations

import pytest
import torch

from model.inference.generate import generate
from tiny_model import make_model, rand_source


def test_kernels_build_where_a_compiler_exists():
    """Every kernel test skips where the kernels are unavailable; on x86-64 Linux with a C++ compiler
    (CI, the Docker image) they must build and pass their self-checks, or those skips would hide a
    broken kernel."""
    import platform
    import shutil
    from model.inference import kernels, settings
    if not settings.current().cpu_kernels or platform.machine() != "x86_64" or shutil.which("c++") is None:
        pytest.skip("no compiler here, or MT_CPU_KERNELS=0")
    assert kernels._module() is not None


def test_a_lock_left_by_an_interrupted_build_is_removed_not_waited_on():
    """torch guards an extension build with a plain ``lock`` file; a killed build leaves it, and torch's
    next load waits for it forever. ``_build`` holds a flock meanwhile and removes such a leftover:
    a fresh process loads the kernels within the timeout, and the file is gone."""
    import subprocess
    import sys
    from pathlib import Path
    from model.inference import kernels
    module = kernels._module()
    if module is None:
        pytest.skip("compiled kernels unavailable here")
    stale = Path(module.__file__).parent / "lock"
    stale.touch()
    try:
        code = "from model.inference import kernels; import sys; sys.exit(0 if kernels._build() is not None else 1)"
        done = subprocess.run([sys.executable, "-c", code], cwd=Path(kernels.__file__).parents[2], timeout=240,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "interrupted build" in done.stderr and not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_compiled_decode_attention_rejects_bad_indices():
    from model.inference import kernels
    if kernels.decode_attention() is None:
        pytest.skip("compiled kernel unavailable here (no C++ compiler); eager attention is used")
    q, k = torch.randn(2, 1, 2, 4), torch.randn(10, 2, 4)
    with pytest.raises(RuntimeError, match="outside"):
        kernels.packed_decode_attention(q, k, k, torch.tensor([0, 10]), torch.tensor([0, 1, 2]), 1)
    with pytest.raises(RuntimeError, match="max_len"):
        kernels.packed_decode_attention(q, k, k, torch.tensor([0, 1, 2]), torch.tensor([0, 3, 3]), 2)
    with pytest.raises(RuntimeError, match="R \\+ 1"):
        kernels.packed_decode_attention(q, k, k, torch.tensor([0]), torch.tensor([0, 1]), 1)


@pytest.mark.parametrize("H,D,NQ", [(8, 32, 1), (8, 64, 2), (16, 8, 1), (8, 24, 3), (2, 4, 2), (3, 32, 1)])
def test_compiled_decode_attention_matches_softmax_attention(H, D, NQ):
    """Both kernel paths (eight heads at a time where H and D are multiples of 8, the generic loop
    elsewhere) against softmax(q K^T / sqrt(D)) V in float64: ragged rows (an empty one included),
    keys gathered out of order, the weights zero past each row's length; and each row's result the
    same bits alone as in the batch."""
    from model.inference import kernels
    if kernels.decode_attention() is None:
        pytest.skip("compiled kernel unavailable here (no C++ compiler); eager attention is used")
    g = torch.Generator().manual_seed(H * D + NQ)
    lengths, max_len = [5, 0, 1, 17, 9], 20
    k, v = torch.randn(60, H, D, generator=g), torch.randn(60, H, D, generator=g)
    q = torch.randn(len(lengths), NQ, H, D, generator=g) * 3
    key_index = torch.randperm(60, generator=g)[: sum(lengths)]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out, w = kernels.packed_decode_attention(q, k, v, key_index, starts, max_len, need_weights=True)
    assert out.shape == q.shape and w.shape == (len(lengths), NQ, H, max_len)
    for r, n in enumerate(lengths):
        keys = key_index[starts[r]: starts[r + 1]]
        if n == 0:
            assert not out[r].any() and not w[r].any()
            continue
        scores = torch.einsum("ahd,nhd->ahn", q[r].double(), k[keys].double()) / D ** 0.5
        p = scores.softmax(-1)
        torch.testing.assert_close(w[r, ..., :n].double(), p, rtol=1e-5, atol=1e-6)
        assert not w[r, ..., n:].any()
        torch.testing.assert_close(out[r].double(), torch.einsum("ahn,nhd->ahd", p, v[keys].double()),
                                   rtol=1e-5, atol=1e-5)
        alone = kernels.packed_decode_attention(q[r: r + 1], k, v, keys, torch.tensor([0, n]), max_len)
        assert torch.equal(alone[0][0], out[r])
    generic = kernels.packed_decode_attention(q, k, v, key_index, starts, max_len, need_weights=True, generic=True)
    torch.testing.assert_close(generic[0], out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(generic[1], w, rtol=1e-5, atol=1e-6)


def test_eager_fallback_decodes_like_the_compiled_kernel(monkeypatch):
    """Where the kernel cannot be built, decoding takes the eager paths and gives the same results."""
    from model.inference import kernels
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


def test_int8_compiled_and_eager_halves_agree(monkeypatch):
    from model.inference import kernels
    from model.inference.linear import PackedWeight, onednn_available
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


@pytest.mark.parametrize("n_in,n_out", [(64, 300), (37, 70), (256, 16), (1024, 33)])
def test_int8_one_call_kernel_gives_the_three_call_bits(monkeypatch, n_in, n_out):
    """The whole-layer int8 kernel of this CPU (``int8_linear_vnni`` on AVX-512 VNNI, ``int8_linear_avx2``
    on AVX2; any rows) against quantize_rows -> torch._int_mm -> dequantize:
    the same bits for every row count, with and without bias, with inputs at +-127 and weights at their
    levels' ends (``kernels.int8_weight_levels``), on shapes that pad the weight on both sides, and
    for a [B, T, in] input; and the layer switching
    between the two paths without a row's result changing."""
    from model.inference import kernels
    from model.inference.linear import PackedWeight, onednn_available
    if not onednn_available() or kernels.int8_linear_kernel() is None:
        pytest.skip("no compiled int8 layer kernel here (it needs AVX-512 VNNI or AVX2)")
    kernel = kernels.int8_linear_kernel()
    g = torch.Generator().manual_seed(n_in + n_out)
    w, b = torch.randn(n_out, n_in, generator=g), torch.randn(n_out, generator=g)
    w[0] = torch.where(torch.arange(n_in) % 2 == 0, 1.0, -1.0)         # a feature of +-127 only
    p = PackedWeight(w, torch.int8)
    assert p.small is not None
    n = 41
    x = torch.randn(n, n_in, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[3] = 0.0
    x[5] = torch.where(torch.arange(n_in) % 3 == 0, -2.0, 2.0)          # a row of +-127 only
    three_call = p._int8(x, b)                                   # the torch._int_mm path
    assert torch.equal(three_call, p(x, b))                      # the layer's own call: the kernel, the same bits
    for rows in (1, 2, 3, 4, 5, 8, 17, 32, 33, n):
        for bias in (b, None):
            one_call = kernel(x[:rows], *p.small, p.scale, bias, n_out)
            assert one_call.shape == (rows, n_out)
            assert torch.equal(one_call, p._int8(x[:rows], bias)), (rows, bias is None)
        assert torch.equal(p(x[:rows], b), three_call[:rows])
    assert torch.equal(p(x[:6].view(2, 3, n_in), b), three_call[:6].view(2, 3, n_out))
    assert not p(x[3:4], b).sub(b).any()                         # an all-zero row gives the bias exactly
    with pytest.raises(RuntimeError, match="does not fit"):       # a wrong width is refused, not read past
        kernel(torch.randn(2, 2 * n_in + 8), *p.small, p.scale, b, n_out)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(x[:2], *p.small, p.scale, b[:-1], n_out)
    monkeypatch.setitem(kernels._loaded, "int8", None)           # eager halves: the same arithmetic
    torch.testing.assert_close(p(x[:5], b), three_call[:5], rtol=1e-6, atol=1e-5)


def test_int8_one_call_kernel_over_many_rows_and_features():
    """Past the kernel's cache blocks (chunks of rows and of feature blocks, and a last partial group of
    feature blocks): 150 rows x 1,100 features, the same bits as torch._int_mm between the two halves."""
    from model.inference import kernels
    from model.inference.linear import PackedWeight, onednn_available
    if not onednn_available() or kernels.int8_linear_kernel() is None:
        pytest.skip("no compiled int8 layer kernel here (it needs AVX-512 VNNI or AVX2)")
    g = torch.Generator().manual_seed(11)
    w, b = torch.randn(1100, 256, generator=g), torch.randn(1100, generator=g)
    p = PackedWeight(w, torch.int8)
    x = torch.randn(150, 256, generator=g)
    got = kernels.int8_linear_kernel()(x, *p.small, p.scale, b, 1100)
    assert got.shape == (150, 1100)
    assert torch.equal(got, p._int8(x, b))
    assert torch.equal(got[37:38], p._int8(x[37:38], b))          # a row alone: the same bits


def test_compiled_kernels_release_the_gil():
    """A long compiled call on one thread lets another Python thread run meanwhile (a serving process's
    event loop while its engine thread is inside a kernel): the other thread's longest pause stays
    well under the length of the call."""
    import threading
    import time
    from model.inference import kernels
    if kernels.int8_linear_kernel() is None:
        pytest.skip("no compiled int8 layer kernel here")
    kernel = kernels.int8_linear_kernel()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1024, generator=g)
    n = 8192
    while True:   # one call of at least 50 ms
        top = kernels.int8_weight_levels()
        w, offset = kernels.vnni_weight(torch.randint(-top, top + 1, (n, 1024), generator=g, dtype=torch.int8))
        scale = torch.ones(n)
        t = time.perf_counter()
        kernel(x, w, offset, scale, None, n)
        one_call = time.perf_counter() - t
        if one_call >= 0.05 or n >= 1 << 18:
            break
        # on to about 60 ms at once (at least doubling): the weights' preparation, not the call,
        # is what takes the time, and doubling from 8192 prepared as many rows again on the way
        n = min(1 << 18, max(2 * n, int(n * 0.06 / max(one_call, 1e-4)) // 1024 * 1024))
    if one_call < 0.05:
        pytest.skip("no call long enough to tell")
    gaps = []
    for _ in range(3):   # a kernel holding the GIL pauses this thread every time; a busy machine's scheduler only sometimes
        worker = threading.Thread(target=kernel, args=(x, w, offset, scale, None, n))
        worker.start()
        last, gap = time.perf_counter(), 0.0
        while worker.is_alive():
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
        worker.join()
        gaps.append(gap)
        if gap < 0.5 * one_call:
            break
    assert min(gaps) < 0.5 * one_call, (gaps, one_call)


def test_log_softmax_topk_is_log_softmax_then_topk_without_the_banned_token():
    """The compiled top k of a row's log-softmax from its logits: the same ids as log_softmax + topk,
    values within float rounding; a banned id never chosen but still in the normaliser; -inf entries
    (padding, BOS) add nothing; a row with fewer finite entries than k ends in -inf."""
    from model.inference import kernels
    op = kernels.log_softmax_topk_op()
    if op is None:
        pytest.skip("no compiled CPU kernels here")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 515, generator=g) * 4
    x[:, :2] = float("-inf")
    x[4, 100:] = float("-inf")                                # ... and only 98 finite entries; k = 8 of them
    x[5] = float("-inf")
    x[5, [7, 300, 512]] = torch.tensor([1.0, 3.0, 2.0])      # 3 finite entries for k = 8
    banned = torch.tensor([-1, 5, -1, int(x[3].argmax()), -1, 300])
    v, i = op(x, 8, banned)
    ref = torch.log_softmax(x, dim=-1)                        # the normaliser keeps the banned entry
    for r, b in enumerate(banned.tolist()):
        if b >= 0:
            ref[r, b] = float("-inf")
    ref_v, ref_i = ref.topk(8, dim=-1)
    assert torch.equal(i[:5], ref_i[:5]) and i[5, :2].tolist() == [512, 7]
    torch.testing.assert_close(v[:5], ref_v[:5], rtol=0, atol=2e-6)
    torch.testing.assert_close(v[5, :2], ref_v[5, :2], rtol=0, atol=2e-6)
    assert torch.isinf(v[5, 2:]).all() and int(banned[3]) not in i[3].tolist()
    with pytest.raises(RuntimeError, match="k must be"):
        op(x, 515, torch.full((6,), -1))
    with pytest.raises(RuntimeError, match="outside"):
        op(x, 4, torch.tensor([0, 0, 0, 0, 0, 515]))
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), 4, torch.full((6,), -1))
