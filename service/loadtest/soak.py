"""Soak test: many mixed requests, a translator replica killed in the middle, replica memory watched.

    python -m service.loadtest soak                        # 10,000 requests, its own service (shipped model)
    python -m service.loadtest soak -n 2000 -c 16 --checkpoint DIR --max-duration 600

It starts the service itself (its own Ray instance, HTTP on a free 127.0.0.1 port, ``--replicas``
translator replicas), sends ``--requests`` requests from ``--concurrency`` closed-loop clients, each
request one of these kinds (drawn with ``--seed``):

    valid      1-3 sentences, beam 1 or 4                          expect 200
    streamed   "stream": true, read to the end                     expect 200 with a `response` event
    invalid    a bad field, an unknown model, a text over the limit expect 4xx
    cancelled  "stream": true, the client leaves after the first event
    deadline   several sentences with a small timeout_s            expect 200 or 504

Halfway through it kills one translator replica's actor (``ray.kill``; Serve starts a new one, and
the gateway retries the requests it held, service/api/backends.py). It prints the count of each
(kind, outcome) and the resident memory (RSS, MiB) of every translator replica process after the
warm-up (``--warmup``, a fraction of the requests), just before the kill, and at the end; memory
has levelled off when each replica that lived through the whole run ends within 5% of its
post-warm-up figure. Bounded: ``--max-duration`` seconds, then the clients stop.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import httpx

from .config import DEFAULT_SENTENCES, check_url, load_sentences

KINDS = {"valid": 0.45, "streamed": 0.2, "invalid": 0.1, "cancelled": 0.1, "deadline": 0.15}
LEVEL_TOLERANCE = 0.05          # memory levelled off: within 5% of the post-warm-up figure
EXPECTED_5XX = {"deadline": {504}}   # the 5xx answers a kind may get by design


@dataclass
class SoakConfig:
    url: str
    requests: int = 10_000
    concurrency: int = 8
    model: Optional[str] = None
    seed: int = 0
    warmup: float = 0.05            # fraction of the requests before the first memory figure
    restart_at: float = 0.5         # fraction of the requests when a replica is killed
    timeout: float = 120.0          # seconds per request
    max_duration: float = 3600.0    # seconds; the clients stop sending then


@dataclass
class SoakResult:
    counts: Counter = field(default_factory=Counter)     # (kind, outcome) -> requests
    rss: dict = field(default_factory=dict)              # phase -> {replica: MiB}
    restarted: Optional[str] = None                      # the killed replica
    elapsed_s: float = 0.0
    sent: int = 0

    def unexpected_5xx(self) -> dict:
        """(kind, outcome) -> count of 5xx answers (or transport failures) a kind should not get."""
        bad = {}
        for (kind, outcome), n in self.counts.items():
            code = int(outcome.split()[0]) if outcome[:1].isdigit() else None
            if outcome.startswith("failed") or (code and code >= 500 and code not in EXPECTED_5XX.get(kind, ())):
                bad[(kind, outcome)] = n
        return bad

    def levelled(self) -> Optional[bool]:
        """Whether every replica present after the warm-up and at the end ends within 5% of its
        post-warm-up RSS (None: no replica lived through the whole run)."""
        start, end = self.rss.get("start", {}), self.rss.get("end", {})
        both = [r for r in start if r in end]
        if not both:
            return None
        return all(abs(end[r] - start[r]) <= LEVEL_TOLERANCE * start[r] for r in both)

    def to_dict(self) -> dict:
        return {"counts": {f"{k} {o}": n for (k, o), n in sorted(self.counts.items())}, "rss_mib": self.rss,
                "restarted": self.restarted, "elapsed_s": round(self.elapsed_s, 1), "sent": self.sent,
                "levelled": self.levelled(), "unexpected_5xx": sum(self.unexpected_5xx().values())}


def make_request(kind: str, rng: random.Random, sentences: Sequence[str], model: Optional[str]) -> dict:
    """The JSON body of one request of ``kind``."""
    def text(n: int) -> str:
        return " ".join(rng.choice(sentences) for _ in range(n))
    body: dict = {"text": text(rng.randint(1, 3))}
    if model:
        body["model"] = model
    if kind == "valid":
        body["beam_size"] = rng.choice((1, 4))
    elif kind in ("streamed", "cancelled"):
        body["stream"] = True
    elif kind == "deadline":
        body.update(text=text(rng.randint(4, 8)), timeout_s=rng.choice((0.01, 0.05, 0.2, 1.0)))
    elif kind == "invalid":
        body.update(rng.choice(({"beam_size": 0}, {"model": "no-such-model"}, {"unknown_field": 1},
                                {"text": "x" * 5001}, {"max_new_tokens": -1}, {"text": 42})))
    return body


async def send_one(client: httpx.AsyncClient, kind: str, body: dict) -> str:
    """The outcome of one request: ``"<status>"``, ``"200 error:<type>"`` for a stream that ended in
    an error event, ``"200 cancelled"`` or ``"failed <exception>"``."""
    try:
        if not body.get("stream"):
            r = await client.post("/v1/translate", json=body)
            return str(r.status_code)
        async with client.stream("POST", "/v1/translate", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return str(r.status_code)
            last = None
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    last = line[7:]
                    if kind == "cancelled":
                        return "200 cancelled"      # leaving closes the connection mid-stream
                elif line.startswith("data: ") and last == "error":
                    return f"200 error:{json.loads(line[6:])['error']['type']}"
            return "200" if last == "response" else "200 incomplete"
    except httpx.HTTPError as e:
        return f"failed {type(e).__name__}"


async def run_soak(cfg: SoakConfig, sentences: Sequence[str], restart: Optional[Callable[[], str]] = None,
                   rss: Optional[Callable[[], dict]] = None, progress: bool = True) -> SoakResult:
    """Send the soak's requests; ``restart()`` (run in a thread) kills a replica and names it,
    ``rss()`` -> {replica: MiB}. Returns the counts and memory figures."""
    rng = random.Random(cfg.seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=cfg.requests)
    bodies = [make_request(k, rng, sentences, cfg.model) for k in kinds]
    res = SoakResult()
    done = 0
    marks = {"start": max(1, int(cfg.warmup * cfg.requests)), "middle": max(1, int(cfg.restart_at * cfg.requests))}
    events: dict[str, asyncio.Event] = {m: asyncio.Event() for m in marks}
    queue = iter(range(cfg.requests))
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=cfg.concurrency, max_keepalive_connections=cfg.concurrency)

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done
        for i in queue:
            if time.monotonic() - t0 > cfg.max_duration:
                return
            res.sent += 1
            res.counts[kinds[i], await send_one(client, kinds[i], bodies[i])] += 1
            done += 1
            for m, at in marks.items():
                if done >= at:
                    events[m].set()

    async def watcher() -> None:
        loop = asyncio.get_running_loop()
        for phase in ("start", "middle"):
            await events[phase].wait()
            if rss is not None:
                res.rss[phase] = await loop.run_in_executor(None, rss)
            if phase == "middle" and restart is not None:
                res.restarted = await loop.run_in_executor(None, restart)
            if progress:
                print(f"  {phase}: {done} requests done, {time.monotonic() - t0:.0f} s"
                      f"{f', killed {res.restarted}' if phase == 'middle' and res.restarted else ''}", flush=True)

    async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout, limits=limits, trust_env=False) as client:
        watch = asyncio.create_task(watcher())
        await asyncio.gather(*(client_loop(client) for _ in range(cfg.concurrency)))
        for e in events.values():
            e.set()
        await watch
    res.elapsed_s = time.monotonic() - t0
    if rss is not None:
        await asyncio.sleep(2.0)        # let the engines finish the sentences of cancelled streams
        res.rss["end"] = rss()
    return res


def format_result(res: SoakResult) -> str:
    lines = [f"{res.sent} requests in {res.elapsed_s:.0f} s", "", f"{'kind':<10} {'outcome':<24} {'count':>6}"]
    for (kind, outcome), n in sorted(res.counts.items()):
        lines.append(f"{kind:<10} {outcome:<24} {n:>6}")
    lines.append(f"{'total':<35} {sum(res.counts.values()):>6}")
    lines += ["", "translator replica RSS (MiB):"]
    for replica in sorted({r for phase in res.rss.values() for r in phase}):
        figs = "  ".join(f"{p} {res.rss[p][replica]:7.0f}" if replica in res.rss.get(p, {}) else f"{p} {'-':>7}"
                         for p in ("start", "middle", "end"))
        lines.append(f"  {replica:<40} {figs}")
    lev = res.levelled()
    lines += [f"killed mid-run: {res.restarted or 'none'}",
              f"memory levelled off (each surviving replica's end within {LEVEL_TOLERANCE:.0%} of start): "
              f"{'n/a' if lev is None else 'yes' if lev else 'NO'}",
              f"unexpected 5xx or failed: {sum(res.unexpected_5xx().values())}"]
    return "\n".join(lines)


# ---- the service the soak runs against (its own Ray instance) -------------------------------------------
def replica_actors(app: str, deployment_prefix: str = "Translator-") -> list[str]:
    """Names of the live replica actors of ``app``'s translator deployments."""
    import ray
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment_prefix}"))


def kill_replica(app: str) -> str:
    """Kill one translator replica actor of ``app`` (Serve replaces it); returns its actor name."""
    import ray
    name = replica_actors(app)[0]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


def replica_rss(app: str) -> dict[str, float]:
    """{``pid <n>``: RSS in MiB} of this machine's translator replica processes of ``app`` (found by
    their process title ``ray::ServeReplica:<app>:Translator-...``; Linux /proc)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            title = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if title.startswith(f"ray::ServeReplica:{app}:Translator-"):
                kb = next(int(line.split()[1]) for line in (d / "status").read_text().splitlines()
                          if line.startswith("VmRSS:"))
                out[f"pid {d.name}"] = kb / 1024
        except (OSError, StopIteration, ValueError):
            continue
    return out


def build_parser() -> argparse.ArgumentParser:
    from model.checkpoint import DEFAULT_CHECKPOINT
    ap = argparse.ArgumentParser(prog="python -m service.loadtest soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--requests", type=int, default=10_000)
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="served model (default: the shipped one)")
    ap.add_argument("--replicas", type=int, default=2, help="translator replicas (default 2)")
    ap.add_argument("--num-cpus", type=int, help="CPUs of the Ray instance (default: all)")
    ap.add_argument("--sentences", default=str(DEFAULT_SENTENCES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-duration", type=float, default=3600.0, help="seconds (default %(default)g)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    return ap


def soak_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.requests < 1 or args.concurrency < 1 or args.replicas < 1:
        build_parser().error("--requests, --concurrency and --replicas must be >= 1")
    from .serve_app import ServeApp
    app = ServeApp(num_cpus=args.num_cpus, namespace="mt-soak")
    app.name = "soak"
    try:
        check_url(app.url)
        print(f"starting the service on {app.url} ({args.replicas} translator replicas)", flush=True)
        app.deploy({"models": [{"name": "de-en", "checkpoint": args.checkpoint}], "ingress": "separate",
                    "translator": {"num_replicas": args.replicas}})   # the gateway retries the killed replica's requests
        cfg = SoakConfig(url=app.url, requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                         max_duration=args.max_duration)
        res = asyncio.run(run_soak(cfg, load_sentences(args.sentences), lambda: kill_replica(app.name),
                                   lambda: replica_rss(app.name)))
    finally:
        app.close()
    print(format_result(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res.to_dict(), indent=2) + "\n")
    return 0 if not res.unexpected_5xx() else 1


if __name__ == "__main__":
    sys.exit(soak_main(sys.argv[1:]))
