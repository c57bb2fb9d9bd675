"""A closed-loop load during which one ingress replica of a local service is killed (SIGKILL).

    python -m service.loadtest.replica_kill                      # starts python -m service, 32 clients, 30 s
    python -m service.loadtest.replica_kill -c 32 -d 30 --kill-at 10 --streams 4 --port 8010

It starts ``python -m service`` (the default layout: ingress replicas holding the translators, behind
HAProxy) on 127.0.0.1, waits for ``/readyz``, runs ``clients`` users each sending its next
request when its previous one ended (``streams`` of them with ``stream: true``), kills one of that
service's own ingress replica processes (``ray::ServeReplica:...:Gateway``, found among the service
process's descendants only) at ``kill_at`` seconds, and prints per kind:

    sent      requests started
    answered  a 2xx answer (a stream: its final ``response`` event)
    failed    an answer that is not 2xx, or a stream that ended with an ``error`` event (its cause named)
    lost      a connection closed without an answer, or a stream cut without an error event

The service is stopped (SIGINT to its process, then SIGKILL of its process group after 60 s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Optional

import httpx

SENTENCES = ["Ein Mann fährt mit dem Fahrrad die Straße entlang.", "Zwei Hunde spielen im Schnee.",
             "Eine Frau liest ein Buch im Park.", "Kinder spielen auf einer Wiese.",
             "Ein Hund rennt über den Strand.", "Ein Mann in einem roten Hemd steht vor einem Gebäude."]


@dataclass
class Tally:
    """Outcomes by kind (plain, stream): sent, answered, failed, lost; the causes seen; and each request's
    (kind, outcome, start, end) in seconds from the load's start (``closed_loop``'s clock)."""
    counts: Counter = field(default_factory=Counter)
    causes: Counter = field(default_factory=Counter)
    records: list[tuple[str, str, float, float]] = field(default_factory=list)

    def add(self, kind: str, outcome: str, cause: str = "", start: float = 0.0, end: float = 0.0) -> None:
        self.counts[(kind, "sent")] += 1
        self.counts[(kind, outcome)] += 1
        self.records.append((kind, outcome, start, end))
        if cause:
            self.causes[f"{kind} {outcome}: {cause[:120]}"] += 1

    def row(self, kind: str) -> dict[str, int]:
        return {k: self.counts[(kind, k)] for k in ("sent", "answered", "failed", "lost")}


async def one(client: httpx.AsyncClient, body: dict, stream: bool) -> tuple[str, str]:
    """(outcome, cause) of one request; outcome answered | failed | lost."""
    try:
        if not stream:
            r = await client.post("/v1/translate", json=body)
            if r.is_success:
                return "answered", ""
            return "failed", f"{r.status_code} {r.text[:100]}"
        last = None
        async with client.stream("POST", "/v1/translate", json={**body, "stream": True}) as r:
            if not r.is_success:
                return "failed", f"{r.status_code} {(await r.aread())[:100]!r}"
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    last = line[6:].strip()
                elif line.startswith("data:") and last == "error":
                    return "failed", "error event " + line[5:].strip()[:100]
        return ("answered", "") if last == "response" else ("lost", f"stream cut after event {last}")
    except httpx.HTTPError as e:
        return "lost", f"{type(e).__name__} {e}"


async def closed_loop(url: str, clients: int, streams: int, duration_s: float,
                      actions: list[tuple[float, Callable[[], object]]] = (), timeout_s: float = 60.0,
                      side: Optional[Callable[[float], Awaitable[None]]] = None) -> tuple[Tally, list[dict]]:
    """``clients`` users for ``duration_s`` seconds, each sending its next request when its previous one
    ended (the first ``streams`` with ``stream: true``); each ``(at_s, fn)`` of ``actions`` runs ``fn()``
    in a thread at ``at_s`` seconds; ``side(start)``, if given, runs beside them (``start``: the load's
    ``time.monotonic()``). Returns the tally and per action ``{"at_s": when it ran, "result": fn()}``."""
    tally, done = Tally(), [{} for _ in actions]
    end = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)

    async def user(k: int, client: httpx.AsyncClient, start: float):
        i = k
        while time.monotonic() < end:
            body = {"text": SENTENCES[i % len(SENTENCES)], "beam_size": 1, "max_new_tokens": 48}
            kind = "stream" if k < streams else "plain"
            t0 = time.monotonic()
            outcome, cause = await one(client, body, kind == "stream")
            tally.add(kind, outcome, cause, round(t0 - start, 4), round(time.monotonic() - start, 4))
            i += clients

    async def act(n: int, at_s: float, fn, start: float):
        await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
        done[n]["at_s"] = round(time.monotonic() - start, 2)
        done[n]["result"] = await asyncio.to_thread(fn)

    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits, trust_env=False) as client:
        start = time.monotonic()
        tasks = [act(n, at, fn, start) for n, (at, fn) in enumerate(actions)] + ([side(start)] if side else [])
        await asyncio.gather(*(user(k, client, start) for k in range(clients)), *tasks)
    return tally, done


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux /proc), breadth first."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out += children.get(p, [])
        todo += children.get(p, [])
    return out


def replicas(service_pid: int, deployment: str = "Gateway") -> list[int]:
    """Live ``ray::ServeReplica:*:<deployment>`` processes below ``service_pid`` (a ``deployment``
    ending in ``*`` matches its prefix: ``Translator-*``; ``*``: every replica)."""
    pids = []
    for p in descendants(service_pid):
        try:
            title = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        name = title.rsplit(":", 1)[-1]
        match = name.startswith(deployment[:-1]) if deployment.endswith("*") else name == deployment
        if title.startswith("ray::ServeReplica:") and match and state != "Z":
            pids.append(p)
    return sorted(pids)


def ingress_replicas(service_pid: int) -> list[int]:
    """Live ``ray::ServeReplica:*:Gateway`` processes below ``service_pid``."""
    return replicas(service_pid, "Gateway")


def haproxy_config(service_pid: int) -> Optional[Path]:
    """The config file of the HAProxy below ``service_pid`` (its ``-f`` argument), if one runs."""
    for p in descendants(service_pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "-f" in argv and "haproxy" in " ".join(argv[:2]) and argv.index("-f") + 1 < len(argv):
            return Path(argv[argv.index("-f") + 1])
    return None


def haproxy_retry_lines(service_pid: int) -> list[str]:
    """The ``retry-on`` / ``retries`` / ``redispatch`` lines of the config of the HAProxy below ``service_pid``."""
    for p in descendants(service_pid):
        try:
            argv = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "-f" in argv and "haproxy" in " ".join(argv[:2]):
            try:
                cfg = Path(argv[argv.index("-f") + 1]).read_text()
            except (OSError, IndexError):
                continue
            return sorted({ln.strip() for ln in cfg.splitlines() if ln.strip().startswith(("retry-on", "retries",
                                                                                          "option "))})
    return []


def start_service(port: int, log: Path, extra: list[str], env: Optional[dict] = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), *extra]
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"python -m service exited with {proc.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the service was not ready within {timeout_s:.0f} s")


def stop_service(proc: subprocess.Popen) -> None:
    """SIGINT to the service process (it shuts Serve and its Ray down), its process group killed after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.loadtest.replica_kill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--clients", type=int, default=32)
    ap.add_argument("--streams", type=int, default=4, help="clients that stream (default %(default)s)")
    ap.add_argument("-d", "--duration", type=float, default=30.0)
    ap.add_argument("--kill-at", type=float, default=10.0, help="seconds into the load (default %(default)s)")
    ap.add_argument("--port", type=int, default=8010)
    ap.add_argument("--replicas", type=int, default=2, help="ingress replicas to wait for (default %(default)s)")
    ap.add_argument("--log", default="replica_kill_service.log", help="the service's output")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep-haproxy-logs", metavar="DIR", help="copy HAProxy's config and logs here after the load")
    ap.add_argument("service_args", nargs="*", help="more arguments of python -m service (after --)")
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    proc = start_service(args.port, Path(args.log), args.service_args)
    try:
        wait_ready(url, proc, 900)
        deadline = time.time() + 300      # /readyz answers once one replica is ready: wait for the others
        while len(ingress_replicas(proc.pid)) < args.replicas and time.time() < deadline:
            time.sleep(1)
        time.sleep(5)                      # their health checks pass in HAProxy
        before = ingress_replicas(proc.pid)
        print(f"ingress replicas: {before}; HAProxy: {haproxy_retry_lines(proc.pid)}", flush=True)

        def kill() -> Optional[int]:
            pids = ingress_replicas(proc.pid)
            if not pids:
                return None
            os.kill(pids[0], signal.SIGKILL)
            return pids[0]
        tally, [event] = asyncio.run(closed_loop(url, args.clients, args.streams, args.duration,
                                                 [(args.kill_at, kill)]))
        event["killed"] = event.pop("result", None)
        event["lost_at_s"] = [round(e, 2) for _, outcome, _, e in tally.records if outcome == "lost"]
        cfg = haproxy_config(proc.pid)
        if args.keep_haproxy_logs and cfg is not None:
            import shutil
            shutil.copytree(cfg.parent, args.keep_haproxy_logs, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.sock", "admin.sock", "metrics.sock"))
        out = {"clients": args.clients, "streams": args.streams, "duration_s": args.duration, "kill": event,
               "plain": tally.row("plain"), "stream": tally.row("stream"), "causes": dict(tally.causes)}
        for kind in ("plain", "stream"):
            print(kind, " ".join(f"{k}={v}" for k, v in out[kind].items()))
        for cause, n in tally.causes.most_common(10):
            print(f"  {n} x {cause}")
        print(f"killed pid {event.get('killed')} at {event.get('at_s')} s", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    finally:
        stop_service(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
