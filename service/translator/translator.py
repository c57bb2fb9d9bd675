"""The translator: one model, its tokenizer and its continuous-batching engine, behind typed async methods.

A Ray Serve replica wraps one ``Translator`` (``service/app.py``); it is plain Python so that it can
also run inside the ingress process and in unit tests. A job's texts are split into lines and
sentences (``text.split_text``), every sentence becomes one engine call, all calls are awaited
together (so they join the engine's prefill and decode batches with everyone else's), and the
translated sentences are rejoined with the original whitespace (``output.build_response``); at
most ``in_flight()`` sentences of a request are in the engine at once, the next going in as one ends.

The gateway has checked the job's fields against the model's limits (``ModelLimits.check``); what
needs tokenization is the translator's: a sentence over the model's source window is cut into parts
that fit (``text.cut_long``). A
multilingual MarianMT model's sources start with the job's target-language token
(``target_prefix``). Its errors and the engine's are the domain errors of ``service/protocol.py``; the API maps them
to HTTP statuses (``service.api.errors.to_service_error``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import torch

from model.load import load_model
from model.tokenizer import check_target_lang, encode_target
from model.inference.linear import linear_dtype
from model.inference.search import Hypothesis
from service.protocol import (MAX_GLOSSARY_ENTRIES, MAX_SENTENCES, MAX_STORED_GLOSSARY_ENTRIES, RETRY_AFTER_S, InvalidRequest, StreamItem, StreamStart, TooLarge, TranslateJob,
                              TranslateResponse, Unavailable)
from service.engine import (Engine, EngineConfig, GenerationOptions, RequestStats, TranslationResult, torch_threads,
                            tune_process)
from service.engine.process import prepare_model
from service.metrics import EngineMetrics

from .card import ModelCard
from .memory import MemoryStore, ResultCache, memory_model, normalize
from .glossary import Glossary
from .output import build_response
from .protect import Protected, Protector, Terms
from .streaming import StreamState, merge_streams
from .text import Piece, Split, cut_long, has_text, split_sentences_of, split_text, trim
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
    ``memory_file``: the translation memory's SQLite file (``memory.MemoryStore``), read for every
    job with a ``memory_scope``; None: no memory. ``cache_entries``: the LRU cache of the engine's
    results (``memory.ResultCache``; 0 = off).
    """

    def __init__(self, card: ModelCard, device: Optional[str] = None, num_threads: Optional[int] = None,
                 protect_spans: Optional[bool] = None, truecase: Optional[bool] = None,
                 keep_file: Optional[str] = None, memory_file: Optional[str] = None, cache_entries: int = 0):
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
        self.memory = MemoryStore(memory_file) if memory_file else None
        self.cache = ResultCache(cache_entries)
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

    # ---- request preparation ------------------------------------------------------------------
    def prepare(self, job: TranslateJob, hits: Optional[dict[int, str]] = None
                ) -> tuple[list[Optional[Split]], list[Piece], list[Protected]]:
        """Split the job's texts into sentences, protect their spans (and the occurrences of the job's
        ``keep`` terms and the stored list's), recase and encode them.

        Returns per text its Split (None for empty or whitespace-only text; no pieces for a text
        without letters, which comes back verbatim), the flat list of pieces to translate and each
        piece's ``Protected`` (what the model sees of it; a sentence of protected spans only, such as
        a lone URL, needs no model and stays in the glue like a sentence without letters).
        ``hits`` (filled when given and the job has a ``memory_scope``): piece index -> the translation
        memory's text for it (the whole text's, or the sentence's; ``memory.py``); such a piece has no
        source ids and no ``Protected`` (None) and is not sent to the engine.
        A sentence longer than the model reads (its source window, ``max_src_len``) is cut into
        chunks that fit (``text.cut_long``), each translated as a sentence.
        Raises Unavailable while the engine is not built yet, TooLarge for a sentence ``cut_long``
        found no cut for.
        """
        if self.engine is None:
            raise Unavailable(f"model {self.name} is loading", retry_after=RETRY_AFTER_S)
        field, max_src = job.field, self.engine.max_src_len
        prefix = self.target_prefix(job.target_lang)
        keep = getattr(self, "keep", Terms()) + Terms(job.keep)    # the stored list and the job's terms
        splits: list[Optional[Split]] = []
        pieces: list[Piece] = []
        prepared: list[Protected] = []
        memory = getattr(self, "memory", None) if hits is not None and job.memory_scope is not None else None
        memory_key = (memory_model(self.name, job.target_lang if self.tok.target_languages else None)
                      if memory is not None else "")
        for i, text in enumerate(job.texts):
            if not has_text(text):   # whitespace or other invisible characters only
                splits.append(None)
                continue
            mode = getattr(job, "split_sentences", "1")     # DeepL's split_sentences (text.split_sentences_of)
            split = (split_text(text, self.card.source_lang) if mode == "1" else
                     split_sentences_of(text, self.card.source_lang, mode))
            seen: dict[str, Protected] = {}     # sentence -> what the model sees of it
            encoded: dict[str, list[int]] = {}  # sentence -> its source ids (with EOS), each encoded once

            def ids_of(s: str) -> list[int]:
                if s not in encoded:
                    encoded[s] = self.protector.encode(seen.setdefault(s, self.protector.prepare(s, keep)))
                return encoded[s]
            split = self.protector.rejoin(split, keep)    # a URL the splitter cut at its "?" is one sentence again
            split = cut_long(split, lambda s: len(prefix) + len(ids_of(s)) <= max_src,
                             lambda s: [(sp.start, sp.end) for sp in self.protector.find_spans(s, keep=keep)])
            self.metrics.split_fallbacks(split.fallbacks)
            split = split.translatable(lambda s: seen.setdefault(s, self.protector.prepare(s, keep)).needs_model)
            stored: dict[str, str] = {}
            if memory is not None:      # one query per text: the whole text and each sentence
                whole = normalize(text)
                stored = memory.lookup(memory_key, job.memory_scope, [whole, *(normalize(s) for s in split.pieces)])
                if whole in stored and split.pieces and [normalize(s) for s in split.pieces] != [whole]:
                    core = trim(text)   # the whole text is in the memory: one piece, its stored translation
                    at = text.find(core)
                    splits.append(Split([core], [text[:at], text[at + len(core):]]))
                    hits[len(pieces)] = stored[whole]
                    pieces.append(Piece(i, 0, []))
                    prepared.append(None)
                    continue
            splits.append(split)    # pieces without letters (for the model) pass through verbatim, in the glue
            for j, sentence in enumerate(split.pieces):
                if stored and normalize(sentence) in stored:
                    hits[len(pieces)] = stored[normalize(sentence)]
                    pieces.append(Piece(i, j, []))
                    prepared.append(None)
                    continue
                prepared.append(seen[sentence])   # translatable() prepared every piece it kept
                ids = prefix + ids_of(sentence)
                if len(ids) > max_src:      # cut_long found no cut that fits
                    where = f"{field}[{i}]" if job.is_list else field
                    raise TooLarge(f"{where}: sentence {j + 1} has {len(ids)} tokens (with EOS); model {self.name} "
                                   f"accepts at most {max_src} per sentence: split it", field)
                pieces.append(Piece(i, j, ids))
        return splits, pieces, prepared

    def in_flight(self) -> int:
        """Sentences of one request in the engine at once (its next ones go in as these finish):
        ``MAX_SENTENCES``, at most the engine's queue (``max_waiting``), so a request of any size fits."""
        return max(1, min(MAX_SENTENCES, self.engine_config.max_waiting))

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
                 prefix: tuple[int, ...] = (), glossary: Optional[Glossary] = None) -> GenerationOptions:
        """A sentence with inner protected spans also tracks cross-attention (to place them), as does
        every sentence when the job returns alignments; ``prefix``: its forced target ids; one with
        glossary terms gets their target ids as decoding constraints (``glossary.py``)."""
        if (prepared.spans or alignment) and "cross" not in options.attention_kinds:
            options = dataclasses.replace(options, attention_kinds=(*options.attention_kinds, "cross"))
        if prefix:
            options = dataclasses.replace(options, target_prefix=prefix)
        constraints = glossary.constraints(prepared.source) if glossary else ()
        return dataclasses.replace(options, constraints=constraints) if constraints else options

    def _all_options(self, job: TranslateJob, pieces: list[Piece], prepared: list[Optional[Protected]],
                     glossary: Optional[Glossary] = None) -> list[GenerationOptions]:
        """Each piece's options: the job's, the target prefix on the first sentence of each text,
        the glossary's constraints where its terms occur (a memory hit's, None: no engine run)."""
        prefix = self.encode_prefix(job.target_prefix)
        firsts = {p.text_index: k for k, p in reversed(list(enumerate(pieces)))}
        return [None if prot is None else
                self._options(prot, job.options, job.return_alignment, prefix if firsts[p.text_index] == k else (),
                              glossary)
                for k, (p, prot) in enumerate(zip(pieces, prepared))]

    def encode_prefix(self, prefix: Optional[str]) -> tuple[int, ...]:
        """``target_prefix``'s target ids (``model.tokenizer.encode_target``); () for None. Any length:
        max_new_tokens counts the tokens after it, and a prefix that fills the model's target window
        is the sentence's answer (finish_reason "length"; ``service.engine.validation``).
        Raises InvalidRequest when it has no tokens or pieces the target vocabulary lacks (<unk>)."""
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
        return tuple(ids)

    def glossary(self, job: TranslateJob) -> Optional[Glossary]:
        """The job's glossary compiled for this model (cached by its entries), or None.
        Raises InvalidRequest for a bad or conflicting entry (``glossary.Glossary``)."""
        if not job.glossary:
            return None
        key = (job.glossary, job.glossary_field)
        cache = self.__dict__.setdefault("_glossaries", {})
        if key not in cache:
            limit = MAX_GLOSSARY_ENTRIES if job.glossary_field == "glossary" else MAX_STORED_GLOSSARY_ENTRIES
            max_tokens = min(self.engine.max_tgt_len, self.model.cfg.max_len - 1) - 1 if self.engine else \
                self.model.cfg.max_len - 2
            while len(cache) >= 32:
                cache.pop(next(iter(cache)))
            cache[key] = Glossary(job.glossary, self.card.source_lang, self.tok, max_tokens, job.glossary_field, limit)
        return cache[key]

    def _text_of(self, prepared: list[Protected], pieces: list[Piece], hits: Optional[dict[int, str]] = None):
        """``text_of`` for build_response: a hypothesis's text with spans and case restored (a memory
        hit's: the stored text)."""
        index = {(p.text_index, p.piece_index): k for k, p in enumerate(pieces)}

        def text_of(piece: Piece, hyp) -> str:
            k = index[piece.text_index, piece.piece_index]
            if hits and k in hits:
                return hits[k]
            return self.protector.restore(prepared[k], piece.src_ids, hyp.tokens, (hyp.attention or {}).get("cross"))
        return text_of

    # ---- translate ----------------------------------------------------------------------------
    async def translate(self, job: TranslateJob) -> TranslateResponse:
        """Translate every text of the job. Raises the domain errors of ``prepare`` or the engine's."""
        hits: dict[int, str] = {}
        splits, pieces, prepared = self.prepare(job, hits)
        options = self._all_options(job, pieces, prepared, self.glossary(job))
        results = await self._results(pieces, options, hits)
        return build_response(self.name, self.tok, job, splits, pieces, results,
                              self._text_of(prepared, pieces, hits), self.card.config)

    async def _results(self, pieces: list[Piece], options: list[Optional[GenerationOptions]],
                       hits: dict[int, str]) -> list[TranslationResult]:
        """Each piece's result: a memory hit's (no tokens; ``memory_hit``), the cache's, else the
        engine's (then cached). Counted in ``mt_memory_lookups_total``."""
        out: list[Optional[TranslationResult]] = [None] * len(pieces)
        todo: list[int] = []
        for k, p in enumerate(pieces):
            if k in hits:
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
        hits: dict[int, str] = {}
        splits, pieces, prepared = self.prepare(job, hits)
        options = self._all_options(job, pieces, prepared, self.glossary(job))
        streams, group = [], object()   # group: as in _run_all
        run = [k for k in range(len(pieces)) if k not in hits]    # memory hits are answered without the engine
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
        text_of = self._text_of(prepared, pieces, hits)
        state = StreamState(self.tok, splits, pieces, lambda k, tokens, hyp: (
            self.protector.partial(prepared[k], tokens) if hyp is None else text_of(pieces[k], hyp)))
        for ev in state.verbatim():     # texts without letters: whole, before any token
            yield ev
        results: list[Optional[TranslationResult]] = [None] * len(pieces)
        for k in hits:
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
        yield build_response(self.name, self.tok, job, splits, pieces, results, text_of, self.card.config)


def memory_hit() -> TranslationResult:
    """The result of a sentence the translation memory answered: one hypothesis without tokens
    (the model generated none), score 0 (log-probability 0: certain); its text is the stored one."""
    return TranslationResult([Hypothesis(tokens=[], log_prob=0.0, score=0.0, finish_reason="eos")],
                             RequestStats(request_id=-1, status="ok", finish_reason="eos", src_tokens=0, beam_size=0))


def cache_key(piece: Piece, options: GenerationOptions) -> tuple:
    """The result cache's key of a sentence: its source ids (target-language token included) and
    every decoding option (``GenerationOptions`` fields), so a hit is the result the engine would give."""
    return tuple(piece.src_ids), dataclasses.astuple(options)
