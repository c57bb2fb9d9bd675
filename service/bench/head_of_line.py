"""Head-of-line blocking: how long one-sentence requests wait behind one very large request.

    python -m service.bench.head_of_line --url http://127.0.0.1:8000

Sends the largest request the API takes (``--texts`` texts of ``--sentences-per-text``
test_2016_flickr sentences each, ``beam_size`` 16, ``min_new_tokens`` 100, ``max_new_tokens`` 120),
then, ``--delay`` seconds later, ``--small`` one-sentence greedy requests one after the other, and
prints each small request's status and latency and the large one's. Run it against a service with
one translator replica (``--config`` with ``translator: {num_replicas: 1}``) to see one engine's
queue: a small request should wait for a slot to free up, not for the whole large request
(``docs/engine.md``, "Turns between API requests"). Bounded: one large and ``--small`` small
requests, each with a time-out. A measurement, not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import httpx

from service.protocol import MAX_BEAM_SIZE, MAX_SENTENCES, MAX_TEXTS
from service.loadtest.config import DEFAULT_SENTENCES, load_sentences


def large_request(lines: list[str], texts: int, per_text: int, min_new_tokens: int, max_new_tokens: int) -> dict:
    """The /v1/translate body of ``texts`` texts, each ``per_text`` consecutive sentences of ``lines``."""
    if texts * per_text > len(lines):
        raise ValueError(f"need {texts * per_text} sentences, the file has {len(lines)}")
    body = [" ".join(lines[per_text * i: per_text * (i + 1)]) for i in range(texts)]
    return {"text": body, "beam_size": MAX_BEAM_SIZE, "min_new_tokens": min_new_tokens,
            "max_new_tokens": max_new_tokens}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m service.bench.head_of_line", description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the service's base URL")
    ap.add_argument("--texts", type=int, default=MAX_TEXTS, help="texts in the large request")
    ap.add_argument("--sentences-per-text", type=int, default=MAX_SENTENCES // MAX_TEXTS)
    ap.add_argument("--min-new-tokens", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=120)
    ap.add_argument("--small", type=int, default=10, help="one-sentence requests sent after it")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds between the large and the first small request")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--sentences", default=str(DEFAULT_SENTENCES), help="sentence file, plain or .gz")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    lines = load_sentences(args.sentences)
    big = large_request(lines, args.texts, args.sentences_per_text, args.min_new_tokens, args.max_new_tokens)
    small_texts = lines[len(lines) // 2:][: args.small]
    result: dict = {}

    def send_large() -> None:
        t = time.perf_counter()
        try:
            r = httpx.post(args.url + "/v1/translate", json=big, timeout=args.timeout)
            result["large"] = (r.status_code, time.perf_counter() - t, "" if r.status_code == 200 else r.text[:200])
        except httpx.HTTPError as e:
            result["large"] = (None, time.perf_counter() - t, repr(e))

    worker = threading.Thread(target=send_large)
    worker.start()
    time.sleep(args.delay)
    latencies = []
    with httpx.Client(timeout=args.timeout) as client:
        for text in small_texts:
            t = time.perf_counter()
            try:
                status = client.post(args.url + "/v1/translate", json={"text": text, "beam_size": 1}).status_code
            except httpx.HTTPError:
                status = None
            latencies.append((status, time.perf_counter() - t))
    worker.join()
    print(f"large request: {args.texts} texts x {args.sentences_per_text} sentences, beam_size {MAX_BEAM_SIZE}, "
          f"min_new_tokens {args.min_new_tokens}, max_new_tokens {args.max_new_tokens}")
    status, seconds, detail = result["large"]
    print(f"  status {status}, {seconds:.2f} s {detail}")
    print(f"{len(latencies)} one-sentence requests, sent one after the other from {args.delay:g} s after it:")
    print("  " + ", ".join(f"{s} {x:.2f} s" for s, x in latencies))
    xs = [x for _, x in latencies]
    if xs:
        print(f"  median {statistics.median(xs):.2f} s, max {max(xs):.2f} s")
    ok = status == 200 and all(s == 200 for s, _ in latencies)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
