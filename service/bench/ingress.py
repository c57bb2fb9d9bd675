"""The cost of a separate ingress deployment: the same app with the translator behind its own
ingress (proxy -> Gateway -> Translator, ``ingress: separate``) and with the translator inside the
ingress replica (proxy -> Gateway+Translator, ``ingress: translator``), side by side, over HTTP.

    python -m service.bench.ingress [--checkpoint DIR] [--requests 60] [--rounds 2]

Per layout and round: latency of sequential requests for an empty text (no model work: the pure
cost of the layers) and for one test sentence (greedy), then the throughput of 32 concurrent
clients. Layouts alternate (A B A B ...) so background load hits both alike. Bounded: every phase
sends a fixed number of requests to 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from model.checkpoint import DEFAULT_CHECKPOINT
from service.loadtest.config import DEFAULT_SENTENCES, load_sentences
from service.loadtest.serve_app import ServeApp


async def _sequential(url: str, texts: list[str], n: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = await c.post(url + "/v1/translate", json={"text": texts[i % len(texts)], "beam_size": 1})
            r.raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


async def _concurrent(url: str, texts: list[str], n: int, clients: int = 32) -> float:
    """Requests per second of `clients` closed-loop clients sending n requests in all."""
    todo = list(range(n))
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as c:
        async def worker():
            while todo:
                i = todo.pop()
                r = await c.post(url + "/v1/translate", json={"text": texts[i % len(texts)], "beam_size": 1})
                r.raise_for_status()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return n / (time.perf_counter() - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m service.bench.ingress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--requests", type=int, default=60, help="requests per sequential phase")
    ap.add_argument("--concurrent-requests", type=int, default=96, help="requests of the 32-client phase")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-cpus", type=int, default=2)
    args = ap.parse_args(argv)
    sentences = load_sentences(DEFAULT_SENTENCES)[:64]
    app = ServeApp(num_cpus=args.num_cpus, namespace="mt-bench-ingress")
    url = app.url
    results: dict[str, dict[str, list]] = {}
    try:
        for rnd in range(args.rounds):
            for layout in ("separate", "translator"):
                app.deploy({"models": [{"checkpoint": args.checkpoint}], "ingress": layout})
                asyncio.run(_sequential(url, sentences, 5))   # warm-up
                empty = asyncio.run(_sequential(url, [""], args.requests))
                one = asyncio.run(_sequential(url, sentences, args.requests))
                rps = asyncio.run(_concurrent(url, sentences, args.concurrent_requests))
                r = results.setdefault(layout, {"empty": [], "one": [], "rps": []})
                r["empty"] += empty
                r["one"] += one
                r["rps"].append(rps)
                print(f"round {rnd + 1} {layout:>10}: empty p50 {statistics.median(empty) * 1e3:6.1f} ms, "
                      f"sentence p50 {statistics.median(one) * 1e3:6.1f} ms, 32 clients {rps:5.1f} req/s", flush=True)
                app.delete()
    finally:
        app.close()
    print("\nlayout                       empty-text p50   sentence p50   32-client req/s")
    for layout, r in results.items():
        name = {"separate": "separate ingress (2 hops)", "translator": "translator as ingress"}[layout]
        print(f"{name:<28} {statistics.median(r['empty']) * 1e3:10.1f} ms {statistics.median(r['one']) * 1e3:11.1f} ms "
              f"{statistics.median(r['rps']):14.1f}")


if __name__ == "__main__":
    main()
