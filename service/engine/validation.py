"""The one validation of generation options against a model's limits.

``check_options`` holds every rule on ``GenerationOptions``; ``ModelLimits`` is what one model
accepts (from its config and its engine settings). The gateway calls ``ModelLimits.check`` on each
job before routing it (the client's 4xx), and the engine calls ``resolve_options`` on each sentence
(for library users, with the settings the replica really runs with): both end in ``check_options``,
so both give the same error, field and message. Errors are ``EngineValidationError`` (422 at the API)
and, for the request's size, ``TooLarge`` (413).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

from model.config import ModelConfig
from model.inference.generate import default_max_new_tokens
from model.inference.constraints import MIN_CONSTRAINED_BEAM
from model.inference.beam import ATTENTION_KINDS, max_beam_size
from service.protocol import (MAX_NO_REPEAT_NGRAM_SIZE, MAX_REPETITION_PENALTY, MAX_TEXT_CHARS, MAX_TEXTS,
                              AttentionSelection, JobOrigin, TooLarge, TranslateJob, short_name)

from .config import EngineConfig
from .errors import EngineValidationError
from .records import GenerationOptions



def _got(value) -> str:
    """A client's value as a message repeats it: its repr, shortened past MAX_NAME_CHARS (``short_name``)."""
    return short_name(repr(value))

def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass(frozen=True)
class ModelLimits:
    """What one model accepts: from its config and its engine settings."""
    model: str                 # model id, named in messages
    max_new_tokens: int        # target tokens per sentence: min(engine max_tgt_len, max_len - 1)
    max_num_seqs: int          # KV-cache slots: the largest beam
    vocab_size: int            # the TARGET vocabulary: a beam may hold at most half of it
    n_heads: int
    n_encoder_layers: int
    n_decoder_layers: int

    @classmethod
    def of(cls, model: str, cfg: ModelConfig, engine: EngineConfig) -> "ModelLimits":
        """The limits of a model of config ``cfg`` served with the engine settings ``engine``."""
        return cls(model, min(engine.max_tgt_len or cfg.max_len, cfg.max_len - 1), engine.max_num_seqs,
                   cfg.target_vocab_size, cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers)

    def check(self, job: TranslateJob, origin: JobOrigin = JobOrigin()) -> None:
        """The gateway's check of a whole job, its texts named as ``origin`` says. Raises TooLarge for
        too many or too long texts, EngineValidationError for an option or attention selection beyond
        this model."""
        f, o = origin.field, job.options
        n_texts = len(job.texts) if origin.n_texts is None else origin.n_texts
        if n_texts > MAX_TEXTS:
            raise TooLarge(f"{f}: at most {MAX_TEXTS} texts per request, got {n_texts}", f)
        check_options(o, self)
        if o.attention_kinds:
            self._check_attention(job.attention, o.attention_kinds)
        for i, text in enumerate(job.texts):
            if len(text) > MAX_TEXT_CHARS:
                raise TooLarge(f"{origin.where(i)}: at most {MAX_TEXT_CHARS} characters per text, got {len(text)}", f)

    def _check_attention(self, att: AttentionSelection, kinds: tuple[str, ...]) -> None:
        n_layers = {"cross": self.n_decoder_layers, "decoder": self.n_decoder_layers, "encoder": self.n_encoder_layers}
        limit = min(n_layers[k] for k in kinds)
        for layer in att.layers or ():
            if not 0 <= layer < limit:
                raise EngineValidationError("attention.layers", f"layer indices must be in 0..{limit - 1} for model "
                                                                f"{self.model} ({'/'.join(kinds)}), got {layer}")
        for head in att.heads or ():
            if not 0 <= head < self.n_heads:
                raise EngineValidationError("attention.heads", f"head indices must be in 0..{self.n_heads - 1} "
                                                               f"for model {self.model}, got {head}")


def check_options(o: GenerationOptions, limits: ModelLimits, default_max_new: Optional[int] = None) -> GenerationOptions:
    """Every rule on one sentence's options against ``limits``. ``default_max_new``: the sentence's
    own budget when ``o.max_new_tokens`` is None (the engine knows it, the gateway does not), raised
    to min_new_tokens where that is larger. Returns the options with their types made
    exact, max_new_tokens resolved where known and attention kinds in canonical order.
    Raises EngineValidationError(field, message)."""
    if not isinstance(o, GenerationOptions):
        raise EngineValidationError("options", f"must be GenerationOptions, got {type(o).__name__}")
    if not _is_int(o.beam_size) or o.beam_size < 1:
        raise EngineValidationError("beam_size", f"must be an integer >= 1, got {_got(o.beam_size)}")
    if o.beam_size > max_beam_size(limits.vocab_size):     # a beam's candidates are target tokens
        raise EngineValidationError("beam_size", f"must be <= {max_beam_size(limits.vocab_size)} (half the "
                                                 f"vocabulary), got {_got(o.beam_size)}")
    if o.beam_size > limits.max_num_seqs:
        raise EngineValidationError("beam_size", f"must be <= max_num_seqs ({limits.max_num_seqs}), "
                                                 f"got {_got(o.beam_size)}")
    if not _is_int(o.n_best) or not 1 <= o.n_best <= o.beam_size:
        raise EngineValidationError("n_best", f"must be an integer in 1..beam_size ({o.beam_size}), "
                                              f"got {_got(o.n_best)}")
    max_new = o.max_new_tokens
    default = max_new is None
    if not default and (not _is_int(max_new) or not 0 <= max_new <= limits.max_new_tokens):
        raise EngineValidationError("max_new_tokens", f"must be an integer in 0..{limits.max_new_tokens}, "
                                                      f"got {_got(max_new)}")
    if not _is_int(o.min_new_tokens) or not 0 <= o.min_new_tokens <= limits.max_new_tokens:
        raise EngineValidationError("min_new_tokens", f"must be an integer in 0..{limits.max_new_tokens}, "
                                                      f"got {_got(o.min_new_tokens)}")
    if default:             # the sentence's default budget, raised to min_new_tokens
        max_new = None if default_max_new is None else \
            min(max(default_max_new, o.min_new_tokens), limits.max_new_tokens)
    elif o.min_new_tokens > max_new:
        raise EngineValidationError("min_new_tokens", f"must be an integer in 0..max_new_tokens ({max_new}), "
                                                      f"got {_got(o.min_new_tokens)}")
    lp = o.length_penalty
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
        raise EngineValidationError("length_penalty", f"must be a finite number, got {_got(lp)}")
    prefix = o.target_prefix
    if not isinstance(prefix, (tuple, list)) or not all(_is_int(t) for t in prefix):
        raise EngineValidationError("target_prefix", f"must be a sequence of token ids, got {_got(prefix)}")
    if not _is_int(o.free_prefix) or not 0 <= o.free_prefix <= len(prefix):
        raise EngineValidationError("free_prefix", f"must be an integer in 0..{len(prefix)} (the target_prefix "
                                                   f"ids), got {_got(o.free_prefix)}")
    rp = o.repetition_penalty
    if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0 < rp <= MAX_REPETITION_PENALTY:
        raise EngineValidationError("repetition_penalty", f"must be a number in (0, {MAX_REPETITION_PENALTY:g}], "
                                                          f"got {_got(rp)}")
    ng = o.no_repeat_ngram_size
    if not _is_int(ng) or not 0 <= ng <= MAX_NO_REPEAT_NGRAM_SIZE:
        raise EngineValidationError("no_repeat_ngram_size", f"must be an integer in 0..{MAX_NO_REPEAT_NGRAM_SIZE}, "
                                                            f"got {_got(ng)}")
    kinds = () if o.attention_kinds is None else o.attention_kinds
    if (isinstance(kinds, str) or not isinstance(kinds, (tuple, list, set, frozenset))
            or not all(isinstance(k, str) and k in ATTENTION_KINDS for k in kinds)):
        raise EngineValidationError("attention_kinds", f"must be a subset of {ATTENTION_KINDS}, got {_got(kinds)}")
    o = dataclasses.replace(o, beam_size=int(o.beam_size), n_best=int(o.n_best),
                            max_new_tokens=None if max_new is None else int(max_new),
                            min_new_tokens=int(o.min_new_tokens), length_penalty=float(lp),
                            attention_kinds=tuple(k for k in ATTENTION_KINDS if k in kinds),
                            target_prefix=tuple(int(t) for t in prefix), free_prefix=int(o.free_prefix),
                            repetition_penalty=float(rp),
                            no_repeat_ngram_size=int(ng))
    if o.constraints and len(o.target_prefix) > o.free_prefix:     # a forced language token alone combines
        raise EngineValidationError("target_prefix", "cannot be combined with glossary terms in one sentence "
                                                     "(send the glossary or the prefix)")
    return check_constraints(o, limits, default) if o.constraints else o


def check_constraints(o: GenerationOptions, limits: ModelLimits, default_max_new: bool) -> GenerationOptions:
    """The rules on ``o.constraints`` (target token ids each output must contain: glossary terms,
    ``model/inference/constraints.py``): non-empty sequences of ids of the target vocabulary, EOS
    excluded, that fit in max_new_tokens together; ``sentence_ends``: ids of the target vocabulary.
    A constrained sentence is searched with a beam of at least MIN_CONSTRAINED_BEAM (at most
    max_num_seqs): greedy requests too. A default max_new_tokens grows by the constraints' tokens (up
    to the model's limit).
    Raises EngineValidationError naming ``constraints``, ``sentence_ends`` or ``max_new_tokens``."""
    cons = o.constraints
    if not isinstance(cons, (tuple, list)) or not all(isinstance(c, (tuple, list)) and c for c in cons):
        raise EngineValidationError("constraints", "must be a list of non-empty lists of target token ids")
    if not isinstance(o.sentence_ends, (tuple, list)):
        raise EngineValidationError("sentence_ends", f"must be a list of target token ids, got {_got(o.sentence_ends)}")
    for name, ids in [("constraints", t) for t in cons] + [("sentence_ends", o.sentence_ends)]:
        for t in ids:
            if not _is_int(t) or not 0 <= t < limits.vocab_size:
                raise EngineValidationError(name, f"ids must be integers in 0..{limits.vocab_size - 1}, got {_got(t)}")
    total = sum(len(c) for c in cons)
    max_new = o.max_new_tokens
    if max_new is not None and total + 1 > max_new:
        if not default_max_new or total + 1 > limits.max_new_tokens:
            limit = max_new if not default_max_new else limits.max_new_tokens
            raise EngineValidationError("max_new_tokens", f"the sentence's glossary terms need {total} target "
                                                          f"tokens and EOS; max_new_tokens is {limit}")
        max_new = min(max_new + total, limits.max_new_tokens)
    beam = max(o.beam_size, min(MIN_CONSTRAINED_BEAM, limits.max_num_seqs))
    if beam < 2:
        raise EngineValidationError("constraints", f"need a beam of 2 or more; the engine has "
                                                   f"max_num_seqs {limits.max_num_seqs}")
    return dataclasses.replace(o, beam_size=beam, max_new_tokens=max_new,
                               constraints=tuple(tuple(int(t) for t in c) for c in cons),
                               sentence_ends=tuple(int(t) for t in o.sentence_ends))


def resolve_options(src_ids: Sequence[int], options: Optional[GenerationOptions], cfg, config: EngineConfig,
                    max_src_len: int, max_tgt_len: int) -> GenerationOptions:
    """The engine's guard for one sentence (direct library use included): its source ids, then
    ``check_options`` with the limits the engine runs with.

    Args:
        src_ids: source ids, EOS included; options: None for the defaults.
        cfg: the model's ``ModelConfig``; config: the engine's settings;
        max_src_len / max_tgt_len: the cache's bounds (source ids, target positions).
    Returns the options with max_new_tokens resolved: the tokens to generate after ``target_prefix``
    (default: ``default_max_new_tokens`` of the source), cut so that the prefix and they fit the
    model's target window (0 when the prefix fills it: the answer is the prefix), min_new_tokens
    at most that.
    Raises EngineValidationError(field, message).
    """
    o = GenerationOptions() if options is None else options
    if not isinstance(src_ids, (list, tuple)):
        raise EngineValidationError("src_ids", "must be a list of token ids")
    if not src_ids:
        raise EngineValidationError("src_ids", "must not be empty (an encoded sentence ends with EOS)")
    if len(src_ids) > max_src_len:
        raise EngineValidationError("src_ids", f"has {len(src_ids)} tokens, the limit is {max_src_len}")
    for t in src_ids:
        if not _is_int(t) or not 0 <= t < cfg.vocab_size or t == cfg.pad_id:
            raise EngineValidationError("src_ids", f"ids must be integers in 0..{cfg.vocab_size - 1} other than "
                                                   f"the pad id {cfg.pad_id}, got {_got(t)}")
    limits = ModelLimits("", min(max_tgt_len, cfg.max_len - 1), config.max_num_seqs, cfg.target_vocab_size,
                         cfg.n_heads, cfg.n_encoder_layers, cfg.n_decoder_layers)   # the cache's bounds, not max_tgt_len
    prefix = o.target_prefix if isinstance(o.target_prefix, (tuple, list)) else ()
    for t in prefix:
        if not _is_int(t) or not 0 <= t < cfg.target_vocab_size or t in (cfg.pad_id, cfg.bos_id, cfg.eos_id):
            raise EngineValidationError("target_prefix", f"ids must be integers in 0..{cfg.target_vocab_size - 1} "
                                                         f"other than pad, BOS and EOS, got {_got(t)}")
    o = check_options(o, limits, default_max_new_tokens(len(src_ids), cfg.max_len))
    # max_new_tokens and min_new_tokens count the tokens after the prefix; prefix + generated tokens fit
    # the model's window (limits.max_new_tokens), so a prefix that fills it leaves 0 to generate
    room = max(limits.max_new_tokens - len(o.target_prefix), 0)
    max_new = min(o.max_new_tokens, room)
    return dataclasses.replace(o, max_new_tokens=max_new, min_new_tokens=min(o.min_new_tokens, max_new))
