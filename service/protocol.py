"""What the gateway, the translators and the engine hand each other, and the errors they raise on
purpose. Imports neither FastAPI nor Ray (nor torch): the API maps these errors to HTTP in its one
place (``service/api/errors.py``), a Ray replica passes the records as they are.

    gateway --TranslateJob--> translator --source ids + GenerationOptions--> engine
    gateway <--TranslateResponse | StreamStart, StreamToken..., TranslateResponse-- translator

Errors, one hierarchy: ``TranslationError`` and its kinds, each with its HTTP ``status``:
``InvalidRequest`` (422), ``TooLarge`` (413), ``Overloaded`` and ``Unavailable`` (503 with
Retry-After), and ``ServiceError`` (any status, for the checks of the request path and the deadline's
504). The engine's own errors (``service/engine/errors.py``) are kinds of these.
``ErrorRecord`` is a ``ServiceError`` as a value: what a translator replica returns instead of raising.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

# Service-wide request limits (the model-dependent ones are in ``service/engine/validation.ModelLimits``).
MAX_TEXTS = 64                 # texts in one request (a list `text` / LibreTranslate `q`)
MAX_TEXT_CHARS = 5_000         # characters in one text, an HTML text's tags included (each sentence has the model's cap)
MAX_SENTENCES = 256            # sentences of one request in the engine at once (its next go in as these end)
MAX_BEAM_SIZE = 16             # beam_size upper bound (each hypothesis holds one KV-cache slot)
MAX_ATTENTION_VALUES = 2_000_000   # attention weights in one response (all texts, kinds, layers, heads)
MAX_KEEP_TERMS = 100           # do-not-translate terms in one request (`keep`)
MAX_KEEP_CHARS = 200           # characters in one do-not-translate term (a request's or the stored list's)
# Documents (POST /v1/documents, /translate_file, /v2/document; service/documents, docs/documents.md)
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024 - 64 * 1024   # bytes of an uploaded file (the body cap, less the form's room)
MAX_FILENAME_CHARS = 255        # characters of a document's file name (its download header stays small for proxies)
MAX_UNCOMPRESSED_BYTES = 48 * 1024 * 1024          # bytes of all members of an archive (docx, pptx, odt) unpacked
MAX_XML_BYTES = 32 * 1024 * 1024                   # bytes of an archive's XML parts unpacked (what the parsers read)
MAX_XML_ELEMENTS = 1_000_000                        # elements in an archive's XML parts (the parsers' trees: ~250 B each)
MAX_COMPRESSION_RATIO = 100                         # a member's unpacked / packed size (over 1 MiB unpacked)
MAX_ARCHIVE_MEMBERS = 2_000                         # files in one archive
MAX_XML_DEPTH = 200                                 # elements nested inside one another in an XML part
MAX_PARSED_NODES = 400_000                          # what a text format's parsers build (HTML tags and text, Markdown lines
                                                    # and tokens, cues): a few hundred bytes each
MAX_DOCUMENT_SEGMENTS = 20_000                      # translatable pieces (paragraphs, cells, cues, runs)
MAX_DOCUMENT_CHARS = 1_000_000                      # characters to translate in one document
MAX_MEMORY_IMPORT = 10_000     # translation-memory entries in one PUT /v1/memory
MAX_MEMORY_ENTRIES = 100_000   # translation-memory entries stored per model and API key
MAX_GLOSSARY_ENTRIES = 100     # glossary entries in one request (`glossary`)
MAX_STORED_GLOSSARY_ENTRIES = 10_000   # entries in one stored glossary (file or POST /v1/glossaries)
MAX_GLOSSARY_IDS = 5           # stored glossaries in one request (DeepL's glossary_ids)
MAX_JOB_GLOSSARY_ENTRIES = MAX_GLOSSARY_IDS * MAX_STORED_GLOSSARY_ENTRIES + MAX_GLOSSARY_ENTRIES   # a job's, all told
MAX_GLOSSARY_TERM_CHARS = 200  # characters in one glossary term (source or target)
# A JSON Schema pattern: a character that is not whitespace as Python's str.strip() sees it (which the
# service's blank checks use; a schema's \s, Unicode White_Space, leaves out U+001C-U+001F)
NOT_BLANK = r"[^\s\x1c-\x1f]"
MAX_GLOSSARIES = 100           # stored glossaries per API key (or in all, with keys off)
MAX_PREFIX_CHARS = 1_000      # characters in a `target_prefix` (one that fills the model's window is the answer)
MAX_REPETITION_PENALTY = 10.0  # `repetition_penalty` in (0, 10]
MAX_NO_REPEAT_NGRAM_SIZE = 32  # `no_repeat_ngram_size` in 0..32 (0 = off)
MAX_NAME_CHARS = 64            # a client-sent name (field, path part, code) longer than this is shortened in messages
RETRY_AFTER_S = 1              # seconds, the Retry-After of every 503 (overload, full queue, loading, restarting)


# ---- errors ------------------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
               413: "payload_too_large", 415: "unsupported_media_type", 422: "invalid_request",
               429: "overloaded", 499: "cancelled", 500: "internal_error", 503: "overloaded"}


class TranslationError(Exception):
    """An error raised on purpose: ``message`` names the field and the limit; ``field`` is the dotted
    request field (or None); ``retry_after`` seconds for the kinds a client should retry; ``status``
    its HTTP status (``service/replica.to_service_error`` is the one mapping)."""
    status = 500

    def __init__(self, message: str, field: Optional[str] = None, retry_after: Optional[float] = None):
        super().__init__(message)
        self.message, self.field, self.retry_after = message, field, retry_after

    def __str__(self) -> str:
        return self.message


class InvalidRequest(TranslationError, ValueError):
    """A field's value is out of range for this model or service (HTTP 422)."""
    status = 422


class TooLarge(TranslationError):
    """The request holds more than a limit allows: texts, characters, sentences, attention (HTTP 413)."""
    status = 413


class Overloaded(TranslationError):
    """Too much work is waiting; retry after ``retry_after`` seconds (HTTP 503)."""
    status = 503


class Unavailable(TranslationError):
    """The model is loading or restarting; retry after ``retry_after`` seconds (HTTP 503)."""
    status = 503


@dataclass(frozen=True)
class ErrorRecord:
    """A ServiceError as a value: what a translator replica returns (or yields) instead of raising it."""
    status: int                          # HTTP status
    message: str                         # names the field and the limit
    field: Optional[str] = None          # dotted request field, e.g. "attention.layers"
    retry_after: Optional[float] = None  # seconds (Retry-After header), for 503s
    type: Optional[str] = None           # None: from the status (ERROR_TYPES)


class ServiceError(TranslationError):
    """An error with its HTTP status, raised anywhere on the request path and rendered in the error
    shape of the route's API (``service/api/errors.py``); ``type`` names its kind in the body."""

    def __init__(self, status: int, message: str, field: Optional[str] = None,
                 retry_after: Optional[float] = None, type: Optional[str] = None):
        super().__init__(message, field, retry_after)
        self.args = (status, message, field, retry_after, type)
        self.status = status
        self.type = type or ERROR_TYPES.get(status, "error")

    @property
    def record(self) -> ErrorRecord:
        return ErrorRecord(self.status, self.message, self.field, self.retry_after, self.type)

    @classmethod
    def from_record(cls, r: ErrorRecord) -> "ServiceError":
        return cls(r.status, r.message, r.field, r.retry_after, r.type)


def short_name(name: str) -> str:
    """A client-sent name as an error message repeats it: whole up to MAX_NAME_CHARS characters, else
    its start and its length (an unknown field named by 100,000 characters is not echoed back whole)."""
    if len(name) <= MAX_NAME_CHARS:
        return name
    return f"{name[:MAX_NAME_CHARS // 2]}...({len(name)} characters)"


def shown(value) -> str:
    """A client-sent value quoted for an error message (``repr``), shortened as ``short_name``."""
    return repr(short_name(str(value)))



# ---- what a caller asks of one sentence --------------------------------------------------------------
@dataclass
class GenerationOptions:
    """Decoding options of one sentence, checked against a model by ``service.engine.validation``."""
    beam_size: int = 4                        # hypotheses kept per sentence (1 = greedy); each holds a cache slot
    n_best: int = 1                           # hypotheses returned, best first; 1..beam_size
    max_new_tokens: Optional[int] = None      # tokens after target_prefix; None: 2 x source length + 10; the
                                              # prefix and these fit the model's window (cut to fit)
    length_penalty: float = 1.0               # score = log_prob / length ** length_penalty
    attention_kinds: tuple[str, ...] = ()     # subset of ("cross", "encoder", "decoder") to return
    min_new_tokens: int = 0                   # EOS is masked until this many follow the prefix (fixed-length benchmarks)
    constraints: tuple[tuple[int, ...], ...] = ()   # target id sequences the output must contain (glossary terms;
                                                    # one listed n times, n times)
    sentence_ends: tuple[int, ...] = ()       # with constraints: target ids that end a sentence (final
                                              # punctuation), written only once every constraint is met
    target_prefix: tuple[int, ...] = ()       # target ids every hypothesis starts with (forced), then free decoding
    free_prefix: int = 0                      # the first this many target_prefix ids are forced at log-prob 0 (a
                                              # multilingual model's target-language token, as transformers forces it)
    repetition_penalty: float = 1.0           # CTranslate2's: logits of generated tokens / p (> 0) or * p (< 0); 1 = off
    no_repeat_ngram_size: int = 0             # CTranslate2's: no n-gram of this many tokens twice; 0 = off



# ---- the gateway -> translator hand-off ----------------------------------------------------------------
@dataclass(frozen=True)
class AttentionSelection:
    layers: Optional[tuple[int, ...]] = None   # layer indices to return; None = all
    heads: Optional[tuple[int, ...]] = None    # head indices to return; None = all


@dataclass
class TranslateJob:
    """One request for one translator: texts and the options every sentence of them is decoded with.
    Its errors name text i ``text[i]`` (field ``text``); the caller's ``JobOrigin`` names it as the
    request did."""
    texts: list[str]                           # each split into sentences by the translator
    options: GenerationOptions                 # attention_kinds: those to return (in request order), or ()
    attention: AttentionSelection = AttentionSelection()
    deadline: Optional[float] = None           # time.time() seconds when it is cancelled (504); None = never
    timeout_s: Optional[float] = None          # the timeout that set the deadline, named in the 504's message
    target_lang: Optional[str] = None          # multilingual models: the >>xx<< token starting each source
    keep: tuple[str, ...] = ()                 # do-not-translate terms: each occurrence comes back verbatim
    memory_scope: Optional[str] = None         # translation memory of this API key's id ("" keys off); None = unused
    memory_threshold: Optional[float] = None   # 0-100: a sentence's best fuzzy match scoring at least this takes
                                               # the memory's translation (translator/fuzzy.py); None: exact only
    split_sentences: str = "1"                 # "1" at punctuation and line breaks, "nonewlines", "0" (DeepL's)
    glossary: tuple[tuple[str, str], ...] = ()   # (source term, target term): each occurring term's target is in the output
    stored_glossary: bool = False              # the glossary is stored ones' alone (glossary_id): errors name glossary_id
    target_prefix: Optional[str] = None        # each text's first sentence starts with it (tokenized by the translator)
    min_confidence: Optional[float] = None     # translations below it carry low_confidence: true
    return_alignment: bool = False             # each translation carries its word alignment
    source_lang: Optional[str] = None          # NLLB-200 / M2M100 / mBART-50: the source-language token of every text
    source_langs: tuple[str, ...] = ()         # ... or one per text (source_lang "auto"); () = source_lang for all


@dataclass(frozen=True)
class JobOrigin:
    """Where a job's texts came from in the request, for the messages that name them. The caller
    keeps it (a translator never sees it): ``ModelLimits.check`` names the texts with it, and
    ``named`` renames a translator's ``text[i]``."""
    field: str = "text"              # the request field of the texts
    is_list: bool = False            # they came as a list: messages name field[i]
    n_texts: Optional[int] = None    # the client's texts, where the job's texts are their HTML segments

    def where(self, i: int) -> str:
        """Text i as messages name it."""
        return f"{self.field}[{i}]" if self.is_list else self.field

    def named(self, e: ServiceError) -> ServiceError:
        """``e`` with the head ``text[i]: `` of a translator's message (field ``text``) named as the
        request named text i; ``e`` itself when it names no text."""
        head = re.match(r"text\[(\d+)\]: ", e.message) if e.field == "text" else None
        if head is None:
            return e
        return ServiceError(e.status, f"{self.where(int(head[1]))}: {e.message[head.end():]}", self.field,
                            e.retry_after, e.type)


# ---- the translator -> gateway answer (also the HTTP response body) ----------------------------------
class Alternative(BaseModel):
    text: str
    tokens: list[str]
    score: float
    finish_reason: Literal["eos", "length"]
    confidence: Optional[float] = Field(None, description="exp(sum of token log-probs / tokens), all sentences; 0..1")
    low_confidence: Optional[bool] = Field(None, description="min_confidence only: confidence < min_confidence")


class PivotLeg(BaseModel):
    """The first leg of a pivoted translation (service/pipeline/pivot.py): source -> ``language``."""
    language: str = Field(..., description="the pivot language the first leg translated into")
    model: str = Field(..., description="the first leg's model")
    text: str = Field(..., description="the first leg's translation: the second leg's input")
    tokens: list[str]
    source_tokens: list[str]
    score: float
    finish_reason: Literal["eos", "length"]
    attention: Optional[dict[str, list]] = Field(None, description="the first leg's attention (return_attention)")


class Translation(BaseModel):
    text: str = Field(..., description="the translation, with the input's whitespace and line breaks")
    tokens: list[str] = Field(..., description="target SentencePiece pieces (EOS excluded), all sentences")
    source_tokens: list[str] = Field(..., description="source pieces, each sentence ending in </s>")
    score: float = Field(..., description="mean over sentences of log_prob / length ** length_penalty")
    finish_reason: Literal["eos", "length"] = Field(..., description="length if any sentence hit max_new_tokens")
    confidence: Optional[float] = Field(None, description="exp(sum of token log-probs / tokens, EOS included), all "
                                               "sentences: the geometric mean token probability, 0..1")
    low_confidence: Optional[bool] = Field(None, description="min_confidence only: confidence < min_confidence")
    alignment: Optional[list[tuple[int, int]]] = Field(
        None, description="return_alignment only: [source word, target word] index pairs (words of "
                          "source_tokens / tokens, docs/controls.md)")
    alternatives: list[Alternative] = Field(default_factory=list, description="hypotheses 2..n_best")
    attention: Optional[dict[str, list]] = Field(
        None, description="kind -> [layer][head][rows][cols]: cross [len(tokens)][len(source_tokens)], "
                          "encoder [len(source_tokens)]^2, decoder [len(tokens)]^2; block-diagonal over sentences")
    # source_lang "auto" only (service/pipeline/autodetect.py):
    detected_language: Optional[str] = Field(None, description='source_lang "auto": the language detected in this '
                                                               'text ("und": no letters)')
    detected_confidence: Optional[float] = Field(None, description='source_lang "auto": confidence 0-100 (< 100)')
    passthrough: Optional[bool] = Field(None, description='source_lang "auto": true when the text comes back '
                                                          "unchanged (detected == target_lang, or no letters)")
    model: Optional[str] = Field(None, description='source_lang "auto": the model that translated this text')
    # pivoted translations only (service/pipeline/pivot.py; absent: one model translated the text directly):
    path: Optional[list[str]] = Field(None, description='pivoted: the language pair of each leg, e.g. ["de-en", '
                                                        '"en-fr"]; the other fields are the last leg\'s')
    pivot: Optional[PivotLeg] = Field(None, description="pivoted: the first leg (its text is the last leg's source)")
    # memory_threshold only (service/translator/fuzzy.py):
    origin: Optional[Literal["memory", "engine", "mixed"]] = Field(
        None, description="memory_threshold: memory when the translation memory answered every sentence, engine "
                          "when none, mixed otherwise; absent for a text with nothing to translate")
    memory_score: Optional[float] = Field(
        None, description="memory_threshold: the lowest match score (0-100, rapidfuzz fuzz.ratio; 100 = the same "
                          "text) of the sentences the memory answered")


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
