"""Models on demand across a pool of translator replicas, on Ray Serve's model multiplexing.

    Gateway --handle.options(multiplexed_model_id=m)--> Pool replica (PoolReplica: a Pool)
                                                          |- resident models, each a Translator with its
                                                          |  own continuous-batching Engine, KV cache and
                                                          |  metrics labels (model=m)
                                                          `- reports what it holds to PoolDirectory

Serve routes a request for model ``m`` to a replica that holds ``m`` (its router's multiplexing:
replicas that hold it, else those holding the fewest models; docs.ray.io "Model Multiplexing"). On a
replica, ``serve.multiplexed(max_num_models_per_replica=N)`` loads ``m`` on its first request and,
when N models are resident, first evicts the least recently used one. Serve's eviction knows nothing
of requests in flight; here each ``ResidentModel`` counts its in-flight requests and an eviction
only takes it out of the routing: its engine keeps serving what it holds and is stopped (KV cache and
weights freed) once the count drops to 0 (``drain_timeout_s`` at most). A request for a model whose
eviction is still draining takes it back (no reload). A memory budget (``memory_budget_mb``) evicts
further LRU models until the resident ones' weights and KV caches fit; an NLLB-200 / M2M100 /
mBART-50 model's size is known before its first load (``weights_bytes``: its weights in float32,
from the safetensors header), so room is made for it before it is read.

Loads run in a worker thread (checkpoint read, weight packing), so the requests of the other resident
models on that replica go on meanwhile. A failed load (unknown model, a folder that is not a model or
has vanished, out of memory) answers 404/503 naming the model and the cause; the replica stays up and
keeps its other models.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from pathlib import Path
from typing import AsyncIterator, Iterator, Optional, Union

import ray
from ray import serve

from service.protocol import (
    RETRY_AFTER_S,
    ErrorRecord,
    ServiceError,
    StreamItem,
    TranslateJob,
    TranslateResponse,
)
from service.translator import ModelCard, Translator, TranslatorInfo, TranslatorSettings

from .api.middleware.access_log import flush_serve_log
from .metrics import PoolMetrics
from .replica import error_record, run_within, stream_within

logger = logging.getLogger("ray.serve")
MULTIPLEX_WRAPPER = "__serve_multiplex_wrapper"   # where serve.multiplexed keeps its LRU cache on the function
HEARTBEAT_S = 5.0          # a pool replica re-reports what it holds this often
REPORT_TIMEOUT_S = 2.0   # a report the directory does not take within this is dropped (the next one follows)
STALE_S = 3 * HEARTBEAT_S  # the directory forgets a replica not heard of for this long (it died)


def discover_models(directory: str | Path) -> dict[str, Path]:
    """The models under ``directory``: each sub-folder with a ``config.json`` (a checkpoint of
    ``model/checkpoint.py`` or a MarianMT folder), named by the folder, sorted by name. Folders
    without one are skipped (logged). Raises FileNotFoundError when ``directory`` is missing or
    holds no model."""
    d = Path(directory).resolve()     # replicas may run in another working directory
    if not d.is_dir():
        raise FileNotFoundError(f"pool.models_dir: {d} is not a directory")
    found, skipped = {}, []
    for sub in sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")):
        (found.__setitem__(sub.name, sub) if (sub / "config.json").is_file() else skipped.append(sub.name))
    if skipped:
        logger.info("pool.models_dir %s: skipped %s (no config.json)", d, skipped)
    if not found:
        raise FileNotFoundError(f"pool.models_dir: {d} holds no model (no sub-folder with a config.json)")
    return found


def model_bytes(translator: Translator) -> int:
    """Bytes a resident model holds: its parameters and buffers plus its engine's KV cache."""
    m = translator.model
    weights = sum(t.numel() * t.element_size() for t in (*m.parameters(), *m.buffers()))
    kv = translator.engine.stats().kv_cache_bytes if translator.engine is not None else 0
    return int(weights + (kv or 0))


def weights_bytes(checkpoint: str | Path) -> int:
    """Bytes of a checkpoint's weights as loaded (float32), from ``model.safetensors``'s header (its
    tensors' shapes; nothing is read beyond it). Raises FileNotFoundError without the file."""
    from safetensors import safe_open
    with safe_open(str(Path(checkpoint) / "model.safetensors"), framework="pt") as f:
        return sum(4 * math.prod(f.get_slice(k).get_shape()) for k in f.keys())


class ResidentModel:
    """One loaded model on a pool replica and the requests it has in flight.

    ``state``: resident (routable) -> draining (evicted; finishes what it holds) -> stopping ->
    stopped. ``use()`` brackets every request. Serve's multiplexer calls the instance's ``__del__``
    on eviction (an instance attribute, so that Python's garbage collector never calls it)."""

    def __init__(self, model_id: str, translator: Translator, load_s: float, on_evict):
        self.id, self.translator, self.load_s = model_id, translator, load_s
        self.bytes = model_bytes(translator)
        self.in_flight = 0
        self.state = "resident"
        self.last_used = time.time()
        self.idle = asyncio.Event()
        self.idle.set()
        self._on_evict = on_evict
        self.arm()

    def arm(self) -> None:
        """(Re)install the eviction hook: Serve's multiplexer replaces an evicted model's ``__del__``
        with a stub, so a model taken back while draining needs its own again."""
        async def evicted() -> None:              # awaited by Serve's multiplexer on eviction
            await self._on_evict(self)
        self.__del__ = evicted

    @contextlib.contextmanager
    def use(self) -> Iterator[Translator]:
        """Count a request in flight for the block. Raises ServiceError 503 when the model has
        stopped (only a request that held it across its teardown can see that)."""
        if self.state in ("stopping", "stopped"):
            raise ServiceError(503, f"model {self.id} was unloaded from this replica; retry",
                               retry_after=RETRY_AFTER_S)
        self.in_flight += 1
        self.idle.clear()
        self.last_used = time.time()
        try:
            yield self.translator
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    def describe(self) -> dict:
        return {"state": self.state, "in_flight": self.in_flight, "bytes": self.bytes,
                "load_seconds": round(self.load_s, 3), "last_used": self.last_used}


class Pool:
    """The models of one pool replica: loads the model a request names (its multiplexed model id)
    and keeps up to ``max_models`` of them (``serve.multiplexed``), or fewer under ``memory_budget_bytes``.
    Built inside the replica's event loop (it starts the residency heartbeat); ``PoolReplica`` is
    the Serve deployment.

    Args:
        cards: every model the pool may load (the gateway's cards of them).
        max_models: models resident at once (Serve's ``max_num_models_per_replica``).
        memory_budget_bytes: resident weights + KV caches at most (None: no budget).
        drain_timeout_s: how long an evicted model may finish its in-flight requests before its
            engine stops anyway (their deadlines fit in it: max_timeout_s + 5 s).
        directory: the ``PoolDirectory`` handle this replica reports its models to (None: none).
        settings: every loaded translator's text stages, memory file and result cache.
        device: where the models run; replica_id: the name residency reports give this replica.

    Errors are answers (``ErrorRecord``), never replica failures: unknown model 404; a load that
    fails 503 naming the model and the cause (Retry-After).
    """

    def __init__(self, cards: list[ModelCard], max_models: int, memory_budget_bytes: Optional[int] = None,
                 drain_timeout_s: float = 65.0, directory=None, settings: Optional[TranslatorSettings] = None,
                 device: str = "cpu", replica_id: str = "local"):
        self.settings = settings or TranslatorSettings()
        self.cards = {c.id: c for c in cards}
        self.max_models, self.budget = max_models, memory_budget_bytes
        self.drain_timeout_s = drain_timeout_s
        self.device, self.replica_id = device, replica_id
        self.engine: dict = {}
        self.resident: dict[str, ResidentModel] = {}      # what the multiplexer holds, by id
        self.draining: dict[str, ResidentModel] = {}      # evicted, still finishing requests
        self._teardowns: dict[str, asyncio.Task] = {}
        self.metrics = PoolMetrics()
        self.metrics.set_resident(0, 0)
        self.directory = directory
        self._sizes: dict[str, int] = {}                 # bytes of each model when last loaded here
        self.loads: dict[str, int] = {}                  # successful loads here, by model
        self.evictions: dict[str, int] = {}              # evictions here, by model

        async def load(model_id: str) -> ResidentModel:    # Serve's multiplexer calls it on a cache miss
            return await self._load(model_id)
        self._load_fn = load
        self.get_model = serve.multiplexed(max_num_models_per_replica=max_models)(load)
        self._heartbeat = asyncio.create_task(self._report_loop())

    async def reconfigure(self, user_config: dict) -> None:
        """user_config = EngineConfig fields for every pool model (a card's ``engine`` overrides
        them); applied to the resident models now and to each later load."""
        self.engine = dict(user_config or {})
        for rm in list(self.resident.values()):
            await rm.translator.reconfigure({**self.engine, **self.cards[rm.id].engine})

    # ---- loading and eviction ------------------------------------------------------------------
    def _wrapper(self):
        return getattr(self._load_fn, MULTIPLEX_WRAPPER, None)

    async def _load(self, model_id: str) -> ResidentModel:
        card = self.cards.get(model_id)
        if card is None:
            raise ServiceError(404, f"model: unknown model {model_id!r}; the pool serves {sorted(self.cards)}", "model")
        wrapper = self._wrapper()
        for lost in [m for m in self.resident if wrapper is not None and m not in wrapper.models]:
            await self._evict(self.resident[lost])    # dropped by the multiplexer without its hook: drain it
        back = self.draining.pop(model_id, None)
        if back is not None and back.state == "draining":    # evicted but still serving: take it back
            self._teardowns.pop(model_id).cancel()
            back.state = "resident"
            back.arm()
            self.resident[model_id] = back
            logger.info("pool: model %s taken back while draining (no reload)", model_id)
            self._changed()
            return back
        await self._fit(self.cards_bytes(model_id))
        t0, translator = time.perf_counter(), None
        try:
            translator = await asyncio.to_thread(self._construct, card)
            await translator.reconfigure({**self.engine, **card.engine})
        except Exception as e:  # noqa: BLE001 - a failed load is an answer naming the model and the cause
            if translator is not None:
                with contextlib.suppress(Exception):
                    await translator.stop()
            self.metrics.load(model_id, "failed", time.perf_counter() - t0)
            cause = "out of memory" if isinstance(e, MemoryError) else f"{type(e).__name__}: {e}"
            logger.warning("pool: loading model %s failed: %s", model_id, cause)
            raise ServiceError(503, f"model {model_id} could not be loaded on replica {self.replica_id}: {cause}",
                               "model", retry_after=RETRY_AFTER_S) from e
        seconds = time.perf_counter() - t0
        rm = ResidentModel(model_id, translator, seconds, self._evict)
        self._sizes[model_id] = rm.bytes
        self.loads[model_id] = self.loads.get(model_id, 0) + 1
        self.resident[model_id] = rm
        self.metrics.load(model_id, "ok", seconds)
        logger.info("pool: loaded model %s in %.2f s (%.1f MB)", model_id, seconds, rm.bytes / 2 ** 20)
        await self._fit(0, keep=model_id)
        self._changed()
        return rm

    def cards_bytes(self, model_id: str) -> int:
        """The bytes ``model_id`` held when last loaded here; before its first load, an NLLB-200 /
        M2M100 / mBART-50 model's float32 weights (``weights_bytes``), any other model's 0."""
        if model_id not in self._sizes and model_id in self.cards and self.cards[model_id].lang_tokens:
            with contextlib.suppress(OSError):
                self._sizes[model_id] = weights_bytes(self.cards[model_id].checkpoint)
        return self._sizes.get(model_id, 0)

    def _construct(self, card: ModelCard) -> Translator:
        """Read and prepare the model (in a worker thread: the event loop keeps serving)."""
        return Translator(card, device=self.device, settings=self.settings)

    def used_bytes(self) -> int:
        return sum(rm.bytes for rm in (*self.resident.values(), *self.draining.values()))

    async def _fit(self, extra: int, keep: Optional[str] = None) -> None:
        """Under a memory budget, evict LRU models (through Serve's multiplexer, so its cache agrees)
        until ``extra`` more bytes fit, never ``keep`` (the model being loaded) nor the last one."""
        wrapper = self._wrapper()
        if self.budget is None or wrapper is None:
            return
        while self.used_bytes() + extra > self.budget and any(k != keep for k in wrapper.models):
            if next(iter(wrapper.models)) == keep:
                wrapper.models.move_to_end(keep)
            await wrapper.unload_model_lru()

    async def _evict(self, rm: ResidentModel) -> None:
        """Serve's multiplexer evicted ``rm`` (its ``__del__``): out of the routing now, stopped once
        idle. Returns at once, so the load that evicted it does not wait for its requests."""
        self.resident.pop(rm.id, None)
        rm.state = "draining"
        self.draining[rm.id] = rm
        self.metrics.evict(rm.id)
        self.evictions[rm.id] = self.evictions.get(rm.id, 0) + 1
        logger.info("pool: evicting model %s (%d requests in flight)", rm.id, rm.in_flight)
        self._teardowns[rm.id] = asyncio.create_task(self._teardown(rm))
        self._changed()

    async def _teardown(self, rm: ResidentModel) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.drain_timeout_s
        while rm.in_flight and loop.time() < end:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rm.idle.wait(), timeout=max(0.0, end - loop.time()))
        if rm.in_flight:
            logger.warning("pool: model %s stopping with %d requests unfinished", rm.id, rm.in_flight)
        rm.state = "stopping"
        self._teardowns.pop(rm.id, None)
        try:
            await rm.translator.stop()
        finally:
            rm.state = "stopped"
            if self.draining.get(rm.id) is rm:
                del self.draining[rm.id]
            self._free(rm)
            self._changed()

    def _free(self, rm: ResidentModel) -> None:
        """Drop the model's weights and KV cache now: the last references, freed by reference
        counting (no cycle holds them; tests/test_pool.py checks it), without a full collection
        pausing the event loop. glibc keeps the freed memory for the next load (``tune_process``)."""
        rm.translator.engine = None
        rm.translator.model = None

    # ---- residency reports ----------------------------------------------------------------------
    def residency(self) -> dict:
        """What this replica holds: ``{"replica", "models": {id: {state, in_flight, bytes, ...}}, "bytes"}``."""
        models = {m: rm.describe() for m, rm in (*self.draining.items(), *self.resident.items())}
        return {"replica": self.replica_id, "models": models, "bytes": self.used_bytes(), "time": time.time(),
                "loads": dict(self.loads), "evictions": dict(self.evictions)}

    def _changed(self) -> None:
        self.metrics.set_resident(len(self.resident), self.used_bytes())
        if self.directory is not None:
            self._report_task = asyncio.create_task(self._report())

    async def _report(self) -> None:
        try:
            await asyncio.wait_for(self.directory.report.remote(self.residency()), timeout=REPORT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - reporting never fails a request
            logger.warning("pool: reporting residency failed: %s", e)

    async def _report_loop(self) -> None:
        while True:
            if self.directory is not None:
                await self._report()
            await asyncio.sleep(HEARTBEAT_S)

    # ---- requests --------------------------------------------------------------------------------
    async def translate(self, job: TranslateJob) -> Union[TranslateResponse, ErrorRecord]:
        """Translate ``job`` with the model the call names (``handle.options(multiplexed_model_id=...)``)."""
        return await self.translate_with(serve.get_multiplexed_model_id(), job)

    async def stream(self, job: TranslateJob) -> AsyncIterator[Union[StreamItem, ErrorRecord]]:
        """``Translator.stream`` of the model the call names."""
        async for item in self.stream_with(serve.get_multiplexed_model_id(), job):
            yield item

    async def _model(self, model_id: str) -> ResidentModel:
        if model_id not in self.cards:      # before the multiplexer, which would evict to make room
            raise ServiceError(404, f"model: unknown model {model_id!r}; the pool serves {sorted(self.cards)}",
                               "model")
        return await self.get_model(model_id)

    async def translate_with(self, model_id: str, job: TranslateJob) -> Union[TranslateResponse, ErrorRecord]:
        try:
            rm = await self._model(model_id)
            with rm.use() as translator:    # no await between the lookup and the count: never evicted unseen
                return await run_within(translator.translate(job), job.deadline, job.timeout_s)
        except Exception as e:  # noqa: BLE001 - an answer if it maps to one, else a failure
            return error_record(e, model_id)

    async def stream_with(self, model_id: str, job: TranslateJob) -> AsyncIterator[Union[StreamItem, ErrorRecord]]:
        try:
            rm = await self._model(model_id)
            with rm.use() as translator:
                async with contextlib.aclosing(stream_within(translator.stream(job), job.deadline,
                                                             job.timeout_s)) as items:
                    async for item in items:
                        yield item
        except Exception as e:  # noqa: BLE001
            yield error_record(e, model_id)

    def ready(self) -> bool:
        """The replica runs (models load on demand: none needs to be resident)."""
        return True

    def info(self) -> TranslatorInfo:
        """The engine settings of the requested model as it runs here; the configured ones when it is
        not resident on this replica (nothing is loaded for this call)."""
        model_id = serve.get_multiplexed_model_id()
        rm = self.resident.get(model_id)
        if rm is not None:
            return rm.translator.info()
        return TranslatorInfo(model_id, self.device, {**self.engine, **self.cards[model_id].engine}
                              if model_id in self.cards else dict(self.engine))

    async def __del__(self):
        """Serve's shutdown hook (after its drain of ongoing calls): every model's engine drains and
        stops, and this replica leaves the directory."""
        self._heartbeat.cancel()
        for rm in list(self.resident.values()):
            await self._evict(rm)
        await asyncio.gather(*list(self._teardowns.values()), return_exceptions=True)
        if self.directory is not None:
            with contextlib.suppress(Exception):    # the directory may be stopping too
                await asyncio.wait_for(self.directory.forget.remote(self.replica_id), timeout=REPORT_TIMEOUT_S)
        flush_serve_log()


class PoolReplica(Pool):
    """A Serve replica of the pool (``service/app.py``): a ``Pool`` on the CPUs and device Ray
    assigned it, named by its Serve replica id."""

    async def __init__(self, cards: list[ModelCard], max_models: int, memory_budget_bytes: Optional[int] = None,
                       drain_timeout_s: float = 65.0, directory=None, settings: Optional[TranslatorSettings] = None):
        import torch
        resources = ray.get_runtime_context().get_assigned_resources()
        torch.set_num_threads(max(1, round(resources.get("CPU", 1))))
        device = "cuda" if resources.get("GPU", 0) > 0 and torch.cuda.is_available() else "cpu"
        super().__init__(cards, max_models, memory_budget_bytes, drain_timeout_s, directory, settings, device,
                         serve.get_replica_context().replica_id.unique_id)


class PoolDirectory:
    """Which models each pool replica holds, as the replicas report it (on every load and eviction,
    and every HEARTBEAT_S); a replica not heard of for STALE_S is forgotten. ``GET /v1/models`` reads
    it. Routing does not: Serve's router has its own view of the same (multiplexed model ids)."""

    def __init__(self):
        self.replicas: dict[str, dict] = {}

    def report(self, residency: dict) -> None:
        seen = self.replicas.get(residency["replica"])
        if seen is None or seen["time"] <= residency["time"]:
            self.replicas[residency["replica"]] = residency

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    def snapshot(self) -> dict[str, dict]:
        now = time.time()
        for r in [r for r, v in self.replicas.items() if now - v["time"] > STALE_S]:
            del self.replicas[r]
        return dict(self.replicas)


def where_loaded(snapshot: dict[str, dict]) -> dict[str, list[str]]:
    """model id -> the replicas it is resident on (sorted), from ``PoolDirectory.snapshot()``."""
    out: dict[str, list[str]] = {}
    for replica, r in sorted(snapshot.items()):
        for model, m in r["models"].items():
            if m["state"] == "resident":
                out.setdefault(model, []).append(replica)
    return out
