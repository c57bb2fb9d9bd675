"""A load run's figures: percentiles, steady-state rates (least-squares slopes), the summary dict,
its text form, and the saturation point of a sweep.

``offered_rate`` (open loop only) and ``achieved_rate`` are the least-squares slopes of the
cumulative count of issued requests, and of successful responses, against time: steady-state
rates that a latency at the edges of the run does not bias. A run keeps up when achieved >= 95%
of offered; the saturation point of a sweep is the highest offered rate that still keeps up.
429 and 503 answers (load shedding) are counted as ``rejected``, apart from ``failed``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from .config import KEEPS_UP, REJECTED_STATUSES

if TYPE_CHECKING:
    from .generator import RunResult


def slope_rate(times: Sequence[float]) -> Optional[float]:
    """Events per second: the least-squares slope of the cumulative count against event time.

    Unlike count / span, it is not biased by the first and last events (the latency at the edges
    of a run). None with fewer than 3 events or when they all share one time."""
    t = np.sort(np.asarray(times, dtype=float))
    if len(t) < 3 or float(np.ptp(t)) <= 0:
        return None
    n = np.arange(1, len(t) + 1, dtype=float)
    return float(np.polyfit(t, n, 1)[0])


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[Optional[float]]:
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
    lat = percentiles([o.latency for o in ok], [50, 90, 99])
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    ttft = percentiles(ttfts, [50, 99])
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
