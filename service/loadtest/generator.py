"""The load loops. Closed loop: N users, each sending its next request when its previous one is
answered; latency is measured from the send. Open loop: requests arrive as a Poisson process of
rate R whatever the service does (what exposes queueing); latency is measured from the scheduled
arrival, so a client-side backlog is never hidden (no coordinated omission). Every run is bounded
by a request count and/or a duration, each request by ``LoadConfig.timeout``."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import aiohttp
import numpy as np

from .config import REJECTED_STATUSES, LoadConfig, RequestMaker, RequestSpec, load_sentences
from .stats import format_summary, summarize
from .targets import HttpTarget, Target


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
    except asyncio.TimeoutError:            # aiohttp's own time-outs are asyncio.TimeoutError too
        error = "timeout"
    except aiohttp.ClientConnectionError:
        error = "connection"
    except (aiohttp.ClientError, ValueError):   # protocol errors, undecodable JSON or UTF-8
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
