"""Compiled CPU kernels, built on first use; eager PyTorch is always the fallback.

``packed_decode_attention`` (``csrc/decode_attention.cpp``) is decode-step attention in which each
row attends over its own cached keys, read through an index (packed rows of different lengths, and
the indirect cache of beam search). In eager PyTorch the same computation gathers every key into a
new tensor and multiplies it elementwise several times; the kernel reads each key once (3-5x faster
at 80-200 rows on a 2-core CPU, ``python -m service.bench_engine`` shows the effect end to end).

The source is compiled with ``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed;
the first build takes ~30 s and is cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, keyed by the source, torch version and CPU). When the build or a
self-check fails, or ``MT_CPU_KERNELS=0`` is set, ``decode_attention()`` returns None and callers use
their eager path: results are the same up to float summation order.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, Optional[Callable]] = {}


def enabled() -> bool:
    """False when MT_CPU_KERNELS is set to 0/false/no/off."""
    return os.environ.get("MT_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_id() -> str:
    """What the -march=native build depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build() -> Optional[Callable]:
    from torch.utils import cpp_extension
    try:  # the ninja that pip installed (a dependency) need not be on PATH when the venv is not activated
        import ninja
        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass
    source = SOURCE.read_bytes()
    key = hashlib.sha1(source + torch.__version__.encode() + _cpu_id().encode() + " ".join(CFLAGS).encode())
    name = f"mt_decode_attention_{key.hexdigest()[:12]}"
    try:
        built = (Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so").is_file()
    except Exception:  # noqa: BLE001 - a private helper; only decides whether to announce the build
        built = True
    if not built:
        log.warning("compiling the CPU decode-attention kernel (once per machine, ~30 s; MT_CPU_KERNELS=0 skips it)")
    module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=CFLAGS, verbose=False)
    fn = module.packed_decode_attention
    _self_check(fn)
    return fn


def _self_check(fn: Callable) -> None:
    """The kernel must match eager attention on a small ragged case (float64), or it is not used."""
    g = torch.Generator().manual_seed(0)
    H, D, lengths = 2, 4, [3, 1, 5]
    k, v = torch.randn(12, H, D, generator=g, dtype=torch.float64), torch.randn(12, H, D, generator=g, dtype=torch.float64)
    q = torch.randn(len(lengths), 2, H, D, generator=g, dtype=torch.float64)
    key_index = torch.tensor([7, 2, 11, 0, 4, 5, 6, 1, 9])
    starts = torch.tensor([0, 3, 4, 9])
    out, w = fn(q, k, v, key_index, starts, max(lengths), D ** -0.5, True)
    for r, n in enumerate(lengths):
        idx = key_index[starts[r]: starts[r + 1]]
        scores = torch.einsum("ahd,nhd->ahn", q[r], k[idx]) * D ** -0.5
        ref_w = torch.softmax(scores, dim=-1)
        ref = torch.einsum("ahn,nhd->ahd", ref_w, v[idx])
        if not (torch.allclose(out[r], ref) and torch.allclose(w[r, :, :, :n], ref_w)
                and not w[r, :, :, n:].any()):
            raise RuntimeError("compiled decode attention disagrees with eager attention")


def decode_attention() -> Optional[Callable]:
    """The compiled ``packed_decode_attention`` function, or None where it is disabled or cannot be
    built (the reason is logged once). Thread-safe; builds at most once per process, and the first
    answer stands for the rest of it."""
    if "decode_attention" in _loaded:
        return _loaded["decode_attention"]
    if not enabled():
        return None
    with _lock:
        if "decode_attention" not in _loaded:
            try:
                _loaded["decode_attention"] = _build()
            except Exception as e:  # noqa: BLE001 - no compiler, build error, failed self-check
                log.warning("compiled CPU decode attention unavailable, using eager PyTorch: %s",
                            str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
                _loaded["decode_attention"] = None
        return _loaded["decode_attention"]


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the compiled decode attention serves tensors of this device and dtype: CPU, float32
    or float64, and the kernel could be built."""
    return torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64) and decode_attention() is not None


def packed_decode_attention(q: Tensor, k: Tensor, v: Tensor, key_index: Tensor, starts: Tensor,
                            max_len: int, need_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """softmax(q K^T / sqrt(d_k)) V (paper eq. 1), each row over its own keys, with the compiled kernel.

    Args:
        q: [R, Q, H, Dh] queries (Q queries per row, e.g. the hypotheses of a beam against one source).
        k, v: [N, H, Dh] cached keys/values (a cache layer viewed as rows of one position).
        key_index: [NK] int64 rows of k/v; row r owns key_index[starts[r]:starts[r + 1]].
        starts: [R + 1] int64 ascending offsets into key_index, starting at 0.
        max_len: at least every row's key count; the width of the returned weights.
    Returns (out [R, Q, H, Dh], weights [R, Q, H, max_len] zero past each row's keys, or None).
    Raises RuntimeError when the kernel is unavailable (check ``decode_attention()`` first), or on
    inconsistent shapes, dtypes or indices (never reads outside k/v).
    """
    fn = decode_attention()
    if fn is None:
        raise RuntimeError("compiled decode attention is unavailable")
    res = fn(q.contiguous(), k, v, key_index, starts, int(max_len), q.size(-1) ** -0.5, need_weights)
    return res[0], (res[1] if need_weights else None)
