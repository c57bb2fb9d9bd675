"""The translator: one model, its tokenizer and its continuous-batching engine, behind typed async methods.

A Ray Serve replica wraps one ``Translator`` (``service/app.py``); it is plain Python so that it can
also run inside the ingress process and in unit tests. A job's texts go through the text pipeline:

    split (text.py) -> protect (protect.py, spans.py) -> case (truecase.py) -> memory (memory.py)
    -> encode -> engine -> place spans (placement.py) -> assemble (assemble.py, output.py)

``prepare`` runs the stages up to encode; every sentence the memory does not answer becomes one
engine call, all calls are awaited together (so they join the engine's prefill and decode batches
with everyone else's), and the translated sentences are rejoined with the original whitespace
(``output.build_response``); at most ``in_flight()`` sentences of a request are in the engine at
once, the next going in as one ends.

The gateway has checked the job's fields against the model's limits (``ModelLimits.check``); what
needs tokenization is the translator's: a sentence over the model's source window is cut into parts
that fit (``text.cut_long``). A multilingual MarianMT model's sources start with the job's
target-language token (``target_prefix``); an NLLB-200 / M2M100 / mBART-50 model's start with the
text's source-language token and every sentence's decoder with the forced target-language token
(``lang_tokens.py``). Its errors and the engine's are the domain errors of
``service/protocol.py``; the API maps them to HTTP statuses (``service.replica.to_service_error``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import AsyncIterator, NamedTuple, Optional

import torch

from model.inference.linear import linear_dtype
from model.load import load_model
from service.engine import Engine, EngineConfig, GenerationOptions, TranslationResult, torch_threads, tune_process
from service.engine.process import prepare_model
from service.metrics import EngineMetrics
from service.protocol import (
    MAX_JOB_GLOSSARY_ENTRIES,
    MAX_SENTENCES,
    RETRY_AFTER_S,
    StreamItem,
    StreamStart,
    TooLarge,
    TranslateJob,
    TranslateResponse,
    Unavailable,
)

from .card import ModelCard
from .config import TranslatorSettings
from .fuzzy import FuzzyMemory, report
from .glossary import Glossary
from .lang_tokens import LangTokens, has_lang_tokens
from .memory import MemoryStore, Recalled, ResultCache, cache_key, memory_hit, memory_model
from .options import prefix_ids, sentence_options, source_prefix
from .output import TextOf, build_response, check_attention_floor
from .protect import Protected, Protector
from .sources import Sources
from .spans import Terms
from .streaming import StreamState, merge_streams
from .text import Piece, Split, cut_long, has_text, needs_model, one_piece, split_sentences_of
from .truecase import Truecaser

logger = logging.getLogger("ray.serve")


@dataclass
class TranslatorInfo:
    """A translator's own view of itself (GET /v1/models shows ``engine``)."""
    model: str                    # model id
    device: str                   # "cpu" or "cuda"
    engine: dict                  # the EngineConfig it runs with, and the model's linear_dtype


class Prepared(NamedTuple):
    """A job's texts up to the engine (``Translator.prepare``)."""
    splits: list[Optional[Split]]       # per text its sentences (None: no visible character)
    pieces: list[Piece]                 # every sentence to translate, in text order
    protected: list[Optional[Protected]]    # each piece's model input (None: a memory hit)


class Translator:
    """Model + tokenizer + Engine for one checkpoint.

    Call ``await reconfigure(engine_config)`` once before use (Ray Serve does so with user_config).
    ``settings`` (``config.TranslatorSettings``): the text pipeline's settings (protected spans,
    recasing, the stored do-not-translate list kept verbatim in every request besides the request's
    ``keep``), the translation memory's SQLite file (``memory.MemoryStore``, read for every job with a
    ``memory_scope``; None: no memory) and the LRU cache of the engine's results
    (``memory.ResultCache``; 0 = off); None: the defaults.
    """

    def __init__(self, card: ModelCard, device: Optional[str] = None, num_threads: Optional[int] = None,
                 settings: Optional[TranslatorSettings] = None):
        self.card = card
        self.name = card.id
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        with torch_threads(1):  # only the engine's worker thread runs multi-threaded (see torch_threads)
            self.model, self.tok, _ = load_model(card.checkpoint, device=self.device, pack=False)  # prepare_model packs
        tune_process()
        settings = settings or TranslatorSettings()
        text = settings.text
        self.protector = Protector(self.tok, Truecaser.load(card.checkpoint, card.source_lang, self.tok),
                                   protect=text.protect_spans, recase=text.truecase)
        self.keep = Terms.load(text.keep_file) if text.keep_file else Terms()   # the stored do-not-translate list
        self.metrics = EngineMetrics(self.name)
        self.memory = MemoryStore(settings.memory_file) if settings.memory_file else None
        self.fuzzy = FuzzyMemory(self.memory) if self.memory else None     # a job's memory_threshold
        self.cache = ResultCache(settings.cache_entries)
        self._glossaries: dict[tuple, Glossary] = {}    # (entries, field) -> compiled, the 32 latest
        self.engine: Optional[Engine] = None
        self.engine_config: Optional[EngineConfig] = None
        self._gauges: Optional[asyncio.Task] = None

    # ---- lifecycle ----------------------------------------------------------------------------
    async def reconfigure(self, engine_config: Optional[dict] = None) -> None:
        """Apply EngineConfig fields (Ray Serve ``user_config``); the first call builds and starts the engine.

        Raises EngineValidationError for unknown fields or bad values.
        """
        config = EngineConfig.from_dict(engine_config)
        if self.engine is None:     # linear_dtype, kernels: before the engine starts; the event loop keeps serving
            await asyncio.to_thread(prepare_model, self.model, config, None)
        else:
            prepare_model(self.model, config, self.engine_config)
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

    # ---- request preparation: split -> protect -> case -> memory -> encode ------------------------
    def prepare(self, job: TranslateJob) -> Prepared:
        """The job's texts up to the engine: each text ``split`` into sentences, each sentence
        protected and recased (``Sources.protected``), answered by the translation memory when the
        job has a ``memory_scope`` (``MemoryStore.recall``: the whole text's, or the sentence's), else
        encoded (``encode``).

        A text without visible characters has no Split (None); one without letters (for the model)
        has no pieces and comes back verbatim, as does a sentence of protected spans only (a lone
        URL): both stay in the glue. A memory hit is a piece without source ids that carries the
        stored text (``Piece.stored``) and has no Protected (None); a text the memory holds whole is
        one such piece. Raises Unavailable while the engine is not built yet, TooLarge for a
        sentence ``text.cut_long`` found no cut for.
        """
        if self.engine is None:
            raise Unavailable(f"model {self.name} is loading", retry_after=RETRY_AFTER_S)
        sources_of = self.sources_of(job)
        out = Prepared([], [], [])
        for i, text in enumerate(job.texts):
            if not has_text(text):   # whitespace or other invisible characters only
                out.splits.append(None)
                continue
            sources = sources_of(i)
            split = self.split(text, job.split_sentences, sources)                  # split
            protected = [sources.protected(s) for s in split.pieces]                # protect -> case
            memory = self.recall(job, text, split)                                  # memory
            if memory.whole is not None:    # one piece, the whole text's stored translation
                out.splits.append(one_piece(text))
                out.pieces.append(Piece(i, 0, [], memory.whole, 100.0))
                out.protected.append(None)
                continue
            out.splits.append(split)
            for j, (sentence, p) in enumerate(zip(split.pieces, protected)):
                stored = memory.of(sentence)
                if stored is not None:
                    out.pieces.append(Piece(i, j, [], stored, memory.score_of(sentence)))
                    out.protected.append(None)
                else:
                    out.pieces.append(Piece(i, j, self.encode(i, j, sentence, sources)))   # encode
                    out.protected.append(p)
        return out

    def sources_of(self, job: TranslateJob):
        """text index -> its ``Sources``: one for the job, or (NLLB-200 / M2M100 / mBART-50) one per
        source language, its token around each source (``lang_tokens.LangTokens``)."""
        keep = self.keep + Terms(job.keep)
        if not has_lang_tokens(self.tok):
            sources = Sources(self.protector, keep, source_prefix(self.tok, self.name, job.target_lang))
            return lambda i: sources
        tokens = LangTokens(self.tok, self.name, job)
        by_lang = {lang: Sources(self.protector, keep, *tokens.around(lang), lang=lang) for lang in set(tokens.source_langs)}
        return lambda i: by_lang[tokens.source_langs[i]]

    def split(self, text: str, mode: str, sources: Sources) -> Split:
        """A text's sentences (``text.split_sentences_of``; ``mode``: DeepL's split_sentences), those a
        protected span runs across joined again (a URL the splitter cut at its "?"), each longer than
        the model reads (its source window, ``max_src_len``) cut into parts that fit (``text.cut_long``),
        and those without letters for the model moved into the glue (they come back verbatim)."""
        split = split_sentences_of(text, sources.lang or self.card.source_lang, mode)
        split = self.protector.rejoin(split, sources.keep)
        split = cut_long(split, lambda s: len(sources.ids(s)) <= self.engine.max_src_len, sources.spans)
        self.metrics.split_fallbacks(split.fallbacks)
        return split.translatable(sources.needs_model)

    def recall(self, job: TranslateJob, text: str, split: Split) -> Recalled:
        """What the memory holds for the text and its sentences (nothing without a memory or ``memory_scope``):
        exact entries, then with ``memory_threshold`` each other sentence's best fuzzy match (``fuzzy.py``)."""
        if self.memory is None or job.memory_scope is None:
            return Recalled()
        recalled = self.memory.recall(key := self.memory_key(job), job.memory_scope, text, split.pieces)
        return recalled if job.memory_threshold is None else self.fuzzy.complete(
            recalled, key, job.memory_scope, split.pieces, job.memory_threshold)

    def memory_key(self, job: TranslateJob) -> str:
        """The store's model key of the job's memory (``memory.memory_model``)."""
        return memory_model(self.name, job.target_lang if self.tok.target_languages else None)

    async def fuzzy_ready(self, job: TranslateJob) -> None:
        """Build the fuzzy index ``memory_threshold`` reads (worker thread) if stale and a text has a letter."""
        if self.fuzzy and job.memory_scope is not None and job.memory_threshold not in (None, 100) and any(map(needs_model, job.texts)):
            await self.fuzzy.refresh(self.memory_key(job), job.memory_scope)

    def encode(self, i: int, j: int, sentence: str, sources: Sources) -> list[int]:
        """Sentence j of text i as source ids (``Sources.ids``). Raises TooLarge when they are more
        than the model reads (``split`` found no cut that fits)."""
        ids, max_src = sources.ids(sentence), self.engine.max_src_len
        if len(ids) > max_src:     # text i as the job names it (the caller's JobOrigin renames it)
            raise TooLarge(f"text[{i}]: sentence {j + 1} has {len(ids)} tokens (with EOS); model {self.name} "
                           f"accepts at most {max_src} per sentence: split it", "text")
        return ids

    # ---- the engine's inputs: the target-language token, target_prefix, the glossary --------------
    def in_flight(self) -> int:
        """Sentences of one request in the engine at once (its next ones go in as these finish):
        ``MAX_SENTENCES``, at most the engine's queue (``max_waiting``), so a request of any size fits."""
        return max(1, min(MAX_SENTENCES, self.engine_config.max_waiting))

    def glossary(self, job: TranslateJob) -> Optional[Glossary]:
        """The job's glossary compiled for this model (cached by its entries), or None.
        Raises InvalidRequest for a bad or conflicting entry (``glossary.Glossary``)."""
        if not job.glossary:
            return None
        key = (job.glossary, job.stored_glossary, job.source_lang, job.source_langs[:1])
        cache = self._glossaries
        if key not in cache:
            # each source of entries was held to its own limit (a request's, a stored glossary's): this
            # bounds their sum (stored glossaries and a request's entries together apply)
            field, limit = ("glossary_id" if job.stored_glossary else "glossary"), MAX_JOB_GLOSSARY_ENTRIES
            max_tokens = min(self.engine.max_tgt_len, self.model.cfg.max_len - 1) - 1 if self.engine else \
                self.model.cfg.max_len - 2
            while len(cache) >= 32:
                cache.pop(next(iter(cache)))
            lang = (job.source_langs[0] if job.source_langs else job.source_lang) or self.card.source_lang
            cache[key] = Glossary(job.glossary, lang, self.tok, max_tokens, field, limit)
        return cache[key]

    # ---- after the engine: place spans -> assemble -------------------------------------------
    def _text_of(self, protected: list[Optional[Protected]], pieces: list[Piece]) -> TextOf:
        """``text_of`` for build_response: a hypothesis's text with its spans placed and the sentence
        assembled (``Protector.restore``); a memory hit's: the stored text."""
        index = {(p.text_index, p.piece_index): k for k, p in enumerate(pieces)}

        def text_of(piece: Piece, hyp) -> str:
            if piece.stored is not None:
                return piece.stored
            k = index[piece.text_index, piece.piece_index]
            return self.protector.restore(protected[k], piece.src_ids, hyp.tokens, (hyp.attention or {}).get("cross"))
        return text_of

    # ---- translate ----------------------------------------------------------------------------
    def engine_inputs(self, job: TranslateJob) -> tuple[list[Optional[Split]], list[Piece],
                                                        list[Optional[Protected]], list[Optional[GenerationOptions]]]:
        """``prepare`` (split -> protect -> case -> memory -> encode), the glossary's terms the model
        cannot read put back as their targets (``Glossary.put_back``), and each sentence's options
        (``options.sentence_options``: the glossary's constraints, target_prefix)."""
        splits, pieces, protected = self.prepare(job)
        glossary = self.glossary(job)
        if glossary is not None:
            protected = [None if p is None else glossary.put_back(p) for p in protected]
        langs = LangTokens(self.tok, self.name, job) if has_lang_tokens(self.tok) else None
        prefix = prefix_ids(self.tok, self.name, langs.prefix_text(job.target_prefix) if langs else job.target_prefix,
                            job.target_lang)
        if langs:
            langs.check_prefix_ids(prefix)
        options = sentence_options(job, pieces, protected, glossary=glossary, prefix=prefix)
        options = langs.options(options) if langs else options
        check_attention_floor(job, pieces, options, self.card.config)     # too large whatever is decoded: now
        return splits, pieces, protected, options

    async def translate(self, job: TranslateJob) -> TranslateResponse:
        """Translate every text of the job. Raises the domain errors of ``prepare`` or the engine's."""
        await self.fuzzy_ready(job)
        splits, pieces, protected, options = self.engine_inputs(job)
        results = await self._results(pieces, options)     # engine
        response = build_response(self.name, self.tok, job, splits, pieces, results,       # place spans -> assemble
                                  self._text_of(protected, pieces), self.card.config)
        if job.memory_threshold is not None:
            report(response.translations, pieces)
        return response

    async def _results(self, pieces: list[Piece], options: list[Optional[GenerationOptions]]
                       ) -> list[TranslationResult]:
        """Each piece's result: a memory hit's (no tokens; ``memory_hit``), the cache's, else the
        engine's (then cached). Counted in ``mt_memory_lookups_total``."""
        out: list[Optional[TranslationResult]] = [None] * len(pieces)
        todo: list[int] = []
        for k, p in enumerate(pieces):
            if p.stored is not None:
                out[k] = memory_hit()
                self.metrics.memory_lookup("memory")
                continue
            cached = self.cache.get(cache_key(p, options[k])) if self.cache.max_entries else None
            if cached is not None:
                out[k] = cached
                self.metrics.memory_lookup("cache")
            else:
                todo.append(k)
                self.metrics.memory_lookup("model")
        ran = await self._run_all([pieces[k] for k in todo], [options[k] for k in todo])
        for k, r in zip(todo, ran):
            out[k] = r
            if self.cache.max_entries and not options[k].attention_kinds:    # results with attention: too big to keep
                self.cache.put(cache_key(pieces[k], options[k]), r)
        return out

    async def _run_all(self, pieces: list[Piece], options: list[GenerationOptions]) -> list[TranslationResult]:
        """Await every piece concurrently (``options[k]`` for piece k), at most ``in_flight()`` in the
        engine at once, in order; on the first failure cancel the rest and raise it."""
        if not pieces:
            return []
        group = object()   # this request's sentences: the engine admits them in turns with other requests'
        slots = asyncio.Semaphore(self.in_flight())

        async def one(p: Piece, o: GenerationOptions) -> TranslationResult:
            async with slots:
                return await self.engine.translate(p.src_ids, o, group)
        tasks = [asyncio.create_task(one(p, o)) for p, o in zip(pieces, options)]
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
        await self.fuzzy_ready(job)
        splits, pieces, protected, options = self.engine_inputs(job)
        streams, group = [], object()   # group: as in _run_all
        run = [k for k, p in enumerate(pieces) if p.stored is None]    # memory hits are answered without the engine
        first = self.in_flight()        # the rest start as these finish (merge_streams)
        later = [functools.partial(self.engine.stream, pieces[k].src_ids, options[k], group) for k in run[first:]]
        try:
            for k in run[:first]:   # QueueFullError comes at once, before anything is streamed
                streams.append(self.engine.stream(pieces[k].src_ids, options[k], group))
        except BaseException:
            for st in streams:
                st.cancel()
            raise
        yield StreamStart()
        text_of = self._text_of(protected, pieces)
        state = StreamState(self.tok, splits, pieces, lambda k, tokens, hyp: (
            self.protector.partial(protected[k], tokens) if hyp is None else text_of(pieces[k], hyp)))
        for ev in state.verbatim():     # texts without letters: whole, before any token
            yield ev
        results: list[Optional[TranslationResult]] = [None] * len(pieces)
        for k in (k for k, p in enumerate(pieces) if p.stored is not None):
            results[k] = memory_hit()
            self.metrics.memory_lookup("memory")
            for ev in state.finish(k, [], results[k].hypotheses[0]):
                yield ev
        for _ in run:
            self.metrics.memory_lookup("model")
        async with contextlib.aclosing(merge_streams(streams, later)) as items:
            async for i, item in items:
                k = run[i]
                if isinstance(item, int):
                    for ev in state.token(k, item):
                        yield ev
                else:
                    results[k] = item
                    for ev in state.finish(k, item.hypotheses[0].tokens, item.hypotheses[0]):
                        yield ev
        response = build_response(self.name, self.tok, job, splits, pieces, results, text_of, self.card.config)
        if job.memory_threshold is not None:
            report(response.translations, pieces)
        yield response

