"""Issue 16 over HTTP, on a second Serve app beside the shared test service (same Ray instance, route
prefix ``/hard``): two translator replicas of a tiny model, at most 4 open streams per client.

- a fifth concurrent stream gets 429 naming the limit; a stream's slot comes back when it ends,
  fails (deadline) or its client leaves;
- one translator replica killed (``ray.kill`` of its actor) under load: every request answers 200
  (the gateway retries what the dead replica held, service/api/backends.py);
- a redeploy of a changed config under load (every translator replica replaced, old ones drain):
  every request 200;
- the soak script with a tiny count: its counts add up, no 5xx but the deadline kind's 504.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import httpx
import pytest

from conftest import SECOND_MODEL
from service.loadtest.soak import SoakConfig, kill_replica, replica_actors, replica_rss, run_soak, send_one

APP, PREFIX, MODEL = "hard", "/hard", "tiny"
STREAMS = 4             # max_streams_per_key of the app; the loads below stay under it
pytestmark = pytest.mark.slow
# 40 sentences of 63 tokens each: 4 such streams through 16 engine slots last a few seconds
LONG = " ".join(["The man rides a bike down the street."] * 40)


def app_args(checkpoint: str, **changes) -> dict:
    # 0.02 CPU each: fits beside the shared service's 1.8 of the session's 2 logical CPUs
    return {"models": [{"name": MODEL, "checkpoint": checkpoint}], "num_cpus": 0.02,
            "translator": {"num_replicas": 2}, "gateway": {"ray_actor_options": {"num_cpus": 0.02}},
            "engine": {"max_num_seqs": 16}, "max_streams_per_key": STREAMS, "drain_timeout_s": 30, **changes}


def deploy(args: dict) -> None:
    from ray import serve
    from service.app import build_app
    serve.run(build_app(args), name=APP, route_prefix=PREFIX, blocking=False)


def wait_running(url: str, replicas: int, timeout_s: float = 180) -> None:
    from ray import serve
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        app = serve.status().applications.get(APP)
        if app is not None and str(app.status).endswith("RUNNING") and len(replica_actors(APP)) == replicas:
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"app {APP} not running with {replicas} translator replicas: {serve.status()}")


@pytest.fixture(scope="module")
def hard(service_info):
    from ray import serve
    ckpt = service_info.models[SECOND_MODEL]
    deploy(app_args(ckpt))
    url = service_info.url + PREFIX
    wait_running(url, 2)
    yield url, ckpt
    serve.delete(APP)


async def load(url: str, n: int, concurrency: int, during=None, after: int = 0) -> list[str]:
    """n requests (4 sentences, up to 40 tokens each) from ``concurrency`` clients, two of which
    stream; ``during()`` runs in a thread once ``after`` have answered. The outcome of each."""
    body = {"text": " ".join(["Two dogs play in the snow."] * 4), "model": MODEL, "max_new_tokens": 40}
    outcomes: list[str] = []
    started = asyncio.Event()
    todo = iter(range(n))

    async def client_loop(client, stream: bool):
        for _ in todo:
            outcomes.append(await send_one(client, "streamed", {**body, "stream": stream}))
            if len(outcomes) >= after:
                started.set()

    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:
        side = None
        if during is not None:
            async def run_during():
                await started.wait()
                await asyncio.get_running_loop().run_in_executor(None, during)
            side = asyncio.create_task(run_during())
        await asyncio.gather(*(client_loop(client, k < 2) for k in range(concurrency)))
        if side is not None:
            await side
    return outcomes


def open_streams(url: str, body: dict, n: int) -> tuple[list, list]:
    """n streams opened (status line received, body unread): (their context managers, responses)."""
    cms = [httpx.Client(base_url=url, timeout=60, trust_env=False).stream("POST", "/v1/translate", json=body)
           for _ in range(n)]
    return cms, [cm.__enter__() for cm in cms]     # (the context managers must stay referenced)


def test_replica_killed_under_load_no_request_fails(hard):
    url, _ = hard
    victim = []
    outcomes = asyncio.run(load(url, 48, 8, during=lambda: victim.append(kill_replica(APP)), after=8))
    assert victim and victim[0] not in replica_actors(APP)
    assert outcomes.count("200") == 48, Counter(outcomes)
    wait_running(url, 2)           # Serve replaces the replica


def test_redeploy_under_load_no_request_fails(hard):
    url, ckpt = hard
    before = set(replica_actors(APP))
    done = threading.Event()

    def redeploy():
        # a new resource request of the translators: each of their replicas is replaced (the gateway
        # stays; with the HAProxy ingress a replaced gateway answered some requests 404, see issue 16)
        deploy(app_args(ckpt, num_cpus=0.03))
        done.set()
    outcomes = asyncio.run(load(url, 48, 8, during=redeploy, after=4))
    assert done.is_set() and outcomes.count("200") == 48, Counter(outcomes)
    wait_running(url, 2)
    assert not before & set(replica_actors(APP))     # all replaced


def test_soak_tiny_counts_add_up(hard):
    url, _ = hard
    cfg = SoakConfig(url=url, requests=60, concurrency=3, model=MODEL, warmup=0.1, restart_at=0.5, timeout=60)
    sentences = ["A man rides a bike.", "Two dogs play in the snow.", "A woman reads a book on the beach."]
    res = asyncio.run(run_soak(cfg, sentences, lambda: kill_replica(APP), lambda: replica_rss(APP), progress=False))
    assert sum(res.counts.values()) == res.sent == 60
    assert res.restarted is not None
    assert not res.unexpected_5xx(), res.counts
    kinds = {k for k, _ in res.counts}
    assert {"valid", "streamed", "invalid"} <= kinds
    assert all(o.startswith("4") for k, o in res.counts if k == "invalid")
    assert all(o in ("200", "200 cancelled") for k, o in res.counts if k in ("valid", "cancelled")), res.counts
    assert set(res.rss) == {"start", "middle", "end"} and all(len(v) >= 1 for v in res.rss.values())
    wait_running(url, 2)


def test_concurrent_streams_per_client_429_and_released(hard):
    # last in the module: the streams it closes at the end may hold their slots a moment longer
    url, _ = hard
    body = {"text": LONG, "model": MODEL, "max_new_tokens": 63, "stream": True}
    short = {"text": "A dog runs.", "model": MODEL, "max_new_tokens": 8, "stream": True}
    cms, streams = open_streams(url, body, STREAMS)
    assert [s.status_code for s in streams] == [200] * STREAMS
    r = httpx.post(url + "/v1/translate", json=short, timeout=60)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "too_many_streams" and err["field"] == "stream"
    assert f"at most {STREAMS} concurrent streams per client" in err["message"] and "Retry-After" in r.headers
    for cm in cms:
        cm.__exit__(None, None, None)      # the clients leave mid-stream: their slots come back
    deadline = time.time() + 20
    while (r := httpx.post(url + "/v1/translate", json=short, timeout=60)).status_code == 429:
        assert time.time() < deadline, "the stream of a client that left was never released"
        time.sleep(0.2)
    assert r.status_code == 200 and "event: response" in r.text     # ended normally: released too
    # a stream that fails (its deadline passes mid-stream, or before it starts) releases its slot too
    for _ in range(STREAMS + 1):
        r = httpx.post(url + "/v1/translate", json={**body, "timeout_s": 0.2}, timeout=60)
        assert r.status_code == 504 or (r.status_code == 200 and "event: error" in r.text), r.text[:300]
    deadline = time.time() + 20     # nothing leaked: STREAMS concurrent streams get in again
    while True:
        cms, streams = open_streams(url, body, STREAMS)
        codes = [s.status_code for s in streams]
        for cm in cms:
            cm.__exit__(None, None, None)
        if codes == [200] * STREAMS or time.time() > deadline:
            break
        time.sleep(0.5)             # the slots of the streams just closed are released asynchronously
    assert codes == [200] * STREAMS
