"""The inference switches, and the environment variables that override their defaults (read here and
nowhere else; no torch here).

    linear_dtype   the arithmetic of the prepared CPU linear layers (``linear.py``): int8, float32, bfloat16
    cpu_kernels    the compiled CPU kernels (``kernels.py``); off: eager PyTorch, the same results, ~40% slower
    fused_step     one compiled call per decoder layer in a CPU decode step (``fused_step.py``)

Each is an explicit argument where it acts: ``pack_for_inference`` (linear_dtype, cpu_kernels), the
KV caches (cpu_kernels, which a decode step's output carries on to ``search_step``), ``decode_step``
and ``encode_into_cache`` (fused_step). The service passes an engine's own ``EngineConfig`` fields
(same names), so models in one process may differ; where a caller passes None, the process's
defaults apply (``current()``: the environment's, read once), which is what the command-line tools
and the benchmarks run with.
``ENV`` names the variables: each replaces its field's default, a value in a config wins over it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

LINEAR_DTYPES = ("int8", "float32", "bfloat16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# field -> the environment variable that overrides its default
ENV = {"linear_dtype": "MT_LINEAR_DTYPE", "cpu_kernels": "MT_CPU_KERNELS", "fused_step": "MT_FUSED_STEP"}


def linear_dtype_name(name: str, what: str = "linear_dtype") -> str:
    """``name`` as one of LINEAR_DTYPES (fp32 and bf16 accepted); ValueError naming ``what`` otherwise."""
    key = str(name).strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in LINEAR_DTYPES:
        raise ValueError(f"{what} must be float32, bfloat16 or int8, got {name!r}")
    return key


@dataclass(frozen=True)
class InferenceSettings:
    linear_dtype: str = "int8"    # prepared CPU linear layers: one of LINEAR_DTYPES
    cpu_kernels: bool = True      # compiled CPU kernels where they build; off: eager PyTorch
    fused_step: bool = True       # a CPU decode step runs each decoder layer in one compiled call

    def __post_init__(self) -> None:
        object.__setattr__(self, "linear_dtype", linear_dtype_name(self.linear_dtype))
        for name in ("cpu_kernels", "fused_step"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")


def from_env(environ: Optional[Mapping[str, str]] = None) -> InferenceSettings:
    """The defaults with the overrides of ``environ`` (default ``os.environ``); an unset or empty
    variable keeps its default. Raises ValueError naming the variable for a value it does not take."""
    environ = os.environ if environ is None else environ
    changes: dict = {}
    for name, var in ENV.items():
        value = environ.get(var, "").strip()
        if not value:
            continue
        if name == "linear_dtype":
            changes[name] = linear_dtype_name(value, var)
        elif value.lower() in _ON + _OFF:
            changes[name] = value.lower() in _ON
        else:
            raise ValueError(f"{var} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")
    return InferenceSettings(**changes)


_current: Optional[InferenceSettings] = None


def current() -> InferenceSettings:
    """The process's defaults: the environment's (``from_env``, read on the first call)."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def or_default(name: str, value):
    """``value``, or where it is None the process's default of the field ``name`` (``current()``)."""
    return getattr(current(), name) if value is None else value
