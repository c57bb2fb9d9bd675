"""Process and thread settings for serving: applied once the model is loaded (by the translator and
the benchmarks); nothing a result depends on changes. ``prepare_model`` prepares a model's linear
layers as its ``EngineConfig`` says.
"""
from __future__ import annotations

import contextlib
import gc
import sys
from typing import Iterator, Optional

import torch

from model.inference.linear import pack_for_inference

from .config import EngineConfig
from .errors import EngineValidationError

# EngineConfig fields the model and its engine are built with before the engine's first step, then fixed
FIXED_AT_START = ("linear_dtype", "cpu_kernels", "fused_step")


def prepare_model(model, config: EngineConfig, running: Optional[EngineConfig] = None) -> None:
    """Prepare ``model`` (loaded with ``pack=False``) for ``config`` before its engine starts
    (``running`` None): its linear layers in ``linear_dtype``, their int8 products through the
    compiled kernels as ``cpu_kernels`` says (``pack_for_inference``; the plain weights off CPU
    float32). The engine takes ``cpu_kernels`` and ``fused_step`` from the same config, so each model
    of a process has its own. Once an engine runs with ``running``, a config that changes one of
    FIXED_AT_START raises EngineValidationError: a new value needs a new engine (a new replica)."""
    if running is not None:
        check_fixed(config, running)
        return
    with torch_threads(1):    # set-up work (see torch_threads)
        pack_for_inference(model, config.linear_dtype, cpu_kernels=config.cpu_kernels)


def check_fixed(config: EngineConfig, running: EngineConfig) -> None:
    """Raise EngineValidationError when ``config`` changes one of FIXED_AT_START from ``running``'s."""
    for name in FIXED_AT_START:
        if getattr(config, name) != getattr(running, name):
            raise EngineValidationError(name, f"the engine runs with {getattr(running, name)!r}; another value "
                                              "needs a new engine (restart the replica)")


def tune_process() -> None:
    """Process settings for serving, applied once the model is loaded (the translator and the
    benchmarks call it; it changes nothing a result depends on):

    - glibc malloc keeps freed memory instead of returning it to the OS after every step. A decode
      step allocates and frees megabytes of temporaries (logits, attention reads); with glibc's
      defaults much of it goes back to the kernel and the next step page-faults it in again, which
      is slow in a VM. (The same as MALLOC_TRIM_THRESHOLD_ etc. in the environment; jemalloc or
      tcmalloc would do as well.) A no-op where glibc's ``mallopt`` is missing.
    - ``gc.freeze()``: the objects that exist now (torch, the model, ...) are moved out of the
      cyclic garbage collector's reach. Otherwise every full collection, triggered by the small
      objects each step makes, scans them all, a long pause.
    - A 0.5 ms GIL switch interval (default 5 ms): the worker thread gives up the GIL inside every
      torch op and must win it back from the event loop thread (HTTP handling, tokenization) to
      issue the next one; shorter turns keep its steps from stalling behind the loop.
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)
        libc.mallopt(m_trim_threshold, 1024 * 1024 * 1024)
        libc.mallopt(m_top_pad, 256 * 1024 * 1024)
    except (OSError, AttributeError):
        pass
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(0.0005)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count.

    Set-up work (loading a model, allocating the KV cache) should run with 1 thread so that only
    the engine's worker thread runs multi-threaded: with OpenMP every thread that enters a parallel
    region keeps a team of helper threads, and once the teams together outnumber the cores, libgomp
    stops spinning between regions and every op pays a sleep/wake-up.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
