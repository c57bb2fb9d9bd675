"""`python -m service` (the README's main command) starts its own Ray instance, serves, and stops
cleanly on Ctrl-C. It starts a Ray instance of its own, so it runs after the shared service is shut
down (``cluster`` marker, ``no_shared_service``)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ROOT, build_tiny_checkpoint, free_port, metric_sum

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_python_m_service_serves_and_stops_on_ctrl_c(no_shared_service, tmp_path):
    ckpt = build_tiny_checkpoint(tmp_path / "m", "de", "en", max_len=64)
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "app.yaml"
    config.write_text("engine:\n  max_num_seqs: 16\ntranslator:\n  max_queued_requests: 32\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--port", str(port), "--metrics-export-port", str(metrics_port),
         "--num-cpus", "2", "--checkpoint", str(ckpt), "--config", str(config)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("python -m service did not become ready within 180 s")
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
    finally:
        proc.send_signal(signal.SIGINT)        # Ctrl-C
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("python -m service did not stop within 60 s of Ctrl-C")
    assert code == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/healthz", timeout=2)
