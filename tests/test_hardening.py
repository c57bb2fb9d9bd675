"""Issue 16 over HTTP, on a second Serve app beside the shared test service (same Ray instance, route
prefix ``/hard``): two translator replicas of a tiny model, at most 4 open streams per client.

- a fifth concurrent stream gets 429 naming the limit; a stream's slot comes back when it ends,
  fails (deadline) or its client leaves;
- one translator replica killed (``ray.kill`` of its actor) under load: every request answers 200
  (the gateway retries what the dead replica held, service/api/backends.py), and the retries are
  counted in ``mt_replica_retries_total`` with none failed;
- the process of the replica decoding a long stream killed mid-stream: the client's stream is
  resumed and its text is the same as the unbroken translation;
- a redeploy of a changed config under load (every translator replica replaced, old ones drain), and
  one that replaces the gateway: every request 200;
- the soak script with a tiny count: its counts add up, no 5xx but the deadline kind's 504.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from conftest import SECOND_MODEL, is_ready, metric_samples, sse_events, wait_for_metric
from service.loadtest.soak import SoakConfig, kill_replica, replica_actors, replica_rss, run_soak, send_one

APP, PREFIX, MODEL = "hard", "/hard", "tiny"
STREAMS = 4             # max_streams_per_key of the app; the loads below stay under it
pytestmark = pytest.mark.slow
# 40 sentences of 63 tokens each: 4 such streams through 16 engine slots last a few seconds
LONG = " ".join(["The man rides a bike down the street."] * 40)


def app_args(checkpoint: str, **changes) -> dict:
    # 0.02 CPU each: fits beside the shared service's 1.6 of the session's 2 logical CPUs. The separate
    # layout: the gateway retries a request of a stopping or killed translator replica on the other.
    return {"models": [{"name": MODEL, "checkpoint": checkpoint}], "ingress": "separate", "num_cpus": 0.02,
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
            if is_ready(url):
                return
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


async def load(url: str, n: int, concurrency: int, during=None, after: int = 0, cover: bool = False) -> list[str]:
    """n requests (4 sentences, up to 40 tokens each) from ``concurrency`` clients, two of which
    stream; ``during()`` runs in a thread once ``after`` have answered. With ``cover``, the clients
    go on past n until ``during()`` has returned (at most 20 n), so the load spans all of it. The
    outcome of each."""
    body = {"text": " ".join(["Two dogs play in the snow."] * 4), "model": MODEL, "max_new_tokens": 40}
    outcomes: list[str] = []
    started, finished = asyncio.Event(), asyncio.Event()
    todo = iter(range(20 * n if cover else n))

    async def client_loop(client, stream: bool):
        for i in todo:
            if cover and i >= n and finished.is_set():
                return
            outcomes.append(await send_one(client, "streamed", {**body, "stream": stream}))
            if len(outcomes) >= after:
                started.set()

    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:
        side = None
        if during is not None:
            async def run_during():
                await started.wait()
                await asyncio.get_running_loop().run_in_executor(None, during)
                finished.set()
            side = asyncio.create_task(run_during())
        await asyncio.gather(*(client_loop(client, k < 2) for k in range(concurrency)))
        if side is not None:
            await side
    return outcomes


def replaced(before: set[str], prefix: str, timeout_s: float = 120) -> None:
    """Wait until none of the replica actors ``before`` (of deployments named ``prefix``...) is left
    and one of the same deployments runs."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        now = set(replica_actors(APP, prefix))
        if now and not before & now:
            return
        time.sleep(0.2)
    raise AssertionError(f"{prefix} replicas {sorted(before)} not replaced: {replica_actors(APP, prefix)}")


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
    # the retries are counted (every series starts at 0, so they are there even if none was needed)
    text = wait_for_metric(url, lambda t: len(retry_series(t)) == 6)
    retries = retry_series(text)
    assert len(retries) == 6 and sum(v for (call, outcome), v in retries.items() if outcome == "failed") == 0, retries


def retry_series(text: str) -> dict[tuple[str, str], float]:
    """ray_mt_replica_retries_total of this app's model: (call, outcome) -> value."""
    out: dict[tuple[str, str], float] = {}
    for sm in metric_samples(text, "ray_mt_replica_retries_total"):
        if sm.labels.get("model") == MODEL and sm.labels.get("application") == APP:
            key = (sm.labels["call"], sm.labels["outcome"])
            out[key] = out.get(key, 0.0) + sm.value
    return out


def live_replica_pids() -> list[int]:
    """Process ids of this app's translator replicas, zombies left out."""
    pids = []
    for key in replica_rss(APP):
        pid = int(key.split()[1])
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(pid)
        except OSError:
            continue
    return pids


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")      # utime + stime


def test_stream_resumed_when_its_replica_dies_mid_stream(hard):
    """The process of the replica decoding a long stream is killed (SIGKILL) after its first tokens:
    the client's one stream goes on where it stopped and its text is the unbroken translation."""
    url, _ = hard
    body = {"text": LONG, "model": MODEL, "max_new_tokens": 63}
    reference = httpx.post(url + "/v1/translate", json=body, timeout=120).json()["translations"]
    deadline = time.time() + 30     # the processes of the translator replicas (a killed one may linger)
    while len(pids := live_replica_pids()) != 2 and time.time() < deadline:
        time.sleep(0.5)
    assert len(pids) == 2, pids
    resumed = wait_for_metric(url, lambda t: len(retry_series(t)) == 6)
    resumed = retry_series(resumed)[("stream_resumed", "ok")]
    killed, block, events = None, [], []
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
        with client.stream("POST", "/v1/translate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    block.append(line)
                    continue
                events += sse_events("\n".join(block))
                block = []
                if killed is None and sum(e == "token" for e, _ in events) == 3:
                    before = {p: cpu_seconds(p) for p in pids}
                    time.sleep(0.5)
                    used = {p: cpu_seconds(p) - before[p] for p in pids}
                    killed = max(pids, key=used.get)    # the one decoding
                    os.kill(killed, signal.SIGKILL)
    assert killed is not None and events[-1][0] == "response", (events[-1], used)
    texts: dict[int, str] = {}
    for e, data in events:
        if e == "token":
            texts[data["index"]] = texts.get(data["index"], "") + data["text"]
    assert [texts.get(i, "") for i in range(len(reference))] == [t["text"] for t in reference]
    assert [t["text"] for t in events[-1][1]["translations"]] == [t["text"] for t in reference]
    text = wait_for_metric(url, lambda t: retry_series(t).get(("stream_resumed", "ok"), 0) > resumed)
    assert retry_series(text)[("stream_resumed", "ok")] == resumed + 1, (retry_series(text), used)  # the stream's
    wait_running(url, 2)


# A new resource request of the translators replaces each of their replicas (the gateway stays); one
# of the gateway replaces its replica (the translators stay; max_surge_percent: the old gateway serves
# until the new one is ready, so the ingress never loses the route). The load goes on until the last
# old replica has left. Run in this order: the second keeps the first's translator change.
@pytest.mark.parametrize("replaced_prefix, changes", [
    ("Translator-", {"num_cpus": 0.03}),
    ("Gateway", {"num_cpus": 0.03, "gateway": {"ray_actor_options": {"num_cpus": 0.03}}}),
], ids=["translators", "gateway"])
def test_redeploy_under_load_no_request_fails(hard, replaced_prefix, changes):
    url, ckpt = hard
    before = set(replica_actors(APP, replaced_prefix))

    def redeploy():
        deploy(app_args(ckpt, **changes))
        replaced(before, replaced_prefix)
    outcomes = asyncio.run(load(url, 48, 8, during=redeploy, after=4, cover=True))
    assert len(outcomes) > 48 and outcomes.count("200") == len(outcomes), Counter(outcomes)
    wait_running(url, 2)


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
