"""A fault benchmark: a closed-loop load on a local service during which replicas are killed and the
app is redeployed, with the outcome and latency around each event.

    python -m service.loadtest.chaos                                  # default layout, kill@10,redeploy@25, 45 s
    python -m service.loadtest.chaos --events kill@10,redeploy@25 -c 32 -d 45 --port 8032
    python -m service.loadtest.chaos --layout separate --events kill:translator@10,kill:gateway@25,redeploy@40

It starts ``python -m service`` on 127.0.0.1 (its Ray GCS on a fixed spare port), waits for its
replicas, runs ``python -m service.loadtest.replica_kill``'s closed loop (``clients`` users, ``streams`` of them
streaming) and applies each event at its second:

    kill[:TARGET]  SIGKILL of one replica process of this service: ``ingress`` (default; in the default
                   layout the translators run in it), ``gateway`` (the same) or ``translator`` (the
                   separate layout's ``Translator-<model>``)
    redeploy       a changed config applied to the running app by a second Ray driver
                   (``python -m service.loadtest.redeploy``: each translator replica's ``num_cpus``
                   lowered by 0.05, so Serve replaces every one; ``--change`` another change); the
                   next redeploy applies the service's own config again
    drain          refused: it needs a second node (``ray.cluster_utils.Cluster``, tests/test_cluster.py),
                   which ``python -m service`` does not start

Then it prints, for the ``--window`` seconds before and after each event (a redeploy's "after" lasts
until the app runs again, at least ``--window``), and for the whole run, the requests that ended in
that span:

    sent      requests (plain and streaming)
    answered  a 2xx answer (a stream: its final ``response`` event)
    retried   HAProxy's layer-7 retries in that span (its Prometheus exporter's
              ``haproxy_backend_retry_warnings_total``, sampled every 0.5 s, a reload's reset
              counted as Prometheus' ``increase()`` does; n/a with ``--proxy ray``)
    failed    an answer that is not 2xx, or a stream ending with an ``error`` event
    lost      a connection closed without an answer, or a stream cut without an error event
    p50, p99  latency of the answered ones, ms
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

from service.loadtest.replica_kill import (
    Tally,
    closed_loop,
    haproxy_config,
    replicas,
    start_service,
    stop_service,
    wait_ready,
)

KINDS = ("kill", "redeploy")
TARGETS = {"ingress": "Gateway", "gateway": "Gateway", "translator": "Translator-*"}
RETRIES = "haproxy_backend_retry_warnings_total"


@dataclass
class Event:
    kind: str            # kill | redeploy
    at_s: float          # seconds into the load
    target: str = ""     # kill: ingress | gateway | translator


def parse_events(text: str) -> list[Event]:
    """``kill@10,redeploy@25,kill:translator@40`` -> events in time order; ValueError naming a bad one."""
    events = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"([a-z]+)(?::([a-z]+))?@(\d+(?:\.\d+)?)", item)
        if not m:
            raise ValueError(f"--events: {item!r} is not KIND[:TARGET]@SECONDS")
        kind, target, at = m.group(1), m.group(2) or "", float(m.group(3))
        if kind == "drain":
            raise ValueError("--events: drain needs a two-node cluster, which python -m service does not start "
                             "(tests/test_cluster.py runs one)")
        if kind not in KINDS:
            raise ValueError(f"--events: {kind!r}: expected one of {', '.join(KINDS)}")
        if kind == "kill":
            target = target or "ingress"
            if target not in TARGETS:
                raise ValueError(f"--events: kill:{target}: expected one of {', '.join(TARGETS)}")
        elif target:
            raise ValueError(f"--events: {kind} takes no target, got {item!r}")
        events.append(Event(kind, at, target))
    return sorted(events, key=lambda e: e.at_s)


def counter_at(samples: list[tuple[float, float]], t: float) -> Optional[float]:
    """The last sampled value at or before ``t`` (the first one before any), None without samples."""
    before = [v for s, v in samples if s <= t]
    return before[-1] if before else (samples[0][1] if samples else None)


def cumulative(samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A counter's samples as increases since the first, across resets (Serve reloads HAProxy when replicas
    change, and the new process counts from 0): a drop counts the new value as the increase, as
    Prometheus' ``increase()`` does."""
    out, total, last = [], 0.0, None
    for t, v in samples:
        total += 0.0 if last is None else (v if v < last else v - last)
        out.append((t, total))
        last = v
    return out


def span_row(tally: Tally, a: float, b: float, retries: list[tuple[float, float]]) -> dict:
    """The requests that ended in [a, b): counts by outcome, HAProxy's retries, answered latency (ms)."""
    ended = [(o, e - s) for _, o, s, e in tally.records if a <= e < b]
    lat = np.array([d for o, d in ended if o == "answered"]) * 1000
    r0, r1 = counter_at(retries, a), counter_at(retries, b)
    row = {"from_s": round(a, 1), "to_s": round(b, 1), "sent": len(ended),
           **{k: sum(o == k for o, _ in ended) for k in ("answered", "failed", "lost")},
           "retried": None if r0 is None or r1 is None else int(r1 - r0)}
    row["p50_ms"], row["p99_ms"] = (round(float(np.percentile(lat, q))) for q in (50, 99)) if len(lat) else (None, None)
    return row


def windows(tally: Tally, done: list[dict], window_s: float, retries: list[tuple[float, float]]) -> list[dict]:
    """Rows: per event (``done``: its ``name``, ``t_s`` and, for a redeploy, ``running_s``) before and after (until
    the load's last answer at most), then the whole run."""
    rows, last = [], max((e for *_, e in tally.records), default=0.0)    # the load's last answer
    for ev in done:
        t = ev["t_s"]
        end = min(max(t + window_s, ev.get("running_s") or 0), last)
        rows.append({"event": ev["name"], "span": "before", **span_row(tally, max(0, t - window_s), t, retries)})
        rows.append({"event": ev["name"], "span": "after", **span_row(tally, t, end, retries)})
    rows.append({"event": "whole run", "span": "", **span_row(tally, 0, float("inf"), retries)})
    return rows


def markdown(rows: list[dict]) -> str:
    cols = ["sent", "answered", "retried", "failed", "lost", "p50_ms", "p99_ms"]
    out = ["| event | span (s) | " + " | ".join(c.replace("_ms", " ms") for c in cols) + " |",
           "|---|---|" + "---:|" * len(cols)]
    for r in rows:
        span = f"{r['span']} {r['from_s']:g}-{r['to_s']:g}" if r["span"] else "all"
        out.append(f"| {r['event']} | {span} | " + " | ".join("n/a" if r[c] is None else f"{r[c]:,}" for c in cols)
                   + " |")
    return "\n".join(out)


def exporter_port(config_text: str) -> Optional[int]:
    """The port of the ``frontend prometheus`` section's ``bind`` line of an HAProxy config."""
    m = re.search(r"^frontend prometheus\n(?:[ \t].*\n)*?[ \t]+bind [^\s]*?:(\d+)", config_text, re.M)
    return int(m.group(1)) if m else None


def haproxy_metrics_url(service_pid: int) -> Optional[str]:
    """The Prometheus exporter of the HAProxy below ``service_pid``, on 127.0.0.1."""
    cfg = haproxy_config(service_pid)
    port = exporter_port(cfg.read_text()) if cfg is not None else None
    return f"http://127.0.0.1:{port}/metrics" if port else None


def read_retries(url: str, client: httpx.Client) -> Optional[float]:
    """The sum of HAProxy's ``haproxy_backend_retry_warnings_total`` over its backends, None if unreadable."""
    try:
        text = client.get(url, timeout=2).text
    except httpx.HTTPError:
        return None
    vals = [float(ln.rsplit(None, 1)[1]) for ln in text.splitlines() if ln.startswith(RETRIES)]
    return sum(vals) if vals else None


class Redeployer:
    """``python -m service.loadtest.redeploy`` joined to the service's Ray; ``apply()`` applies the next config."""

    def __init__(self, address: str, config: Optional[str], cpus: Optional[float], change: Optional[str], log: Path):
        cmd = [sys.executable, "-m", "service.loadtest.redeploy", "--address", address]
        cmd += ["--config", config] if config else []
        cmd += ["--cpus", str(cpus)] if cpus else []
        cmd += ["--change", change] if change else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"),
                                     bufsize=0, start_new_session=True)
        if self.line(time.monotonic() + 600) != "ready":
            raise RuntimeError(f"python -m service.loadtest.redeploy did not start (exit {self.proc.poll()}; see {log})")

    def line(self, deadline: float) -> Optional[str]:
        """The driver's next line, None at ``deadline`` (read a byte at a time: nothing waits in a buffer)."""
        fd, buf = self.proc.stdout.fileno(), b""
        while not buf.endswith(b"\n"):
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            byte = os.read(fd, 1)
            if not byte:
                raise RuntimeError(f"the redeploy driver ended (exit {self.proc.wait()})")
            buf += byte
        return buf.decode().strip()

    def apply(self, timeout_s: float = 300.0) -> dict:
        """Seconds from the call to ``applied`` and to ``running`` (None: not running within ``timeout_s``)."""
        t0 = time.monotonic()
        self.proc.stdin.write(b"go\n")
        out = {"running_after_s": None}
        while out["running_after_s"] is None:
            line = self.line(t0 + timeout_s)
            if line is None:
                return out
            word, t = line.split()
            out[f"{word}_after_s"] = round(float(t) - t0, 2)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run(args) -> dict:
    """Starts the service, runs the load with its events, stops everything; the figures."""
    from service.ray_env import spare_port
    events = parse_events(args.events)
    url = f"http://127.0.0.1:{args.port}"
    gcs = spare_port()
    env = {**os.environ, "RAY_GCS_SERVER_PORT": str(gcs)}      # a fixed GCS port for the redeploy driver
    extra = (["--config", args.config] if args.config else []) + (["--num-cpus", str(args.num_cpus)] if args.num_cpus
                                                                   else [])
    extra += ["--ingress", args.layout, "--proxy", args.proxy, *args.service_args]
    proc = start_service(args.port, Path(args.log), extra, env=env)
    redeployer = None
    try:
        wait_ready(url, proc, 900)
        ingress = args.replicas or (2 if args.layout == "translator" else 1)
        deadline = time.time() + 300      # /readyz answers once one replica is ready: wait for the others
        while len(replicas(proc.pid)) < ingress or (args.layout == "separate" and not replicas(proc.pid, "Translator-*")):
            if time.time() > deadline:
                raise RuntimeError(f"replicas not up within 300 s: ingress {replicas(proc.pid)} (want {ingress}), "
                                   f"translators {replicas(proc.pid, 'Translator-*')}; see {args.log}")
            time.sleep(1)
        if any(e.kind == "redeploy" for e in events):
            redeployer = Redeployer(f"127.0.0.1:{gcs}", args.config, args.num_cpus, args.change,
                                    Path(args.log).with_suffix(".redeploy.log"))
        time.sleep(5)                     # the last replica's health checks pass in HAProxy
        metrics = haproxy_metrics_url(proc.pid) if args.proxy == "haproxy" else None
        print(f"replicas: ingress {replicas(proc.pid)}, translators {replicas(proc.pid, 'Translator-*')}; "
              f"HAProxy exporter {metrics}", flush=True)

        def action(ev: Event):
            def kill():
                pids = replicas(proc.pid, TARGETS[ev.target])
                if not pids:
                    return {"killed": None}
                os.kill(pids[0], 9)
                return {"killed": pids[0]}
            def redeploy():
                before = set(replicas(proc.pid, "*"))
                out = redeployer.apply()
                after = set(replicas(proc.pid, "*"))
                return {**out, "replaced": len(before - after), "kept": len(before & after)}
            return kill if ev.kind == "kill" else redeploy

        samples: list[tuple[float, float]] = []

        async def sample(start: float):
            with httpx.Client(trust_env=False) as c:
                while metrics and time.monotonic() < start + args.duration + 2:
                    v = await asyncio.to_thread(read_retries, metrics, c)
                    if v is not None:
                        samples.append((round(time.monotonic() - start, 2), v))
                    await asyncio.sleep(0.5)
        tally, done = asyncio.run(closed_loop(url, args.clients, args.streams, args.duration,
                                              [(e.at_s, action(e)) for e in events], side=sample))
        for ev, d in zip(events, done):
            d.update(d.pop("result", None) or {}, name=f"{ev.kind}{':' + ev.target if ev.target else ''}@{ev.at_s:g}")
            d["t_s"] = round(d["at_s"] + d.get("applied_after_s", 0), 2)
            if d.get("running_after_s") is not None:
                d["running_s"] = round(d["at_s"] + d["running_after_s"], 2)
        rows = windows(tally, done, args.window, cumulative(samples))
        return {"layout": args.layout, "clients": args.clients, "streams": args.streams, "duration_s": args.duration,
                "events": done, "rows": rows, "plain": tally.row("plain"), "stream": tally.row("stream"),
                "causes": dict(tally.causes.most_common(10))}
    finally:
        if redeployer:
            redeployer.close()
        stop_service(proc)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.loadtest.chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", default="kill@10,redeploy@25", help="KIND[:TARGET]@SECONDS, ... (default %(default)s)")
    ap.add_argument("--layout", choices=("translator", "separate"), default="translator")
    ap.add_argument("-c", "--clients", type=int, default=32)
    ap.add_argument("--streams", type=int, default=4, help="clients that stream (default %(default)s)")
    ap.add_argument("-d", "--duration", type=float, default=45.0)
    ap.add_argument("--window", type=float, default=5.0, help="seconds before and after each event (default 5)")
    ap.add_argument("--port", type=int, default=8032)
    ap.add_argument("--config", help="python -m service --config FILE (the redeploy changes it)")
    ap.add_argument("--num-cpus", type=float, help="python -m service --num-cpus")
    ap.add_argument("--proxy", choices=("haproxy", "ray"), default="haproxy")
    ap.add_argument("--change", help="the redeploy's change, build_app arguments as JSON "
                                     "(default: num_cpus 0.05 lower)")
    ap.add_argument("--replicas", type=int, help="ingress replicas to wait for (default 2; separate layout 1)")
    ap.add_argument("--log", default="chaos_service.log", help="the service's output")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("service_args", nargs="*", help="more arguments of python -m service (after --)")
    args = ap.parse_args(argv)
    try:
        parse_events(args.events)
    except ValueError as e:
        ap.error(str(e))
    out = run(args)
    for ev in out["events"]:
        print(" ".join(f"{k}={v}" for k, v in ev.items()))
    print(markdown(out["rows"]))
    for kind in ("plain", "stream"):
        print(kind, " ".join(f"{k}={v}" for k, v in out[kind].items()))
    for cause, n in out["causes"].items():
        print(f"  {n} x {cause}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
