"""service/loadtest/stats.py: steady-state rates, percentiles, the summary and a sweep's saturation."""
from __future__ import annotations

import pytest

from service.loadtest import (KEEPS_UP, LoadConfig, Outcome, RunResult, format_summary, percentiles, saturation,
                              slope_rate)


def test_slope_rate_is_unbiased_by_edges():
    times = [0.5 + i / 8 for i in range(80)]                   # 8 events/s
    assert slope_rate(times) == pytest.approx(8.0)
    # The same events, each delayed by its own latency (bounded, not growing): still ~8/s,
    # where count / span would be biased by the latencies of the first and last events.
    delayed = [t + (0.9 if i in (0, 79) else 0.3) for i, t in enumerate(times)]
    assert slope_rate(delayed) == pytest.approx(8.0, rel=0.03)
    assert slope_rate([1.0, 2.0]) is None


def test_summary_counts_rejections_apart_from_failures():
    outs = [Outcome(scheduled=i * 0.5, done=i * 0.5 + 0.2, status=200, error=None, generated_tokens=10, ttft=None,
                    texts=1, response_bytes=100) for i in range(10)]
    outs += [Outcome(5.0, 5.1, 503, "503", 0, None, 1), Outcome(5.2, 5.3, 429, "429", 0, None, 1),
             Outcome(5.4, 65.4, None, "timeout", 0, None, 1)]
    res = RunResult(LoadConfig(rate=2.0, duration=6.0), outs, issued=len(outs), issue_end=5.4, wall=65.4,
                    stopped_by="duration")
    s = res.summary()
    assert (s["requests"], s["ok"], s["rejected"], s["failed"]) == (13, 10, 2, 1)
    assert s["errors"] == {"429": 1, "503": 1, "timeout": 1} and s["generated_tokens"] == 100
    assert s["latency_s"]["p50"] == pytest.approx(0.2) and s["response_bytes_mean"] == 100
    assert s["keeps_up"] == (s["achieved_rate"] >= KEEPS_UP * s["offered_rate"])
    text = format_summary(s)
    assert "13 requests" in text and "rejected (429/503) 2" in text and "latency p50 0.200s" in text
    assert percentiles([], [50, 99]) == [None, None]


def test_saturation_of_open_and_closed_sweeps():
    def point(rate, achieved):
        return {"loop": "open", "rate": rate, "achieved_rate": achieved, "keeps_up": achieved >= KEEPS_UP * rate}
    points = [point(1, 1.0), point(2, 1.99), point(4, 3.0)]
    assert saturation(points)["rate"] == 2 and saturation([point(4, 3.0)]) is None and saturation([]) is None
    closed = [{"loop": "closed", "concurrency": c, "achieved_rate": a} for c, a in ((1, 2.0), (4, 7.7), (16, 8.0))]
    assert saturation(closed)["concurrency"] == 4     # 7.7 >= 95% of the best (8.0)
