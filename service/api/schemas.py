"""The HTTP API's own pydantic models: requests (strict types: a beam_size of "4" or 4.5 is a 422, not
silently coerced; unknown fields are rejected, so nothing a client sends is ignored), errors, models
and languages, and ``validate``: fields checked against a model, errors naming the field and its
limits. A request becomes a ``TranslateJob`` (``service/protocol.py``), whose answer
``TranslateResponse`` is the response body; the service-wide limits live there too, and what one model
accepts in ``service.engine.validation.ModelLimits``. What needs tokenization (a sentence over the
model's window) is the translator's: it cuts such a sentence, and no count of tokens or sentences is refused.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, TypeVar, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from model.inference.search import ATTENTION_KINDS
from service.protocol import (
    MAX_BEAM_SIZE,
    MAX_GLOSSARY_ENTRIES,
    MAX_GLOSSARY_TERM_CHARS,
    MAX_KEEP_CHARS,
    MAX_KEEP_TERMS,
    MAX_NO_REPEAT_NGRAM_SIZE,
    MAX_PREFIX_CHARS,
    MAX_REPETITION_PENALTY,
    MAX_TEXT_CHARS,
    MAX_TEXTS,
    NOT_BLANK,
    AttentionSelection,
    GenerationOptions,
    JobOrigin,
    ServiceError,
    TranslateJob,
    shown,
)

from .errors import format_validation_error
from .glossaries import GlossaryEntry


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# a do-not-translate term as the schema states it: 1..MAX_KEEP_CHARS characters, not blank
KeepTerm = Annotated[str, StringConstraints(min_length=1, max_length=MAX_KEEP_CHARS, pattern=NOT_BLANK)]

def _whole(v: Any) -> Any:
    """A JSON number with no fractional part (4.0) is the integer it equals, as JSON Schema's
    "integer" says; 4.5, "4" and true stay refused (strict)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v



class AttentionOptions(_Strict):
    """Which attention weights to return; layers and heads select rows of each kind to keep payloads small."""
    kinds: list[Literal[ATTENTION_KINDS]] = Field(
        default_factory=lambda: ["cross"], min_length=1, max_length=3,
        description="any of cross (decoder->encoder), encoder (self), decoder (self)")
    layers: Optional[list[Annotated[int, Field(ge=0)]]] = Field(None, min_length=1, description="layer indices (0-based, "
                                                                "below the model's layer count); null = all")
    heads: Optional[list[Annotated[int, Field(ge=0)]]] = Field(None, min_length=1, description="head indices (0-based, "
                                                               "below the model's head count); null = all")

    @field_validator("layers", "heads", mode="before")
    @classmethod
    def _whole_indices(cls, v: Any) -> Any:
        return [_whole(i) for i in v] if isinstance(v, list) else v


class TranslateRequest(_Strict):
    """POST /v1/translate body."""
    # Per model (beam_size and n_best <= max_num_seqs, max_new_tokens, attention indices): stated by
    # service/api/openapi.py. Rules between fields are behaviour, not refusals: n_best above beam_size
    # widens the beam to n_best (the beam_size sent changes nothing: X-Ignored-Fields); attention
    # without return_attention turns it on; glossary and glossary_id together both apply.
    _beam_raised: bool = PrivateAttr(False)
    text: Union[str, Annotated[list[str], Field(min_length=1)]] = Field(
        ..., description=f"one text or a list of 1 to {MAX_TEXTS}; each up to {MAX_TEXT_CHARS} characters, "
                         "split into lines and sentences that are translated in one batch")
    source_lang: Optional[Annotated[str, Field(json_schema_extra={"pattern": NOT_BLANK})]] = Field(
        None, description='source language code; null = the model\'s; "auto": each '
                                                         "text's language detected, each text sent to its model")
    target_lang: Optional[Annotated[str, Field(json_schema_extra={"not": {"enum": ["auto", "AUTO", "Auto"]},
                                                                  "pattern": NOT_BLANK})]] = Field(
        None, description="target language code; null = the model's (never auto)")
    model: Optional[str] = Field(None, description="model id from GET /v1/models; null = chosen by languages")
    beam_size: int = Field(4, ge=1, le=MAX_BEAM_SIZE, description="1 = greedy search; left out: 4. Below n_best: "
                                                                    "n_best (named in X-Ignored-Fields when sent)")
    n_best: int = Field(1, ge=1, le=MAX_BEAM_SIZE, description="hypotheses returned per text (the beam is at least "
                                                                 "this wide)")
    max_new_tokens: Optional[int] = Field(
        None, ge=0, description="target tokens per sentence after target_prefix; null = 2 * source_len + 10; "
                                "the prefix and these are cut to the model's max_len - 1 (finish_reason length)")
    min_new_tokens: int = Field(0, ge=0, description="EOS is not generated before this many tokens after target_prefix (for "
                                                     "fixed-length benchmarks); raises the default budget; at or "
                                                     "above max_new_tokens: exactly max_new_tokens tokens")
    length_penalty: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False,
                                  description="score = log_prob / length ** length_penalty")
    return_attention: bool = Field(False, description="attention weights in the answer; left out: true when attention "
                                                      "is sent")
    attention: AttentionOptions = Field(default_factory=AttentionOptions, description="which weights to return; with "
                                        "return_attention: false it is not applied (named in X-Ignored-Fields)")
    stream: bool = Field(False, description="answer with Server-Sent Events, one per new target token")
    timeout_s: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False, description="seconds until the request is cancelled and answered 504 "
                                                     "(at most the server's max_timeout_s; null = that maximum)")
    keep: Optional[list[KeepTerm]] = Field(
        None, max_length=MAX_KEEP_TERMS,
        description=f"do-not-translate terms (up to {MAX_KEEP_TERMS}, each up to {MAX_KEEP_CHARS} characters, not "
                    "blank): each occurrence in the text (case-sensitive, whole words) comes back verbatim; "
                    "null = none besides the server's stored list")

    glossary: Optional[list[GlossaryEntry]] = Field(
        None, max_length=MAX_GLOSSARY_ENTRIES,
        description=f"terminology (up to {MAX_GLOSSARY_ENTRIES} entries, terms up to {MAX_GLOSSARY_TERM_CHARS} "
                    "characters, not blank): where a source term occurs (case-insensitive, any inflection with "
                    "the same Snowball stem), its target term is in the translation (constrained beam search, at "
                    "least beam 4); one source term with two targets is a 422. With glossary_id: both apply")
    glossary_id: Optional[str] = Field(None, min_length=1, description="a stored glossary's name "
                                                                       "(GET /v1/glossaries; unknown: 404)")

    target_prefix: Optional[str] = Field(
        None, min_length=1, max_length=MAX_PREFIX_CHARS,
        description=f"the translation of each text starts with this text (its first sentence; up to "
                    f"{MAX_PREFIX_CHARS} characters; max_new_tokens counts the tokens after it, and one that fills "
                    f"the model's max_len - 1 tokens is that sentence's translation); null = free")
    min_confidence: Optional[float] = Field(
        None, ge=0.0, le=1.0, allow_inf_nan=False,
        description="translations (and alternatives) with confidence below it carry low_confidence: true; "
                    "nothing is dropped")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False,
        description="CTranslate2's: logits of tokens already generated are divided (if > 0) or multiplied "
                    "(if < 0) by it; > 1 discourages repetition; 1 = off")
    no_repeat_ngram_size: int = Field(
        0, ge=0, le=MAX_NO_REPEAT_NGRAM_SIZE,
        description="CTranslate2's: no n-gram of this many tokens occurs twice in a sentence's translation; 0 = off")
    return_alignment: bool = Field(False, description="each translation carries alignment: [source word, target "
                                                      "word] pairs from cross-attention (docs/controls.md)")
    memory_threshold: Optional[float] = Field(
        None, ge=0.0, le=100.0, allow_inf_nan=False,
        description="0-100: a sentence the translation memory has no exact entry for takes the stored translation "
                    "of its most similar stored source when that one scores at least this (rapidfuzz fuzz.ratio; "
                    "docs/clients.md#translation-memory); each translation then carries origin and memory_score. "
                    "null = exact entries only")

    @field_validator("glossary", mode="before")
    @classmethod
    def _glossary_entries(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, list):
            raise ValueError(f'must be a list of {{"source": ..., "target": ...}} entries or null; got {type(v).__name__}')
        if len(v) > MAX_GLOSSARY_ENTRIES:
            raise ValueError(f"at most {MAX_GLOSSARY_ENTRIES} entries, got {len(v)} (store a larger glossary with "
                             "POST /v1/glossaries and send its glossary_id)")
        for i, e in enumerate(v):
            if not isinstance(e, dict):
                raise ValueError(f'glossary[{i}]: must be an object {{"source": ..., "target": ...}}, '
                                 f"got {type(e).__name__}")
            for side in ("source", "target"):
                term = e.get(side)
                if isinstance(term, str):
                    if not term.strip():
                        raise ValueError(f"glossary[{i}].{side}: must not be empty or whitespace only, got {shown(term)}")
                    if len(term) > MAX_GLOSSARY_TERM_CHARS:
                        raise ValueError(f"glossary[{i}].{side}: at most {MAX_GLOSSARY_TERM_CHARS} characters, "
                                         f"got {len(term)}")
                    check_unicode([term], f"glossary[{i}].{side}")
            source = e.get("source")
            if isinstance(source, str) and source.strip() and not re.search(r"\w", source):
                raise ValueError(f"glossary[{i}].source: needs a letter or digit to be matched, got {shown(source)}")
        return v

    @field_validator("target_prefix")
    @classmethod
    def _prefix_text(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            if not v.strip():
                raise ValueError(f"must not be empty or whitespace only (leave it out for none), got {shown(v)}")
            check_unicode([v], "target_prefix")
        return v

    @field_validator("text", mode="before")
    @classmethod
    def _text_type(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError(f"an empty list; send one text or a list of 1 to {MAX_TEXTS}")
            bad = next((i for i, t in enumerate(v) if not isinstance(t, str)), None)
            if bad is not None:
                raise ValueError(f"must be a string or a list of strings; text[{bad}] has type "
                                 f"{type(v[bad]).__name__}")
        elif not isinstance(v, str):
            raise ValueError("must be a string or a list of strings")
        check_unicode([v] if isinstance(v, str) else v, "text")
        return v

    @field_validator("beam_size", "n_best", "max_new_tokens", "min_new_tokens", "no_repeat_ngram_size", mode="before")
    @classmethod
    def _whole_number(cls, v: Any) -> Any:
        return _whole(v)

    @field_validator("keep", mode="before")
    @classmethod
    def _keep_terms(cls, v: Any) -> Any:
        return check_keep(v)

    @field_validator("model", "source_lang", "target_lang")
    @classmethod
    def _names_are_unicode(cls, v: Optional[str], info) -> Optional[str]:
        if v is not None:
            check_unicode([v], info.field_name)
        return v

    @field_validator("source_lang", "target_lang")
    @classmethod
    def _language_code(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.strip():
            raise ValueError(f"must be a language code such as 'de', or null for the model's; got {shown(v)}")
        return v

    @model_validator(mode="after")
    def _n_best_within_beam(self) -> "TranslateRequest":
        if self.n_best > self.beam_size:        # n_best hypotheses need a beam at least as wide
            self._beam_raised = "beam_size" in self.model_fields_set
            self.beam_size = self.n_best
        if "attention" in self.model_fields_set and "return_attention" not in self.model_fields_set:
            self.return_attention = True        # a selection asks for the weights
        return self

    @property
    def ignored(self) -> list[str]:
        """Fields sent that change nothing (named in the X-Ignored-Fields header): attention with
        return_attention: false; a beam_size below n_best (the beam is n_best wide)."""
        return (["attention"] if "attention" in self.model_fields_set and not self.return_attention else []) + \
            (["beam_size"] if self._beam_raised else [])

    @property
    def texts(self) -> list[str]:
        return [self.text] if isinstance(self.text, str) else list(self.text)

    def job(self) -> TranslateJob:
        """The translator's job for this request (attention kinds only when return_attention)."""
        kinds = tuple(dict.fromkeys(self.attention.kinds)) if self.return_attention else ()
        # min_new_tokens above max_new_tokens: EOS is never allowed before the cap, so exactly
        # max_new_tokens tokens, which min_new_tokens = max_new_tokens says too
        min_new = self.min_new_tokens if self.max_new_tokens is None else min(self.min_new_tokens, self.max_new_tokens)
        options = GenerationOptions(beam_size=self.beam_size, n_best=self.n_best, max_new_tokens=self.max_new_tokens,
                                    length_penalty=self.length_penalty, attention_kinds=kinds,
                                    min_new_tokens=min_new, repetition_penalty=self.repetition_penalty,
                                    no_repeat_ngram_size=self.no_repeat_ngram_size)
        att = self.attention
        selection = AttentionSelection(tuple(att.layers) if att.layers else None,
                                       tuple(att.heads) if att.heads else None)
        return TranslateJob(self.texts, options, selection, target_lang=self.target_lang, keep=tuple(self.keep or ()),
                            glossary=tuple((e.source, e.target) for e in self.glossary or ()),
                            target_prefix=self.target_prefix, min_confidence=self.min_confidence,
                            return_alignment=self.return_alignment, memory_threshold=self.memory_threshold)

    def origin(self) -> JobOrigin:
        """Where the job's texts came from: ``text``, a string or a list."""
        return JobOrigin("text", isinstance(self.text, list))


class ErrorBody(BaseModel):
    type: str
    message: str = Field(..., description="names the field and the limit")
    field: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
    request_id: Optional[str] = None


class ModelInfo(BaseModel):
    id: str
    source_lang: str = Field(..., description='the source language; "mul" for an NLLB-200 / M2M100 / mBART-50 model')
    source_langs: list[str] = Field(default_factory=list, description="the source languages a request may name: "
                                    "[source_lang], or every language of an NLLB-200 / M2M100 / mBART-50 model")
    target_lang: Optional[str] = Field(..., description="the target language; null for a multilingual model")
    target_langs: list[str] = Field(..., description="the target languages a request may name: a multilingual "
                                                     "model's >>xx<< codes, else [target_lang]")
    config: dict
    test_bleu: Optional[float] = Field(None, description="BLEU on Multi30k test_2016_flickr, from the checkpoint")
    metadata: dict = Field(default_factory=dict)
    engine: dict = Field(default_factory=dict, description="engine settings (user_config)")
    pool: bool = Field(False, description="loaded on demand by the model pool (docs/deploy.md#model-pool)")
    loaded_on: Optional[list[str]] = Field(None, description="a pool model: the pool replicas (ids) it is loaded "
                                                             "on now, [] when none; null for a pinned model")


class PivotInfo(BaseModel):
    """A pair served through a pivot language (service/pipeline/pivot.py): two models, one after the other."""
    id: str = Field(..., description='the route\'s id, its models joined by "+" (a request may name it as model)')
    source_lang: str
    target_lang: str
    via: str = Field(..., description="the pivot language")
    path: list[str] = Field(..., description='the language pair of each leg, e.g. ["de-en", "en-fr"]')
    models: list[str] = Field(..., description="the model of each leg")


class ModelsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfo]
    pivots: list[PivotInfo] = Field(default_factory=list, description="pairs no model serves directly, translated "
                                                                      "through a pivot language")


class LibreLanguage(BaseModel):
    """GET /languages item, as LibreTranslate returns it."""
    code: str
    name: str
    targets: list[str] = Field(..., description="codes it translates into, the pivot-reachable ones (via) included")
    via: Optional[dict[str, str]] = Field(None, description="target -> the pivot language it is translated through, "
                                                            "for the targets no model serves directly; absent: none")


def check_keep(v: Any) -> Any:
    """The rules on ``keep`` (do-not-translate terms), the same on every route: None, or a list of
    at most MAX_KEEP_TERMS strings, each not blank, at most MAX_KEEP_CHARS characters, valid
    Unicode. Returns v; raises ValueError naming the term (``keep[i]``) and the limit."""
    if v is None:
        return v
    if not isinstance(v, list):
        raise ValueError(f"must be a list of strings (do-not-translate terms) or null; got {type(v).__name__}")
    if len(v) > MAX_KEEP_TERMS:
        raise ValueError(f"at most {MAX_KEEP_TERMS} terms, got {len(v)}")
    for i, term in enumerate(v):
        if not isinstance(term, str):
            raise ValueError(f"keep[{i}]: must be a string, got {type(term).__name__}")
        if not term.strip():
            raise ValueError(f"keep[{i}]: must not be empty or whitespace only, got {shown(term)}")
        if len(term) > MAX_KEEP_CHARS:
            raise ValueError(f"keep[{i}]: at most {MAX_KEEP_CHARS} characters, got {len(term)}")
        check_unicode([term], f"keep[{i}]")
    return v


def check_unicode(texts: list[str], field: str) -> None:
    """Raise ValueError if a text holds lone surrogates (JSON "\\ud800"), which no tokenizer can encode."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            where = f"{field}[{i}]" if len(texts) > 1 else field
            raise ValueError(f"{where}: not valid Unicode: a lone surrogate (U+{ord(t[e.start]):04X}) "
                             f"at character {e.start}") from None


M = TypeVar("M", bound=BaseModel)


# ---- validating fields against a model ------------------------------------------------------------
class FormFields(dict):
    """Fields that came as text (a form, or the query string alone): ``validate`` lets the model
    read "2" as a number and an empty field as its default (validation context ``{"form": True}``)."""


def field_limits(model: type[BaseModel], name: str) -> str:
    """The limits of a model's field as a message states them ("0 <= alternatives <= 15", "at most
    100 items"), or "" when it has none."""
    info = model.model_fields.get(name)
    if info is None:
        return ""
    parts, low, high = [], None, None
    for m in info.metadata:
        for attr, op in (("ge", "<="), ("gt", "<")):
            if getattr(m, attr, None) is not None:
                low = f"{getattr(m, attr)} {op} "
        for attr, op in (("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                high = f" {op} {getattr(m, attr)}"
        if getattr(m, "min_length", None) is not None:
            parts.append(f"length >= {m.min_length}")
        if getattr(m, "max_length", None) is not None:
            parts.append(f"length <= {m.max_length}")
    if low or high:
        parts.insert(0, f"{low or ''}{name}{high or ''}")
    return "; ".join(parts)


def validate(model: type[M], fields: object, status: int = 422) -> M:
    """``fields`` (``read_fields``, or a decoded JSON body) validated by the pydantic ``model`` (with
    FormFields, in the validation context ``{"form": True}``: a model may read text as a number).
    Raises ServiceError ``status`` naming the first invalid field, what is wrong and the field's
    limits (``errors.format_validation_error`` + ``field_limits``); a ValueError or OverflowError
    raised while converting is that error too, never a 500."""
    try:
        return model.model_validate(fields, context={"form": isinstance(fields, FormFields)})
    except ValidationError as e:
        errors = e.errors()
        field, message = format_validation_error(errors[0])
        if errors[0].get("type") == "missing":
            message = f"Invalid request: missing {field} parameter (required)"
        top = field.split(".")[0].split("[")[0]
        limits = field_limits(model, top)
        if limits and errors[0].get("type") != "missing":
            message += f" (allowed: {limits})"
        raise ServiceError(status, message, field) from None
    except (ValueError, OverflowError) as e:
        raise ServiceError(status, f"body: {e}", "body") from None
