"""Engine settings: one small dataclass, validated on construction (no torch here).

Ray Serve passes them as a translator deployment's ``user_config`` (``EngineConfig.from_dict``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from .errors import EngineValidationError

POLICIES = ("decode_first", "prefill_first", "static")   # see scheduler.py


@dataclass
class EngineConfig:
    max_num_seqs: int = 256                   # KV-cache slots = hypotheses in flight (a beam-4 text holds 4)
    max_prefill_tokens: int = 4096            # padded source tokens (batch x longest) per prefill batch
    max_waiting: int = 1024                   # bounded waiting queue; full -> QueueFullError at once
    max_running_requests: Optional[int] = None  # cap on concurrent requests (1 = no batching)
    policy: str = "decode_first"              # one of POLICIES
    prefill_every: int = 4                    # k: while requests wait, at least every k-th step prefills
    waiting_ratio: float = 1.0                # ... or when (waiting requests that fit now) / running exceeds this
    max_src_len: Optional[int] = None         # cache bound on source ids (default: model max_len)
    max_tgt_len: Optional[int] = None         # cache bound on target positions (default: model max_len)

    def __post_init__(self) -> None:
        def bad(name, msg):
            raise EngineValidationError(name, msg)
        for name in ("max_num_seqs", "max_prefill_tokens", "max_waiting", "prefill_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, f"must be a positive integer, got {v!r}")
        if self.max_running_requests is not None and (not isinstance(self.max_running_requests, int)
                                                      or self.max_running_requests < 1):
            bad("max_running_requests", f"must be None or an integer >= 1, got {self.max_running_requests!r}")
        if self.policy not in POLICIES:
            bad("policy", f"must be one of {POLICIES}, got {self.policy!r}")
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
