"""The load generator (service/loadtest/) against the real running service (``service_url``).

- its counts agree with the service's Prometheus counters (GET /metrics);
- it stops by itself at its request-count and duration bounds (closed and open loop, CLI too);
- it reports 503s as rejections when the service is overloaded (the shared service's second model
  has tiny engine and Serve queues, see conftest.SECOND_ENGINE / SECOND_DEPLOYMENT).
The parts that need no service are tested in test_loadtest_config.py, _stats.py and _report.py.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from conftest import DATA, ROOT, SECOND_MODEL, family_samples
from service.loadtest import KEEPS_UP, LoadConfig, load_sentences, plot_sweep, run_load, run_sweep, saturation

GERMAN = str(DATA / "test_2016_flickr.de.gz")
ENGLISH = str(DATA / "test_2016_flickr.en.gz")
REQUESTS = "ray_mt_requests_total"
GENERATED = "ray_mt_generated_tokens_total"
SENTENCES = "ray_mt_sentences_total"


# ---- helpers: the service's Prometheus counters ------------------------------------------------
def scrape(url: str) -> list:
    """The samples of the service's own series (``ray_mt_*``; the rest of the text is Ray's, and
    megabytes after a run of every route)."""
    r = httpx.get(url + "/metrics", timeout=10, trust_env=False)
    r.raise_for_status()
    return list(family_samples(r.text, "ray_mt_"))


def total(samples: list, name: str, **labels: str) -> float:
    """Sum of the samples of one series name whose labels include labels (over replicas)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def counters(url: str, model: str) -> dict[str, float]:
    samples = scrape(url)
    translate = {"model": model, "endpoint": "/v1/translate"}
    return {"200": total(samples, REQUESTS, status="200", **translate),
            "503": total(samples, REQUESTS, status="503", **translate),
            "all": total(samples, REQUESTS, **translate),
            "generated": total(samples, GENERATED, model=model),
            "eos": total(samples, SENTENCES, model=model, finish_reason="eos")}


def settled(url: str, model: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Counters once two scrapes 1.5 s apart agree (Ray exports them every second or so)."""
    deadline, last = time.monotonic() + timeout_s, counters(url, model)
    while time.monotonic() < deadline:
        time.sleep(1.5)
        now = counters(url, model)
        if now == last:
            return now
        last = now
    return last


def wait_for(url: str, model: str, check, timeout_s: float = 30.0) -> dict[str, float]:
    """Polls the counters until check(counters) holds or timeout_s passes; returns the last ones."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = counters(url, model)
        if check(now) or time.monotonic() > deadline:
            return now
        time.sleep(1.0)


# ---- against the real service -------------------------------------------------------------------
@pytest.mark.slow
def test_counts_agree_with_prometheus(service_url):
    before = settled(service_url, "de-en")
    # Greedy requests, so that the engine's scored-token counter is exactly the returned tokens plus
    # one EOS per sentence that ended with it. A mix of 1 and 3 texts, some with attention (closed
    # loop), then streamed requests (open loop).
    closed = asyncio.run(run_load(LoadConfig(url=service_url, concurrency=4, duration=3.0, sentences=GERMAN,
                                             texts="1:2,3:1", beam_size="1", attention=0.25, seed=3)))
    stream = asyncio.run(run_load(LoadConfig(url=service_url, rate=4.0, duration=2.0, sentences=GERMAN,
                                             beam_size="1", stream=True, seed=4)))
    a, b = closed.summary(), stream.summary()
    assert a["ok"] >= 4 and b["ok"] >= 1 and a["failed"] == b["failed"] == a["rejected"] == b["rejected"] == 0
    assert a["requests"] == len(closed.outcomes) == closed.issued and b["requests"] == stream.issued
    ok = a["ok"] + b["ok"]
    tokens = a["generated_tokens"] + b["generated_tokens"]
    assert tokens > 0
    # Every streamed request has its time to first token, before its last byte.
    assert all(o.ttft is not None and 0 < o.ttft <= o.latency for o in stream.outcomes)
    assert b["ttft_s"]["p50"] <= b["latency_s"]["p50"]

    def agrees(now: dict) -> bool:
        return (now["200"] - before["200"] == ok and now["all"] - before["all"] == ok
                and now["generated"] - before["generated"] == tokens + (now["eos"] - before["eos"]))

    now = wait_for(service_url, "de-en", agrees)
    delta = {k: now[k] - before[k] for k in now}
    assert delta["200"] == ok, (delta, ok)
    assert delta["all"] == ok, delta                      # no other status was recorded
    assert delta["generated"] == tokens + delta["eos"], (delta, tokens)


@pytest.mark.slow
def test_stops_at_its_bounds(service_url):
    # Request count, closed loop: exactly n requests, whatever the concurrency.
    res = asyncio.run(asyncio.wait_for(run_load(LoadConfig(url=service_url, concurrency=3, requests=5,
                                                           sentences=GERMAN, beam_size="1")), 60))
    assert res.issued == len(res.outcomes) == 5 and res.stopped_by == "requests"
    assert sum(o.ok for o in res.outcomes) == 5
    # Duration, open loop: no arrival at or after the bound; it ends once the last answer is in.
    t0 = time.monotonic()
    res = asyncio.run(asyncio.wait_for(run_load(LoadConfig(url=service_url, rate=5.0, duration=1.5,
                                                           sentences=GERMAN, beam_size="1", seed=2)), 60))
    elapsed = time.monotonic() - t0
    assert res.stopped_by == "duration" and res.issued == len(res.outcomes) >= 1
    assert max(o.scheduled for o in res.outcomes) < 1.5
    assert res.wall == pytest.approx(max(o.done for o in res.outcomes))
    assert elapsed < 1.5 + max(o.latency for o in res.outcomes) + 5.0
    # Duration, closed loop: no send after the bound.
    res = asyncio.run(asyncio.wait_for(run_load(LoadConfig(url=service_url, concurrency=2, duration=1.0,
                                                           sentences=GERMAN, beam_size="1")), 60))
    assert res.stopped_by == "duration" and max(o.scheduled for o in res.outcomes) < 1.0


@pytest.mark.slow
def test_cli_request_bound_and_json(service_url, tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "service.loadtest", "--url", service_url, "-c", "2", "-n", "3",
                           "--beam-size", "1:1,2:1", "--texts", "1:1,2:1", "--sentences", GERMAN, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert (s["requests"], s["ok"], s["stopped_by"]) == (3, 3, "requests")
    assert s["generated_tokens"] > 0 and s["latency_s"]["p50"] <= s["latency_s"]["max"]
    assert "3 requests" in proc.stdout and "latency p50" in proc.stdout
    # Never a non-loopback target without --allow-remote (refused before anything is sent).
    proc = subprocess.run([sys.executable, "-m", "service.loadtest", "--url", "http://192.0.2.1:8000", "-n", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "loopback" in proc.stderr


@pytest.mark.slow
def test_sweep_and_plot(service_url, tmp_path):
    cfg = LoadConfig(url=service_url, rate=1.0, duration=1.5, sentences=GERMAN, beam_size="1", seed=5)
    points = asyncio.run(run_sweep(cfg, "rate", [1.0, 3.0], progress=False, log=lambda _: None))
    assert [p["rate"] for p in points] == [1.0, 3.0] and all(p["loop"] == "open" for p in points)
    sat = saturation(points)
    keeping = [p for p in points if p["achieved_rate"] >= KEEPS_UP * p["offered_rate"]]
    assert sat == (max(keeping, key=lambda p: p["rate"]) if keeping else None)
    png = plot_sweep(points, tmp_path / "sweep.png", title="test")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_reports_503_when_overloaded(service_url, tmp_path):
    # Short sentences: the tiny model's max_len (64) would answer long ones with 413.
    short = tmp_path / "short.en"
    short.write_text("\n".join(line for line in load_sentences(ENGLISH) if len(line) <= 50) + "\n")
    before = settled(service_url, SECOND_MODEL)
    # 80 beam-4 requests within ~0.1 s, far more than the tiny model's queues hold (8 cache slots =
    # 2 beam-4 sentences running, 8 waiting; 4 ongoing + 4 queued at Serve): the surplus must come
    # back as 503s, counted as rejections. Short outputs keep the admitted ones quick.
    res = asyncio.run(run_load(LoadConfig(url=service_url, rate=1000.0, requests=80, sentences=str(short),
                                          source_lang="en", target_lang="de", model=SECOND_MODEL,
                                          beam_size="4", max_new_tokens=8, timeout=60.0, seed=6)))
    s = res.summary()
    assert s["requests"] == 80 and s["stopped_by"] == "requests"
    assert s["rejected"] > 0 and s["errors"].get("503", 0) == s["rejected"]
    assert s["failed"] == 0 and s["ok"] + s["rejected"] == 80 and s["ok"] > 0, s["errors"]
    assert all(o.status == 503 and o.generated_tokens == 0 for o in res.outcomes if not o.ok)
    assert s["keeps_up"] is False and s["achieved_rate"] < s["offered_rate"]
    now = wait_for(service_url, SECOND_MODEL,
                   lambda c: c["503"] - before["503"] == s["rejected"] and c["200"] - before["200"] == s["ok"])
    assert (now["503"] - before["503"], now["200"] - before["200"]) == (s["rejected"], s["ok"])


@pytest.mark.slow
def test_compare_echo_measures_from_a_process_of_its_own(service_url, capsys):
    """--compare-echo's client runs in a spawned process (not the Ray driver's): its summary comes back
    whole, and a load that cannot run is an error naming it, not a hang."""
    import os

    from service.loadtest.echo import _measure
    s = _measure(LoadConfig(url="http://127.0.0.1:1", concurrency=2, requests=4, sentences=GERMAN, beam_size="1"),
                 service_url, "service", quiet=True)
    assert (s["requests"], s["ok"], s["stopped_by"]) == (4, 4, "requests") and s["generated_tokens"] > 0
    assert "--- service" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="the echo app load failed"):
        _measure(LoadConfig(url=service_url, concurrency=1, requests=1, sentences=os.devnull + ".missing"),
                 service_url, "echo app", quiet=True)


def test_compare_echo_rounds_alternate_and_report_the_median(monkeypatch, capsys):
    """--compare-echo --rounds N: N pairs of runs, the service first in odd rounds and the echo app first
    in even ones, each app deployed before and deleted after its run; the printed and returned ratio is
    the median of the rounds' ratios (the apps and the load are stood in for here: the real pair is
    measured by the command)."""
    from service.loadtest import echo

    events, rates = [], {"service": iter([60.0, 50.0, 90.0]), "echo app": iter([100.0, 200.0, 100.0])}

    class FakeApp:
        url = "http://127.0.0.1:1"

        def __init__(self, **kw):
            events.append("start")

        def deploy(self, app_args):
            events.append("deploy service")

        def delete(self):
            events.append("delete")

        def close(self):
            events.append("close")

    def measure(cfg, url, label, quiet):
        name = label.split(" (")[0]
        events.append(f"measure {name}")
        return {"requests_per_s": next(rates[name])}

    monkeypatch.setattr(echo, "ServeApp", FakeApp)
    monkeypatch.setattr(echo, "_deploy_echo", lambda app, args: events.append("deploy echo"))
    monkeypatch.setattr(echo, "_measure", measure)
    out = echo.compare_echo(LoadConfig(concurrency=2, requests=4), {}, rounds=3)
    pair = ["deploy service", "measure service", "delete", "deploy echo", "measure echo app", "delete"]
    assert events == ["start", *pair, *pair[3:], *pair[:3], *pair, "close"]
    assert out["ratios"] == [0.6, 0.25, 0.9] and out["ratio"] == 0.6
    assert out["service"]["requests_per_s"] == 60.0 and out["echo"]["requests_per_s"] == 100.0
    printed = capsys.readouterr().out
    assert "round 2: service / echo app = 50.0 / 200.0 req/s = 0.25" in printed
    assert "median of 3 rounds 0.60 (rounds: 0.60, 0.25, 0.90)" in printed
    with pytest.raises(ValueError, match="rounds"):
        echo.compare_echo(LoadConfig(concurrency=2, requests=4), {}, rounds=0)
