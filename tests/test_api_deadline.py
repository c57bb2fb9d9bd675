"""Deadlines through the running service (the shared Ray Serve app of conftest.py): a request past
its ``timeout_s`` is answered 504 (an SSE ``error`` event once a stream has started), and the
translator's engine has no running or waiting sentence left afterwards."""
from __future__ import annotations

import time

import httpx
import pytest

from conftest import IN_INGRESS, metric_sum, scrape

SENTENCES = ["Ein Mann fährt mit dem Fahrrad die Straße entlang.", "Zwei Hunde spielen im Schnee.",
             "Eine Frau liest ein Buch im Park.", "Kinder spielen Fußball auf der Wiese."]
# Every sentence must generate 200 tokens with beam 4: far longer than the deadlines below (64 such
# sentences are 200 steps of 256 rows, seconds on any machine of this kind; 8 of them could finish
# within 0.5 s on a fast one).
LONG = {"text": " ".join(SENTENCES * 16), "beam_size": 4, "max_new_tokens": 200, "min_new_tokens": 200}


pytestmark = pytest.mark.slow      # every test runs against the shared Ray Serve app (service_url)


def engine_counts(url: str, model: str = "de-en") -> tuple[int, int]:
    """(running, waiting) of the model's engine: its translator deployment's stats, or, when the
    translators run in the ingress replicas (the default layout), the sum of every replica's
    gauges (running sequences, waiting sentences) in /metrics."""
    if IN_INGRESS:
        text = scrape(url)
        return (int(metric_sum(text, "ray_mt_running_sequences", model=model)),
                int(metric_sum(text, "ray_mt_waiting_requests", model=model)))
    from ray import serve
    s = serve.get_deployment_handle(f"Translator-{model}", app_name="mt").stats.remote().result()
    return s["running_requests"], s["waiting_requests"]


def wait_idle(url: str, timeout_s: float = 20) -> tuple[int, int]:
    deadline = time.time() + timeout_s
    while (counts := engine_counts(url)) != (0, 0) and time.time() < deadline:
        time.sleep(0.2)
    return counts


def test_deadline_504_and_engine_empty_afterwards(service_url):
    t0 = time.perf_counter()
    r = httpx.post(service_url + "/v1/translate", json={**LONG, "timeout_s": 0.5}, timeout=60)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["type"] == "timeout" and err["field"] == "timeout_s" and "0.5 s" in err["message"]
    assert elapsed < 10
    assert wait_idle(service_url) == (0, 0)


def test_deadline_in_a_started_stream_is_an_error_event(service_url):
    # Greedy streams its first tokens within a step or two; 64 sentences x 200 tokens take several times
    # the deadline on any machine of this kind (8 sentences could finish within 1 s on a fast one).
    body = {**LONG, "text": " ".join(SENTENCES * 16), "beam_size": 1, "timeout_s": 0.5, "stream": True}
    with httpx.stream("POST", service_url + "/v1/translate", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[-1] == "error" and "response" not in events, events
    assert wait_idle(service_url) == (0, 0)


def test_timeout_s_is_validated_against_the_server_maximum(service_url):
    for value, status in ((0, 422), (-1, 422), (61, 422), ("1", 422)):
        r = httpx.post(service_url + "/v1/translate", json={"text": "Hallo.", "timeout_s": value}, timeout=60)
        assert r.status_code == status, (value, r.text)
        assert r.json()["error"]["field"] == "timeout_s"
    r = httpx.post(service_url + "/v1/translate", json={"text": "Hallo.", "timeout_s": 61}, timeout=60)
    assert "max_timeout_s" in r.json()["error"]["message"] and "60" in r.json()["error"]["message"]
    r = httpx.post(service_url + "/v1/translate", json={"text": "Hallo.", "timeout_s": 30, "max_new_tokens": 8},
                   timeout=60)
    assert r.status_code == 200 and r.json()["translations"][0]["text"]
