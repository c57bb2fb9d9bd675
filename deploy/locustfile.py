"""Locust load test for the translation service, with the request mix of ``python -m service.loadtest``.

    pip install -e ".[loadtest]"
    locust -f deploy/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s \\
        --texts 1:3,4:1 --beam-size 1:1,4:1 --attention 0.1 [--stream-ttft]

Each user is a closed loop (wait_time 0): it sends its next request when the previous one is
answered, like ``service.loadtest --concurrency``. ``--user-rate R`` paces each user to R requests/s
(locust's constant_throughput), so -u N approximates an offered rate of N*R requests/s; locust has
no Poisson arrivals, which is what ``service.loadtest --rate`` is for. Requests are drawn from the
same sentence file and texts/beam/attention mix by service.loadtest.RequestMaker. 429 and 503
answers are reported as failures named "rejected 429"/"rejected 503"; with --stream-ttft the time
to first token is reported as its own entry ("SSE", "time to first token"). Locust stays an
optional dependency (the ``loadtest`` extra); nothing in service/ imports it.
"""
from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from locust import HttpUser, constant, constant_throughput, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repo, when not pip-installed
from service.loadtest import DEFAULT_SENTENCES, REJECTED_STATUSES, LoadConfig, RequestMaker, load_sentences  # noqa: E402


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--sentences", default=str(DEFAULT_SENTENCES), help="sentence file, plain or .gz")
    parser.add_argument("--texts", default="1", help="texts per request, a mix VALUE[:WEIGHT],...")
    parser.add_argument("--beam-size", default="4", help="beam sizes, a mix VALUE[:WEIGHT],...")
    parser.add_argument("--attention", type=float, default=0.0, help="fraction of requests with return_attention")
    parser.add_argument("--stream-ttft", action="store_true", help="stream (SSE) and report time to first token")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--user-rate", type=float, default=0.0, help="requests/s per user (0: closed loop)")
    parser.add_argument("--seed", type=int, default=0)


_sentences: dict[str, list[str]] = {}


class TranslateUser(HttpUser):
    """One simulated client of POST /v1/translate."""

    def wait_time(self) -> float:
        rate = self.environment.parsed_options.user_rate
        return (constant_throughput(rate) if rate > 0 else constant(0))(self)

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.cfg = LoadConfig(url=self.host, concurrency=1, duration=1.0, sentences=o.sentences, texts=o.texts,
                              beam_size=o.beam_size, attention=o.attention, stream=o.stream_ttft,
                              max_new_tokens=o.max_new_tokens, allow_remote=True)
        if o.sentences not in _sentences:
            _sentences[o.sentences] = load_sentences(o.sentences)
        seed = o.seed * 1_000_003 + id(self) % 1_000_003
        self.make = RequestMaker(self.cfg, _sentences[o.sentences], random.Random(seed))

    @task
    def translate(self) -> None:
        spec = self.make()
        name = f"/v1/translate texts={len(spec.texts)} beam={spec.beam_size}" + (" attn" if spec.return_attention else "")
        start = time.perf_counter()
        with self.client.post(self.cfg.path, json=spec.body(self.cfg), name=name, stream=spec.stream,
                              catch_response=True) as resp:
            if resp.status_code in REJECTED_STATUSES:
                resp.failure(f"rejected {resp.status_code}")
                return
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            if not spec.stream:
                data = resp.json()
                if len(data.get("translations", [])) != len(spec.texts):
                    resp.failure("wrong number of translations")
                return
            first, final, event, error = None, None, "message", None
            for raw in resp.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if line.startswith("event:"):
                    event = line[6:].strip()
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                payload = json.loads(line[5:])
                if event == "error":
                    error = payload
                elif isinstance(payload, dict) and "usage" in payload:
                    final = payload
                elif first is None:
                    first = time.perf_counter()
            # A streamed entry times the whole stream, not just the response headers.
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            if error is not None:
                resp.failure(f"stream error: {error}")
                return
            if final is None:
                resp.failure("stream ended without the final event")
                return
            ttft_ms = ((first or time.perf_counter()) - start) * 1000
            self.environment.events.request.fire(request_type="SSE", name="time to first token",
                                                 response_time=ttft_ms, response_length=0, exception=None,
                                                 context={})
