"""Engine settings: one small dataclass, validated on construction (no torch here).

Ray Serve passes them as a translator deployment's ``user_config`` (``EngineConfig.from_dict``).
``linear_dtype``, ``cpu_kernels`` and ``fused_step`` default to ``model.inference.settings.from_env()``:
the built-in defaults unless MT_LINEAR_DTYPE / MT_CPU_KERNELS / MT_FUSED_STEP say otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from model.inference import settings

from .errors import EngineValidationError

POLICIES = ("decode_first", "prefill_first", "static")   # see scheduler.py
ADMISSIONS = ("fifo", "shortest_first")                  # the order waiting requests are admitted in (scheduler.py)
DTYPES = ("auto", "float32", "bfloat16", "float16")       # the model's weights and KV cache in the engine


def resolve_dtype(name: str, device_type: str, loaded: str = "float32") -> str:
    """The weight/KV-cache dtype an engine on ``device_type`` ("cpu", "cuda", ...) runs for the
    ``dtype`` setting ``name``, for a model loaded in ``loaded`` (a torch dtype name): "auto" is
    bfloat16 on CUDA and the loaded dtype elsewhere (float32 for checkpoints, see model.load.load_model);
    an explicit name is kept, except float16 off CUDA, which raises EngineValidationError (CPU
    float16 matmuls are slow and unsupported in places: use bfloat16 or float32 there)."""
    if name not in DTYPES:
        raise EngineValidationError("dtype", f"must be one of {DTYPES}, got {name!r}")
    if name == "auto":
        return "bfloat16" if device_type == "cuda" else loaded
    if name == "float16" and device_type != "cuda":
        raise EngineValidationError("dtype", f"float16 needs a CUDA device, this engine runs on {device_type}; "
                                             "use bfloat16 or float32")
    return name


@dataclass
class EngineConfig:
    max_num_seqs: int = 256                   # KV-cache slots = hypotheses in flight (a beam-4 text holds 4)
    max_prefill_tokens: int = 4096            # padded source tokens (batch x longest) per prefill batch
    max_waiting: int = 1024                   # bounded waiting queue; full -> QueueFullError at once
    max_running_requests: Optional[int] = None  # cap on concurrent requests (1 = no batching)
    policy: str = "decode_first"              # one of POLICIES
    prefill_every: int = 4                    # k: while requests wait, at least every k-th step prefills
    waiting_ratio: float = 1.0                # ... or when (waiting requests that fit now) / running exceeds this
    admission: str = "fifo"                   # one of ADMISSIONS: arrival order, or the smallest jobs first
    max_wait_steps: int = 256                 # shortest_first: a request waiting this many steps goes first
    max_src_len: Optional[int] = None         # cache bound on source ids (default: model max_len)
    max_tgt_len: Optional[int] = None         # cache bound on target positions (default: model max_len)
    kv_block_size: int = 16                   # positions per KV-cache block (paged cache)
    kv_blocks: Optional[int] = None           # KV-cache blocks (default: 64 positions per slot, see paged_cache.py)
    dtype: str = "auto"                       # weights and KV cache: one of DTYPES (see resolve_dtype)
    cuda_graphs: bool = True                  # CUDA: replay the decode step from captured graphs (cuda_graphs.py)
    # how the model computes on CPU (model/inference/settings.py), fixed when the engine starts (process.py)
    linear_dtype: str = field(default_factory=lambda: settings.from_env().linear_dtype)  # int8, float32 or bfloat16
    cpu_kernels: bool = field(default_factory=lambda: settings.from_env().cpu_kernels)   # off: eager PyTorch
    fused_step: bool = field(default_factory=lambda: settings.from_env().fused_step)     # one call per decoder layer

    def __post_init__(self) -> None:
        def bad(name, msg):
            raise EngineValidationError(name, msg)
        for name in ("max_num_seqs", "max_prefill_tokens", "max_waiting", "prefill_every", "kv_block_size",
                     "max_wait_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, f"must be a positive integer, got {v!r}")
        if self.max_running_requests is not None and (not isinstance(self.max_running_requests, int)
                                                      or self.max_running_requests < 1):
            bad("max_running_requests", f"must be None or an integer >= 1, got {self.max_running_requests!r}")
        if self.kv_block_size < 2:
            bad("kv_block_size", f"must be an integer >= 2, got {self.kv_block_size!r}")
        if self.kv_blocks is not None and (isinstance(self.kv_blocks, bool) or not isinstance(self.kv_blocks, int)
                                           or self.kv_blocks < 1):
            bad("kv_blocks", f"must be None or a positive integer, got {self.kv_blocks!r}")
        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("cuda_graphs", "cpu_kernels", "fused_step"):
            if not isinstance(getattr(self, name), bool):
                bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.linear_dtype not in settings.LINEAR_DTYPES:
            bad("linear_dtype", f"must be one of {settings.LINEAR_DTYPES}, got {self.linear_dtype!r}")
        if self.policy not in POLICIES:
            bad("policy", f"must be one of {POLICIES}, got {self.policy!r}")
        if self.admission not in ADMISSIONS:
            bad("admission", f"must be one of {ADMISSIONS}, got {self.admission!r}")
        if not isinstance(self.waiting_ratio, (int, float)) or not self.waiting_ratio >= 0:
            bad("waiting_ratio", f"must be a number >= 0, got {self.waiting_ratio!r}")
        for name in ("max_src_len", "max_tgt_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 2):
                bad(name, f"must be None or an integer >= 2, got {v!r}")

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "EngineConfig":
        """Build from a mapping (e.g. Ray Serve ``user_config``); unknown keys are an error."""
        d = dict(d or {})
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise EngineValidationError(unknown[0], f"unknown engine option; choose from {sorted(names)}")
        return cls(**d)
