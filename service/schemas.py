"""Request, response and error models of the HTTP API (pydantic), and the service-wide request limits.

Types are strict (a beam_size of "4" or 4.5 is a 422, not silently coerced) and unknown fields are
rejected, so nothing a client sends is silently ignored. Limits that depend on the model (source
length, max_new_tokens, attention layers and heads) are checked by the translator, which knows the
model, and raised as ``ServiceError``.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ATTENTION_KINDS = ("cross", "encoder", "decoder")

# Service-wide request limits (the model-dependent ones live in the checkpoint's config).
MAX_TEXTS = 64                 # texts in one request (a list `text` / LibreTranslate `q`)
MAX_TEXT_CHARS = 5_000         # characters in one text (the per-text cap; each sentence has the model's cap)
MAX_SENTENCES = 256            # sentences in one request after splitting every text
MAX_BEAM_SIZE = 16             # beam_size upper bound (each hypothesis holds one KV-cache slot)


class ServiceError(Exception):
    """An error with its HTTP status, raised anywhere in the service and rendered as ErrorResponse.

    All fields travel in ``args`` so the error survives pickling across Ray processes.
    """

    def __init__(self, status: int, message: str, field: Optional[str] = None,
                 retry_after: Optional[float] = None, type: Optional[str] = None):
        super().__init__(status, message, field, retry_after, type)
        self.status, self.message, self.field, self.retry_after = status, message, field, retry_after
        self.type = type or _ERROR_TYPES.get(status, "error")

    def __str__(self) -> str:
        return self.message


_ERROR_TYPES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
                415: "unsupported_media_type", 422: "invalid_request",
                429: "overloaded", 499: "cancelled", 500: "internal_error", 503: "overloaded"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class AttentionOptions(_Strict):
    """Which attention weights to return; layers and heads select rows of each kind to keep payloads small."""
    kinds: list[Literal["cross", "encoder", "decoder"]] = Field(
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

    @model_validator(mode="after")
    def _n_best_within_beam(self) -> "TranslateRequest":
        if self.n_best > self.beam_size:
            raise ValueError(f"n_best: must be <= beam_size ({self.beam_size}), got {self.n_best}")
        return self

    @property
    def texts(self) -> list[str]:
        return [self.text] if isinstance(self.text, str) else list(self.text)


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


class StreamToken(BaseModel):
    """One SSE `token` event: text delta of translation `index` (concatenated deltas = final text)."""
    index: int
    text: str
    token: Optional[str] = None     # the SentencePiece piece; null for whitespace-only deltas


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
    target_lang: str
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
            raise ValueError(f"{where} is not valid Unicode (a lone surrogate at character {e.start})") from None


def format_validation_error(err: dict) -> tuple[str, str]:
    """(field, message) for one pydantic error dict: the dotted field path and a message naming it."""
    if err.get("type") == "json_invalid":  # loc is ("body", character offset)
        offset = err.get("loc", (None, None))[-1]
        return "body", f"body: invalid JSON at character {offset}: {err.get('msg', 'JSON decode error')}"
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query")]
    # Union members and the model-level validator add noise to the path.
    loc = [p for p in loc if p not in ("str", "list[str]", "function-after[_n_best_within_beam(), TranslateRequest]")]
    field = ".".join(loc)
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if not field and msg.startswith("n_best"):
        field = "n_best"
    if not field:   # the body itself (missing, not an object, unparsable)
        field = "body"
    if "input" in err and err.get("type") not in ("missing", "extra_forbidden") and not isinstance(err["input"], (dict, list)):
        got = repr(err["input"])
        if len(got) <= 40:
            msg += f" (got {got})"
    return field, f"{field}: {msg}" if field and not msg.startswith(field) else msg
