"""The request schema (service/api/schemas.py) and the model limits the gateway checks
(service/engine/validation.py), mapped to HTTP errors as the gateway maps them, in-process."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from model.config import ModelConfig
from service.api.schemas import TranslateRequest
from service.engine import EngineConfig, EngineValidationError
from service.engine.validation import ModelLimits
from service.protocol import MAX_TEXT_CHARS, MAX_TEXTS, JobOrigin, ServiceError
from service.replica import mapped_errors

TINY = ModelConfig.from_name("tiny", vocab_size=500, max_len=64)   # 2 layers, 4 heads
LIMITS = ModelLimits.of("tiny", TINY, EngineConfig(max_num_seqs=4, max_waiting=5))


def gateway_check(limits: ModelLimits, job, origin: JobOrigin = JobOrigin()) -> None:
    """``limits.check(job, origin)`` with its domain errors mapped to ServiceError, as the gateway does."""
    with mapped_errors(limits.model):
        limits.check(job, origin)


def job(**fields):
    return TranslateRequest(**{"text": "x", "beam_size": 2, "max_new_tokens": 6, **fields}).job()


def test_limits_come_from_the_model_config_and_the_engine():
    assert (LIMITS.max_new_tokens, LIMITS.max_num_seqs, LIMITS.n_heads) == (63, 4, 4)
    assert ModelLimits.of("tiny", TINY, EngineConfig(max_tgt_len=20)).max_new_tokens == 20


@pytest.mark.parametrize("fields, status, field, words", [
    ({"beam_size": 5}, 422, "beam_size", "4"),
    ({"max_new_tokens": 64}, 422, "max_new_tokens", "63"),
    ({"max_new_tokens": 64, "min_new_tokens": 70}, 422, "max_new_tokens", "63"),
    ({"return_attention": True, "attention": {"kinds": ["cross"], "layers": [2]}}, 422, "attention.layers", "0..1"),
    ({"return_attention": True, "attention": {"kinds": ["encoder"], "heads": [4]}}, 422, "attention.heads", "0..3"),
    ({"text": ["x"] * (MAX_TEXTS + 1)}, 413, "text", str(MAX_TEXTS)),
    ({"text": ["x", "y" * (MAX_TEXT_CHARS + 1)]}, 413, "text", "text[1]"),
])
def test_model_limits_are_service_errors_naming_field_and_limit(fields, status, field, words):
    with pytest.raises(ServiceError) as e:
        gateway_check(LIMITS, job(**fields), TranslateRequest(**{"text": "x", **fields}).origin())
    assert (e.value.status, e.value.field) == (status, field), e.value.message
    assert words in e.value.message and field.split(".")[0] in e.value.message


def test_within_the_limits_passes_and_attention_indices_matter_only_when_asked():
    LIMITS.check(job(beam_size=4, max_new_tokens=63, min_new_tokens=63))
    with pytest.raises(ServiceError) as e:      # a selection without return_attention asks for the weights
        gateway_check(LIMITS, job(attention={"kinds": ["cross"], "layers": [7]}))
    assert e.value.field == "attention.layers"
    LIMITS.check(job(return_attention=False, attention={"kinds": ["cross"], "layers": [7]}))   # not applied
    assert TranslateRequest(text="x", return_attention=False, attention={"layers": [7]}).ignored == ["attention"]
    LIMITS.check(job(max_new_tokens=None, min_new_tokens=63))   # raises the sentence's default budget
    with pytest.raises(EngineValidationError, match="min_new_tokens: must be an integer in 0..63, got 64"):
        LIMITS.check(job(max_new_tokens=None, min_new_tokens=64))


def test_the_job_carries_the_resolved_options():
    body = TranslateRequest(text=["a", "b"], beam_size=3, n_best=2, return_attention=True,
                            attention={"kinds": ["decoder", "cross", "decoder"], "heads": [1]})
    j = body.job()
    assert (j.texts, body.origin()) == (["a", "b"], JobOrigin("text", True))
    assert TranslateRequest(text="a").origin() == JobOrigin("text", False)
    assert (j.options.beam_size, j.options.n_best, j.options.max_new_tokens) == (3, 2, None)
    assert j.options.attention_kinds == ("decoder", "cross")      # request order, once each
    assert (j.attention.layers, j.attention.heads) == (None, (1,))
    assert TranslateRequest(text="a", return_attention=False).job().options.attention_kinds == ()


def test_schema_rejects_what_no_model_accepts():
    for bad in ({"text": "x", "beam_size": "4"},
                {"text": "x", "attention": {"kinds": ["sideways"]}}, {"text": "\ud800"}):
        with pytest.raises(ValidationError):
            TranslateRequest(**bad)
    with pytest.raises(ValidationError) as e:        # nothing to translate: refused, as DeepL's route does
        TranslateRequest(text=[])
    assert [(err["loc"], "an empty list" in err["msg"]) for err in e.value.errors()] == [(("text",), True)]
    assert TranslateRequest(text=[""]).job().texts == [""]          # one empty text is a text


def test_beam_limit_uses_the_target_vocabulary():
    """With separate vocabularies (an imported "tc-big" MarianMT model) a beam may hold at most half of
    the TARGET vocabulary, in the gateway's limits and in the engine's own guard alike; source ids
    still range over the source vocabulary."""
    from service.engine.errors import EngineValidationError
    from service.engine.records import GenerationOptions
    from service.engine.validation import resolve_options
    cfg = ModelConfig.from_name("tiny", vocab_size=500, tgt_vocab_size=20, share_embeddings=False,
                                tie_target_output=True, max_len=64)
    engine = EngineConfig(max_num_seqs=64)
    limits = ModelLimits.of("separate", cfg, engine)
    assert limits.vocab_size == cfg.target_vocab_size == 20
    limits.check(job(beam_size=10))
    with pytest.raises(ServiceError) as e:
        gateway_check(limits, job(beam_size=11))
    assert (e.value.status, e.value.field) == (422, "beam_size")
    assert "must be <= 10 (half the vocabulary)" in e.value.message
    src = [400, 7, cfg.eos_id]                       # a source id beyond the target vocabulary: fine
    assert resolve_options(src, GenerationOptions(beam_size=10), cfg, engine, 64, 64).beam_size == 10
    with pytest.raises(EngineValidationError, match="must be <= 10 \\(half the vocabulary\\), got 11"):
        resolve_options(src, GenerationOptions(beam_size=11), cfg, engine, 64, 64)
    shared = ModelLimits.of("shared", TINY, engine)     # tgt_vocab_size 0: the joint vocabulary
    assert shared.vocab_size == 500


def test_min_new_tokens_above_max_new_tokens_means_exactly_max_new_tokens():
    """EOS is never allowed before the cap: the job asks for min = max (what the schema accepts is served)."""
    job = TranslateRequest(text="x", max_new_tokens=5, min_new_tokens=6).job()
    assert (job.options.min_new_tokens, job.options.max_new_tokens) == (5, 5)
    LIMITS.check(job)
    assert TranslateRequest(text="x", min_new_tokens=6).job().options.min_new_tokens == 6


def test_n_best_above_beam_size_widens_the_beam_and_names_a_sent_beam_size_as_ignored():
    assert (TranslateRequest(text="x", n_best=6).beam_size, TranslateRequest(text="x", n_best=6).ignored) == (6, [])
    assert TranslateRequest(text="x", n_best=2).beam_size == 4
    narrow = TranslateRequest(text="x", n_best=6, beam_size=5)
    assert (narrow.beam_size, narrow.job().options.beam_size, narrow.ignored) == (6, 6, ["beam_size"])
    wide = TranslateRequest(text="x", n_best=3, beam_size=5)
    assert (wide.beam_size, wide.ignored) == (5, [])
    schema = TranslateRequest.model_json_schema()
    assert "if" not in schema and "then" not in schema       # a rule of behaviour, not a refusal
