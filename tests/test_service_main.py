"""`python -m service` (the README's main command) starts its own Ray instance, serves, and stops
cleanly on SIGTERM (and Ctrl-C, the same handler): under load, every request it had accepted is
answered 200 before it exits (the app drains first, service/__main__.py). It starts a Ray instance of its own, so it runs after the shared service is shut
down (``cluster`` marker, ``no_shared_service``)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import ROOT, build_tiny_checkpoint, free_port, metric_sum, wait_until_ready

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.parametrize("args, config, words", [
    (["--port", "99999"], None, "--port: must be a TCP port in 1..65535, got 99999"),
    (["--checkpoint", "{tmp}"], None, "has no config.json"),
    (["--config", "{cfg}"], "num_cpus: lots\n", "num_cpus Input should be a valid number"),
    (["--config", "{cfg}"], "a: [\n", "expected the node content"),
    (["--config", "{tmp}/missing.yaml"], None, "No such file or directory"),
    (["--ingress", "both"], None, "ingress Input should be 'translator' or 'separate'"),
    (["--config", "{cfg}"], "engine: {max_num_seq: 8}\n", "max_num_seq: unknown engine option"),
    (["--config", "{cfg}"], "applications: [{args: {}, deployments: [{name: Gateway}]}]\n",
     "deployment options go in the application's args"),
])
def test_bad_arguments_are_one_line_before_ray_starts(tmp_path, args, config, words):
    cfg = tmp_path / "app.yaml"
    if config is not None:
        cfg.write_text(config)
    args = [a.format(tmp=tmp_path, cfg=cfg) for a in args]
    r = subprocess.run([sys.executable, "-m", "service", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and words in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Started a local Ray instance" not in r.stderr + r.stdout


@pytest.mark.parametrize("config, cpus, gpu, want", [
    ({}, 2, False, {"translator": {"num_replicas": 2}}),
    ({}, 16, False, {"translator": {"num_replicas": 2}}),
    ({}, 1, False, {"translator": {"num_replicas": 1}}),       # a second would not fit
    ({}, 8, True, {"translator": {"num_replicas": 1}}),        # one GPU per replica
    ({"translator": {"max_queued_requests": 32}}, 2, False, {"translator": {"max_queued_requests": 32, "num_replicas": 2}}),
    ({"translator": {"num_replicas": 3}}, 2, False, {"translator": {"num_replicas": 3}}),
    ({"translator": {"autoscaling_config": {"max_replicas": 4}}}, 2, False,
     {"translator": {"autoscaling_config": {"max_replicas": 4}}}),
    ({"ingress": "translator"}, 2, False, {"ingress": "translator", "translator": {"num_replicas": 2}}),
    ({"ingress": "separate"}, 2, False, {"ingress": "separate"}),                # the config's choice, as it is
])
def test_local_layout(config, cpus, gpu, want):
    from service.__main__ import local_layout
    before = repr(config)
    assert local_layout(config, cpus=cpus, gpu=gpu) == want
    assert repr(config) == before        # the caller's dict is left as it was


@contextlib.contextmanager
def python_m_service(port: int, *args: str, env: dict | None = None, ready_s: float = 180, stop_s: float = 60):
    """``python -m service --port PORT ARGS`` in a session of its own, ready on 127.0.0.1:PORT within
    ``ready_s``; yields its Popen. Then Ctrl-C (SIGINT): it must exit 0 within ``stop_s`` (else it is
    killed, with its session, and the test fails)."""
    proc = subprocess.Popen([sys.executable, "-m", "service", "--port", str(port), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        def alive():
            assert proc.poll() is None, proc.stdout.read()
        wait_until_ready(f"http://127.0.0.1:{port}", timeout_s=ready_s, what="python -m service", interval_s=1,
                         alive=alive)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)        # Ctrl-C
        try:
            code = proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"python -m service did not stop within {stop_s:.0f} s of Ctrl-C")
    assert code == 0, proc.stdout.read()[-3000:]


def test_python_m_service_serves_and_stops_on_ctrl_c(no_shared_service, tmp_path):
    ckpt = build_tiny_checkpoint(tmp_path / "m", "de", "en", max_len=64)
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "app.yaml"
    config.write_text("engine:\n  max_num_seqs: 16\ntranslator:\n  max_queued_requests: 32\n")
    url = f"http://127.0.0.1:{port}"
    with python_m_service(port, "--metrics-export-port", str(metrics_port), "--num-cpus", "2",
                          "--checkpoint", str(ckpt), "--config", str(config)) as proc:
        r = httpx.post(url + "/v1/translate", json={"text": "Ein Hund läuft.", "max_new_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "de-en"
        assert len(r.json()["translations"][0]["tokens"]) <= 4
        models = httpx.get(url + "/v1/models").json()["data"]
        assert models[0]["engine"]["max_num_seqs"] == 16      # --config reached the engine
        # the metrics agent runs on the fixed port given, and /metrics on the HTTP port reads it
        deadline = time.time() + 30
        while time.time() < deadline:
            text = httpx.get(url + "/metrics", timeout=10).text
            if metric_sum(text, "ray_mt_requests_total", model="de-en", status="200") >= 1:
                break
            time.sleep(1)
        assert metric_sum(text, "ray_mt_requests_total", model="de-en", status="200") >= 1
        direct = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert "ray_mt_requests_total" in direct
        sigterm_under_load(proc, url)
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/healthz", timeout=2)


def sigterm_under_load(proc: subprocess.Popen, url: str) -> None:
    """4 clients send requests of one to a few seconds back to back (48 sentences each: well over the
    0.5 s margin below however fast the machine); SIGTERM (once as many answers as clients came back,
    at a moment when a request sent over 0.6 s ago is still running: the engine takes turns between
    requests, so clients that started together finish, and send again, together); every request sent
    at least 0.5 s before it (accepted by then) gets its 200, some of them were still running when it
    came, and the process exits 0. The clients send nothing after the signal (with clients still
    sending, the drain can last up to drain_timeout_s)."""
    body = {"text": " ".join(["Ein Mann fährt mit dem Fahrrad."] * 48), "max_new_tokens": 40}
    results: list[tuple[float, float, object]] = []        # (sent, answered, status or error)
    stop = threading.Event()
    sent: dict[int, float] = {}                              # client -> when its request in flight was sent

    def client(i: int):
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as c:
            while not stop.is_set():
                t0 = sent[i] = time.monotonic()
                try:
                    out = c.post("/v1/translate", json=body).status_code
                except httpx.HTTPError as e:
                    out = type(e).__name__
                sent.pop(i, None)
                results.append((t0, time.monotonic(), out))
    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120         # every client in its stride: as many answers as clients came back
    while len(results) < len(threads) and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(time.monotonic() - t0 > 0.6 for t0 in list(sent.values())):
        time.sleep(0.02)
    t_term = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stop.set()          # no new requests after the signal: the drain waits for the accepted ones
    try:
        code = proc.wait(timeout=120)
    finally:
        for t in threads:
            t.join(timeout=70)
    accepted = [(t0, t1, out) for t0, t1, out in results if t0 < t_term - 0.5]
    assert accepted and all(out == 200 for _, _, out in accepted), accepted
    assert any(t1 > t_term for _, t1, _ in accepted), "no request was in flight at SIGTERM"
    assert code == 0, proc.stdout.read()[-3000:]
