"""#38 part 3: a redeploy in the default layout (translators inside the ingress replicas, behind
HAProxy) loses nothing: a second Serve app beside the shared test service (same Ray instance, route
prefix ``/redeploy``), two ingress replicas of a tiny model, steady load while a changed config
replaces both replicas: every request answered 200 (no 404 while the route moves, no 5xx).
The separate layout's redeploys (translators only, gateway only) are tests/test_hardening.py's."""
from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

import pytest

from conftest import SECOND_MODEL, is_ready
from service.loadtest.soak import replica_actors
from test_hardening import MODEL, load

APP, PREFIX = "redeploy", "/redeploy"
pytestmark = pytest.mark.slow


REPLICAS = int(os.environ.get("MT_TEST_REDEPLOY_REPLICAS", "2"))   # as `python -m service` on >= 2 CPUs


def app_args(checkpoint: str, num_cpus: float) -> dict:
    # the default layout; 0.02 CPU each: fits beside the shared service on 2 logical CPUs
    return {"models": [{"name": MODEL, "checkpoint": checkpoint}], "num_cpus": num_cpus,
            "translator": {"num_replicas": REPLICAS}, "engine": {"max_num_seqs": 16}, "drain_timeout_s": 30}


def deploy(args: dict) -> None:
    from ray import serve
    from service.app import build_app
    serve.run(build_app(args), name=APP, route_prefix=PREFIX, blocking=False)


def ingress_replicas() -> set[str]:
    return set(replica_actors(APP, "Gateway"))


def wait_ready(url: str, replicas: int, timeout_s: float = 240) -> None:
    from ray import serve
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        app = serve.status().applications.get(APP)
        if app is not None and str(app.status).endswith("RUNNING") and len(ingress_replicas()) == replicas:
            if is_ready(url):
                return
        time.sleep(0.5)
    raise AssertionError(f"app {APP} not running with {replicas} ingress replicas: {serve.status()}")


@pytest.fixture(scope="module")
def app(service_info):
    from ray import serve
    ckpt = service_info.models[SECOND_MODEL]
    deploy(app_args(ckpt, 0.02))
    url = service_info.url + PREFIX
    wait_ready(url, REPLICAS)
    yield url, ckpt
    serve.delete(APP)


def test_default_layout_redeploy_under_load_loses_nothing(app):
    url, ckpt = app
    before = ingress_replicas()

    def redeploy():
        deploy(app_args(ckpt, 0.03))        # a new resource request: every ingress replica is replaced
        deadline = time.time() + 180
        while not (ingress_replicas() and not before & ingress_replicas()):
            assert time.time() < deadline, f"ingress replicas {sorted(before)} not replaced: {ingress_replicas()}"
            time.sleep(0.2)
        wait_ready(url, REPLICAS)           # the load goes on until the new replicas serve
    outcomes = asyncio.run(load(url, 48, 8, during=redeploy, after=4, cover=True))
    print(f"{REPLICAS} ingress replicas replaced under load: {Counter(outcomes)}")
    # the clients go on until the new replicas serve (``cover``): the load spans the whole swap
    assert len(outcomes) >= 48 and outcomes.count("200") == len(outcomes), Counter(outcomes)
    wait_ready(url, REPLICAS)
