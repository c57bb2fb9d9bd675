"""``python -m service.bench.fuzzy_memory``: fuzzy lookups in the translation memory
(service/translator/fuzzy.py) at 10,000 and 100,000 stored segments; figures, not a test.

    python -m service.bench.fuzzy_memory [--data-dir ../shared/data/multi30k] [--sizes 10000 100000]
                                         [--queries 2000] [--check 200] [--threshold 75]

Segments: the Multi30k train sentences of de, en, fr and cs (29,000 each; never a test set),
normalized as the memory keys them, deduplicated and shuffled (seed 0); a memory of N holds the first
N (targets: the sources upper-cased), put into a MemoryStore file as /v1/memory would. Queries,
interleaved: half near matches (a stored segment with one word replaced), half train sentences the
memory does not hold (mostly no match at 75).

Per size: the index's first build (``FuzzyMemory.index``: the store's export and ``FuzzyIndex``); each
query's lookup as a request makes it (the store's generation read, then ``FuzzyIndex.best`` at
--threshold), p50/p99 of wall-clock ms and of the thread's CPU ms (``time.thread_time``: the lookup's
own cost, apart from waiting for a core on a shared machine); the queries matched; agreement with a
full scan (rapidfuzz ``process.extractOne`` over every segment at the same threshold: the same score,
or no match for both) on the first --check queries; and the exact lookup every request makes
(``MemoryStore.lookup`` of one sentence through SQLite), p50/p99 ms. The load average is printed
before and after: figures from a busy machine say so.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from rapidfuzz import fuzz, process

from service.translator.fuzzy import FuzzyMemory
from service.translator.memory import MemoryStore, normalize

DATA_DIR = "../shared/data/multi30k"
LANGS = ("de", "en", "fr", "cs")
REPLACEMENTS = ("Hund", "cat", "rouge", "velký", "blue", "Mann", "femme", "street")


def segments(data: Path) -> list[str]:
    """The train sentences of LANGS, normalized, deduplicated, shuffled (seed 0)."""
    lines: list[str] = []
    for lang in LANGS:
        with gzip.open(data / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            lines += [normalize(x) for x in f]
    out = [x for x in dict.fromkeys(lines) if x]
    random.Random(0).shuffle(out)
    return out


def near(line: str, rnd: random.Random) -> str:
    words = line.split()
    words[rnd.randrange(len(words))] = rnd.choice(REPLACEMENTS)
    return " ".join(words)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(size: int, pool: list[str], unseen: list[str], n_queries: int, n_check: int, threshold: float,
        tmp: Path) -> dict:
    stored = pool[:size]
    rnd = random.Random(size)
    queries = [near(rnd.choice(stored), rnd) if i % 2 == 0 else unseen[i // 2 % len(unseen)]
               for i in range(n_queries)]
    store = MemoryStore(tmp / f"memory-{size}.sqlite3")
    for i in range(0, size, 10_000):
        store.put("bench", "", [(s, s.upper()) for s in stored[i:i + 10_000]], origin="import")
    fuzzy = FuzzyMemory(store)
    t = time.perf_counter()
    fuzzy.index("bench", "")
    build_s = time.perf_counter() - t
    wall, cpu, matched = [], [], 0
    gc.collect()
    for q in queries:
        t, c = time.perf_counter(), time.thread_time()
        match = fuzzy.index("bench", "").best(q, threshold)
        cpu.append((time.thread_time() - c) * 1e3)
        wall.append((time.perf_counter() - t) * 1e3)
        matched += match is not None
    agree = 0
    index = fuzzy.index("bench", "")
    for q in queries[:n_check]:
        full, match = process.extractOne(q, stored, scorer=fuzz.ratio, score_cutoff=threshold), index.best(q, threshold)
        agree += (full is None and match is None) or (full is not None and match is not None and full[1] == match.score)
    exact = []
    for q in stored[:n_queries]:
        t = time.perf_counter()
        store.lookup("bench", "", [q])
        exact.append((time.perf_counter() - t) * 1e3)
    return {"size": size, "build_s": build_s, "wall": wall, "cpu": cpu, "matched": matched, "n": len(queries),
            "agree": agree, "checked": min(n_check, len(queries)), "exact": exact}


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    words = set(text.split())
    return " ".join(sorted(w for w in words if w.startswith("avx512") or w in ("avx2", "fma")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--check", type=int, default=200, help="queries also answered by a full scan (agreement)")
    p.add_argument("--threshold", type=float, default=75.0)
    args = p.parse_args()
    pool = segments(Path(args.data_dir))
    unseen = pool[max(args.sizes):]         # queries no memory holds
    if not unseen:
        p.error(f"--sizes: at most {len(pool) - 1} (the segments there are)")
    print(f"{len(pool)} segments from train.{{{','.join(LANGS)}}}.gz; threshold {args.threshold:g}; "
          f"{os.cpu_count()} CPUs ({cpu_flags()}); load average {os.getloadavg()[0]:.1f} before")
    print(f"{'segments':>9} {'build s':>8} {'wall p50':>9} {'wall p99':>9} {'cpu p50':>8} {'cpu p99':>8} "
          f"{'matched':>9} {'= scan':>8} {'exact p50':>10} {'exact p99':>10}   (ms)")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            r = run(size, pool, unseen, args.queries, args.check, args.threshold, Path(tmp))
            print(f"{r['size']:>9,} {r['build_s']:>8.2f} {pct(r['wall'], .5):>9.2f} {pct(r['wall'], .99):>9.2f} "
                  f"{pct(r['cpu'], .5):>8.2f} {pct(r['cpu'], .99):>8.2f} {r['matched']:>4}/{r['n']:<4} "
                  f"{r['agree']:>3}/{r['checked']:<4} {pct(r['exact'], .5):>10.3f} {pct(r['exact'], .99):>10.3f}")
    print(f"load average {os.getloadavg()[0]:.1f} after; mean wall ms at {r['size']:,}: "
          f"{statistics.fmean(r['wall']):.2f}")


if __name__ == "__main__":
    main()
