"""The app on a local two-node Ray cluster in the separate layout: two translator replicas, one per
node, both serving; killing one replica's actor answers every in-flight request (200 or 503 within
60 s: the gateway retries it on the other) and Serve brings the replica back.

The cluster is ``ray.cluster_utils.Cluster`` (two nodes on this machine, 1 logical CPU each, both
advertising 127.0.0.1), started after the shared test service is shut down (``no_shared_service``;
the ``cluster`` marker moves this test to the end of the run). The app is deployed from
``deploy/serve_config.yaml`` the way ``serve run`` deploys a config file, with these substitutions:
HTTP on 127.0.0.1 and a free port, one proxy (both nodes share the machine's ports), a tiny random
model, ``ingress: separate`` (the one field that picks the other layout; in the default one the
requests in flight on a killed replica are lost) and ``num_replicas: 2`` instead of autoscaling;
the proxy's readiness timeout is raised for this slow shared machine. Only this cluster's processes
are stopped at the end (never ``ray stop``).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import build_tiny_checkpoint, free_port, is_ready
from service.ray_env import HAPROXY_DEFAULT_PORTS, remove_workdir, serve_env

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
APP = "translator"
TRANSLATOR = "Translator-de-en"
TEXT = "Ein Mann fährt mit dem Fahrrad. Zwei Hunde spielen im Schnee. Eine Frau liest ein Buch."

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def cluster_serve_config(checkpoint: Path, http_port: int) -> dict:
    cfg = yaml.safe_load(SERVE_CONFIG.read_text())
    cfg["http_options"].update(host="127.0.0.1", port=http_port)
    cfg["proxy_location"] = "HeadOnly"
    [app] = cfg["applications"]
    args = app["args"]
    args["models"] = [{"name": "de-en", "checkpoint": str(checkpoint)}]
    args["ingress"] = "separate"
    args["translator"].pop("autoscaling_config")
    args["translator"]["num_replicas"] = 2
    return cfg


def add_node_with_retry(cluster, monkeypatch, attempts: int = 3, **node_args):
    """`cluster.add_node(**node_args)`, tried up to `attempts` times.

    Ray waits a fixed 30 s for a new raylet to register with the GCS (ray/_private/node.py); on a
    2-core machine that CI shares with other jobs it sometimes takes longer, and the node start
    raises "The current node timed out during startup". The processes that attempt started are then
    killed (Node.__init__ raised, so nobody else holds them) before the next try.
    """
    from ray._private.node import Node

    original_init = Node.__init__

    def init_killing_on_failure(self, *args, **kwargs):
        try:
            original_init(self, *args, **kwargs)
        except Exception:
            self.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
            raise

    monkeypatch.setattr(Node, "__init__", init_killing_on_failure)
    try:
        for attempt in range(attempts):
            try:
                return cluster.add_node(**node_args)
            except Exception as error:
                if "timed out during startup" not in str(error) or attempt == attempts - 1:
                    raise
    finally:
        monkeypatch.setattr(Node, "__init__", original_init)


def replica_actor_names() -> set[str]:
    import ray
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#{TRANSLATOR}#")}


def running_replicas() -> int:
    from ray import serve
    app = serve.status().applications.get(APP)
    if app is None or TRANSLATOR not in app.deployments:
        return 0
    states = {str(getattr(k, "value", k)): v for k, v in app.deployments[TRANSLATOR].replica_states.items()}
    return states.get("RUNNING", 0)


def sentences_by_replica(metrics_port: int) -> dict[str, float]:
    """replica id -> sentences finished, from one node's Ray metrics agent."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        if family.name in ("ray_mt_sentences", "ray_mt_sentences_total"):
            for s in family.samples:
                if s.name == "ray_mt_sentences_total" and s.labels.get("deployment") == TRANSLATOR:
                    out[s.labels["replica"]] += s.value
    return dict(out)


def running_sequences(metrics_port: int, replica: str) -> float:
    """The running-sequences gauge of one translator replica, from its node's Ray metrics agent."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "ray_mt_running_sequences" and s.labels.get("deployment") == TRANSLATOR
               and s.labels.get("replica") == replica)


async def translate_many(url: str, n: int, max_new_tokens: int, timeout_s: float = 60) -> list[tuple[int, float, dict]]:
    """n concurrent requests; (status, seconds, body) each. A request unanswered in timeout_s fails."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        async def one():
            t0 = time.perf_counter()
            r = await asyncio.wait_for(
                client.post("/v1/translate", json={"text": TEXT, "beam_size": 4, "max_new_tokens": max_new_tokens}),
                timeout_s)
            return r.status_code, time.perf_counter() - t0, r.json()
        return await asyncio.gather(*(one() for _ in range(n)))


def test_two_node_cluster_replicas_and_failover(no_shared_service, tmp_path, monkeypatch, request):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    checkpoint = build_tiny_checkpoint(tmp_path / "de-en", "de", "en", max_len=64)
    # Worker processes start slowly on a busy 2-core machine (one at a time per 1-CPU node): give
    # the Serve proxy more than the default 5 s to come up. The nodes' processes inherit this.
    for var in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        monkeypatch.setenv(var, "30")
    # The data plane of `python -m service` (HAProxy + throughput mode; MT_TEST_PROXY=ray: Serve's proxy).
    # (HAProxy's directory: a short path under /tmp, its socket paths must stay under 98 characters)
    env = serve_env(os.environ.get("MT_TEST_PROXY", "haproxy"),
                    **{arg: free_port() for arg in HAPROXY_DEFAULT_PORTS})
    request.addfinalizer(lambda: remove_workdir(env))
    for var, value in env.items():
        if var != "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S":
            monkeypatch.setenv(var, value)
    head_metrics, worker_metrics, http_port = free_port(), free_port(), free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "metrics_export_port": head_metrics, "object_store_memory": 100 * 1024 ** 2,
        "_system_config": {"metrics_report_interval_ms": 1000}})
    try:
        add_node_with_retry(cluster, monkeypatch, num_cpus=1, metrics_export_port=worker_metrics,
                            object_store_memory=100 * 1024 ** 2)
        ray.init(address=cluster.address, log_to_driver=False)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2

        config = ServeDeploySchema.model_validate(cluster_serve_config(checkpoint, http_port))
        serve.start(proxy_location=config.proxy_location, http_options=config.http_options.model_dump())
        _get_global_client().deploy_apps(config)       # what `serve run deploy/serve_config.yaml` does
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.time() + 240      # ~30 s on an idle 2-core machine; slow when it is shared
        while not (running_replicas() == 2 and is_ready(url)):
            assert time.time() < deadline, f"app not running with 2 replicas: {serve.status()}"
            time.sleep(1)
        original = replica_actor_names()
        assert len(original) == 2

        # Both replicas serve, one on each node (each node's agent exports its own replicas).
        results = asyncio.run(translate_many(url, 24, max_new_tokens=8))
        assert [s for s, _, _ in results] == [200] * 24
        assert all(len(body["translations"]) == 1 for _, _, body in results)
        deadline = time.time() + 30
        while True:
            per_node = [sentences_by_replica(p) for p in (head_metrics, worker_metrics)]
            serving = [{r for r, v in node.items() if v > 0} for node in per_node]
            if all(len(s) == 1 for s in serving):
                break
            assert time.time() < deadline, f"replicas that served, per node: {per_node}"
            time.sleep(1)
        assert serving[0] != serving[1]
        victim_id = next(iter(serving[1]))                  # the replica on the worker node
        victim = next(n for n in original if n.endswith("#" + victim_id))

        # Kill it while requests are in flight: each gets 200 or 503 within 60 s, none hangs.
        async def kill_during_load():
            load = asyncio.create_task(translate_many(url, 24, max_new_tokens=48))
            deadline = time.monotonic() + 30     # once its node's agent shows it decoding (exported every ~1 s)
            while not load.done() and time.monotonic() < deadline and \
                    not await asyncio.to_thread(running_sequences, worker_metrics, victim_id):
                await asyncio.sleep(0.2)
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            return await load
        results = asyncio.run(kill_during_load())
        statuses = [s for s, _, _ in results]
        assert len(results) == 24
        assert set(statuses) <= {200, 503}, statuses
        assert 200 in statuses
        assert max(t for _, t, _ in results) < 60
        for status, _, body in results:
            if status == 503:
                assert body["error"]["message"]
            else:
                assert len(body["translations"]) == 1

        # Serve replaces the dead replica.
        deadline = time.time() + 90
        while not (running_replicas() == 2 and victim not in (names := replica_actor_names()) and len(names) == 2):
            assert time.time() < deadline, f"the killed replica was not replaced: {serve.status()}"
            time.sleep(1)
        assert len(names - original) == 1
        results = asyncio.run(translate_many(url, 8, max_new_tokens=8))
        assert [s for s, _, _ in results] == [200] * 8
        print(f"\nkill during load: {statuses.count(200)} x 200, {statuses.count(503)} x 503; "
              f"replacement {sorted(names - original)}")
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


