"""What crosses the HTTP API and the gateway -> translator hand-off.

- pydantic request/response models of the HTTP API. Types are strict (a beam_size of "4" or 4.5 is
  a 422, not silently coerced) and unknown fields are rejected, so nothing a client sends is ignored.
- the service-wide request limits, and ``ModelLimits``: what one model accepts (from its config and
  its engine settings), checked by the gateway before a request is routed (``ModelLimits.check``).
- ``TranslateJob``: what the gateway sends a translator; a translator answers ``TranslateResponse``
  (or, streaming, ``StreamStart``, ``StreamToken``s, then the ``TranslateResponse``).

What needs tokenization (tokens per sentence, sentences per request) is the translator's to check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from model.inference.search import ATTENTION_KINDS
from service.engine.config import EngineConfig
from service.engine.records import GenerationOptions

from .errors import ServiceError, shown

# Service-wide request limits (the model-dependent ones are in ModelLimits).
MAX_TEXTS = 64                 # texts in one request (a list `text` / LibreTranslate `q`)
MAX_TEXT_CHARS = 5_000         # characters in one text (the per-text cap; each sentence has the model's cap)
MAX_SENTENCES = 256            # sentences in one request after splitting every text
MAX_BEAM_SIZE = 16             # beam_size upper bound (each hypothesis holds one KV-cache slot)
MAX_ATTENTION_VALUES = 2_000_000   # attention weights in one response (all texts, kinds, layers, heads)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class AttentionOptions(_Strict):
    """Which attention weights to return; layers and heads select rows of each kind to keep payloads small."""
    kinds: list[Literal[ATTENTION_KINDS]] = Field(
        default_factory=lambda: ["cross"], min_length=1, max_length=3,
        description="any of cross (decoder->encoder), encoder (self), decoder (self)")
    layers: Optional[list[int]] = Field(None, min_length=1, description="layer indices (0-based); null = all")
    heads: Optional[list[int]] = Field(None, min_length=1, description="head indices (0-based); null = all")


class TranslateRequest(_Strict):
    """POST /v1/translate body."""
    text: Union[str, list[str]] = Field(
        ..., description=f"one text or a list of up to {MAX_TEXTS}; each up to {MAX_TEXT_CHARS} characters, "
                         "split into lines and sentences that are translated in one batch")
    source_lang: Optional[str] = Field(None, description="source language code; null = the model's")
    target_lang: Optional[str] = Field(None, description="target language code; null = the model's")
    model: Optional[str] = Field(None, description="model id from GET /v1/models; null = chosen by languages")
    beam_size: int = Field(4, ge=1, le=MAX_BEAM_SIZE, description="1 = greedy search")
    n_best: int = Field(1, ge=1, le=MAX_BEAM_SIZE, description="hypotheses returned per text (<= beam_size)")
    max_new_tokens: Optional[int] = Field(
        None, ge=0, description="target tokens per sentence; null = min(2 * source_len + 10, model max_len - 1)")
    min_new_tokens: int = Field(0, ge=0, description="EOS is not generated before this many tokens "
                                                     "(<= max_new_tokens; for fixed-length benchmarks)")
    length_penalty: float = Field(1.0, ge=0.0, le=10.0, allow_inf_nan=False,
                                  description="score = log_prob / length ** length_penalty")
    return_attention: bool = False
    attention: AttentionOptions = Field(default_factory=AttentionOptions)
    stream: bool = Field(False, description="answer with Server-Sent Events, one per new target token")
    timeout_s: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False, description="seconds until the request is cancelled and answered 504 "
                                                     "(at most the server's max_timeout_s; null = that maximum)")

    @field_validator("text", mode="before")
    @classmethod
    def _text_type(cls, v: Any) -> Any:
        if isinstance(v, list):
            bad = next((i for i, t in enumerate(v) if not isinstance(t, str)), None)
            if bad is not None:
                raise ValueError(f"must be a string or a list of strings; text[{bad}] has type "
                                 f"{type(v[bad]).__name__}")
        elif not isinstance(v, str):
            raise ValueError("must be a string or a list of strings")
        check_unicode([v] if isinstance(v, str) else v, "text")
        return v

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
        if self.n_best > self.beam_size:
            raise ValueError(f"n_best: must be <= beam_size ({self.beam_size}), got {self.n_best}")
        if "attention" in self.model_fields_set and not self.return_attention:   # nothing sent is ignored
            raise ValueError("attention: selects the weights return_attention returns; send return_attention: "
                             "true with it, or leave attention out")
        return self

    @property
    def texts(self) -> list[str]:
        return [self.text] if isinstance(self.text, str) else list(self.text)

    def job(self) -> "TranslateJob":
        """The translator's job for this request (attention kinds only when return_attention)."""
        kinds = tuple(dict.fromkeys(self.attention.kinds)) if self.return_attention else ()
        options = GenerationOptions(beam_size=self.beam_size, n_best=self.n_best, max_new_tokens=self.max_new_tokens,
                                    length_penalty=self.length_penalty, attention_kinds=kinds,
                                    min_new_tokens=self.min_new_tokens)
        att = self.attention
        selection = AttentionSelection(tuple(att.layers) if att.layers else None,
                                       tuple(att.heads) if att.heads else None)
        return TranslateJob(self.texts, options, selection, "text", isinstance(self.text, list),
                            target_lang=self.target_lang)


class Alternative(BaseModel):
    text: str
    tokens: list[str]
    score: float
    finish_reason: Literal["eos", "length"]


class Translation(BaseModel):
    text: str = Field(..., description="the translation, with the input's whitespace and line breaks")
    tokens: list[str] = Field(..., description="target SentencePiece pieces (EOS excluded), all sentences")
    source_tokens: list[str] = Field(..., description="source pieces, each sentence ending in </s>")
    score: float = Field(..., description="mean over sentences of log_prob / length ** length_penalty")
    finish_reason: Literal["eos", "length"] = Field(..., description="length if any sentence hit max_new_tokens")
    alternatives: list[Alternative] = Field(default_factory=list, description="hypotheses 2..n_best")
    attention: Optional[dict[str, list]] = Field(
        None, description="kind -> [layer][head][rows][cols]: cross [len(tokens)][len(source_tokens)], "
                          "encoder [len(source_tokens)]^2, decoder [len(tokens)]^2; block-diagonal over sentences")


class Usage(BaseModel):
    source_tokens: int = Field(..., description="source token ids fed to the encoder (EOS included)")
    generated_tokens: int = Field(..., description="target tokens of the returned best hypotheses")


class TranslateResponse(BaseModel):
    model: str
    translations: list[Translation]
    usage: Usage

    def body(self) -> dict:
        """The JSON body: ``attention`` only where it was asked for."""
        return self.model_dump(exclude_none=True)

    def body_bytes(self) -> bytes:
        """``body()`` encoded as JSON by pydantic's serializer in one step (the same bytes as
        ``JSONResponse(body())``, without the intermediate dicts)."""
        return self.__pydantic_serializer__.to_json(self, exclude_none=True)


class StreamStart(BaseModel):
    """First item of a translator's stream: the request was admitted (errors before it are HTTP errors)."""


class StreamToken(BaseModel):
    """One SSE `token` event: text delta of translation `index` (concatenated deltas = final text)."""
    index: int
    text: str
    token: Optional[str] = None     # the SentencePiece piece; null for whitespace-only deltas


StreamItem = Union[StreamStart, StreamToken, TranslateResponse]


class ErrorBody(BaseModel):
    type: str
    message: str = Field(..., description="names the field and the limit")
    field: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
    request_id: Optional[str] = None


class ModelInfo(BaseModel):
    id: str
    source_lang: str
    target_lang: Optional[str] = Field(..., description="the target language; null for a multilingual model")
    target_langs: list[str] = Field(..., description="the target languages a request may name: a multilingual "
                                                     "model's >>xx<< codes, else [target_lang]")
    config: dict
    test_bleu: Optional[float] = Field(None, description="BLEU on Multi30k test_2016_flickr, from the checkpoint")
    metadata: dict = Field(default_factory=dict)
    engine: dict = Field(default_factory=dict, description="engine settings (user_config)")


class ModelsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfo]


class LibreLanguage(BaseModel):
    """GET /languages item, as LibreTranslate returns it."""
    code: str
    name: str
    targets: list[str]


def check_unicode(texts: list[str], field: str) -> None:
    """Raise ValueError if a text holds lone surrogates (JSON "\\ud800"), which no tokenizer can encode."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            where = f"{field}[{i}]" if len(texts) > 1 else field
            raise ValueError(f"{where}: not valid Unicode: a lone surrogate (U+{ord(t[e.start]):04X}) "
                             f"at character {e.start}") from None


# ---- the gateway -> translator hand-off --------------------------------------------------------------
@dataclass(frozen=True)
class AttentionSelection:
    layers: Optional[tuple[int, ...]] = None   # layer indices to return; None = all
    heads: Optional[tuple[int, ...]] = None    # head indices to return; None = all


@dataclass
class TranslateJob:
    """One request for one translator: texts and the options every sentence of them is decoded with."""
    texts: list[str]                           # each split into sentences by the translator
    options: GenerationOptions                 # attention_kinds: those to return (in request order), or ()
    attention: AttentionSelection = AttentionSelection()
    field: str = "text"                        # the request field the texts came from, for error messages
    is_list: bool = False                      # the texts came as a list: errors name field[i]
    deadline: Optional[float] = None           # time.time() seconds when it is cancelled (504); None = never
    timeout_s: Optional[float] = None          # the timeout that set the deadline, named in the 504's message
    target_lang: Optional[str] = None          # multilingual models: the >>xx<< token starting each source
    n_texts: Optional[int] = None              # the client's texts when ``texts`` are their HTML segments


@dataclass(frozen=True)
class ModelLimits:
    """What one model accepts: from its config (``config.json``) and its engine settings.

    The engine's own guard (``service/engine/validation.py``) checks the same options again with the
    settings the replica really runs with, and its errors map to the same statuses and messages.
    """
    model: str                 # model id, named in messages
    max_new_tokens: int        # target tokens per sentence: min(engine max_tgt_len, max_len - 1)
    max_num_seqs: int          # KV-cache slots: the largest beam
    vocab_size: int            # the TARGET vocabulary: a beam may hold at most half of it
    n_heads: int
    n_encoder_layers: int
    n_decoder_layers: int

    @classmethod
    def of(cls, model: str, config: dict, engine: EngineConfig) -> "ModelLimits":
        max_len = config["max_len"]
        target_vocab = config.get("tgt_vocab_size") or config["vocab_size"]   # separate vocabularies: the target's
        return cls(model, min(engine.max_tgt_len or max_len, max_len - 1), engine.max_num_seqs, target_vocab,
                   config["n_heads"], config["n_encoder_layers"], config["n_decoder_layers"])

    def check(self, job: TranslateJob) -> None:
        """Raise ServiceError: 413 for too many or too long texts, 422 for an option beyond this model."""
        f, o = job.field, job.options
        n_texts = len(job.texts) if job.n_texts is None else job.n_texts
        if n_texts > MAX_TEXTS:
            raise ServiceError(413, f"{f}: at most {MAX_TEXTS} texts per request, got {n_texts}", f)
        if o.attention_kinds:
            self._check_attention(job.attention, o.attention_kinds)
        if 2 * o.beam_size > self.vocab_size:
            raise ServiceError(422, f"beam_size: must be <= {self.vocab_size // 2} (half the vocabulary), "
                                    f"got {o.beam_size}", "beam_size")
        if o.beam_size > self.max_num_seqs:
            raise ServiceError(422, f"beam_size: must be <= max_num_seqs ({self.max_num_seqs}), got {o.beam_size}",
                               "beam_size")
        if o.max_new_tokens is not None:   # None: resolved per sentence by the engine
            if o.max_new_tokens > self.max_new_tokens:
                raise ServiceError(422, f"max_new_tokens: must be an integer in 0..{self.max_new_tokens}, "
                                        f"got {o.max_new_tokens}", "max_new_tokens")
            if o.min_new_tokens > o.max_new_tokens:
                raise ServiceError(422, f"min_new_tokens: must be an integer in 0..max_new_tokens "
                                        f"({o.max_new_tokens}), got {o.min_new_tokens}", "min_new_tokens")
        for i, text in enumerate(job.texts):
            if len(text) > MAX_TEXT_CHARS:
                where = f"{f}[{i}]" if job.is_list else f
                raise ServiceError(413, f"{where}: at most {MAX_TEXT_CHARS} characters per text, got {len(text)}", f)

    def _check_attention(self, att: AttentionSelection, kinds: tuple[str, ...]) -> None:
        n_layers = {"cross": self.n_decoder_layers, "decoder": self.n_decoder_layers, "encoder": self.n_encoder_layers}
        limit = min(n_layers[k] for k in kinds)
        for layer in att.layers or ():
            if not 0 <= layer < limit:
                raise ServiceError(422, f"attention.layers: layer indices must be in 0..{limit - 1} for model "
                                        f"{self.model} ({'/'.join(kinds)}), got {layer}", "attention.layers")
        for head in att.heads or ():
            if not 0 <= head < self.n_heads:
                raise ServiceError(422, f"attention.heads: head indices must be in 0..{self.n_heads - 1} for "
                                        f"model {self.model}, got {head}", "attention.heads")
