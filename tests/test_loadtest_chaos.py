"""``python -m service.loadtest.chaos``: its event list, the counts and latency per span around each
event, the HAProxy exporter's port, the redeploy's changed config; and (slow: it starts ``python -m
service``) a short run with one kill and one redeploy that loses nothing (docs/performance.md#faults)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.loadtest.chaos import (
    Event,
    Redeployer,
    counter_at,
    cumulative,
    exporter_port,
    main,
    markdown,
    parse_events,
    span_row,
    windows,
)
from service.loadtest.redeploy import configs, merged
from service.loadtest.replica_kill import Tally, replicas


def test_events_parse_in_time_order_with_their_targets():
    assert parse_events("redeploy@25, kill@10,kill:translator@40.5") == [
        Event("kill", 10.0, "ingress"), Event("redeploy", 25.0), Event("kill", 40.5, "translator")]


@pytest.mark.parametrize("text, words", [
    ("kill@", "KIND[:TARGET]@SECONDS"), ("kill:proxy@3", "kill:proxy"), ("restart@3", "'restart'"),
    ("redeploy:gateway@3", "takes no target"), ("drain@20", "two-node cluster")])
def test_a_bad_event_is_refused_by_name(text, words):
    with pytest.raises(ValueError, match="--events") as e:
        parse_events(text)
    assert words in str(e.value)


def tally() -> Tally:
    t = Tally()
    for start, end in [(0.0, 0.1), (0.5, 0.7), (1.0, 1.3), (4.0, 4.2)]:   # before the event at 5 s
        t.add("plain", "answered", start=start, end=end)
    t.add("plain", "lost", "RemoteProtocolError", start=4.9, end=5.0)    # ends at the event: after it
    t.add("stream", "failed", "error event", start=5.0, end=6.0)
    t.add("plain", "answered", start=5.0, end=7.0)
    t.add("plain", "answered", start=20.0, end=21.0)                    # outside both spans
    return t


def test_each_span_counts_the_requests_that_ended_in_it():
    retries = [(0.0, 10.0), (4.5, 10.0), (5.5, 13.0), (9.9, 14.0)]
    before = span_row(tally(), 0, 5, retries)
    assert before == {"from_s": 0, "to_s": 5, "sent": 4, "answered": 4, "failed": 0, "lost": 0, "retried": 0,
                      "p50_ms": 200, "p99_ms": 297}
    after = span_row(tally(), 5, 10, retries)
    assert (after["sent"], after["answered"], after["failed"], after["lost"], after["retried"]) == (3, 1, 1, 1, 4)
    assert after["p50_ms"] == after["p99_ms"] == 2000                     # the one answered, 2 s
    assert span_row(tally(), 5, 10, [])["retried"] is None              # no exporter: n/a


def test_rows_per_event_then_the_whole_run_and_a_redeploy_lasts_until_it_runs():
    rows = windows(tally(), [{"name": "kill@5", "t_s": 5.0}, {"name": "redeploy@3", "t_s": 3.0, "running_s": 12.0}],
                   window_s=2.0, retries=[])
    assert [(r["event"], r["span"], r["from_s"], r["to_s"], r["sent"]) for r in rows] == [
        ("kill@5", "before", 3.0, 5.0, 1), ("kill@5", "after", 5.0, 7.0, 2),
        ("redeploy@3", "before", 1.0, 3.0, 1), ("redeploy@3", "after", 3.0, 12.0, 4), ("whole run", "", 0, float("inf"), 8)]
    late = windows(tally(), [{"name": "redeploy@3", "t_s": 3.0, "running_s": 40.0}], window_s=2.0, retries=[])
    assert late[1]["to_s"] == 21.0                                       # the load's last answer
    table = markdown(rows).splitlines()
    assert table[0] == "| event | span (s) | sent | answered | retried | failed | lost | p50 ms | p99 ms |"
    assert table[3] == "| kill@5 | after 5-7 | 2 | 0 | n/a | 1 | 1 | n/a | n/a |"
    assert table[-1].startswith("| whole run | all | 8 | 6 | n/a | 1 | 1 |")


def test_the_counter_is_read_at_the_last_sample_before_a_time():
    samples = [(1.0, 3.0), (2.0, 5.0)]
    assert [counter_at(samples, t) for t in (0.5, 1.0, 1.9, 9.0)] == [3.0, 3.0, 3.0, 5.0]
    assert counter_at([], 1.0) is None


def test_the_exporter_port_is_read_from_the_config_serve_writes():
    cfg = ("global\n    maxconn 1000\nfrontend prometheus\n    bind 127.0.0.1:9123\n    mode http\n"
           "frontend http_frontend\n    bind 127.0.0.1:8000\n")
    assert exporter_port(cfg) == 9123
    assert exporter_port(cfg.replace("frontend prometheus", "frontend other")) is None


def test_the_redeploy_changes_the_replicas_resources_and_keeps_the_rest(tmp_path):
    assert merged({"engine": {"a": 1, "b": 2}, "x": 1}, {"engine": {"b": 3}}) == {"engine": {"a": 1, "b": 3}, "x": 1}
    cfg = tmp_path / "app.yaml"
    cfg.write_text("engine: {max_num_seqs: 16}\n")
    base, changed = configs(str(cfg), 2, None)
    assert base["translator"] == changed["translator"] == {"num_replicas": 2}   # as python -m service on 2 CPUs
    assert "num_cpus" not in base and changed["num_cpus"] == 0.75
    assert changed["engine"] == {"max_num_seqs": 16}
    assert configs(str(cfg), 1, {"engine": {"max_num_seqs": 8}})[1] == {"engine": {"max_num_seqs": 8},
                                                                        "translator": {"num_replicas": 1}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.cluster      # stops the shared service: runs after every test that uses it (conftest)
def test_a_kill_and_a_redeploy_under_load_lose_nothing(no_shared_service, tmp_path):
    from conftest import build_tiny_checkpoint
    ckpt = build_tiny_checkpoint(tmp_path / "de-en", "de", "en", max_len=64)
    cfg = tmp_path / "app.yaml"
    cfg.write_text(f"models: [{{name: de-en, checkpoint: {ckpt}}}]\nengine: {{max_num_seqs: 16}}\n")
    out = tmp_path / "chaos.json"
    # plain requests only: a stream under way on the killed replica is cut (docs/deploy.md#replica-loss)
    assert main(["--config", str(cfg), "--events", "kill@5,redeploy@10", "-c", "8", "--streams", "0",
                 "-d", "35", "--port", str(free_port()), "--log", str(tmp_path / "service.log"),
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    kill, redeploy = result["events"]
    assert kill["killed"] > 0 and kill["t_s"] >= 5
    assert 0 <= redeploy["applied_after_s"] < redeploy["running_after_s"] and redeploy["t_s"] >= 10
    # num_cpus changed: Serve replaced every replica that ran when the redeploy began (the killed one's
    # replacement may still have been starting then)
    assert redeploy["replaced"] >= 1 and redeploy["kept"] == 0
    print(markdown(result["rows"]))
    whole = result["rows"][-1]
    assert whole["event"] == "whole run" and whole["sent"] >= 50
    assert whole["lost"] == 0 and whole["failed"] == 0 and whole["answered"] == whole["sent"], result
    assert whole["retried"] is not None and whole["retried"] >= 0
    assert result["stream"]["sent"] == 0 and result["plain"]["sent"] == whole["sent"]
    assert [r["span"] for r in result["rows"]] == ["before", "after", "before", "after", ""]
    assert Path(tmp_path / "service.log").read_text().count("service ready on") == 1


def test_kill_targets_are_found_by_deployment_among_the_services_processes():
    procs = {name: subprocess.Popen([f"ray::ServeReplica:mt:{name}", "30"], executable="sleep")
             for name in ("Gateway", "Translator-de-en", "Translator-en-fr")}
    try:
        mine = os.getpid()
        assert set(replicas(mine, "Translator-*")) >= {procs["Translator-de-en"].pid, procs["Translator-en-fr"].pid}
        assert procs["Gateway"].pid not in replicas(mine, "Translator-*")
        assert procs["Gateway"].pid in replicas(mine) and procs["Translator-de-en"].pid not in replicas(mine)
        assert set(replicas(mine, "*")) >= {p.pid for p in procs.values()}
        assert replicas(procs["Gateway"].pid) == []
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_retries_add_up_across_haproxy_reloads():
    raw = [(0.0, 5.0), (1.0, 7.0), (2.0, 2.0), (3.0, 2.0), (4.0, 6.0)]     # a reload between 1 and 2 s
    assert cumulative(raw) == [(0.0, 0.0), (1.0, 2.0), (2.0, 4.0), (3.0, 4.0), (4.0, 8.0)]
    assert cumulative([]) == []


def test_the_redeploy_driver_is_read_with_a_deadline_and_nothing_left_in_a_buffer():
    driver = ("import sys, time\n"
              "sys.stdin.readline(); print('applied 1.5\\nrunning 4.0', flush=True)\n"   # both lines at once
              "sys.stdin.readline(); print('applied 9.0', flush=True); time.sleep(30)\n")
    r = Redeployer.__new__(Redeployer)
    r.proc = subprocess.Popen([sys.executable, "-c", driver], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    try:
        first = r.apply(timeout_s=20)
        assert first["running_after_s"] - first["applied_after_s"] == 2.5
        t0 = time.monotonic()
        second = r.apply(timeout_s=1.0)                # applied, never running
        assert second["running_after_s"] is None and "applied_after_s" in second
        assert 0.9 < time.monotonic() - t0 < 10
    finally:
        r.proc.kill()
        r.proc.wait()
