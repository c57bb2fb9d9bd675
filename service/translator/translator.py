"""The translator: one model, its tokenizer and its continuous-batching engine, behind typed async methods.

A Ray Serve replica wraps one ``Translator`` (``service/app.py``); it is plain Python so that it can
also run inside the ingress process and in unit tests. A job's texts are split into lines and
sentences (``text.split_text``), every sentence becomes one engine call, all calls are awaited
together (so they join the engine's prefill and decode batches with everyone else's), and the
translated sentences are rejoined with the original whitespace (``output.build_response``).

The gateway has checked the job's fields against the model's limits (``ModelLimits.check``); the
translator checks what needs tokenization: tokens per sentence and sentences per request. A
multilingual MarianMT model's sources start with the job's target-language token
(``target_prefix``). Its errors and the engine's are the domain errors of ``service/protocol.py``; the API maps them
to HTTP statuses (``service.api.errors.to_service_error``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import torch

from model.load import load_model
from model.tokenizer import check_target_lang, encode_target
from model.inference.linear import linear_dtype
from service.protocol import (MAX_SENTENCES, RETRY_AFTER_S, InvalidRequest, StreamItem, StreamStart, TooLarge, TranslateJob,
                              TranslateResponse, Unavailable)
from service.engine import Engine, EngineConfig, GenerationOptions, TranslationResult, torch_threads, tune_process
from service.engine.process import prepare_model
from service.metrics import EngineMetrics

from .card import ModelCard
from .output import build_response
from .protect import Protected, Protector, Terms
from .streaming import StreamState, merge_streams
from .text import Piece, Split, has_text, split_text
from .truecase import Truecaser

logger = logging.getLogger("ray.serve")


@dataclass
class TranslatorInfo:
    """A translator's own view of itself (GET /v1/models shows ``engine``)."""
    model: str                    # model id
    device: str                   # "cpu" or "cuda"
    engine: dict                  # the EngineConfig it runs with, and the model's linear_dtype


class Translator:
    """Model + tokenizer + Engine for one checkpoint.

    Call ``await reconfigure(engine_config)`` once before use (Ray Serve does so with user_config).
    ``protect_spans`` / ``truecase`` (default on; env ``MT_PROTECT_SPANS=0`` / ``MT_TRUECASE=0``
    turn them off): protected spans and recasing (``protect.py``, ``truecase.py``). ``keep_file``
    (default: env ``MT_KEEP_FILE``): the stored list of do-not-translate terms, one a line
    (``protect.Terms.load``), kept verbatim in every request besides the request's ``keep``.
    """

    def __init__(self, card: ModelCard, device: Optional[str] = None, num_threads: Optional[int] = None,
                 protect_spans: Optional[bool] = None, truecase: Optional[bool] = None,
                 keep_file: Optional[str] = None):
        self.card = card
        self.name = card.id
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        with torch_threads(1):  # only the engine's worker thread runs multi-threaded (see torch_threads)
            self.model, self.tok, _ = load_model(card.checkpoint, device=self.device, pack=False)  # prepare_model packs
        tune_process()
        if protect_spans is None:
            protect_spans = os.environ.get("MT_PROTECT_SPANS", "1") != "0"
        if truecase is None:
            truecase = os.environ.get("MT_TRUECASE", "1") != "0"
        self.protector = Protector(self.tok, Truecaser.load(card.checkpoint, card.source_lang, self.tok),
                                   protect=protect_spans, recase=truecase)
        keep_file = keep_file if keep_file is not None else os.environ.get("MT_KEEP_FILE", "")
        self.keep = Terms.load(keep_file) if keep_file else Terms()   # the stored do-not-translate list
        self.metrics = EngineMetrics(self.name)
        self.engine: Optional[Engine] = None
        self.engine_config: Optional[EngineConfig] = None
        self._gauges: Optional[asyncio.Task] = None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def reconfigure(self, engine_config: Optional[dict] = None) -> None:
        """Apply EngineConfig fields (Ray Serve ``user_config``); the first call builds and starts the engine.

        Raises EngineValidationError for unknown fields or bad values.
        """
        config = EngineConfig.from_dict(engine_config)
        prepare_model(self.model, config, self.engine_config)   # linear_dtype, kernels: before the engine starts
        if self.engine is None:
            self.engine = Engine(self.model, config, on_step=self.metrics.on_step, on_finish=self.metrics.on_finish)
            await self.engine.start()
            self._gauges = asyncio.create_task(self._refresh_gauges())
        elif config != self.engine_config:
            await self.engine.reconfigure(config)
        self.engine_config = config
        self.metrics.set_ready(True)
        logger.info("translator %s ready on %s: %s", self.name, self.device, config)

    async def _refresh_gauges(self, period_s: float = 0.5) -> None:
        """Keep the gauges fresh while idle (the engine reports them only when it steps)."""
        while True:
            try:
                if self.engine is not None:
                    s = self.engine.stats()
                    self.metrics.set_state(s.running_sequences, s.waiting_requests, s.kv_cache_usage)
                    self.metrics.set_ready(True)
            except Exception:  # never let metrics kill the replica
                logger.exception("gauge refresh failed")
            await asyncio.sleep(period_s)

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Wait until the engine has no running or waiting request (at most ``timeout_s`` seconds);
        returns how many are left (0 = drained). A replica's shutdown hook calls it before ``stop``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, timeout_s)
        while True:
            s = self.engine.stats() if self.engine is not None else None
            left = 0 if s is None else s.running_requests + s.waiting_requests
            if not left or loop.time() >= end:
                return left
            await asyncio.sleep(poll_s)

    async def stop(self) -> None:
        self.metrics.set_ready(False)
        if self._gauges is not None:
            self._gauges.cancel()
        if self.engine is not None:
            await self.engine.stop()

    def ready(self) -> bool:
        return self.engine is not None

    def stats(self) -> dict:
        """The engine's ``EngineStats`` as a dict, with the model's name (what a replica's ``stats`` returns)."""
        return {"model": self.name, **(self.engine.stats().as_dict() if self.engine else {})}

    def info(self) -> TranslatorInfo:
        engine = dataclasses.asdict(self.engine_config) if self.engine_config else {}
        s = self.engine.stats().as_dict() if self.engine is not None else {}
        kv = {k: s[k] for k in ("kv_blocks", "free_kv_blocks", "kv_block_size", "kv_cache_bytes",
                                "kv_cache_bytes_used", "kv_cache_usage", "preemptions") if k in s}
        return TranslatorInfo(self.name, self.device, {**engine, "linear_dtype": linear_dtype(self.model),
                                                       "kv_cache": kv})

    # ---- request preparation ------------------------------------------------------------------
    def prepare(self, job: TranslateJob) -> tuple[list[Optional[Split]], list[Piece], list[Protected]]:
        """Split the job's texts into sentences, protect their spans (and the occurrences of the job's
        ``keep`` terms and the stored list's), recase and encode them.

        Returns per text its Split (None for empty or whitespace-only text; no pieces for a text
        without letters, which comes back verbatim), the flat list of pieces to translate and each
        piece's ``Protected`` (what the model sees of it; a sentence of protected spans only, such as
        a lone URL, needs no model and stays in the glue like a sentence without letters).
        Raises Unavailable while the engine is not built yet, TooLarge for a sentence longer than the
        model accepts or more sentences than one request may have.
        """
        if self.engine is None:
            raise Unavailable(f"model {self.name} is loading", retry_after=RETRY_AFTER_S)
        field, max_src = job.field, self.engine.max_src_len
        prefix = self.target_prefix(job.target_lang)
        keep = getattr(self, "keep", Terms()) + Terms(job.keep)    # the stored list and the job's terms
        splits: list[Optional[Split]] = []
        pieces: list[Piece] = []
        prepared: list[Protected] = []
        for i, text in enumerate(job.texts):
            if not has_text(text):   # whitespace or other invisible characters only
                splits.append(None)
                continue
            split = split_text(text, self.card.source_lang)
            self.metrics.split_fallbacks(split.fallbacks)
            seen: dict[str, Protected] = {}
            split = self.protector.rejoin(split, keep)    # a URL the splitter cut at its "?" is one sentence again
            split = split.translatable(lambda s: seen.setdefault(s, self.protector.prepare(s, keep)).needs_model)
            splits.append(split)    # pieces without letters (for the model) pass through verbatim, in the glue
            for j, sentence in enumerate(split.pieces):
                prepared.append(seen[sentence])   # translatable() prepared every piece it kept
                ids = prefix + self.protector.encode(prepared[-1])
                if len(ids) > max_src:
                    where = f"{field}[{i}]" if job.is_list else field
                    raise TooLarge(f"{where}: sentence {j + 1} has {len(ids)} tokens (with EOS); model {self.name} "
                                   f"accepts at most {max_src} per sentence: split it", field)
                pieces.append(Piece(i, j, ids))
        limit = min(MAX_SENTENCES, self.engine_config.max_waiting)
        if len(pieces) > limit:
            raise TooLarge(f"{field}: at most {limit} sentences per request, got {len(pieces)}", field)
        return splits, pieces, prepared

    def target_prefix(self, target_lang: Optional[str]) -> list[int]:
        """The ids every source starts with: a multilingual model's ``>>target_lang<<`` token, as
        ``model.tokenizer.encode_source`` puts it; [] for a model of one target (the gateway has
        matched target_lang to it). Raises InvalidRequest naming the choices for a multilingual
        model's missing or unknown target_lang."""
        if not self.tok.target_languages:
            return []
        try:
            check_target_lang(self.tok, target_lang)
        except ValueError as e:
            raise InvalidRequest(f"target_lang: model {self.name!r}: {e}", "target_lang") from None
        return self.tok.encode(f">>{target_lang}<<")

    def _options(self, prepared: Protected, options: GenerationOptions, alignment: bool = False,
                 prefix: tuple[int, ...] = ()) -> GenerationOptions:
        """A sentence with inner protected spans also tracks cross-attention (to place them), as does
        every sentence when the job returns alignments; ``prefix``: its forced target ids."""
        if (prepared.spans or alignment) and "cross" not in options.attention_kinds:
            options = dataclasses.replace(options, attention_kinds=(*options.attention_kinds, "cross"))
        return dataclasses.replace(options, target_prefix=prefix) if prefix else options

    def _all_options(self, job: TranslateJob, pieces: list[Piece], prepared: list[Protected]) -> list[GenerationOptions]:
        """Each piece's options: the job's, the target prefix on the first sentence of each text."""
        prefix = self.encode_prefix(job.target_prefix, job.options.max_new_tokens)
        firsts = {p.text_index: k for k, p in reversed(list(enumerate(pieces)))}
        return [self._options(prot, job.options, job.return_alignment, prefix if firsts[p.text_index] == k else ())
                for k, (p, prot) in enumerate(zip(pieces, prepared))]

    def encode_prefix(self, prefix: Optional[str], max_new_tokens: Optional[int] = None) -> tuple[int, ...]:
        """``target_prefix``'s target ids (``model.tokenizer.encode_target``); () for None.
        Raises InvalidRequest when it has no tokens or pieces the target vocabulary lacks (<unk>),
        or more tokens than ``max_new_tokens`` or the model may generate per sentence."""
        if prefix is None:
            return ()
        ids = encode_target(self.tok, prefix)
        if not ids:
            raise InvalidRequest(f"target_prefix: has no tokens for model {self.name} (got {prefix!r}); leave it out",
                                 "target_prefix")
        unknown = [p for p, i in zip(self.tok.pieces(ids), ids) if i == self.tok.unk_id or p == "<unk>"]
        if unknown:
            raise InvalidRequest(f"target_prefix: model {self.name}'s target vocabulary cannot produce it: "
                                 f"{len(unknown)} unknown piece(s) (<unk>) in {prefix!r}", "target_prefix")
        limit = self.engine.max_tgt_len - 1 if self.engine is not None else len(ids)
        if len(ids) > limit:
            raise InvalidRequest(f"target_prefix: has {len(ids)} tokens; model {self.name} generates at most "
                                 f"{limit} per sentence", "target_prefix")
        if max_new_tokens is not None and len(ids) > max_new_tokens:
            raise InvalidRequest(f"target_prefix: has {len(ids)} tokens, more than max_new_tokens ({max_new_tokens})",
                                 "target_prefix")
        return tuple(ids)

    def _text_of(self, prepared: list[Protected], pieces: list[Piece]):
        """``text_of`` for build_response: a hypothesis's text with spans and case restored."""
        index = {(p.text_index, p.piece_index): k for k, p in enumerate(pieces)}

        def text_of(piece: Piece, hyp) -> str:
            return self.protector.restore(prepared[index[piece.text_index, piece.piece_index]], piece.src_ids,
                                          hyp.tokens, (hyp.attention or {}).get("cross"))
        return text_of

    # ---- translate ----------------------------------------------------------------------------
    async def translate(self, job: TranslateJob) -> TranslateResponse:
        """Translate every text of the job. Raises the domain errors of ``prepare`` or the engine's."""
        splits, pieces, prepared = self.prepare(job)
        results = await self._run_all(pieces, self._all_options(job, pieces, prepared))
        return build_response(self.name, self.tok, job, splits, pieces, results, self._text_of(prepared, pieces),
                              self.card.config)

    async def _run_all(self, pieces: list[Piece], options: list[GenerationOptions]) -> list[TranslationResult]:
        """Await every piece concurrently (``options[k]`` for piece k); on the first failure cancel the
        rest and raise it."""
        if not pieces:
            return []
        group = object()   # this request's sentences: the engine admits them in turns with other requests'
        tasks = [asyncio.create_task(self.engine.translate(p.src_ids, o, group)) for p, o in zip(pieces, options)]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            # Let cancellations reach the engine before the caller goes on.
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- streaming ----------------------------------------------------------------------------
    async def stream(self, job: TranslateJob) -> AsyncIterator[StreamItem]:
        """``StreamStart`` once every sentence is admitted, then a ``StreamToken`` per text delta
        (concatenated ``text`` of one index = that translation's final text), then the
        ``TranslateResponse`` that ``translate`` returns.

        Sentences of one text are decoded concurrently but streamed in order (``StreamState``).
        Errors before ``StreamStart`` (validation, a full queue) are raised before anything is
        streamed. Closing the generator cancels every sentence.
        """
        splits, pieces, prepared = self.prepare(job)
        options = self._all_options(job, pieces, prepared)
        streams, group = [], object()   # group: as in _run_all
        try:
            for p, o in zip(pieces, options):   # QueueFullError comes at once, before anything is streamed
                streams.append(self.engine.stream(p.src_ids, o, group))
        except BaseException:
            for st in streams:
                st.cancel()
            raise
        yield StreamStart()
        text_of = self._text_of(prepared, pieces)
        state = StreamState(self.tok, splits, pieces, lambda k, tokens, hyp: (
            self.protector.partial(prepared[k], tokens) if hyp is None else text_of(pieces[k], hyp)))
        for ev in state.verbatim():     # texts without letters: whole, before any token
            yield ev
        results: list[Optional[TranslationResult]] = [None] * len(pieces)
        async with contextlib.aclosing(merge_streams(streams)) as items:
            async for k, item in items:
                if isinstance(item, int):
                    for ev in state.token(k, item):
                        yield ev
                else:
                    results[k] = item
                    for ev in state.finish(k, item.hypotheses[0].tokens, item.hypotheses[0]):
                        yield ev
        yield build_response(self.name, self.tok, job, splits, pieces, results, text_of, self.card.config)
