"""Load generator for the translation service: closed and open loop, sweeps, plots, a report.

    python -m service.loadtest --concurrency 16 --duration 30                 # closed loop, 16 users
    python -m service.loadtest --rate 8 --requests 500 --beam-size 1:3,4:1   # open loop, Poisson 8/s
    python -m service.loadtest --rate 4 -d 20 --texts 1:4,3:1 --attention 0.1 --stream --json run.json
    python -m service.loadtest --sweep rate=1,2,4,8 -d 20 --plot sweep.png   # latency/throughput plot
    python -m service.loadtest report --out perf/                            # the README's figures

Closed loop: N users, each sending its next request when its previous one is answered; latency
is measured from the send. Open loop: requests arrive as a Poisson process of rate R whatever
the service does (what exposes queueing); latency is measured from the scheduled arrival, so a
client-side backlog is never hidden (no coordinated omission). Every run is bounded by a request
count and/or a duration, each request by --timeout, and it targets only the URL it is given
(loopback unless --allow-remote).

Rates. ``offered_rate`` (open loop only) and ``achieved_rate`` are the least-squares slopes of the
cumulative count of issued requests, and of successful responses, against time: steady-state
rates that a latency at the edges of the run does not bias. A run keeps up when achieved >= 95% of offered;
the saturation point of a sweep is the highest offered rate that still keeps up.
429 and 503 answers (load shedding) are counted as ``rejected``, apart from ``failed``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gzip
import ipaddress
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence
from urllib.parse import urlsplit

import httpx
import numpy as np

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_SENTENCES = Path(__file__).resolve().parents[1] / "model" / "data" / "multi30k" / "test_2016_flickr.de.gz"
REJECTED_STATUSES = (429, 503)   # load shedding: counted apart from failures
KEEPS_UP = 0.95                  # a run keeps up when achieved_rate >= KEEPS_UP * offered_rate


# ----------------------------------------------------------------------------------------------
# Configuration and the request mix


@dataclass(frozen=True)
class Mix:
    """A discrete distribution over ints, written ``"VALUE[:WEIGHT],..."`` (weights are relative).

    ``Mix.parse("1:3,4:1")`` draws 1 three times as often as 4. Raises ValueError on bad syntax,
    values below 1 or weights that are not positive.
    """
    values: tuple[int, ...]
    weights: tuple[float, ...]

    @classmethod
    def parse(cls, text: str, name: str = "mix") -> "Mix":
        values, weights = [], []
        for part in str(text).split(","):
            value, _, weight = part.strip().partition(":")
            try:
                v, w = int(value), float(weight) if weight else 1.0
            except ValueError:
                raise ValueError(f"{name}: expected VALUE[:WEIGHT],... got {text!r}") from None
            if v < 1 or not (w > 0 and math.isfinite(w)):
                raise ValueError(f"{name}: values must be >= 1 and weights > 0, got {part.strip()!r}")
            values.append(v)
            weights.append(w)
        return cls(tuple(values), tuple(weights))

    def sample(self, rng: random.Random) -> int:
        return self.values[0] if len(self.values) == 1 else rng.choices(self.values, self.weights)[0]

    def __str__(self) -> str:
        return ",".join(f"{v}:{w:g}" for v, w in zip(self.values, self.weights))


@dataclass
class LoadConfig:
    """One load run. Exactly one of concurrency (closed loop) or rate (open loop); at least one of
    requests or duration bounds it."""
    url: str = DEFAULT_URL                 # service base URL; only this host is ever contacted
    path: str = "/v1/translate"            # endpoint that receives the requests
    concurrency: Optional[int] = None      # closed loop: simulated users, one request in flight each
    rate: Optional[float] = None           # open loop: mean Poisson arrival rate, requests/s
    requests: Optional[int] = None         # stop issuing after this many requests
    duration: Optional[float] = None       # stop issuing after this many seconds
    sentences: str = str(DEFAULT_SENTENCES)  # source sentences, one per line, plain or .gz
    texts: str = "1"                       # Mix of texts per request ("1:3,4:1")
    beam_size: str = "4"                   # Mix of beam sizes (the API's default is 4)
    attention: float = 0.0                 # fraction of requests with return_attention
    stream: bool = False                   # Server-Sent Events; measures time to first token
    max_new_tokens: Optional[int] = None   # sent when set; the service's default otherwise
    source_lang: str = "de"
    target_lang: str = "en"
    model: Optional[str] = None            # "model" field of the request, when set
    timeout: float = 60.0                  # total seconds per request, streaming included
    max_inflight: int = 1024               # open loop: arrivals beyond this many in flight are dropped (reported)
    warmup: int = 0                        # requests sent one by one before the run, not counted
    seed: int = 0                          # seeds arrivals, sentences and the mix
    allow_remote: bool = False             # permit a URL that is not a loopback address

    def validate(self) -> None:
        """Raises ValueError naming the field when the run would be unbounded or ill-formed."""
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.requests is None and self.duration is None:
            raise ValueError("a run needs a bound: requests and/or duration")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(f"duration must be > 0 s, got {self.duration}")
        if not 0.0 <= self.attention <= 1.0:
            raise ValueError(f"attention must be a fraction in [0, 1], got {self.attention}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout}")
        if self.max_inflight < 1 or self.warmup < 0:
            raise ValueError("max_inflight must be >= 1 and warmup >= 0")
        Mix.parse(self.texts, "texts")
        Mix.parse(self.beam_size, "beam_size")
        check_url(self.url, self.allow_remote)

    @property
    def loop(self) -> str:
        return "closed" if self.concurrency is not None else "open"


def check_url(url: str, allow_remote: bool = False) -> None:
    """Raises ValueError unless url is http(s) on a loopback host (or allow_remote is set)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be http(s)://HOST[:PORT], got {url!r}")
    if allow_remote:
        return
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ValueError(f"refusing to load {host}: not a loopback address (pass --allow-remote to load it)")


def load_sentences(path: str | os.PathLike) -> list[str]:
    """Non-empty lines of a UTF-8 text file, plain or gzipped (by the .gz suffix).

    Raises FileNotFoundError, or ValueError when the file holds no non-empty line."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no sentences")
    return lines


@dataclass
class RequestSpec:
    """What one request asks for."""
    texts: list[str]           # 1 or more source sentences
    beam_size: int
    return_attention: bool
    stream: bool

    def body(self, cfg: LoadConfig) -> dict[str, Any]:
        """The JSON body for POST /v1/translate."""
        body: dict[str, Any] = {
            "text": self.texts[0] if len(self.texts) == 1 else self.texts,
            "source_lang": cfg.source_lang, "target_lang": cfg.target_lang,
            "beam_size": self.beam_size, "return_attention": self.return_attention, "stream": self.stream,
        }
        if cfg.max_new_tokens is not None:
            body["max_new_tokens"] = cfg.max_new_tokens
        if cfg.model is not None:
            body["model"] = cfg.model
        return body


class RequestMaker:
    """Draws requests from the sentences and the configured mix, reproducibly from the seed."""

    def __init__(self, cfg: LoadConfig, sentences: Sequence[str], rng: random.Random):
        self.cfg, self.sentences, self.rng = cfg, list(sentences), rng
        self.texts, self.beams = Mix.parse(cfg.texts, "texts"), Mix.parse(cfg.beam_size, "beam_size")

    def __call__(self) -> RequestSpec:
        n = self.texts.sample(self.rng)
        return RequestSpec(texts=[self.rng.choice(self.sentences) for _ in range(n)],
                           beam_size=self.beams.sample(self.rng),
                           return_attention=self.rng.random() < self.cfg.attention, stream=self.cfg.stream)


# ----------------------------------------------------------------------------------------------
# Targets: where requests go (the HTTP service, or an engine in this process for comparison)


@dataclass
class Reply:
    """What a target observed for one request."""
    status: Optional[int]                  # HTTP status (200 for the in-process engine); None: no response
    error: Optional[str] = None            # None on success; else the status code or a failure kind
    generated_tokens: int = 0              # usage.generated_tokens of a successful response
    first_token_at: Optional[float] = None  # time.perf_counter() of the first streamed token
    response_bytes: int = 0                # size of the response body


class Target(Protocol):
    async def send(self, spec: RequestSpec) -> Reply: ...
    async def aclose(self) -> None: ...


class HttpTarget:
    """Sends requests to the service with one shared httpx.AsyncClient (keep-alive pool)."""

    def __init__(self, cfg: LoadConfig, max_connections: int):
        check_url(cfg.url, cfg.allow_remote)
        self.cfg = cfg
        # trust_env=False: no proxy from the environment may redirect the load elsewhere.
        self.client = httpx.AsyncClient(
            base_url=cfg.url, trust_env=False, timeout=httpx.Timeout(cfg.timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))
        self._ids = 0

    async def send(self, spec: RequestSpec) -> Reply:
        self._ids += 1
        headers = {"X-Request-ID": f"loadtest-{os.getpid()}-{self._ids}"}
        body = spec.body(self.cfg)
        if not spec.stream:
            r = await self.client.post(self.cfg.path, json=body, headers=headers)
            if r.status_code != 200:
                return Reply(r.status_code, error=str(r.status_code))
            reply = self._parse_final(r.status_code, r.json(), len(spec.texts))
            reply.response_bytes = len(r.content)
            return reply
        async with self.client.stream("POST", self.cfg.path, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Reply(r.status_code, error=str(r.status_code))
            return await self._read_events(r, len(spec.texts))

    async def _read_events(self, r: httpx.Response, n_texts: int) -> Reply:
        """Reads Server-Sent Events: token events, then one final event with the whole response."""
        first_token_at, event, final, nbytes = None, "message", None, 0
        async for line in r.aiter_lines():
            nbytes += len(line) + 1
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if event == "error" or (isinstance(payload, dict) and "error" in payload and "usage" not in payload):
                    return Reply(r.status_code, error="stream_error")
                if isinstance(payload, dict) and "usage" in payload:
                    final = payload
                elif first_token_at is None:
                    first_token_at = time.perf_counter()
            elif not line:
                event = "message"
        if final is None:
            return Reply(r.status_code, error="incomplete_stream")
        reply = self._parse_final(r.status_code, final, n_texts)
        reply.first_token_at = first_token_at or time.perf_counter()  # no token event: output was empty
        reply.response_bytes = nbytes
        return reply

    @staticmethod
    def _parse_final(status: int, data: Any, n_texts: int) -> Reply:
        try:
            if len(data["translations"]) != n_texts:
                return Reply(status, error="invalid_response")
            return Reply(status, generated_tokens=int(data["usage"]["generated_tokens"]))
        except (KeyError, TypeError, ValueError):
            return Reply(status, error="invalid_response")

    async def aclose(self) -> None:
        await self.client.aclose()


class EngineTarget:
    """The continuous-batching engine in this process, without HTTP or Ray Serve: the baseline for
    their overhead. Sentences are encoded as the service does (model.translate.encode_source)."""

    def __init__(self, cfg: LoadConfig, checkpoint: str | os.PathLike, engine_config: Optional[dict] = None,
                 threads: Optional[int] = None):
        import torch
        from model.checkpoint import load_checkpoint
        from service.engine import Engine, EngineConfig
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.model, self.tok, _ = load_checkpoint(checkpoint)
        if torch.cuda.is_available():
            self.model = self.model.cuda()
        from_dict = getattr(EngineConfig, "from_dict", None)
        config = from_dict(engine_config or {}) if from_dict else EngineConfig(**(engine_config or {}))
        self.engine = Engine(self.model, config)
        self._started = False

    async def _ensure_started(self) -> None:
        if not self._started:
            await self.engine.start()
            self._started = True

    def _options(self, spec: RequestSpec):
        from service.engine import GenerationOptions
        kwargs: dict[str, Any] = {"beam_size": spec.beam_size,
                                  "attention_kinds": ("cross",) if spec.return_attention else ()}
        if self.cfg.max_new_tokens is not None:
            kwargs["max_new_tokens"] = self.cfg.max_new_tokens
        return GenerationOptions(**kwargs)

    async def send(self, spec: RequestSpec) -> Reply:
        """Like the service: QueueFullError is a 503, EngineValidationError a 422, other EngineErrors a 500."""
        from service.engine import EngineError, EngineValidationError, QueueFullError
        try:
            return await self._send(spec)
        except QueueFullError:
            return Reply(503, error="503")
        except EngineValidationError:
            return Reply(422, error="422")
        except EngineError:
            return Reply(500, error="500")

    async def _send(self, spec: RequestSpec) -> Reply:
        from model.translate import encode_source
        await self._ensure_started()
        options = self._options(spec)
        srcs = [encode_source(self.tok, text, self.model.cfg.max_len) for text in spec.texts]
        if not spec.stream:
            results = await asyncio.gather(*(self.engine.translate(s, options) for s in srcs))
            return Reply(200, generated_tokens=sum(len(r.hypotheses[0].tokens) for r in results))
        first: list[Optional[float]] = [None]

        async def one(src: list[int]) -> int:
            async for item in self.engine.stream(src, options):
                if isinstance(item, int):
                    first[0] = first[0] or time.perf_counter()
                else:
                    return len(item.hypotheses[0].tokens)
            return 0
        tokens = sum(await asyncio.gather(*(one(s) for s in srcs)))
        return Reply(200, generated_tokens=tokens, first_token_at=first[0] or time.perf_counter())

    async def aclose(self) -> None:
        if self._started:
            await self.engine.stop()


# ----------------------------------------------------------------------------------------------
# The load loops


@dataclass
class Outcome:
    """One request, times in seconds since the run started (time.perf_counter based)."""
    scheduled: float            # when it was due: its Poisson arrival (open) or its send (closed)
    done: float                 # when its response (or error) was complete
    status: Optional[int]       # HTTP status; None when none arrived
    error: Optional[str]        # None on success; the status code ("503") or "timeout", "connection", ...
    generated_tokens: int       # usage.generated_tokens (0 unless successful)
    ttft: Optional[float]       # time to first token, streaming only: first token event - scheduled
    texts: int                  # texts in the request
    response_bytes: int = 0     # size of the response body (successful requests)

    @property
    def latency(self) -> float:
        return self.done - self.scheduled

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class RunResult:
    config: LoadConfig
    outcomes: list[Outcome] = field(default_factory=list)
    issued: int = 0             # requests started (including those still in flight at the end)
    dropped: int = 0            # open loop: arrivals not sent because max_inflight were in flight
    issue_end: float = 0.0      # when the last request was issued (s since start)
    inflight: int = 0           # requests sent and not yet answered (the progress line shows it)
    wall: float = 0.0           # start -> last response, seconds
    stopped_by: str = ""        # "requests" or "duration"

    def summary(self) -> dict[str, Any]:
        return summarize(self)


class Progress:
    """A live progress line on stderr: rewritten in place on a terminal, every few seconds otherwise."""

    def __init__(self, enabled: bool = True, stream=None, label: str = ""):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.5 if self.tty else 5.0
        self.label = label

    def line(self, result: RunResult, now: float, inflight: int) -> str:
        ok = [o for o in result.outcomes if o.ok]
        rejected = sum(1 for o in result.outcomes if o.status in REJECTED_STATUSES)
        failed = len(result.outcomes) - len(ok) - rejected
        p50 = p99 = float("nan")
        if ok:
            p50, p99 = np.percentile([o.latency for o in ok], [50, 99])
        rate = len(ok) / now if now > 0 else 0.0
        return (f"{self.label}{now:6.1f}s  sent {result.issued}  ok {len(ok)}  rejected {rejected}  failed {failed}"
                f"  in flight {inflight}  {rate:.2f} req/s  p50 {p50:.3f}s  p99 {p99:.3f}s")

    def show(self, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


async def run_load(cfg: LoadConfig, target: Optional[Target] = None, progress: Optional[Progress] = None) -> RunResult:
    """Runs one closed- or open-loop load test against target (HTTP to cfg.url by default).

    Returns when the bound is reached and every request issued has completed (each is bounded by
    cfg.timeout). Raises ValueError for an invalid configuration."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    make = RequestMaker(cfg, load_sentences(cfg.sentences), rng)
    own = target is None
    if target is None:
        target = HttpTarget(cfg, cfg.concurrency or cfg.max_inflight)
    result = RunResult(cfg)
    try:
        for _ in range(cfg.warmup):
            await _one(target, make(), cfg.timeout, time.perf_counter(), time.perf_counter())
        t0 = time.perf_counter()
        ticker = asyncio.create_task(_tick(result, progress, t0)) if progress and progress.enabled else None
        try:
            if cfg.loop == "closed":
                await _closed_loop(cfg, target, make, result, t0)
            else:
                await _open_loop(cfg, target, make, result, t0, rng)
        finally:
            if ticker:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
        result.wall = max((o.done for o in result.outcomes), default=time.perf_counter() - t0)
        if progress:
            progress.show(progress.line(result, result.wall, 0), final=True)
    finally:
        if own:
            await target.aclose()
    return result


async def _one(target: Target, spec: RequestSpec, timeout: float, t0: float, scheduled_at: float,
               result: Optional[RunResult] = None) -> Outcome:
    """Sends one request and times it; never raises for the request's own failures."""
    if result is not None:
        result.inflight += 1
    status, error, tokens, first, nbytes = None, None, 0, None, 0
    try:
        reply = await asyncio.wait_for(target.send(spec), timeout)
        status, error, tokens, first = reply.status, reply.error, reply.generated_tokens, reply.first_token_at
        nbytes = reply.response_bytes
    except (asyncio.TimeoutError, httpx.TimeoutException):
        error = "timeout"
    except httpx.TransportError:
        error = "connection"
    except (httpx.HTTPError, ValueError):   # protocol errors, undecodable JSON
        error = "invalid_response"
    except Exception as e:  # noqa: BLE001 - reported by kind in the error counts, never ends the run
        error = type(e).__name__
    finally:
        if result is not None:
            result.inflight -= 1
    done = time.perf_counter()
    return Outcome(scheduled=scheduled_at - t0, done=done - t0, status=status, error=error,
                   generated_tokens=tokens if error is None else 0,
                   ttft=(first - scheduled_at) if (first is not None and error is None) else None,
                   texts=len(spec.texts), response_bytes=nbytes if error is None else 0)


async def _closed_loop(cfg: LoadConfig, target: Target, make: RequestMaker, result: RunResult, t0: float) -> None:
    deadline = t0 + cfg.duration if cfg.duration is not None else math.inf

    async def user() -> None:
        while True:
            if cfg.requests is not None and result.issued >= cfg.requests:
                result.stopped_by = result.stopped_by or "requests"
                return
            now = time.perf_counter()
            if now >= deadline:
                result.stopped_by = result.stopped_by or "duration"
                return
            result.issued += 1
            result.issue_end = now - t0
            result.outcomes.append(await _one(target, make(), cfg.timeout, t0, now, result))

    await asyncio.gather(*(user() for _ in range(cfg.concurrency)))


async def _open_loop(cfg: LoadConfig, target: Target, make: RequestMaker, result: RunResult, t0: float,
                     rng: random.Random) -> None:
    tasks: set[asyncio.Task] = set()
    arrival = 0.0
    while True:
        arrival += rng.expovariate(cfg.rate)     # Poisson process: exponential inter-arrival gaps
        if cfg.duration is not None and arrival >= cfg.duration:
            result.stopped_by = "duration"
            break
        if cfg.requests is not None and result.issued + result.dropped >= cfg.requests:
            result.stopped_by = "requests"
            break
        delay = t0 + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= cfg.max_inflight:
            result.dropped += 1
            continue
        result.issued += 1
        result.issue_end = arrival
        task = asyncio.create_task(_one(target, make(), cfg.timeout, t0, t0 + arrival, result))
        task.add_done_callback(lambda t: (tasks.discard(t), t.cancelled() or result.outcomes.append(t.result())))
        tasks.add(task)
    while tasks:
        await asyncio.gather(*list(tasks))
    if cfg.duration is not None and result.stopped_by == "duration":
        result.issue_end = cfg.duration


async def _tick(result: RunResult, progress: Progress, t0: float) -> None:
    while True:
        await asyncio.sleep(progress.interval)
        progress.show(progress.line(result, time.perf_counter() - t0, result.inflight))


# ----------------------------------------------------------------------------------------------
# Statistics


def slope_rate(times: Sequence[float]) -> Optional[float]:
    """Events per second: the least-squares slope of the cumulative count against event time.

    Unlike count / span, it is not biased by the first and last events (the latency at the edges
    of a run). None with fewer than 3 events or when they all share one time."""
    t = np.sort(np.asarray(times, dtype=float))
    if len(t) < 3 or float(np.ptp(t)) <= 0:
        return None
    n = np.arange(1, len(t) + 1, dtype=float)
    return float(np.polyfit(t, n, 1)[0])


def _pct(values: Sequence[float], qs: Sequence[float]) -> list[Optional[float]]:
    if not len(values):
        return [None] * len(qs)
    return [float(v) for v in np.percentile(np.asarray(values, dtype=float), qs)]


def summarize(result: RunResult) -> dict[str, Any]:
    """The run's figures as a JSON-ready dict (seconds, requests/s, tokens/s)."""
    cfg, outs = result.config, result.outcomes
    ok = [o for o in outs if o.ok]
    errors: dict[str, int] = {}
    for o in outs:
        if o.error is not None:
            errors[o.error] = errors.get(o.error, 0) + 1
    rejected = sum(1 for o in outs if o.status in REJECTED_STATUSES)
    wall = result.wall or 1e-9
    tokens = sum(o.generated_tokens for o in ok)
    lat = _pct([o.latency for o in ok], [50, 90, 99])
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    ttft = _pct(ttfts, [50, 99])
    # Closed loop: users send as fast as they are answered, so no rate is offered independently.
    offered = slope_rate([o.scheduled for o in outs]) if cfg.loop == "open" else None
    achieved = slope_rate([o.done for o in ok])
    issue_window = result.issue_end or wall
    if offered is None and cfg.loop == "open":
        offered = len(outs) / issue_window
    if achieved is None:
        achieved = len(ok) / wall
    return {
        "loop": cfg.loop,
        "concurrency": cfg.concurrency,
        "rate": cfg.rate,
        "requests": len(outs),
        "ok": len(ok),
        "rejected": rejected,                           # 429 + 503
        "failed": len(outs) - len(ok) - rejected,       # every other error
        "dropped": result.dropped,
        "errors": dict(sorted(errors.items())),         # by status code or failure kind
        "texts": sum(o.texts for o in ok),
        "generated_tokens": tokens,
        "response_bytes_mean": float(np.mean([o.response_bytes for o in ok])) if ok else None,
        "duration_s": wall,
        "stopped_by": result.stopped_by,
        "requests_per_s": len(ok) / wall,
        "texts_per_s": sum(o.texts for o in ok) / wall,
        "generated_tokens_per_s": tokens / wall,
        "offered_rate": offered,
        "achieved_rate": achieved,
        "keeps_up": achieved >= KEEPS_UP * offered if offered is not None else None,  # closed loop: n/a
        "latency_s": {"p50": lat[0], "p90": lat[1], "p99": lat[2],
                      "max": max((o.latency for o in ok), default=None),
                      "mean": float(np.mean([o.latency for o in ok])) if ok else None},
        "ttft_s": {"p50": ttft[0], "p99": ttft[1]} if cfg.stream else None,
    }


def _fmt(v: Optional[float], unit: str = "s", digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def format_summary(s: dict[str, Any]) -> str:
    load = f"concurrency {s['concurrency']}" if s["loop"] == "closed" else f"Poisson rate {s['rate']:g}/s"
    lat, lines = s["latency_s"], []
    lines.append(f"{s['loop']} loop, {load}: {s['requests']} requests in {s['duration_s']:.1f} s "
                 f"(stopped by {s['stopped_by'] or 'n/a'})")
    lines.append(f"  ok {s['ok']}  rejected (429/503) {s['rejected']}  failed {s['failed']}"
                 + (f"  dropped by client {s['dropped']}" if s["dropped"] else "")
                 + (f"  errors {s['errors']}" if s["errors"] else ""))
    lines.append(f"  throughput {s['requests_per_s']:.2f} req/s, {s['texts_per_s']:.2f} texts/s, "
                 f"{s['generated_tokens_per_s']:.1f} generated tokens/s")
    verdict = "" if s["keeps_up"] is None else (" (keeps up)" if s["keeps_up"] else " (SATURATED: below 95%)")
    offered = "" if s["offered_rate"] is None else f"offered {s['offered_rate']:.2f} req/s, "
    lines.append(f"  {offered}achieved {s['achieved_rate']:.2f} req/s{verdict}")
    lines.append(f"  latency p50 {_fmt(lat['p50'])}  p90 {_fmt(lat['p90'])}  p99 {_fmt(lat['p99'])}  "
                 f"max {_fmt(lat['max'])}")
    if s["ttft_s"] is not None:
        lines.append(f"  time to first token p50 {_fmt(s['ttft_s']['p50'])}  p99 {_fmt(s['ttft_s']['p99'])}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Sweeps and plots


def saturation(points: Sequence[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The saturation point of a sweep (points sorted by offered load).

    Open loop: the highest offered rate that is still achieved at >= 95% (``keeps_up``). Closed
    loop: the lowest concurrency whose throughput is >= 95% of the highest seen (more users beyond
    it only add latency). None when no point qualifies."""
    if not points:
        return None
    if points[0]["loop"] == "open":
        return max((p for p in points if p["keeps_up"]), key=lambda p: p["rate"], default=None)
    top = max(p["achieved_rate"] for p in points)
    return next(p for p in sorted(points, key=lambda p: p["concurrency"]) if p["achieved_rate"] >= KEEPS_UP * top)


async def run_sweep(cfg: LoadConfig, kind: str, values: Sequence[float], target: Optional[Target] = None,
                    progress: bool = True, log=print) -> list[dict[str, Any]]:
    """Runs cfg once per value of kind ("rate" or "concurrency"); returns the summaries."""
    points = []
    for v in values:
        run_cfg = dataclasses.replace(cfg, rate=float(v) if kind == "rate" else None,
                                      concurrency=int(v) if kind == "concurrency" else None)
        res = await run_load(run_cfg, target, Progress(progress, label=f"[{kind} {v:g}] "))
        s = res.summary()
        log(format_summary(s))
        points.append(s)
    return points


def plot_sweep(points: Sequence[dict[str, Any]], path: str | os.PathLike, title: str = "") -> Path:
    """Writes a PNG: latency percentiles (top) and throughput (bottom) against offered load, the
    saturation point marked. Returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    open_loop = points[0]["loop"] == "open"
    pts = sorted(points, key=lambda p: p["rate"] if open_loop else p["concurrency"])
    x = [p["rate"] if open_loop else p["concurrency"] for p in pts]
    fig, (ax_lat, ax_tp) = plt.subplots(2, 1, sharex=True, figsize=(7, 7))
    for key, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
        ax_lat.plot(x, [p["latency_s"][key] if p["latency_s"][key] is not None else np.nan for p in pts],
                    style, label=f"latency {key}")
    if pts[0]["ttft_s"] is not None:
        ax_lat.plot(x, [p["ttft_s"]["p50"] if p["ttft_s"]["p50"] is not None else np.nan for p in pts], "x:",
                    label="time to first token p50")
    ax_lat.set_ylabel("seconds")
    ax_lat.set_yscale("log")
    ax_lat.grid(True, which="both", alpha=0.3)
    ax_lat.legend(loc="upper left", fontsize=8)
    ax_tp.plot(x, [p["achieved_rate"] for p in pts], "o-", label="achieved requests/s")
    if open_loop:
        ax_tp.plot(x, [p["offered_rate"] for p in pts], "x:", color="gray", label="offered requests/s (measured)")
    ax_tok = ax_tp.twinx()
    ax_tok.plot(x, [p["generated_tokens_per_s"] for p in pts], "d--", color="tab:green", label="generated tokens/s")
    ax_tok.set_ylabel("generated tokens/s")
    ax_tp.set_ylabel("requests/s")
    ax_tp.set_xlabel("offered rate (requests/s, Poisson)" if open_loop else "concurrent users (closed loop)")
    ax_tp.grid(True, alpha=0.3)
    sat = saturation(pts)
    if sat is not None:
        xs = sat["rate"] if open_loop else sat["concurrency"]
        for ax in (ax_lat, ax_tp):
            ax.axvline(xs, color="red", linestyle="--", alpha=0.7)
        ax_tp.annotate(f"saturation: {xs:g}{'/s' if open_loop else ' users'}\n{sat['achieved_rate']:.2f} req/s",
                       (xs, sat["achieved_rate"]), textcoords="offset points", xytext=(8, -28), fontsize=8,
                       color="red")
    lines = ax_tp.get_legend_handles_labels()
    extra = ax_tok.get_legend_handles_labels()
    ax_tp.legend(lines[0] + extra[0], lines[1] + extra[1], loc="lower right", fontsize=8)
    if not open_loop and max(x) >= 8 * min(x):
        ax_tp.set_xscale("log", base=2)
        ax_tp.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    fig.suptitle(title or "translation service under load")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------
# Command line


def _values(text: str) -> tuple[str, list[float]]:
    kind, _, vals = text.partition("=")
    kind = kind.strip()
    if kind not in ("rate", "concurrency") or not vals:
        raise argparse.ArgumentTypeError(f"expected rate=R1,R2,... or concurrency=N1,N2,..., got {text!r}")
    try:
        values = sorted(float(v) for v in vals.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep values must be numbers, got {vals!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("--sweep values must be > 0")
    return kind, values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m service.loadtest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=DEFAULT_URL, help="service base URL (default %(default)s)")
    ap.add_argument("--path", default="/v1/translate", help="endpoint (default %(default)s)")
    loop = ap.add_mutually_exclusive_group()
    loop.add_argument("-c", "--concurrency", type=int, help="closed loop: concurrent users (default 8)")
    loop.add_argument("-r", "--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    ap.add_argument("-n", "--requests", type=int, help="stop after this many requests")
    ap.add_argument("-d", "--duration", type=float, help="stop after this many seconds (default 30 without -n)")
    ap.add_argument("--sentences", default=str(DEFAULT_SENTENCES), help="sentence file, plain or .gz")
    ap.add_argument("--texts", default="1", help="texts per request, a mix VALUE[:WEIGHT],... (default 1)")
    ap.add_argument("--beam-size", default="4", help="beam sizes, a mix VALUE[:WEIGHT],... (default 4)")
    ap.add_argument("--attention", type=float, default=0.0, help="fraction of requests with return_attention")
    ap.add_argument("--stream", action="store_true", help="stream (SSE) and measure time to first token")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--model")
    ap.add_argument("--source-lang", default="de")
    ap.add_argument("--target-lang", default="en")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    ap.add_argument("--max-inflight", type=int, default=1024, help="open loop: in-flight cap (default 1024)")
    ap.add_argument("--warmup", type=int, default=0, help="uncounted requests sent first, one by one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", type=_values, metavar="rate=R1,R2,...|concurrency=N1,N2,...",
                    help="run once per value and plot latency and throughput against offered load")
    ap.add_argument("--plot", default="loadtest_sweep.png", help="PNG written by --sweep (default %(default)s)")
    ap.add_argument("--json", metavar="FILE", help="write the figures (and every sweep point) as JSON")
    ap.add_argument("--engine", metavar="CHECKPOINT",
                    help="load an engine in this process instead of HTTP (the baseline for HTTP overhead)")
    ap.add_argument("--engine-config", default="{}", help="EngineConfig fields as JSON, with --engine")
    ap.add_argument("--threads", type=int, help="torch threads for --engine")
    ap.add_argument("--allow-remote", action="store_true", help="permit a non-loopback --url")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    return ap


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    concurrency = args.concurrency if args.concurrency is not None or args.rate is not None else 8
    duration = args.duration if args.duration is not None or args.requests is not None else 30.0
    return LoadConfig(url=args.url, path=args.path, concurrency=concurrency, rate=args.rate,
                      requests=args.requests, duration=duration, sentences=args.sentences, texts=args.texts,
                      beam_size=args.beam_size, attention=args.attention, stream=args.stream,
                      max_new_tokens=args.max_new_tokens, source_lang=args.source_lang,
                      target_lang=args.target_lang, model=args.model, timeout=args.timeout,
                      max_inflight=args.max_inflight, warmup=args.warmup, seed=args.seed,
                      allow_remote=args.allow_remote)


async def _amain(args: argparse.Namespace, cfg: LoadConfig) -> dict[str, Any]:
    target = None
    if args.engine:
        target = EngineTarget(cfg, args.engine, json.loads(args.engine_config), args.threads)
    try:
        if args.sweep:
            kind, values = args.sweep
            points = await run_sweep(cfg, kind, values, target, progress=not args.quiet)
            sat = saturation(points)
            plot = plot_sweep(points, args.plot, title=f"{kind} sweep: texts {cfg.texts}, beam {cfg.beam_size}")
            print(f"saturation: {_describe_saturation(sat)}; plot written to {plot}")
            return {"config": dataclasses.asdict(cfg), "sweep": kind, "points": points, "saturation": sat,
                    "plot": str(plot)}
        res = await run_load(cfg, target, Progress(not args.quiet))
        s = res.summary()
        print(format_summary(s))
        return {"config": dataclasses.asdict(cfg), "summary": s}
    finally:
        if target is not None:
            await target.aclose()


def _describe_saturation(sat: Optional[dict[str, Any]]) -> str:
    if sat is None:
        return "none of the points kept up"
    load = f"rate {sat['rate']:g}/s" if sat["loop"] == "open" else f"{sat['concurrency']} users"
    return f"{load}, {sat['achieved_rate']:.2f} req/s, {sat['generated_tokens_per_s']:.1f} tokens/s"


# ----------------------------------------------------------------------------------------------
# The performance report: python -m service.loadtest report (README "Performance")

README_MARKER = "<!-- section: performance (loadtest) -->"
README_END = "<!-- /section: performance (loadtest) -->"
SWEEP_FRACTIONS = (0.3, 0.6, 0.8, 0.95, 1.1, 1.3)   # sweep rates, as fractions of the closed-loop capacity


@dataclass
class ReportPlan:
    """Durations and loads of the report's runs; ``scale`` multiplies every duration."""
    scale: float = 1.0
    probe_s: float = 10.0           # closed-loop capacity probe before each sweep
    probe_users: int = 32           # its concurrency (batching off: a quarter, enough to keep one slot busy)
    point_requests: float = 80.0    # a sweep point lasts ~point_requests / capacity seconds ...
    point_s: tuple[float, float] = (10.0, 25.0)   # ... clamped to this range
    half_s: tuple[float, float] = (15.0, 30.0)    # the run at 50% of saturation lasts ~half_requests / rate s
    half_requests: float = 60.0
    fixed_s: float = 10.0           # each closed-loop run of the attention and overhead comparisons
    loaded_users: int = 16          # "under load" concurrency of those comparisons
    budget_s: float = 780.0         # every load run ends by then (shortened or skipped): the report stays < 15 min
    timeout_s: float = 30.0         # per request; also bounds the drain after the budget
    warmup: int = 4                 # uncounted requests before each probe


class _OutOfTime(Exception):
    pass


def _clamp(x: float, lo_hi: tuple[float, float]) -> float:
    return min(max(x, lo_hi[0]), lo_hi[1])


def _round2(x: float) -> float:
    """x rounded to 2 significant digits (readable sweep rates)."""
    return float(f"{x:.2g}")


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeApp:
    """A Ray instance and the service's Serve app, started by the report on free 127.0.0.1 ports.

    ``close()`` shuts down only what this started (serve.shutdown + ray.shutdown; never `ray stop`)."""

    def __init__(self, num_cpus: Optional[int] = None):
        import ray
        from ray import serve
        self.port = _free_port()
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 _metrics_export_port=_free_port(), log_to_driver=False, namespace="mt-loadtest-report")
        try:
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": self.port})
            except ray.exceptions.RayActorError:
                # On a busy machine the HTTP proxy can miss its readiness checks; the controller then
                # restarts it and start() gives up. Connect to that controller; deploy() waits for HTTP.
                serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        except BaseException:
            ray.shutdown()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def deploy(self, app_args: dict, timeout_s: float = 300.0) -> None:
        """(Re)deploys build_app(app_args) and waits until /readyz answers and /v1/models shows the
        engine settings of app_args["engine"]. Raises RuntimeError after timeout_s."""
        from ray import serve
        from service.deployment import build_app
        serve.run(build_app(app_args), name="mt", route_prefix="/", blocking=False)
        want = app_args.get("engine", {})
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
                    if client.get("/readyz").status_code == 200:
                        engine = client.get("/v1/models").json()["data"][0].get("engine", {})
                        if all(engine.get(k) == v for k, v in want.items()):
                            return
                time.sleep(0.5)
        raise RuntimeError(f"the service did not become ready with engine {want} within {timeout_s:.0f} s")

    def close(self) -> None:
        import ray
        from ray import serve
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _cmd(cfg: LoadConfig, sweep: str = "", engine: bool = False) -> str:
    """The command line that repeats a report run against a service at $URL (or the engine alone)."""
    parts = ["python -m service.loadtest", "--engine $CHECKPOINT --threads $THREADS" if engine else "--url $URL"]
    if sweep:
        parts.append(sweep)
    elif cfg.concurrency is not None:
        parts.append(f"-c {cfg.concurrency}")
    else:
        parts.append(f"-r {cfg.rate:g}")
    if cfg.duration is not None:
        parts.append(f"-d {cfg.duration:g}")
    if cfg.requests is not None:
        parts.append(f"-n {cfg.requests}")
    parts.append(f"--beam-size {cfg.beam_size}")
    if cfg.texts != "1":
        parts.append(f"--texts {cfg.texts}")
    if cfg.attention:
        parts.append(f"--attention {cfg.attention:g}")
    if cfg.stream:
        parts.append("--stream")
    if cfg.warmup:
        parts.append(f"--warmup {cfg.warmup}")
    parts.append(f"--timeout {cfg.timeout:g} --seed {cfg.seed}")
    return " ".join(parts)


class Report:
    """Runs the report's phases within the plan's time budget and keeps every figure (``self.data``)."""

    def __init__(self, out: Path, checkpoint: str, plan: ReportPlan, quiet: bool = False):
        self.out, self.checkpoint, self.plan, self.quiet = out, checkpoint, plan, quiet
        self.t0 = time.monotonic()
        self.deadline = self.t0 + plan.budget_s
        self.data: dict[str, Any] = {"skipped": [], "shortened": [], "commands": {}}

    def log(self, text: str) -> None:
        if not self.quiet:
            print(text, flush=True)

    def run(self, cfg: LoadConfig, target=None, name: str = "") -> dict[str, Any]:
        """One load run, shortened to end by the deadline; raises _OutOfTime when under 3 s are left."""
        left = self.deadline - time.monotonic()
        if left < 3.0:
            raise _OutOfTime(name)
        if cfg.duration is not None and cfg.duration > left:
            self.data["shortened"].append(name)
            cfg = dataclasses.replace(cfg, duration=round(left, 1))
        res = asyncio.run(self._run(cfg, target))
        s = res.summary()
        self.log(format_summary(s))
        return s

    async def _run(self, cfg: LoadConfig, target) -> RunResult:
        target = target() if callable(target) else target
        try:
            return await run_load(cfg, target, Progress(not self.quiet))
        finally:
            if target is not None:
                await target.aclose()

    def phase(self, key: str, fn, *args) -> None:
        """Runs fn(*args) -> entry into data[key]; a phase out of time keeps what it measured."""
        entry: dict[str, Any] = {}
        try:
            fn(entry, *args)
        except _OutOfTime:
            self.data["skipped"].append(key if not entry else f"{key} (partly)")
            self.log(f"[report] time budget spent: {key} {'cut short' if entry else 'skipped'}")
        if entry:
            self.data[key] = entry

    def sweep(self, entry: dict, title: str, base: LoadConfig, users: int) -> None:
        """Capacity probe (closed loop), Poisson sweep around it, then a run at 50% of saturation."""
        p, key = self.plan, self._current_key
        entry["title"] = title
        self.log(f"[report] {title}: capacity probe, {users} users")
        probe_cfg = dataclasses.replace(base, concurrency=users, rate=None, duration=p.probe_s * p.scale,
                                        warmup=p.warmup)
        entry["probe"] = probe = self.run(probe_cfg, name=f"{title}: probe")
        entry["commands"] = {"probe": _cmd(probe_cfg)}
        capacity = max(probe["achieved_rate"], 1e-3)
        rates = sorted({_round2(capacity * f) for f in SWEEP_FRACTIONS})
        duration = round(_clamp(p.point_requests / capacity, p.point_s) * p.scale, 1)
        sweep_cfg = dataclasses.replace(base, concurrency=None, rate=rates[0], duration=duration)
        entry.update(capacity_estimate=capacity, rates=rates, duration_s=duration, points=[])
        entry["commands"]["sweep"] = _cmd(sweep_cfg, "--sweep rate=" + ",".join(f"{r:g}" for r in rates)
                                          + f" --plot sweep_{key}.png")
        self.log(f"[report] {title}: Poisson sweep over {rates} req/s, {duration:g} s each")
        try:
            for r in rates:
                entry["points"].append(self.run(dataclasses.replace(sweep_cfg, rate=r), name=f"{title}: rate {r:g}"))
        finally:
            if entry["points"]:
                entry["saturation"] = saturation(entry["points"])
                entry["plot"] = str(plot_sweep(entry["points"], self.out / f"sweep_{key}.png", title=title))
        if entry["saturation"] is not None:
            half_rate = entry["saturation"]["rate"] / 2
            half_cfg = dataclasses.replace(base, concurrency=None, rate=half_rate,
                                           duration=round(_clamp(p.half_requests / half_rate, p.half_s) * p.scale, 1))
            self.log(f"[report] {title}: 50% of saturation, {half_rate:g} req/s")
            entry["commands"]["half"] = _cmd(half_cfg)
            entry["half"] = self.run(half_cfg, name=f"{title}: 50%")

    def runs(self, entry: dict, cfgs: dict[str, LoadConfig], targets: Optional[dict[str, Any]] = None) -> None:
        for name, cfg in cfgs.items():
            self.log(f"[report] {self._current_key}: {name}")
            self.data["commands"][f"{self._current_key}/{name}"] = _cmd(cfg, engine=name.startswith("engine"))
            entry[name] = self.run(cfg, (targets or {}).get(name), name=f"{self._current_key}/{name}")

    def __call__(self, key: str, fn, *args) -> None:
        self._current_key = key   # names the plot and the commands of the phase
        self.phase(key, fn, *args)
        self.save()

    def save(self) -> None:
        """Writes report.json (after every phase, so an interrupted report keeps what it measured)."""
        self.data["elapsed_s"] = time.monotonic() - self.t0
        self.data["plan"] = dataclasses.asdict(self.plan)
        (self.out / "report.json").write_text(json.dumps(self.data, indent=2) + "\n")


def machine_facts(checkpoint: str) -> dict[str, Any]:
    import platform
    facts: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                             "date": time.strftime("%Y-%m-%d %H:%M %Z"), "checkpoint": str(checkpoint)}
    with contextlib.suppress(OSError):
        facts["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(Exception):
        import torch
        facts["torch"] = torch.__version__
        facts["cuda"] = torch.cuda.is_available()
    with contextlib.suppress(Exception):
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
        facts["model"] = {k: cfg[k] for k in ("d_model", "n_heads", "d_ff", "n_encoder_layers", "n_decoder_layers",
                                               "vocab_size") if k in cfg}
    return facts


def run_report(out: Path, checkpoint: str, plan: ReportPlan, quiet: bool = False,
               sentences: str = str(DEFAULT_SENTENCES)) -> dict[str, Any]:
    """Starts the service (its default deployment, serving checkpoint), measures every README figure
    within plan.budget_s, and writes report.json and the plots into out. Returns the report data.

    Phases, most important first: greedy with continuous batching; the same with batching off
    (``max_running_requests`` = 1, applied by reconfigure); beam 4; return_attention and the engine
    alone at 1 and ``loaded_users`` users; streaming at 50% of the greedy saturation."""
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out, checkpoint, plan, quiet)
    rep.data["machine"] = machine_facts(checkpoint)
    from service.deployment import AppArgs
    defaults = AppArgs()
    threads = max(1, round(defaults.num_cpus))      # what a translator replica gives torch
    rep.data["service"] = {"num_cpus_per_replica": defaults.num_cpus, "torch_threads_per_replica": threads,
                           "replicas": 1, "ingress": defaults.ingress}
    models = [{"name": "de-en", "checkpoint": str(checkpoint)}]
    batching = {"models": models, "engine": {"max_running_requests": None}}
    no_batching = {"models": models, "engine": {"max_running_requests": 1}}
    app = ServeApp()
    try:
        rep.log(f"[report] service on {app.url}: continuous batching (default engine config)")
        app.deploy(batching)
        base = LoadConfig(url=app.url, duration=plan.fixed_s * plan.scale, sentences=sentences, beam_size="1",
                          timeout=plan.timeout_s, seed=1)
        rep("batching_greedy", rep.sweep, "continuous batching, greedy", base, plan.probe_users)
        if time.monotonic() < rep.deadline - 10:
            rep.log("[report] same service, batching off: max_running_requests = 1")
            app.deploy(no_batching)
            rep("no_batching_greedy", rep.sweep, "batching off (max_running_requests=1), greedy", base,
                max(4, plan.probe_users // 4))
            rep.log("[report] continuous batching again")
            app.deploy(batching)
        rep("batching_beam4", rep.sweep, "continuous batching, beam 4", dataclasses.replace(base, beam_size="4"),
            plan.probe_users)
        c1 = dataclasses.replace(base, concurrency=1, warmup=2)
        cn = dataclasses.replace(base, concurrency=plan.loaded_users, warmup=2)
        rep("attention", rep.runs, {"off_1": c1, "on_1": dataclasses.replace(c1, attention=1.0),
                                           "off_n": cn, "on_n": dataclasses.replace(cn, attention=1.0)})
        rep("overhead", rep.runs, {"engine_1": c1, "engine_n": cn},
            {"engine_1": lambda: EngineTarget(c1, checkpoint, {}, threads),
             "engine_n": lambda: EngineTarget(cn, checkpoint, {}, threads)})
        sat = rep.data.get("batching_greedy", {}).get("saturation")
        if sat is not None:
            rate = sat["rate"] / 2
            cfg = dataclasses.replace(base, rate=rate, stream=True,
                                      duration=round(_clamp(plan.half_requests / rate, plan.half_s) * plan.scale, 1))
            rep("stream_greedy_half", rep.runs, {"stream": cfg})
    finally:
        app.close()
    rep.save()
    return rep.data


def _ms(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"


def _describe_model(m: dict[str, Any]) -> str:
    from model.checkpoint import DEFAULT_CHECKPOINT
    c = m.get("model", {})
    what = "the shipped model" if Path(m["checkpoint"]).resolve() == DEFAULT_CHECKPOINT.resolve() else f"`{m['checkpoint']}`"
    if not c:
        return what
    return (f"{what} (d_model {c.get('d_model')}, {c.get('n_heads')} heads, d_ff {c.get('d_ff')}, "
            f"{c.get('n_encoder_layers')}+{c.get('n_decoder_layers')} layers, vocabulary {c.get('vocab_size')})")


def report_markdown(data: dict[str, Any], out: Path, readme_dir: Path, command: str) -> str:
    """The README "Performance" section for report data (plots linked relative to readme_dir).
    Phases missing from data (out of time) are left out and named at the end."""
    m, svc = data["machine"], data["service"]
    lines = ["## Performance", "",
             f"Measured with the load generator (`python -m service.loadtest`) on this machine: {m['cpus']} CPU cores, "
             f"{'a GPU' if m.get('cuda') else 'no GPU'}, load average {m.get('load_average_at_start')} when the run "
             f"started ({m.get('date', '')}), serving {_describe_model(m)}, with sentences from test_2016_flickr "
             f"(German). The service ran its default deployment: the HTTP ingress and one translator replica with "
             f"{svc['num_cpus_per_replica']} CPU ({svc['torch_threads_per_replica']} torch thread). One command "
             "produced every figure below. It starts the service on a free 127.0.0.1 port, runs each measurement "
             "within fixed bounds, and writes the plots and `report.json`:", "",
             "```bash", command, "```", "",
             "Saturation is the highest offered Poisson rate that is still achieved at ≥ 95%. Achieved and offered "
             "rates are least-squares slopes of completions and arrivals over time. Latencies are measured from the "
             "scheduled arrival, so queueing in front of the service counts. The load generator shares the cores "
             "with the service, like a client on the same host."]

    sweeps = [(k, label) for k, label in (("batching_greedy", "continuous batching, greedy"),
                                          ("no_batching_greedy", "batching off (`max_running_requests` = 1), greedy"),
                                          ("batching_beam4", "continuous batching, beam 4"))
              if data.get(k, {}).get("points")]
    if sweeps:
        lines += ["", "### Continuous batching against batching off, greedy against beam 4", "",
                  "| service | saturation (offered req/s) | achieved there | peak achieved | "
                  "p50 / p99 at 50% of saturation |", "|---|---|---|---|---|"]
        for k, label in sweeps:
            e = data[k]
            sat, lat = e.get("saturation"), (e.get("half") or {}).get("latency_s", {})
            peak = max(p["achieved_rate"] for p in e["points"])
            if sat is None:
                lines.append(f"| {label} | none of {e['rates']} kept up | | {peak:.2f} req/s | |")
            else:
                lines.append(f"| {label} | {sat['rate']:g} | {sat['achieved_rate']:.2f} req/s, "
                             f"{sat['generated_tokens_per_s']:.0f} tokens/s | {peak:.2f} req/s | "
                             f"{_ms(lat.get('p50'))} / {_ms(lat.get('p99'))} |")
        g, n, b = (data.get(k, {}).get("saturation") for k in ("batching_greedy", "no_batching_greedy", "batching_beam4"))
        lines.append("")
        if g and n:
            lines.append(f"Continuous batching sustains {g['achieved_rate'] / n['achieved_rate']:.1f}× the request "
                         "rate of the same service with batching switched off.")
        if g and b:
            lines.append(f"Beam 4 saturates at {b['achieved_rate'] / g['achieved_rate']:.2f}× the greedy request rate "
                         f"({b['generated_tokens_per_s']:.0f} against {g['generated_tokens_per_s']:.0f} returned "
                         "tokens/s): each beam-4 sentence keeps four hypotheses in the batch.")
        lines += ["", " ".join(f"![{data[k]['title']}]({os.path.relpath(data[k]['plot'], readme_dir)})"
                               for k, _ in sweeps), "",
                  "Each row is a closed-loop capacity probe, a Poisson sweep around it, and a run at half the "
                  "saturation rate. Against a running service at $URL the same runs are:", "", "```bash"]
        for k, _ in sweeps:
            lines += [f"# {data[k]['title']}"] + [data[k]["commands"][c] for c in ("probe", "sweep", "half")
                                                  if c in data[k].get("commands", {})]
        lines += ["```", "Batching off is the same deployment with the engine setting `max_running_requests: 1` "
                         "(`build_app` args `engine`, applied to the replica through `user_config`)."]
    s = data.get("stream_greedy_half", {}).get("stream")
    if s and s.get("ttft_s"):
        lines += ["", f"Streaming (SSE) greedy requests at {s['rate']:g} req/s (half the greedy saturation): time to "
                      f"first token p50 {_ms(s['ttft_s']['p50'])}, p99 {_ms(s['ttft_s']['p99'])}; whole response p50 "
                      f"{_ms(s['latency_s']['p50'])}, p99 {_ms(s['latency_s']['p99'])}."]
    a = data.get("attention", {})
    if all(k in a for k in ("off_1", "on_1", "off_n", "on_n")):
        n_users = a["off_n"]["concurrency"]
        lines += ["", "### The cost of `return_attention`", "",
                  "Greedy, closed loop; attention on returns the cross-attention of every layer and head.", "",
                  "| users | attention | latency p50 | latency p99 | requests/s | mean response size |",
                  "|---|---|---|---|---|---|"]
        for k in ("off_1", "on_1", "off_n", "on_n"):
            r = a[k]
            lines.append(f"| {r['concurrency']} | {k[:-2]} | {_ms(r['latency_s']['p50'])} | {_ms(r['latency_s']['p99'])} "
                         f"| {r['requests_per_s']:.2f} | {(r['response_bytes_mean'] or 0) / 1024:.1f} KiB |")
        lines += ["", f"With attention, {n_users} users get {a['on_n']['requests_per_s'] / a['off_n']['requests_per_s']:.2f}× "
                      f"the throughput, and one user's p50 latency is "
                      f"{a['on_1']['latency_s']['p50'] / a['off_1']['latency_s']['p50']:.2f}× that without."]
    o = data.get("overhead", {})
    if all(k in o for k in ("engine_1", "engine_n")) and all(k in a for k in ("off_1", "off_n")):
        lines += ["", "### HTTP and Ray Serve overhead: the engine alone against the same engine through HTTP", "",
                  "The engine alone runs inside the load generator's process (`--engine`): same checkpoint, same "
                  "torch thread count as a replica, default engine settings. The HTTP rows are the attention-off "
                  "runs above.", "",
                  "| greedy, closed loop | latency p50 | latency p99 | requests/s | tokens/s |", "|---|---|---|---|---|"]
        for label, r in (("engine alone, 1 user", o["engine_1"]), ("HTTP + Ray Serve, 1 user", a["off_1"]),
                         (f"engine alone, {o['engine_n']['concurrency']} users", o["engine_n"]),
                         (f"HTTP + Ray Serve, {a['off_n']['concurrency']} users", a["off_n"])):
            lines.append(f"| {label} | {_ms(r['latency_s']['p50'])} | {_ms(r['latency_s']['p99'])} | "
                         f"{r['requests_per_s']:.2f} | {r['generated_tokens_per_s']:.0f} |")
        d1 = a["off_1"]["latency_s"]["p50"] - o["engine_1"]["latency_s"]["p50"]
        lines += ["", f"HTTP and Ray Serve add {d1 * 1000:.0f} ms to one user's p50 latency. Under load the service "
                      f"answers {a['off_n']['requests_per_s'] / o['engine_n']['requests_per_s']:.2f}× the requests/s of "
                      f"the engine alone ({o['engine_n']['requests_per_s']:.2f} → {a['off_n']['requests_per_s']:.2f}); "
                      "on two cores the proxy, the ingress and the client take CPU time from the engine."]
    cmds = data.get("commands", {})
    if cmds:
        lines += ["", "The comparison runs, against a running service at $URL (or the engine alone, with $CHECKPOINT "
                      "and a replica's $THREADS):", "", "```bash", *cmds.values(), "```"]
    if data.get("skipped") or data.get("shortened"):
        lines += ["", f"Out of the time budget: skipped {data.get('skipped') or 'nothing'}, shortened "
                      f"{data.get('shortened') or 'nothing'}."]
    lines += ["", f"The whole report took {data['elapsed_s'] / 60:.1f} minutes."]
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, section: str) -> None:
    """Replaces the performance section of readme: the text from README_MARKER to README_END (or
    just the marker line, the first time). Raises ValueError when the marker is missing."""
    text = readme.read_text()
    start = text.find(README_MARKER)
    if start < 0:
        raise ValueError(f"{readme}: no {README_MARKER!r} marker")
    end_at = text.find(README_END, start)
    end = end_at + len(README_END) if end_at >= 0 else start + len(README_MARKER)
    readme.write_text(text[:start] + README_MARKER + "\n" + section + README_END + text[end:])


def report_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.loadtest report",
                                 description="Measure the README 'Performance' figures in one bounded run: starts "
                                             "the service itself on a free 127.0.0.1 port (its own Ray instance).")
    from model.checkpoint import DEFAULT_CHECKPOINT
    ap.add_argument("--out", default="deploy/performance", help="plots, report.json, performance.md (default %(default)s)")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="served model (default: the shipped one)")
    ap.add_argument("--sentences", default=str(DEFAULT_SENTENCES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every run's duration (0.3 = a quick try)")
    ap.add_argument("--budget", type=float, default=ReportPlan.budget_s,
                    help="seconds by which every load run has ended, shortened or skipped if need be (default "
                         "%(default)g; with service start-up and shut-down the report stays under 15 minutes)")
    ap.add_argument("--readme", help="also replace the performance section of this README")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(list(argv))
    if not (args.scale > 0 and args.budget > 0):
        ap.error("--scale and --budget must be > 0")
    if not (Path(args.checkpoint) / "config.json").exists():
        ap.error(f"--checkpoint {args.checkpoint}: no config.json there")
    out = Path(args.out)
    plan = ReportPlan(scale=args.scale, budget_s=args.budget)
    data = run_report(out, args.checkpoint, plan, args.quiet, args.sentences)
    command = "python -m service.loadtest report" + (" " + shlex.join(argv) if argv else "")
    readme_dir = Path(args.readme).resolve().parent if args.readme else out.resolve()
    (out / "performance.md").write_text(report_markdown(data, out.resolve(), out.resolve(), command))
    if args.readme:
        update_readme(Path(args.readme), report_markdown(data, out.resolve(), readme_dir, command))
    print(f"report written to {out}/ (report.json, performance.md, plots) in {data['elapsed_s'] / 60:.1f} min")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        return report_main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    cfg = config_from_args(args)
    if args.engine:
        cfg.url = DEFAULT_URL   # unused: the engine runs in this process
    try:
        cfg.validate()
    except ValueError as e:
        ap.error(str(e))
    out = asyncio.run(_amain(args, cfg))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
