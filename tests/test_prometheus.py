"""A real Prometheus server scrapes the running test service with the scrape config from deploy/.

Prometheus (Debian's ``prometheus`` package; ``deploy/install_prometheus.sh`` installs it when it is
missing, and the test fails if that does not work) runs as this test's own process on a free
127.0.0.1 port. Its config is ``deploy/prometheus.yml`` with the targets swapped for the test
service's Ray metrics agent on 127.0.0.1. Beside the shared service runs a small pool app (the
separate layout: a gateway, a pinned model, one pool replica holding one of two models at a time),
so that the pool's, the gateway's retry and every other declared family has series. After
successful, 4xx and 503 traffic, documents, language detection and pool loads and evictions, every
PromQL expression of the Grafana dashboard (template variables substituted) must return at least
one non-NaN sample through Prometheus's HTTP API, and every metric name docs/metrics.md lists must
be among Prometheus's ``__name__`` label values.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import SECOND_MODEL, build_tiny_checkpoint, free_port, wait_until_ready

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SCRAPE_CONFIG = DEPLOY / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "translator.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
RATE_WINDOW = "5m"        # $__rate_interval / $__interval: wide enough to cover the whole test

pytestmark = pytest.mark.slow

GERMAN = ["Ein Mann fährt mit dem Fahrrad die Straße entlang.", "Zwei Hunde spielen im Schnee.",
          "Eine Frau liest ein Buch im Park."]
ENGLISH = "A man rides his bike down the street. Two dogs play in the snow. A woman reads a book."


def ensure_prometheus() -> tuple[str, str]:
    """Paths of prometheus and promtool, installed with the project's script when missing."""
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        r = subprocess.run(["bash", str(DEPLOY / "install_prometheus.sh")], capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, f"deploy/install_prometheus.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    assert prometheus and promtool, "prometheus/promtool not on PATH after deploy/install_prometheus.sh"
    return prometheus, promtool


def test_config_scrape_targets_every_job():
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert cfg["scrape_configs"], "no scrape job"
    for job in cfg["scrape_configs"]:
        assert job["metrics_path"] == "/metrics"
        assert all(sc["targets"] for sc in job["static_configs"])


def promtool_check(promtool: str, path: Path) -> None:
    r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"promtool check config {path}:\n{r.stdout}\n{r.stderr}"


def test_promtool_accepts_the_shipped_config():
    _, promtool = ensure_prometheus()
    promtool_check(promtool, SCRAPE_CONFIG)


@pytest.fixture(scope="module")
def prometheus(service_info, tmp_path_factory):
    """A Prometheus server (own process, free 127.0.0.1 port) scraping the test service."""
    binary, promtool = ensure_prometheus()
    workdir = tmp_path_factory.mktemp("prometheus")
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    target = f"127.0.0.1:{service_info.metrics_port}"
    for job in cfg["scrape_configs"]:
        for sc in job["static_configs"]:
            sc["targets"] = [target]
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(cfg))
    promtool_check(promtool, config)
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "prometheus did not become ready within 60 s"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


POOL_APP, POOL_MODELS = "dashpool", ("pool-a", "pool-b")


@pytest.fixture(scope="module")
def pool_url(service_info, tmp_path_factory):
    """URL of a pool app beside the shared service: a pinned model and one pool replica that holds
    one of POOL_MODELS at a time (a request for the other loads it and evicts the first)."""
    from ray import serve
    from service.app import build_app
    root = tmp_path_factory.mktemp("dashboard-pool")
    models = [{"name": n, "checkpoint": str(build_tiny_checkpoint(root / n, "de", "en", seed=20 + i, max_len=64))}
              for i, n in enumerate(POOL_MODELS)]
    args = {"models": [{"name": "dash-pinned", "checkpoint": service_info.models[SECOND_MODEL]}],
            "ingress": "separate", "num_cpus": 0.02, "translator": {"num_replicas": 1},
            "gateway": {"ray_actor_options": {"num_cpus": 0.02}},
            "engine": {"max_num_seqs": 8, "max_waiting": 64, "linear_dtype": "float32"},
            "pool": {"models": models, "max_models_per_replica": 1, "deployment": {"num_replicas": 1}}}
    serve.run(build_app(args), name=POOL_APP, route_prefix="/" + POOL_APP, blocking=False)
    url = f"{service_info.url}/{POOL_APP}"
    try:
        wait_until_ready(url, what="the pool app", interval_s=1)
        yield url
    finally:
        serve.delete(POOL_APP, _blocking=False)


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    assert body["data"]["resultType"] == "vector", expr
    return body["data"]["result"]


def finite_samples(result: list[dict]) -> list[float]:
    return [float(s["value"][1]) for s in result if not math.isnan(float(s["value"][1]))]


def scalar(prom: str, expr: str) -> float:
    samples = finite_samples(query(prom, expr))
    return samples[0] if samples else float("nan")


async def send_traffic(url: str, pool: str) -> dict[int, int]:
    """One round of successful, client-error and overload traffic, documents, detection, and each pool
    model in turn (a load and an eviction each); returns status -> count."""
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def post(path: str, body: dict) -> int:
            r = await client.post(path, json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            return r.status_code

        ok = await asyncio.gather(
            post("/v1/translate", {"text": GERMAN, "beam_size": 2, "max_new_tokens": 24}),
            post("/v1/translate", {"text": GERMAN[0], "beam_size": 1, "max_new_tokens": 24}),
            post("/v1/translate", {"text": GERMAN[1], "max_new_tokens": 24, "stream": True}),
            post("/translate", {"q": GERMAN[2], "source": "de", "target": "en"}),
            # pysbd raises on this text: the fallback splitter cuts it and counts it
            post("/v1/translate", {"text": "Er hat einen B.A. in Sport. Dazu eine B(asic) Lizenz.",
                                   "max_new_tokens": 24}))
        assert ok == [200, 200, 200, 200, 200]
        bad = await asyncio.gather(
            post("/v1/translate", {"text": GERMAN[0], "beam_size": 0}),
            post("/v1/translate", {"text": GERMAN[0], "model": "no-such-model"}),
            post("/v1/translate", {"text": GERMAN[0], "max_new_tokens": -1}))
        assert bad == [422, 404, 422]
        auto = await asyncio.gather(
            post("/v1/translate", {"text": GERMAN[:2], "source_lang": "auto", "max_new_tokens": 24}),
            post("/detect", {"q": ENGLISH}))
        assert auto == [200, 200]
        for name, data in (("a.txt", GERMAN[0].encode()), ("a.pdf", b"%PDF-1.4")):
            r = await client.post("/v1/documents", files={"file": (name, data)}, data={"target_lang": "en"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        for model in POOL_MODELS:      # one at a time: each loads its model and evicts the other
            r = await client.post(pool + "/v1/translate", json={"text": GERMAN[0], "model": model,
                                                                "max_new_tokens": 16})
            assert r.status_code == 200, r.text
        # The second test model has 4 ongoing + 4 queued requests and 8 engine slots: a burst of
        # 48 concurrent requests overloads it, and the overflow must get 503 (never a hang or a 500).
        burst = await asyncio.gather(*(post("/v1/translate", {"text": ENGLISH, "model": SECOND_MODEL, "beam_size": 4,
                                                              "max_new_tokens": 40}) for _ in range(48)))
        assert set(burst) <= {200, 503}, burst
        assert 503 in burst and 200 in burst, burst
    return statuses


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) for every target, with the dashboard's variables substituted."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = {"__rate_interval": RATE_WINDOW, "__interval": RATE_WINDOW, "__range": RATE_WINDOW}
    for var in dashboard["templating"]["list"]:
        if var["type"] == "datasource":
            continue
        if var.get("includeAll"):
            values[var["name"]] = var.get("allValue") or ".*"
        else:
            values[var["name"]] = var["current"]["value"]
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name in sorted(values, key=len, reverse=True):
                expr = expr.replace("${%s}" % name, values[name]).replace("$" + name, values[name])
            assert "$" not in expr, f"unsubstituted variable in {expr}"
            out.append((panel["title"], expr))
    return out


def documented_metric_names() -> list[str]:
    """Metric names listed in docs/metrics.md's series table (backticked ray_* names)."""
    text = METRICS_DOC.read_text()
    m = re.search(r"^## Series[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, "docs/metrics.md has no series section"
    return sorted(set(re.findall(r"`(ray_[a-z0-9_]+)(?:\{[^`]*)?`", m.group(1))))


@pytest.fixture(scope="module")
def scraped_traffic(prometheus, service_url, pool_url) -> dict[int, int]:
    """Two rounds of traffic, both scraped by Prometheus; returns status -> count of round 2."""
    prom = prometheus
    # The target is up, scraped with the config from deploy/.
    deadline = time.time() + 30
    while True:
        targets = httpx.get(f"{prom}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        if targets and all(t["health"] == "up" for t in targets):
            break
        assert time.time() < deadline, f"scrape targets not up: {targets}"
        time.sleep(1)

    # Round 1 creates the series; round 2 makes every counter and histogram move inside the rate
    # window (a rate over a series whose first sample already holds all counts is 0, a quantile NaN).
    first = asyncio.run(send_traffic(service_url, pool_url))
    assert {200, 404, 415, 422, 503} <= set(first)
    moved = ("sum(ray_mt_sentences_total)", "sum(ray_mt_pool_model_loads_total)", "sum(ray_mt_documents_total)",
             "sum(ray_mt_pool_model_evictions_total)", "sum(ray_mt_language_detections_total)")
    deadline = time.time() + 60
    while math.isnan(before := scalar(prom, 'sum(ray_mt_requests_total{status="503"})')) or \
            any(math.isnan(scalar(prom, e)) for e in ("sum(ray_mt_decode_batch_size_count)", *moved)):
        assert time.time() < deadline, "round-1 metrics did not reach prometheus within 60 s"
        time.sleep(1)
    for _ in range(3):      # a series first seen in the last round (another replica's) has no rate yet: again
        counts = {e: scalar(prom, e) for e in moved}
        before = scalar(prom, 'sum(ray_mt_requests_total{status="503"})')
        second = asyncio.run(send_traffic(service_url, pool_url))
        deadline = time.time() + 60
        while not (scalar(prom, 'sum(ray_mt_requests_total{status="503"})') >= before + second[503] and
                   all(scalar(prom, e) > counts[e] for e in moved)):
            assert time.time() < deadline, "the traffic did not reach prometheus within 60 s"
            time.sleep(1)
        deadline = time.time() + 20
        while (empty := [e for _, e in dashboard_queries() if not finite_samples(query(prom, e))]) and \
                time.time() < deadline:
            time.sleep(2)
        if not empty:
            break
    return second


def test_every_dashboard_query_returns_samples(prometheus, scraped_traffic):
    prom = prometheus
    queries = dashboard_queries()
    assert len(queries) >= 30
    deadline = time.time() + 30
    while True:
        failing = {}
        for title, expr in queries:
            assert "vector(" not in expr, f"{title}: padded expression {expr}"
            result = query(prom, expr)
            if not finite_samples(result):
                failing[f"{title}: {expr}"] = result
        if not failing or time.time() > deadline:
            break
        time.sleep(2)
    assert failing == {}, "dashboard expressions without a non-NaN sample"

    # The dashboard's model variable resolves to the served models.
    r = httpx.get(f"{prom}/api/v1/label/model/values", params={"match[]": "ray_mt_replicas_ready"}, timeout=10)
    assert {"de-en", SECOND_MODEL} <= set(r.json()["data"])
    # Error ratio reflects the 5xx share actually sent (the window covers both rounds).
    ratio = scalar(prom, f'sum(increase(ray_mt_requests_total{{status=~"5.."}}[{RATE_WINDOW}])) / '
                         f'sum(increase(ray_mt_requests_total[{RATE_WINDOW}]))')
    assert 0 < ratio < 1


def test_documented_metric_names_are_exported(prometheus, scraped_traffic):
    names = documented_metric_names()
    assert names, "docs/metrics.md's series section lists no ray_* metric names"
    from conftest import exported_names
    assert set(exported_names()) <= set(names), "docs/metrics.md misses names that service/metrics.py exports"
    deadline = time.time() + 60
    while True:
        present = set(httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"])
        missing = [n for n in names if n not in present]
        if not missing or time.time() > deadline:
            break
        time.sleep(2)
    assert missing == [], f"docs/metrics.md names that Prometheus never scraped: {missing}"
