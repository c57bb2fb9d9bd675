"""The translator: one model, its tokenizer and its continuous-batching engine, behind plain async methods.

A Ray Serve replica wraps one ``Translator`` (see ``deployment.py``); it is plain Python so that it
can also run inside the ingress process and in unit tests. A request's texts are split into lines
and sentences (``text.split_text``), every sentence becomes one engine call, all calls are awaited
together (so they join the engine's prefill and decode batches with everyone else's), and the
translated sentences are rejoined with the original whitespace.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Optional

import torch

from model.checkpoint import load_checkpoint

from .engine import (Engine, EngineConfig, EngineError, EngineStoppedError, EngineValidationError,
                     GenerationOptions, QueueFullError, torch_threads, tune_process)
from .metrics import EngineMetrics
from .schemas import ATTENTION_KINDS, MAX_SENTENCES, MAX_TEXT_CHARS, MAX_TEXTS, ServiceError, check_unicode
from .text import Split, has_text, split_text

logger = logging.getLogger("ray.serve")

RETRY_AFTER_S = 1.0     # Retry-After for 503s caused by a full queue


def model_card(name: str, checkpoint: str | Path, source_lang: Optional[str] = None,
               target_lang: Optional[str] = None) -> dict:
    """What the ingress needs to know about a model without loading it: read from the checkpoint's JSON files.

    Raises FileNotFoundError when the checkpoint lacks config.json, ValueError when the languages
    are neither given nor in metadata.json.
    """
    d = Path(checkpoint)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"model {name!r}: checkpoint {d} has no config.json")
    config = json.loads((d / "config.json").read_text())
    meta = json.loads((d / "metadata.json").read_text()) if (d / "metadata.json").exists() else {}
    src = source_lang or meta.get("source_lang")
    tgt = target_lang or meta.get("target_lang")
    if not src or not tgt:
        raise ValueError(f"model {name!r}: source_lang/target_lang are not in {d / 'metadata.json'}; pass them")
    return {"id": name, "checkpoint": str(d), "source_lang": src, "target_lang": tgt, "config": config,
            "metadata": meta, "test_bleu": _test_bleu(meta)}


def _test_bleu(meta: dict) -> Optional[float]:
    """BLEU on the test set as the checkpoint's metadata records it (``test_bleu`` or ``test*: {bleu}``)."""
    if isinstance(meta.get("test_bleu"), (int, float)):
        return float(meta["test_bleu"])
    for key, value in meta.items():
        if "test" in key and isinstance(value, dict) and isinstance(value.get("bleu"), (int, float)):
            return float(value["bleu"])
    return None


@dataclass
class _Piece:
    """One sentence of one text, as sent to the engine."""
    text_index: int
    piece_index: int
    src_ids: list[int]          # piece ids + EOS
    options: GenerationOptions


class Translator:
    """Model + tokenizer + Engine for one checkpoint. Methods take and return plain dicts (JSON-ready).

    Call ``await reconfigure(engine_config)`` once before use (Ray Serve does so with user_config).
    """

    def __init__(self, card: dict, device: Optional[str] = None, num_threads: Optional[int] = None):
        self.card = card
        self.name = card["id"]
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        with torch_threads(1):  # only the engine's worker thread runs multi-threaded (see torch_threads)
            self.model, self.tok, _ = load_checkpoint(card["checkpoint"], device=self.device)
        tune_process()
        self.cfg = self.model.cfg
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
                    self.metrics.set_state(s.get("running_sequences"), s.get("waiting_requests"),
                                           s.get("kv_cache_usage"))
                    self.metrics.set_ready(True)
            except Exception:  # never let metrics kill the replica
                logger.exception("gauge refresh failed")
            await asyncio.sleep(period_s)

    async def stop(self) -> None:
        self.metrics.set_ready(False)
        if self._gauges is not None:
            self._gauges.cancel()
        if self.engine is not None:
            await self.engine.stop()

    def ready(self) -> bool:
        return self.engine is not None

    def stats(self) -> dict:
        return {"model": self.name, **(self.engine.stats() if self.engine else {})}

    def info(self) -> dict:
        engine = dataclasses.asdict(self.engine_config) if self.engine_config else {}
        return {**{k: v for k, v in self.card.items() if k != "checkpoint"}, "device": self.device,
                "engine": {**engine, "linear_dtype": self.model.linear_dtype}}

    # ---- request preparation ------------------------------------------------------------------
    def _prepare(self, req: dict) -> tuple[list[Optional[Split]], list[_Piece]]:
        """Validate model-dependent limits, split texts into sentences and encode them.

        Returns per text its Split (None for empty or whitespace-only text) and the flat list of
        pieces to translate. Raises ServiceError (413 for sizes, 422 for fields, 503 while loading).
        """
        if self.engine is None:
            raise ServiceError(503, f"model {self.name} is loading", retry_after=RETRY_AFTER_S)
        texts = req["texts"]
        field = req.get("field", "text")
        if len(texts) > MAX_TEXTS:
            raise ServiceError(413, f"{field}: at most {MAX_TEXTS} texts per request, got {len(texts)}", field)
        try:
            check_unicode(texts, field)
        except ValueError as e:
            raise ServiceError(422, str(e), field) from None
        max_src = self.engine.max_src_len
        max_new = req.get("max_new_tokens")     # None: the engine's default for each sentence's length
        kinds = tuple(req["attention"]["kinds"]) if req.get("return_attention") else ()
        if kinds:
            self._check_attention_indices(req["attention"], kinds)
        options = GenerationOptions(beam_size=req["beam_size"], n_best=req["n_best"], max_new_tokens=max_new,
                                    length_penalty=req["length_penalty"], attention_kinds=kinds,
                                    min_new_tokens=req.get("min_new_tokens", 0))
        try:    # the options alone, so that a bad field is reported even when every text is empty
            self.engine.validate([self.tok.eos_id], dataclasses.replace(
                options, min_new_tokens=options.min_new_tokens if max_new is not None else 0))
        except EngineValidationError as e:
            raise ServiceError(422, _engine_message(e), e.field) from None
        splits: list[Optional[Split]] = []
        pieces: list[_Piece] = []
        for i, text in enumerate(texts):
            where = f"{field}[{i}]" if req.get("is_list") else field
            if len(text) > MAX_TEXT_CHARS:
                raise ServiceError(413, f"{where}: at most {MAX_TEXT_CHARS} characters per text, got {len(text)}",
                                   field)
            if not has_text(text):   # whitespace or other invisible characters only
                splits.append(None)
                continue
            split = split_text(text, self.card["source_lang"])
            splits.append(split)
            for j, sentence in enumerate(split.pieces):
                ids = self.tok.encode(sentence) + [self.tok.eos_id]
                if len(ids) > max_src:
                    raise ServiceError(
                        413, f"{where}: sentence {j + 1} has {len(ids)} tokens (with EOS); model {self.name} "
                             f"accepts at most {max_src} per sentence: split it", field)
                pieces.append(_Piece(i, j, ids, options))
        limit = min(MAX_SENTENCES, self.engine_config.max_waiting)
        if len(pieces) > limit:
            raise ServiceError(413, f"{field}: at most {limit} sentences per request, got {len(pieces)}", field)
        for p in pieces:
            try:
                self.engine.validate(p.src_ids, p.options)
            except EngineValidationError as e:
                raise ServiceError(422, _engine_message(e), getattr(e, "field", None)) from None
        return splits, pieces

    def _check_attention_indices(self, att: dict, kinds: tuple) -> None:
        cfg = self.cfg
        n_layers = {"cross": cfg.n_decoder_layers, "decoder": cfg.n_decoder_layers, "encoder": cfg.n_encoder_layers}
        for kind in kinds:
            if kind not in ATTENTION_KINDS:
                raise ServiceError(422, f"attention.kinds: unknown kind {kind!r}; choose from {ATTENTION_KINDS}",
                                   "attention.kinds")
        limit = min(n_layers[k] for k in kinds)
        for layer in att.get("layers") or []:
            if not 0 <= layer < limit:
                raise ServiceError(422, f"attention.layers: layer indices must be in 0..{limit - 1} for model "
                                        f"{self.name} ({'/'.join(kinds)}), got {layer}", "attention.layers")
        for head in att.get("heads") or []:
            if not 0 <= head < cfg.n_heads:
                raise ServiceError(422, f"attention.heads: head indices must be in 0..{cfg.n_heads - 1} for model "
                                        f"{self.name}, got {head}", "attention.heads")

    # ---- translate ----------------------------------------------------------------------------
    async def translate(self, req: dict) -> dict:
        """Translate req["texts"] (see schemas.TranslateRequest; ``texts`` is the list form of ``text``)."""
        splits, pieces = self._prepare(req)
        results = await self._run_all(pieces)
        return self._response(req, splits, pieces, results)

    async def _run_all(self, pieces: list[_Piece]) -> list:
        """Await every piece concurrently; on the first failure cancel the rest and raise it."""
        if not pieces:
            return []
        tasks = [asyncio.create_task(self.engine.translate(p.src_ids, p.options)) for p in pieces]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise _map_engine_error(t.exception())
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            # Let cancellations reach the engine before the caller goes on.
            await asyncio.gather(*tasks, return_exceptions=True)

    def _response(self, req: dict, splits: list[Optional[Split]], pieces: list[_Piece], results: list) -> dict:
        by_text: dict[int, list] = {}
        for p, r in zip(pieces, results):
            by_text.setdefault(p.text_index, []).append((p, r))
        att = req.get("attention") or {}
        kinds = tuple(att.get("kinds", ())) if req.get("return_attention") else ()
        translations, src_total, gen_total = [], 0, 0
        for i, split in enumerate(splits):
            items = by_text.get(i, [])
            t = self._text_result(split, items, req["n_best"], kinds, att.get("layers"), att.get("heads"))
            src_total += sum(len(p.src_ids) for p, _ in items)
            gen_total += sum(len(r.hypotheses[0].tokens) for _, r in items)
            translations.append(t)
        return {"model": self.name, "translations": translations,
                "usage": {"source_tokens": src_total, "generated_tokens": gen_total}}

    def _text_result(self, split: Optional[Split], items: list, n_best: int, kinds: tuple,
                     layers: Optional[list[int]], heads: Optional[list[int]]) -> dict:
        if split is None:   # empty, whitespace or invisible characters only: "" without touching the model
            out = {"text": "", "tokens": [], "source_tokens": [], "score": 0.0, "finish_reason": "eos",
                   "alternatives": []}
            if kinds:
                out["attention"] = {k: [] for k in kinds}
            return out
        best = [r.hypotheses[0] for _, r in items]
        out = {
            "text": split.join([self.tok.decode(h.tokens) for h in best]),
            "tokens": [piece for h in best for piece in self.tok.pieces(h.tokens)],
            "source_tokens": [piece for p, _ in items for piece in self.tok.pieces(p.src_ids)],
            "score": _finite(sum(h.score for h in best) / len(best)),
            "finish_reason": "length" if any(h.finish_reason == "length" for h in best) else "eos",
            "alternatives": [],
        }
        for k in range(1, n_best):
            # Alternative k of a text = each sentence's k-th hypothesis (its best when it has fewer).
            hyps = [r.hypotheses[min(k, len(r.hypotheses) - 1)] for _, r in items]
            if all(len(r.hypotheses) <= k for _, r in items):
                break
            out["alternatives"].append({
                "text": split.join([self.tok.decode(h.tokens) for h in hyps]),
                "tokens": [piece for h in hyps for piece in self.tok.pieces(h.tokens)],
                "score": _finite(sum(h.score for h in hyps) / len(hyps)),
                "finish_reason": "length" if any(h.finish_reason == "length" for h in hyps) else "eos"})
        if kinds:
            out["attention"] = {kind: _block_diagonal(kind, best, [p.src_ids for p, _ in items], layers, heads)
                                for kind in kinds}
        return out

    # ---- streaming ----------------------------------------------------------------------------
    async def stream(self, req: dict) -> AsyncIterator[dict]:
        """Server-sent events as dicts: {"event": "start"} once the request is admitted, then
        {"event": "token", "index", "text", "token"} per new target token (concatenated ``text`` of one
        index = that translation's final text), then {"event": "response", "data": <translate() result>}.

        Sentences of one text are decoded concurrently but streamed in order; their tokens are held
        back until the sentences before them are done. Closing the generator cancels every sentence.
        """
        splits, pieces = self._prepare(req)
        streams = []
        try:
            for p in pieces:    # submitting raises QueueFullError at once, before anything is streamed
                streams.append(self.engine.stream(p.src_ids, p.options))
        except BaseException as e:
            for st in streams:
                st.cancel()
            raise _map_engine_error(e) from None
        yield {"event": "start"}
        queue: asyncio.Queue = asyncio.Queue()

        async def run(k: int, st) -> None:
            try:
                async for item in st:
                    queue.put_nowait((k, item))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer, cancellation included
                st.cancel()
                queue.put_nowait((k, e))
                if isinstance(e, asyncio.CancelledError):
                    raise

        tasks = [asyncio.create_task(run(k, st)) for k, st in enumerate(streams)]
        try:
            emit = _StreamState(self.tok, splits, pieces)
            results: list = [None] * len(pieces)
            remaining = len(pieces)
            while remaining:
                k, item = await queue.get()
                if isinstance(item, BaseException):
                    raise _map_engine_error(item)
                if isinstance(item, int):
                    for ev in emit.token(k, item):
                        yield ev
                else:
                    results[k] = item
                    remaining -= 1
                    for ev in emit.finish(k, item):
                        yield ev
            yield {"event": "response", "data": self._response(req, splits, pieces, results)}
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for st in streams:
                st.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _StreamState:
    """Turns per-sentence token ids into in-order text deltas per text (incremental detokenization).

    Invariant: for every text, the concatenated ``text`` of its events equals the final translation
    (leading whitespace, each sentence with the whitespace before it, trailing whitespace).
    """

    def __init__(self, tok, splits: list[Optional[Split]], pieces: list[_Piece]):
        self.tok, self.splits, self.pieces = tok, splits, pieces
        self.order: dict[int, list[int]] = {}           # text index -> its piece keys, in text order
        for k, p in enumerate(pieces):
            self.order.setdefault(p.text_index, []).append(k)
        self.current = {i: 0 for i in self.order}       # position in order[i] now being streamed
        self.tokens: list[list[int]] = [[] for _ in pieces]
        self.emitted: list[str] = ["" for _ in pieces]  # text of piece k already sent
        self.started: list[bool] = [False for _ in pieces]
        self.done: set[int] = set()

    def _current(self, i: int) -> Optional[int]:
        order = self.order[i]
        return order[self.current[i]] if self.current[i] < len(order) else None

    def _emit(self, k: int, final: bool) -> list[dict]:
        p = self.pieces[k]
        text = self.tok.decode(self.tokens[k])
        prev = self.emitted[k]
        if not text.startswith(prev) or (not final and text.endswith("\ufffd")):
            return []       # e.g. an incomplete multi-byte character: wait for the next token
        glue = "" if self.started[k] else self.splits[p.text_index].glue[p.piece_index]
        delta = text[len(prev):]
        if not delta and (not final or not glue):
            return []       # the whitespace before a sentence goes out with its first token
        self.started[k], self.emitted[k] = True, text
        token = self.tok.pieces(self.tokens[k][-1:])[0] if self.tokens[k] and not final else None
        return [{"event": "token", "index": p.text_index, "text": glue + delta, "token": token}]

    def token(self, k: int, token_id: int) -> list[dict]:
        self.tokens[k].append(token_id)
        return self._emit(k, final=False) if self._current(self.pieces[k].text_index) == k else []

    def finish(self, k: int, result) -> list[dict]:
        # The result's best hypothesis is authoritative (beam search yields its tokens only at the end).
        self.tokens[k] = list(result.hypotheses[0].tokens)
        self.done.add(k)
        i = self.pieces[k].text_index
        out: list[dict] = []
        while (cur := self._current(i)) is not None and cur in self.done:
            out += self._emit(cur, final=True)
            self.current[i] += 1
            if self._current(i) is None:
                tail = self.splits[i].glue[-1]
                if tail:
                    out.append({"event": "token", "index": i, "text": tail, "token": None})
        if (cur := self._current(i)) is not None:
            out += self._emit(cur, final=False)     # catch up on tokens held back while it waited
        return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -1e9


def _engine_message(e: Exception) -> str:
    field = getattr(e, "field", None)
    msg = getattr(e, "message", None) or str(e)
    return msg if not field or msg.startswith(field) else f"{field}: {msg}"


def _map_engine_error(e: BaseException) -> BaseException:
    if isinstance(e, ServiceError) or isinstance(e, asyncio.CancelledError):
        return e
    if isinstance(e, QueueFullError):
        return ServiceError(503, f"engine queue is full: {e}; retry later", retry_after=RETRY_AFTER_S)
    if isinstance(e, EngineValidationError):
        return ServiceError(422, _engine_message(e), getattr(e, "field", None))
    if isinstance(e, EngineStoppedError):
        return ServiceError(503, f"engine is restarting: {e}; retry later", retry_after=RETRY_AFTER_S)
    if isinstance(e, EngineError):
        return ServiceError(500, f"engine error: {e}")
    return e


def _block_diagonal(kind: str, hyps: list, sources: list[list[int]], layers: Optional[list[int]],
                    heads: Optional[list[int]]) -> list:
    """Per-sentence attention [L, H, rows, cols] placed on the diagonal of one text-level matrix.

    cross: rows = target tokens, cols = source tokens; encoder: both source; decoder: both target.
    Entries between different sentences are 0 (a token never attends to another sentence), so every
    row still sums to 1. Returned as nested lists rounded to 5 decimals.
    """
    mats = [h.attention[kind] for h in hyps]
    rows = [len(h.tokens) if kind != "encoder" else len(s) for h, s in zip(hyps, sources)]
    cols = [len(s) if kind != "decoder" else len(h.tokens) for h, s in zip(hyps, sources)]
    ref = next((m for m in mats if m is not None and m.dim() == 4), None)
    if ref is None:
        return []
    L, H = ref.shape[:2]
    li = torch.tensor(layers if layers else list(range(L)))
    hi = torch.tensor(heads if heads else list(range(H)))
    out = torch.zeros(len(li), len(hi), sum(rows), sum(cols), dtype=torch.float64)
    r0 = c0 = 0
    for m, r, c in zip(mats, rows, cols):
        if r and c and m is not None and m.dim() == 4:
            block = m.detach().to("cpu", torch.float64).index_select(0, li).index_select(1, hi)
            out[:, :, r0:r0 + r, c0:c0 + c] = block[:, :, :r, :c]
        r0, c0 = r0 + r, c0 + c
    return out.mul(1e5).round().div(1e5).tolist()
