"""Request validation inside the engine: what ``Engine.translate`` and ``Engine.stream`` accept."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence

from model.inference.search import ATTENTION_KINDS
from model.inference.generate import default_max_new_tokens

from .config import EngineConfig
from .errors import EngineValidationError
from .records import GenerationOptions


def resolve_options(src_ids: Sequence[int], options: Optional[GenerationOptions], cfg, config: EngineConfig,
                    max_src_len: int, max_tgt_len: int) -> GenerationOptions:
    """The engine's own guard for direct library use (the HTTP schema validates requests first).

    Args:
        src_ids: source ids, EOS included; options: None for the defaults.
        cfg: the model's ``ModelConfig``; config: the engine's settings;
        max_src_len / max_tgt_len: the cache's bounds (source ids, target positions).
    Returns the options with max_new_tokens resolved (default: ``default_max_new_tokens``) and
    attention kinds in canonical order. Raises EngineValidationError(field, message).
    """
    o = GenerationOptions() if options is None else options
    if not isinstance(o, GenerationOptions):
        raise EngineValidationError("options", f"must be GenerationOptions, got {type(o).__name__}")

    def is_int(v) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if not isinstance(src_ids, (list, tuple)):
        raise EngineValidationError("src_ids", "must be a list of token ids")
    if not src_ids:
        raise EngineValidationError("src_ids", "must not be empty (an encoded sentence ends with EOS)")
    if len(src_ids) > max_src_len:
        raise EngineValidationError("src_ids", f"has {len(src_ids)} tokens, the limit is {max_src_len}")
    for t in src_ids:
        if not is_int(t) or not 0 <= t < cfg.vocab_size or t == cfg.pad_id:
            raise EngineValidationError("src_ids", f"ids must be integers in 0..{cfg.vocab_size - 1} other than "
                                                   f"the pad id {cfg.pad_id}, got {t!r}")
    if not is_int(o.beam_size) or o.beam_size < 1:
        raise EngineValidationError("beam_size", f"must be an integer >= 1, got {o.beam_size!r}")
    if 2 * o.beam_size > cfg.target_vocab_size:     # a beam's candidates are target tokens
        raise EngineValidationError("beam_size", f"must be <= {cfg.target_vocab_size // 2} (half the vocabulary), "
                                                 f"got {o.beam_size}")
    if o.beam_size > config.max_num_seqs:
        raise EngineValidationError("beam_size", f"must be <= max_num_seqs ({config.max_num_seqs}), "
                                                 f"got {o.beam_size}")
    if not is_int(o.n_best) or not 1 <= o.n_best <= o.beam_size:
        raise EngineValidationError("n_best", f"must be an integer in 1..beam_size ({o.beam_size}), "
                                              f"got {o.n_best!r}")
    limit = min(max_tgt_len, cfg.max_len - 1)
    max_new = o.max_new_tokens
    default = max_new is None
    if default:
        max_new = min(default_max_new_tokens(len(src_ids), cfg.max_len), limit)
    elif not is_int(max_new) or not 0 <= max_new <= limit:
        raise EngineValidationError("max_new_tokens", f"must be an integer in 0..{limit}, got {max_new!r}")
    if not is_int(o.min_new_tokens) or not 0 <= o.min_new_tokens <= max_new:
        which = "the default max_new_tokens for this sentence's length" if default else "max_new_tokens"
        raise EngineValidationError("min_new_tokens", f"must be an integer in 0..max_new_tokens ({max_new}: "
                                                      f"{which}), got {o.min_new_tokens!r}")
    lp = o.length_penalty
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
        raise EngineValidationError("length_penalty", f"must be a finite number, got {lp!r}")
    kinds = () if o.attention_kinds is None else o.attention_kinds
    if (isinstance(kinds, str) or not isinstance(kinds, (tuple, list, set, frozenset))
            or not all(isinstance(k, str) and k in ATTENTION_KINDS for k in kinds)):
        raise EngineValidationError("attention_kinds", f"must be a subset of {ATTENTION_KINDS}, got {kinds!r}")
    return dataclasses.replace(o, beam_size=int(o.beam_size), n_best=int(o.n_best), max_new_tokens=int(max_new),
                               min_new_tokens=int(o.min_new_tokens), length_penalty=float(lp),
                               attention_kinds=tuple(k for k in ATTENTION_KINDS if k in kinds))
