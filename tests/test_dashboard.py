"""The provisioned Grafana dashboard reads every metric family service/metrics.py declares, the way an
operator reads it: a counter through rate() or increase(), a histogram through histogram_quantile()
over rate() of its buckets (or a _sum/_count ratio), a gauge as it is. Offline; tests/test_prometheus.py
runs every expression against a real Prometheus scraping the service."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from service.metrics import METRICS, PREFIX

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "translator.json"


def panel_exprs() -> dict[str, list[str]]:
    """Panel title -> its targets' PromQL expressions."""
    return {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in json.loads(DASHBOARD.read_text())["panels"]}


def reads(expr: str, name: str, kind: str) -> bool:
    """Whether ``expr`` reads family ``name`` (of ``kind``) as an operator would."""
    series = re.escape(PREFIX + name)
    if kind == "counter":
        return re.search(rf"\b(rate|increase)\(\s*{series}\b", expr) is not None
    if kind == "histogram":
        quantile = "histogram_quantile(" in expr and re.search(rf"\brate\(\s*{series}_bucket\b", expr)
        mean = re.search(rf"\brate\(\s*{series}_sum\b", expr) and re.search(rf"\brate\(\s*{series}_count\b", expr)
        return bool(quantile or mean)
    return re.search(rf"\b{series}\b", expr) is not None and not re.search(rf"\b(rate|increase)\(\s*{series}\b", expr)


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_declared_family_has_a_panel_that_reads_it(name):
    kind = METRICS[name][0]
    panels = [title for title, exprs in panel_exprs().items() if any(reads(e, name, kind) for e in exprs)]
    assert panels, f"no dashboard panel reads {PREFIX}{name} ({kind}) as a {kind} is read"


def test_the_reader_check_tells_wrong_reads_apart():
    assert reads("sum(rate(ray_mt_requests_total[5m]))", "mt_requests_total", "counter")
    assert not reads("sum(ray_mt_requests_total)", "mt_requests_total", "counter")       # a raw counter
    assert not reads("sum(rate(ray_mt_requests_total_x[5m]))", "mt_requests_total", "counter")
    assert reads('histogram_quantile(0.9, sum by (le) (rate(ray_mt_queue_wait_seconds_bucket[5m])))',
                 "mt_queue_wait_seconds", "histogram")
    assert not reads("sum(rate(ray_mt_queue_wait_seconds_bucket[5m]))", "mt_queue_wait_seconds", "histogram")
    assert not reads("rate(ray_mt_waiting_requests[5m])", "mt_waiting_requests", "gauge")


def test_panels_have_unique_ids_and_do_not_overlap():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
