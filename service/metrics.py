"""Every Prometheus metric of the service, declared once.

Metrics are Ray metrics (``ray.serve.metrics``): each replica records its own series, Ray adds the
``deployment``, ``replica`` and ``application`` labels, and every node's metrics agent exports them
in the Prometheus text format with the prefix ``ray_``. Counters are declared with their ``_total``
suffix (Ray then adds none), histograms come out as ``_bucket``/``_count``/``_sum``; docs/metrics.md
lists the exact names a scrape shows, and a test checks that they are METRICS's.
``GET /metrics`` on the service's HTTP port returns the text of every node's agent
(``scrape_metrics``), families merged so each has one HELP/TYPE header.
"""
from __future__ import annotations

import asyncio
from typing import Optional

import httpx
import ray
from ray.serve.metrics import Counter, Gauge, Histogram

from .protocol import RETRY_AFTER_S, ServiceError

PREFIX = "ray_"   # added by Ray's metrics agent

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
STEP_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
# 2^k - 1 and 2^k, so that `_count - _bucket{le="15"}` counts batches of 16 or more.
BATCH_BUCKETS = [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512]

# name -> (kind, description, label keys besides Ray's); kind is counter | histogram | gauge.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # HTTP layer (recorded by the ingress replica that answered)
    "mt_requests_total": ("counter", "HTTP requests answered, by model, endpoint and status code",
                          ("model", "endpoint", "status")),
    "mt_request_duration_seconds": ("histogram", "HTTP request latency until the last byte, seconds",
                                    ("model", "endpoint")),
    "mt_guard_requests_total": ("counter", "requests the access guard decided on, by key id (a short hash; "
                                "anonymous when keys are off; missing or invalid) and decision (allowed, "
                                "unauthorized, rate_limited)", ("key", "decision")),
    "mt_replica_retries_total": ("counter", "calls the gateway sent again because the translator replica holding "
                                 "them was lost, by model and call (translate; stream; stream_resumed: a stream "
                                 "that had sent tokens) and outcome (ok, failed)", ("model", "call", "outcome")),
    # engine (recorded by the translator replica that ran the work)
    "mt_queue_wait_seconds": ("histogram", "time a sentence waited in the engine queue before prefill, seconds",
                              ("model",)),
    "mt_time_to_first_token_seconds": ("histogram", "time from enqueue to the first target token, seconds",
                                       ("model",)),
    "mt_time_per_output_token_seconds": ("histogram", "decode time per generated token after the first, seconds",
                                         ("model",)),
    "mt_sentence_duration_seconds": ("histogram", "time from enqueue to the finished translation of one sentence, "
                                     "seconds", ("model",)),
    "mt_prefill_duration_seconds": ("histogram", "duration of one prefill batch (encoder and cross-attention K/V; "
                                    "its first decoder step runs in the shared decode step), seconds",
                                    ("model",)),
    "mt_decode_step_duration_seconds": ("histogram", "duration of one batched decode step, seconds", ("model",)),
    "mt_prefill_batch_size": ("histogram", "sentences per prefill batch", ("model",)),
    "mt_decode_batch_size": ("histogram", "sequences (hypotheses) per decode step", ("model",)),
    "mt_source_tokens_total": ("counter", "source tokens prefilled (EOS included)", ("model",)),
    "mt_generated_tokens_total": ("counter", "target tokens scored by the engine (every hypothesis of every step)",
                                  ("model",)),
    "mt_sentences_total": ("counter", "sentences the engine ended, by finish reason (eos, length, cancelled, error)",
                           ("model", "finish_reason")),
    "mt_running_sequences": ("gauge", "sequences (hypotheses) in the running batch", ("model",)),
    "mt_waiting_requests": ("gauge", "sentences waiting in the engine queue", ("model",)),
    "mt_kv_cache_usage_ratio": ("gauge", "fraction of KV-cache blocks in use, 0..1", ("model",)),
    "mt_replicas_ready": ("gauge", "1 per translator replica whose model is loaded and engine running",
                          ("model",)),
    # model pool (recorded by the pool replica; service/pool.py)
    "mt_pool_model_loads_total": ("counter", "models a pool replica loaded on demand, by model and outcome (ok, failed)",
                                  ("model", "outcome")),
    "mt_pool_model_load_seconds": ("histogram", "time to load a model on a pool replica (read, prepare, start its "
                                   "engine), seconds", ("model",)),
    "mt_pool_model_evictions_total": ("counter", "models a pool replica evicted (least recently used), by model",
                                      ("model",)),
    "mt_pool_models_resident": ("gauge", "models resident on a pool replica (the replica label says which)", ()),
    "mt_pool_resident_bytes": ("gauge", "weights and KV caches of the models a pool replica holds, evicted ones "
                               "still draining included, bytes", ()),
    # text preparation (recorded by the translator replica)
    "mt_sentence_split_fallbacks_total": ("counter", "lines cut by the fallback sentence splitter, by reason "
                                          "(error: the segmenter raised; timeout: the text's segmenter time "
                                          "budget was spent)", ("model", "reason")),
    "mt_memory_lookups_total": ("counter", "sentences answered by the translation memory (memory: a stored "
                                "translation), the result cache (cache) or the engine (model), by model",
                                ("model", "result")),
    # documents and language detection (recorded by the ingress replica that answered)
    "mt_documents_total": ("counter", "documents the service finished, by format (the file's extension; other: an "
                           "unsupported one) and outcome (ok; refused: the file was refused before translation; "
                           "failed: translation raised; cancelled: the client left)", ("format", "outcome")),
    "mt_language_detections_total": ("counter", "texts whose language was detected (source auto, /detect, documents), "
                                     "by the detected language (und: none found) and confidence (high: at least "
                                     "50%, low)", ("language", "confidence")),
}

_BUCKETS = {"mt_request_duration_seconds": LATENCY_BUCKETS_S, "mt_queue_wait_seconds": LATENCY_BUCKETS_S,
            "mt_time_to_first_token_seconds": LATENCY_BUCKETS_S, "mt_sentence_duration_seconds": LATENCY_BUCKETS_S,
            "mt_time_per_output_token_seconds": STEP_BUCKETS_S, "mt_prefill_duration_seconds": STEP_BUCKETS_S,
            "mt_decode_step_duration_seconds": STEP_BUCKETS_S, "mt_prefill_batch_size": BATCH_BUCKETS,
            "mt_decode_batch_size": BATCH_BUCKETS, "mt_pool_model_load_seconds": LATENCY_BUCKETS_S}


def _make(name: str):
    kind, desc, tags = METRICS[name]
    if kind == "counter":
        return Counter(name, description=desc, tag_keys=tags)
    if kind == "gauge":
        return Gauge(name, description=desc, tag_keys=tags)
    return Histogram(name, description=desc, boundaries=_BUCKETS[name], tag_keys=tags)


class HttpMetrics:
    """The HTTP-layer metrics; create one per ingress replica (inside the replica)."""

    def __init__(self):
        self.requests = _make("mt_requests_total")
        self.duration = _make("mt_request_duration_seconds")

    def record(self, model: str, endpoint: str, status: int, seconds: float) -> None:
        self.requests.inc(1, tags={"model": model, "endpoint": endpoint, "status": str(status)})
        self.duration.observe(seconds, tags={"model": model, "endpoint": endpoint})


class GuardMetrics:
    """The access guard's decisions (``service.api.middleware.guard``); one per ingress replica."""

    def __init__(self):
        self.requests = _make("mt_guard_requests_total")

    def record(self, key: str, decision: str) -> None:
        self.requests.inc(1, tags={"key": key, "decision": decision})


class DocumentMetrics:
    """Documents finished, refused, failed or cancelled (``service.api.documents``); one per ingress replica."""

    def __init__(self):
        self.documents = _make("mt_documents_total")

    def record(self, fmt: str, outcome: str) -> None:
        self.documents.inc(1, tags={"format": fmt, "outcome": outcome})


class DetectionMetrics:
    """Language detections (``service.pipeline.autodetect``); one per ingress replica. ``language``
    is one of the detector's candidates or ``und``, so the series stay as few as its languages."""

    def __init__(self):
        self.detections = _make("mt_language_detections_total")

    def record(self, language: str, sure: bool) -> None:
        self.detections.inc(1, tags={"language": language, "confidence": "high" if sure else "low"})


class RetryMetrics:
    """The gateway's retries after a lost translator replica (``service.api.backends``); one per ingress replica.

    Every (model, call, outcome) series starts at 0, so a scrape shows the counter before the first
    retry and ``increase()`` sees the first one (Ray's public ``inc`` refuses 0, hence ``_record``).
    """
    CALLS, OUTCOMES = ("translate", "stream", "stream_resumed"), ("ok", "failed")

    def __init__(self, models: list[str]):
        self.retries = _make("mt_replica_retries_total")
        for model in models:
            for call in self.CALLS:
                for outcome in self.OUTCOMES:
                    self.retries._record(0, tags={"model": model, "call": call, "outcome": outcome})

    def record(self, model: str, call: str, ok: bool) -> None:
        self.retries.inc(1, tags={"model": model, "call": call, "outcome": "ok" if ok else "failed"})


class EngineMetrics:
    """The engine metrics of one model; create one per translator replica (inside the replica).

    ``on_step`` / ``on_finish`` are passed to ``Engine`` as callbacks; ``set_state`` refreshes the
    gauges (called after every step and by a periodic task, so idle replicas report zeros).
    """

    def __init__(self, model: str):
        self.tags = {"model": model}
        self.model = model
        for name in ("mt_queue_wait_seconds", "mt_time_to_first_token_seconds", "mt_time_per_output_token_seconds",
                     "mt_sentence_duration_seconds", "mt_prefill_duration_seconds", "mt_decode_step_duration_seconds",
                     "mt_prefill_batch_size", "mt_decode_batch_size", "mt_source_tokens_total",
                     "mt_generated_tokens_total", "mt_sentences_total", "mt_running_sequences",
                     "mt_waiting_requests", "mt_kv_cache_usage_ratio", "mt_replicas_ready",
                     "mt_sentence_split_fallbacks_total", "mt_memory_lookups_total"):
            setattr(self, name[3:], _make(name))

    def on_step(self, step) -> None:
        """Record one engine step (``engine.StepStats``)."""
        t = self.tags
        if step.num_prefill_requests:
            self.prefill_batch_size.observe(step.num_prefill_requests, tags=t)
            self.prefill_duration_seconds.observe(step.prefill_s, tags=t)
            self.source_tokens_total.inc(step.num_prefill_tokens, tags=t)
        if step.num_decode_seqs:
            self.decode_batch_size.observe(step.num_decode_seqs, tags=t)
            self.decode_step_duration_seconds.observe(step.decode_s, tags=t)
        if step.num_scored_rows:
            self.generated_tokens_total.inc(step.num_scored_rows, tags=t)
        self.set_state(step.running_sequences, step.waiting_requests, step.kv_cache_usage)

    def on_finish(self, stats) -> None:
        """Record one finished, cancelled or failed sentence (``engine.RequestStats``)."""
        t = self.tags
        self.sentences_total.inc(1, tags={**t, "finish_reason": stats.finish_reason})
        self.queue_wait_seconds.observe(stats.queue_wait_s, tags=t)
        self.sentence_duration_seconds.observe(stats.total_s, tags=t)
        if stats.status == "ok":
            self.time_to_first_token_seconds.observe(stats.time_to_first_token_s, tags=t)
            if stats.generated_tokens > 1:
                self.time_per_output_token_seconds.observe(stats.decode_s / (stats.generated_tokens - 1), tags=t)

    def set_state(self, running: Optional[int], waiting: Optional[int], kv_cache_usage: Optional[float]) -> None:
        t = self.tags
        if running is not None:
            self.running_sequences.set(running, tags=t)
        if waiting is not None:
            self.waiting_requests.set(waiting, tags=t)
        if kv_cache_usage is not None:
            self.kv_cache_usage_ratio.set(kv_cache_usage, tags=t)

    def set_ready(self, ready: bool) -> None:
        self.replicas_ready.set(1 if ready else 0, tags=self.tags)

    def memory_lookup(self, result: str) -> None:
        """One sentence answered by the memory, the cache or the model (``result``)."""
        self.memory_lookups_total.inc(1, tags={"model": self.model, "result": result})

    def split_fallbacks(self, reasons: list[str]) -> None:
        """Count the lines of one text that the fallback sentence splitter cut (``Split.fallbacks``)."""
        for reason in reasons:
            self.sentence_split_fallbacks_total.inc(1, tags={**self.tags, "reason": reason})


class PoolMetrics:
    """A pool replica's loads, evictions and residency (``service.pool``); one per pool replica."""

    def __init__(self):
        for name in ("mt_pool_model_loads_total", "mt_pool_model_load_seconds", "mt_pool_model_evictions_total",
                     "mt_pool_models_resident", "mt_pool_resident_bytes"):
            setattr(self, name[8:], _make(name))

    def load(self, model: str, outcome: str, seconds: float) -> None:
        self.model_loads_total.inc(1, tags={"model": model, "outcome": outcome})
        if outcome == "ok":
            self.model_load_seconds.observe(seconds, tags={"model": model})

    def evict(self, model: str) -> None:
        self.model_evictions_total.inc(1, tags={"model": model})

    def set_resident(self, models: int, nbytes: int) -> None:
        self.models_resident.set(models)
        self.resident_bytes.set(nbytes)


# ---- GET /metrics: the whole cluster's series ----------------------------------------------------------
async def scrape_metrics(timeout_s: float = 5.0) -> str:
    """The Prometheus text of every alive node's Ray metrics agent (the local one reached on 127.0.0.1).

    Every replica's series are exported by the agent of its node, so this is the whole cluster.
    Raises ServiceError 503 when no agent answers.
    """
    nodes = await asyncio.to_thread(ray.nodes)
    local = ray.get_runtime_context().get_node_id()
    urls = []
    for n in nodes:
        port = n.get("MetricsExportPort")
        if not n.get("Alive") or not port:
            continue
        host = "127.0.0.1" if n.get("NodeID") == local else n.get("NodeManagerAddress")
        urls.append(f"http://{host}:{port}/metrics")
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        texts = await asyncio.gather(*(client.get(u) for u in urls), return_exceptions=True)
    ok = [r.text for r in texts if isinstance(r, httpx.Response) and r.status_code == 200]
    if len(urls) > 0 and not ok:
        raise ServiceError(503, "metrics: no Ray metrics agent answered", retry_after=RETRY_AFTER_S)
    return ok[0] if len(ok) == 1 else merge_prometheus(ok)


def merge_prometheus(texts: list[str]) -> str:
    """Concatenate Prometheus text expositions, keeping one HELP/TYPE per family."""
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                headers.setdefault(family, [])
                if len(headers[family]) < 2 and line not in headers[family]:
                    headers[family].append(line)
                families.setdefault(family, [])
            elif line and not line.startswith("#"):
                families.setdefault(family or line.split("{")[0].split(" ")[0], []).append(line)
    out = []
    for fam, lines in families.items():
        out += headers.get(fam, []) + lines
    return "\n".join(out) + "\n"
