"""Compiled CPU kernels, built on first use; eager PyTorch is always the fallback.

``packed_decode_attention`` (``csrc/decode_attention.cpp``) is decode-step attention in which each
row attends over its own cached keys, read through an index (packed rows of different lengths, and
the indirect cache of beam search). In eager PyTorch the same computation gathers every key into a
new tensor and multiplies it elementwise several times; the kernel reads each key once
(``python -m service.bench_engine`` shows the effect end to end).
``quantize_rows`` and ``dequantize`` (``csrc/int8_linear.cpp``) are the two elementwise halves of
the int8 linear layers (``model/inference/linear.py``), one pass each instead of five or six;
``int8_linear_vnni`` is a whole int8 layer in one call, any number of rows (AVX-512 VNNI CPUs only;
the same bits as the three-call path); ``int8_linear_avx2`` the same on AVX2 CPUs without VNNI, where
oneDNN's int8 product behind ``torch._int_mm`` can be tens of times slower than float32, for weights of
63 levels a side (``int8_weight_levels``). ``row_topk``
(``csrc/row_topk.cpp``) is the per-row top-k of beam search's candidates in one pass over each row.
``decoder_layer_step`` (``csrc/decoder_step.cpp``) is one decoder layer of a decode step in one call
(``model/inference/fused_step.py``).

Every compiled function releases the GIL while it runs (as PyTorch's own operators do), so that a
serving process's event loop keeps running during a long kernel call on the engine's thread.

The source is compiled with ``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed;
the first build is slow and is cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, keyed by the source, its directory, torch version and CPU). When the build or a
self-check fails, ``decode_attention()`` and the other accessors return None and callers use their
eager path: results are the same up to float rounding. Whether a caller asks at all is its own switch
(``cpu_kernels``: ``EngineConfig.cpu_kernels`` in the service, ``MT_CPU_KERNELS=0`` for the tools;
``settings.py``), so nothing is built where they are switched off.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).resolve().parent / "csrc" / name for name in ("decode_attention.cpp", "int8_linear.cpp",
                                                                    "row_topk.cpp", "decoder_step.cpp")]
HEADERS = [SOURCES[0].parent / "simd_math.h"]     # included by the sources: part of the build's key
# -ffp-contract=off: no fused multiply-add, so the compiled float arithmetic rounds as eager PyTorch does
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]

_lock = threading.Lock()
_loaded: dict[str, Optional[Callable]] = {}


def _cpu_id() -> str:
    """What the -march=native build depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build():
    from torch.utils import cpp_extension
    try:  # the ninja that pip installed (a dependency) need not be on PATH when the venv is not activated
        import ninja
        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    # The sources' directory is part of the key: torch's build files record absolute source paths, so
    # two copies of the repository sharing one build would rebuild each other's at every load.
    key = hashlib.sha1(source + torch.__version__.encode() + _cpu_id().encode() + " ".join(CFLAGS).encode()
                       + str(SOURCES[0].parent).encode())
    name = f"mt_cpu_kernels_{key.hexdigest()[:12]}"
    try:
        build_dir: Optional[Path] = Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:  # noqa: BLE001 - a private helper: without it, no announcement and no stale-lock check
        build_dir = None
    if build_dir is not None and not (build_dir / f"{name}.so").is_file():
        log.warning("compiling the CPU kernels (once per machine and copy of the sources; cpu_kernels false "
                    "or MT_CPU_KERNELS=0 skips it)")
    with _build_lock(build_dir):
        module = cpp_extension.load(name, [str(p) for p in SOURCES], extra_cflags=CFLAGS, verbose=False)
    _self_check(module.packed_decode_attention)
    _self_check_int8(module)
    _self_check_topk(module)
    return module


@contextlib.contextmanager
def _build_lock(build_dir: Optional[Path]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the build directory while torch builds or loads the extension.

    torch guards a build with a plain ``lock`` file that only the building process removes; a build
    that is killed (Ctrl-C, a timeout) leaves it behind, and every later process then waits for it
    forever, silently, at its first decode step. The OS releases a ``flock`` when its holder dies, and
    every build of this module takes it first, so a ``lock`` file found while holding it is left over
    from a dead build: it is removed (with a warning) instead of waited on."""
    if build_dir is None:
        yield
        return
    try:
        import fcntl
        build_dir.mkdir(parents=True, exist_ok=True)
        handle = open(build_dir / "mt_build.flock", "w")
    except (ImportError, OSError):   # no flock here (not POSIX) or an unwritable directory: torch's lock alone
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by an interrupted build of the CPU kernels", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _self_check(fn: Callable) -> None:
    """The kernel must match eager attention on small ragged cases, or it is not used: float64 (the
    generic loop) and float32 with eight heads of 8 (the eight-heads-at-a-time loop, on AVX2), each
    without and with a relative position bias table (T5) and another scale."""
    g = torch.Generator().manual_seed(0)
    for H, D, dtype, tol, biased in ((2, 4, torch.float64, 1e-8, False), (8, 8, torch.float32, 1e-5, False),
                                     (2, 4, torch.float64, 1e-8, True), (8, 8, torch.float32, 1e-5, True)):
        lengths = [3, 1, 5]
        k, v = torch.randn(12, H, D, generator=g, dtype=dtype), torch.randn(12, H, D, generator=g, dtype=dtype)
        q = torch.randn(len(lengths), 2, H, D, generator=g, dtype=dtype)
        key_index = torch.tensor([7, 2, 11, 0, 4, 5, 6, 1, 9])
        starts = torch.tensor([0, 3, 4, 9])
        scale = 1.0 if biased else D ** -0.5
        bias = torch.randn(7, H, generator=g, dtype=dtype) if biased else None
        bias_start = torch.tensor([2, 0, 1]) if biased else None
        out, w = fn(q, k, v, key_index, starts, max(lengths), scale, True, False, bias, bias_start)
        for r, n in enumerate(lengths):
            idx = key_index[starts[r]: starts[r + 1]]
            scores = torch.einsum("ahd,nhd->ahn", q[r].double(), k[idx].double()) * scale
            if biased:
                scores = scores + bias[bias_start[r]: bias_start[r] + n].double().t()
            ref_w = torch.softmax(scores, dim=-1)
            ref = torch.einsum("ahn,nhd->ahd", ref_w, v[idx].double())
            if not (torch.allclose(out[r].double(), ref, rtol=tol, atol=tol)
                    and torch.allclose(w[r, :, :, :n].double(), ref_w, rtol=tol, atol=tol)
                    and not w[r, :, :, n:].any()):
                raise RuntimeError("compiled decode attention disagrees with eager attention")


def quantize_rows_eager(x: Tensor, levels: int = 127) -> tuple[Tensor, Tensor]:
    """x [M, K] float32 -> (q [M, K] int8 in -levels..levels, scale [M]): each row scaled by its own
    absmax / levels (1 for an all-zero row) and rounded half to even. With the default 127, the eager
    form of the compiled ``quantize_rows`` (inputs); weights take ``int8_weight_levels()``."""
    scale = x.abs().amax(dim=1) / float(levels)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale[:, None]).clamp_(-levels, levels).to(torch.int8), scale


QUANTIZE_ROWS = 8192   # weight rows per pass of quantize_weight (its float temporaries: this x K x 4 bytes each)


def quantize_weight(w: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """A weight [N, K] float32 (out, in) -> (q [N, K] int8 in -levels..levels, scale [N]): one scale per
    output feature, QUANTIZE_ROWS features at a time (every step is per feature, so the result is the
    same; a 256k-row output projection's temporaries would otherwise be several copies of its 1 GB). With 127 levels, absmax / 127 (``quantize_rows_eager``). With fewer, each feature's
    scale is the one of absmax x c / levels, c in 1.00, 0.98, ..., 0.70, whose rounding (values past the
    clip saturate) has the least squared error: at 63 levels, absmax alone leaves most values on a few
    levels. This is the mean-squared-error scale search of weight-only quantizers (e.g. torch.ao's
    per-channel observers with an MSE criterion), chosen on Multi30k's validation set: BLEU of the
    shipped de-en model 39.75 against 39.69 with absmax (greedy; 39.83 at 127 levels; 2026-12-04)."""
    if w.size(0) > QUANTIZE_ROWS:
        parts = [_quantize_weight(w[i: i + QUANTIZE_ROWS], levels) for i in range(0, w.size(0), QUANTIZE_ROWS)]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    return _quantize_weight(w, levels)


def _quantize_weight(w: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    q, scale = quantize_rows_eager(w, levels)
    if levels >= 127:
        return q, scale
    err = (q.float() * scale[:, None] - w).square().sum(1)
    full = scale                                  # absmax / levels: the clip c = 1
    for i in range(1, 16):
        s = full * (1.0 - 0.02 * i)
        qi = torch.round(w / s[:, None]).clamp_(-levels, levels)
        e = (qi * s[:, None] - w).square().sum(1)
        better = e < err
        q[better], scale, err = qi[better].to(torch.int8), torch.where(better, s, scale), torch.where(better, e, err)
    return q, scale


def dequantize_eager(acc: Tensor, row_scale: Tensor, col_scale: Tensor, bias: Optional[Tensor]) -> Tensor:
    """acc [M, N] int32 -> acc * row_scale[:, None] * col_scale (+ bias), float32 [M, N]. The eager form
    of the compiled ``dequantize``."""
    out = acc.float().mul_(row_scale[:, None]).mul_(col_scale)
    return out if bias is None else out.add_(bias)


def vnni_weight(q: Tensor) -> tuple[Tensor, Tensor]:
    """An int8 weight [N, K] (out, in) in the layout of the compiled ``int8_linear_vnni``: ([ceil(N/16),
    ceil(K/4), 16, 4] int8, zero-padded: 16 output features x 4 inputs per 64-byte vector; [16 *
    ceil(N/16)] int32: 128 x each feature's weight sum, what the kernel's unsigned inputs (q + 128) add)."""
    N, K = q.shape
    n16, k4 = -(-N // 16) * 16, -(-K // 4) * 4
    padded = torch.zeros(n16, k4, dtype=torch.int8)
    padded[:N, :K] = q
    offset = padded.sum(1, dtype=torch.int32) * 128
    return padded.view(n16 // 16, 16, k4 // 4, 4).permute(0, 2, 1, 3).contiguous(), offset


def _self_check_int8(module) -> None:
    """quantize_rows, dequantize and int8_linear_vnni must equal the eager arithmetic exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, generator=g) * torch.tensor([1e-3, 1.0, 0.0, 50.0, 3.0])[:, None]
    q, scale = module.quantize_rows(x)
    ref_q, ref_scale = quantize_rows_eager(x)
    if not (torch.equal(scale, ref_scale) and torch.equal(q, ref_q)):
        raise RuntimeError("compiled int8 quantization disagrees with eager PyTorch")
    acc = torch.randint(-2 ** 20, 2 ** 20, (5, 11), generator=g, dtype=torch.int32)
    cols, bias = torch.rand(11, generator=g), torch.randn(11, generator=g)
    for b in (bias, None):
        if not torch.equal(module.dequantize(acc, scale, cols, b), dequantize_eager(acc, scale, cols, b)):
            raise RuntimeError("compiled int8 dequantization disagrees with eager PyTorch")
    for name in ("int8_linear_vnni", "int8_linear_avx2"):   # the one this build has
        if not getattr(module, "has_" + name, False):
            continue
        # 37 inputs, 70 features: padding on both sides of the weight; the extremes everywhere in row 0
        top = 127 if name == "int8_linear_vnni" else AVX2_WEIGHT_LEVELS
        w, cols = torch.randint(-top, top + 1, (70, 37), generator=g, dtype=torch.int8), torch.rand(70, generator=g)
        w[0, ::2], w[0, 1::2] = top, -top
        vw, offset = vnni_weight(w)
        for b in (torch.randn(70, generator=g), None):
            got = getattr(module, name)(x, vw, offset, cols, b, 70)
            if not torch.equal(got, dequantize_eager(torch._int_mm(ref_q, w.t().contiguous()), ref_scale, cols, b)):
                raise RuntimeError(f"compiled {name} disagrees with eager PyTorch")


def _self_check_topk(module) -> None:
    """row_topk must equal torch.topk on distinct values (and keep -inf entries)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, generator=g, dtype=torch.float64)
    x[:, :5] = float("-inf")
    x[3, -4:] = 10.0 + torch.arange(4, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        v, i = module.row_topk(x.to(dtype), 7)
        ref_v, ref_i = x.to(dtype).topk(7, dim=-1)
        if not (torch.equal(v, ref_v) and torch.equal(i, ref_i)):
            raise RuntimeError("compiled row_topk disagrees with torch.topk")
    v, i = module.row_topk(torch.full((1, 5), float("-inf")), 3)
    if not (torch.isinf(v).all() and i.tolist() == [[0, 1, 2]]):
        raise RuntimeError("compiled row_topk mishandles -inf rows")
    x = x.float()
    ref_v, ref_i = torch.log_softmax(x, dim=-1).topk(7, dim=-1)
    v, i = module.log_softmax_topk(x, 7, torch.full((4,), -1, dtype=torch.long))
    if not (torch.equal(i, ref_i) and torch.allclose(v, ref_v, rtol=1e-5, atol=1e-5)):
        raise RuntimeError("compiled log_softmax_topk disagrees with torch.log_softmax + topk")


def _module():
    """The compiled extension, or None where it cannot be built (the reason is logged once).
    Thread-safe; builds at most once per process, and the first answer stands."""
    if "module" in _loaded:
        return _loaded["module"]
    with _lock:
        if "module" not in _loaded:
            try:
                _loaded["module"] = _build()
            except Exception as e:  # noqa: BLE001 - no compiler, build error, failed self-check
                log.warning("compiled CPU kernels unavailable, using eager PyTorch: %s",
                            str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
                _loaded["module"] = None
        return _loaded["module"]


def _op(switch: str, attr: Optional[str]):
    """``attr`` of the compiled module (the module itself for None), or None where it is unavailable
    or switched off (tests set ``_loaded[switch] = None``)."""
    if switch in _loaded:
        return _loaded[switch]
    module = _module()
    return module if module is None or attr is None else getattr(module, attr)


def decode_attention() -> Optional[Callable]:
    """The compiled ``packed_decode_attention`` function, or None (see ``_module``)."""
    return _op("decode_attention", "packed_decode_attention")


def paged_key_index_op() -> Optional[Callable]:
    """The compiled ``paged_key_index(slots, lengths, table, block_size) -> (key_index, starts)``
    (``AttentionPlan`` on a paged cache), or None (see ``_module``)."""
    return _op("paged_key_index", "paged_key_index")


def topk_op() -> Optional[Callable]:
    """The compiled ``row_topk(x [N, V] float32/float64, k) -> (values [N, k], ids [N, k])``, or None
    (see ``_module``)."""
    return _op("topk", "row_topk")


def log_softmax_topk_op() -> Optional[Callable]:
    """The compiled ``log_softmax_topk(logits [N, V] float32, k, banned [N] int64) -> (values [N, k],
    ids [N, k])``: the top k of each row's log-softmax without the [N, V] log-probabilities, ``banned``
    a token id per row left out of its top k (-1: none), or None (see ``_module``; ``_loaded["topk"] =
    None`` switches it off with ``row_topk``)."""
    if "topk" in _loaded and _loaded["topk"] is None:
        return None
    return _op("log_softmax_topk", "log_softmax_topk")


def rank_beams_op() -> Optional[Callable]:
    """The compiled ``rank_beams(top_v [N, W], top_i [N, W], prefix [R] float64, first [S], count [S],
    beam [S]) -> (log_probs [S, T], parents [S, T], tokens [S, T])`` (sentence s: rows first[s] ..
    first[s] + count[s] - 1, their hypotheses' log-probs the next count[s] of prefix, R = sum(count)):
    every sentence's best min(2k, all) beam candidates ranked as ``model.inference.beam.BeamSearch`` ranks one
    sentence's (``csrc/row_topk.cpp``), or None (see ``_module``;
    ``_loaded["topk"] = None`` switches it off with ``row_topk``)."""
    if "topk" in _loaded and _loaded["topk"] is None:
        return None
    return _op("rank_beams", "rank_beams")


def int8_ops():
    """The compiled ``quantize_rows`` / ``dequantize`` (as attributes of the returned object), or None
    (see ``_module``); same arithmetic as ``quantize_rows_eager`` / ``dequantize_eager``."""
    return _op("int8", None)


AVX2_WEIGHT_LEVELS = 63   # |w| <= 64 keeps int8_linear_avx2's int16 pair sums exact (csrc/int8_linear.cpp)


@functools.lru_cache(maxsize=None)
def int8_weight_levels() -> int:
    """The int8 weights' levels on each side of zero (scale = absmax / levels) on this CPU: 63 on x86
    CPUs with AVX2 and without AVX-512 VNNI, where the compiled ``int8_linear_avx2`` multiplies unsigned
    inputs by weights exactly only for |w| <= 64 (half the levels roughly doubles the weights'
    rounding error; the shipped models' BLEU moved by under 0.3, docs/model.md); else 127.
    It depends on the CPU alone, not on whether the kernels are built or switched on, so that they
    change speed and never results: the torch._int_mm path multiplies the same values. ``PackedWeight``
    asks when it quantizes a weight."""
    flags = {f for line in _cpu_id().splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    if not flags:    # no /proc/cpuinfo (macOS): what torch dispatches to
        capability = torch.backends.cpu.get_cpu_capability()
        flags = {"avx2"} if capability == "AVX2" else {"avx512f", "avx512_vnni"} if "AVX512" in capability else set()
    vnni = {"avx512f", "avx512_vnni"} <= flags
    return AVX2_WEIGHT_LEVELS if "avx2" in flags and not vnni else 127


def int8_linear_vnni() -> Optional[Callable]:
    """The compiled ``int8_linear_vnni(x [M, K] float32, w, offset, col_scale [N], bias [N] or None, N)
    -> [M, N] float32`` (``w``, ``offset`` from ``vnni_weight``), or None: no AVX-512 VNNI, or the
    kernels are unavailable. The same bits as ``quantize_rows`` -> ``torch._int_mm`` -> ``dequantize``."""
    ops = int8_ops()
    return ops.int8_linear_vnni if ops is not None and getattr(ops, "has_int8_linear_vnni", False) else None


def int8_linear_kernel() -> Optional[Callable]:
    """The compiled whole int8 layer of this CPU, for any number of rows: ``int8_linear_vnni`` with AVX-512
    VNNI, else ``int8_linear_avx2`` on AVX2 (where oneDNN's int8 product without VNNI can be tens of times
    slower than float32), else None (also when tests and benchmarks set ``_loaded["int8_layer"] = None``).
    Same signature and the same bits either way, and as ``torch._int_mm`` between the two halves."""
    if "int8_layer" in _loaded and _loaded["int8_layer"] is None:
        return None
    vnni = int8_linear_vnni()
    if vnni is not None:
        return vnni
    ops = int8_ops()
    avx2 = ops is not None and getattr(ops, "has_int8_linear_avx2", False)
    # only for weights it multiplies exactly (a build without VNNI on a CPU that has it would get 127)
    return ops.int8_linear_avx2 if avx2 and int8_weight_levels() <= 64 else None


def decoder_step_op() -> Optional[Callable]:
    """The compiled ``decoder_layer_step`` (one decoder layer of a decode step, ``model/inference/fused_step.py``),
    or None (see ``_module``)."""
    return _op("decoder_step", "decoder_layer_step")


def encoder_step_op() -> Optional[Callable]:
    """The compiled ``encoder_layer_step`` (one encoder layer over a packed batch, ``model/inference/fused_step.py``),
    or None (see ``_module``; ``_loaded["decoder_step"] = None`` switches it off with the decoder's)."""
    if "decoder_step" in _loaded and _loaded["decoder_step"] is None:
        return None
    return _op("encoder_step", "encoder_layer_step")


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the compiled decode attention serves tensors of this device and dtype: CPU, float32
    or float64, and the kernel could be built."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64) and decode_attention() is not None


def packed_decode_attention(q: Tensor, k: Tensor, v: Tensor, key_index: Tensor, starts: Tensor,
                            max_len: int, need_weights: bool = False, generic: bool = False,
                            scale: Optional[float] = None, bias: Optional[Tensor] = None,
                            bias_start: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """softmax(q K^T / sqrt(d_k)) V (paper eq. 1), each row over its own keys, with the compiled kernel;
    softmax(q K^T · scale + bias) V with ``scale`` / ``bias`` (T5).

    Args:
        q: [R, Q, H, Dh] queries (Q queries per row, e.g. the hypotheses of a beam against one source).
        k, v: [N, H, Dh] cached keys/values (a cache layer viewed as rows of one position).
        key_index: [NK] int64 rows of k/v; row r owns key_index[starts[r]:starts[r + 1]].
        starts: [R + 1] int64 ascending offsets into key_index, starting at 0.
        max_len: at least every row's key count; the width of the returned weights.
        generic: use the kernel's generic loop even for float32 heads with H and Dh multiples of 8
            (which otherwise take eight heads at a time, with FMA and a vectorized exp: the same values
            to float rounding); for tests and ``python -m service.bench.attention``.
        scale: the logits' factor (default 1/sqrt(Dh); T5: 1.0).
        bias: [NB, H] rows of biases (q's dtype) with ``bias_start`` [R] int64: row r's n-th key adds
            bias[bias_start[r] + n] to its logits, every query of the row alike (relative positions:
            ``attention_plan.relative_bias_rows``).
    Returns (out [R, Q, H, Dh], weights [R, Q, H, max_len] zero past each row's keys, or None).
    Raises RuntimeError when the kernel is unavailable (check ``decode_attention()`` first), or on
    inconsistent shapes, dtypes or indices (never reads outside k/v).
    """
    fn = decode_attention()
    if fn is None:
        raise RuntimeError("compiled decode attention is unavailable")
    scale = q.size(-1) ** -0.5 if scale is None else scale
    res = fn(q.contiguous(), k, v, key_index, starts, int(max_len), scale, need_weights, generic, bias, bias_start)
    return res[0], (res[1] if need_weights else None)
