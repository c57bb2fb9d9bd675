"""The decode step with each decoder layer in one compiled call (``model/fused_step.py``) against the
module path, interleaved, one torch thread:

    python -m service.bench.fused_step                         # int8 (the default linear dtype)
    MT_LINEAR_DTYPE=float32 python -m service.bench.fused_step

(1) one ``decode_step`` of R rows on the shipped model's paged cache (R German test_2016_flickr
sentences, each at target position 8), in ms per step, median of interleaved repeats, for R in
1..256; (2) ``generate`` on one sentence at a time (batch 1, greedy, the first ``--sentences``
sentences), in ms per sentence: a single client's latency. Both paths give the same bits
(``tests/test_fused_step.py``). A timing, not a test.
"""
from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import time
from pathlib import Path

ROWS = (1, 4, 16, 32, 64, 128, 256)
SOURCES = Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k" / "test_2016_flickr.de.gz"
PATHS = ("compiled layer step", "module path")


def _switch(name: str, op) -> None:
    from model import kernels
    kernels._loaded["decoder_step"] = op if name == PATHS[0] else None


def steps(model, srcs, repeats: int = 7) -> None:
    """Part (1): one decode step of R rows, both paths."""
    import torch
    from model.decoding import decode_step, encode_into_cache, pad_batch
    from model.paged_cache import PagedKVCache
    n = max(ROWS)
    srcs = (srcs * (-(-n // len(srcs))))[:n]
    cache = PagedKVCache.for_model(model, n, max_tgt_len=32)
    slots = torch.tensor(cache.slots.allocate(n))
    with torch.inference_mode():
        encode_into_cache(model, cache, slots[:, None], pad_batch(srcs, model.cfg.pad_id),
                          torch.tensor([len(s) for s in srcs]))
        g = torch.Generator().manual_seed(0)
        for p in range(9):   # every row's target history up to position 8
            decode_step(model, cache, slots, torch.randint(4, model.cfg.vocab_size, (n,), generator=g),
                        torch.full((n,), p))
    from model import kernels
    op = kernels.decoder_step_op()
    print(f"(1) one decode_step, {model.linear_dtype} linear layers, ms (compiled layer step / module path)")
    print(f"{'rows':>6} {'compiled':>10} {'module':>10} {'ratio':>7}")
    for rows in ROWS:
        s = slots[:rows]
        tokens = torch.randint(4, model.cfg.vocab_size, (rows,), generator=g)
        pos = torch.full((rows,), 8)
        inner = max(3, 400 // rows)
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        with torch.inference_mode():
            for _ in range(repeats):
                for name in PATHS:
                    _switch(name, op)
                    t = time.perf_counter()
                    for _ in range(inner):
                        decode_step(model, cache, s, tokens, pos)
                    times[name].append((time.perf_counter() - t) / inner)
        a, b = (statistics.median(times[p]) * 1e3 for p in PATHS)
        print(f"{rows:>6} {a:10.3f} {b:10.3f} {b / a:6.2f}x")
    kernels._loaded.pop("decoder_step", None)


def latency(model, srcs, rounds: int = 3) -> None:
    """Part (2): batch-1 greedy ``generate``, both paths, interleaved rounds."""
    from model import kernels
    from model.decoding import generate
    op = kernels.decoder_step_op()
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    tokens = 0
    for s in srcs[:5]:
        generate(model, [s])
    for _ in range(rounds):
        for name in PATHS:
            _switch(name, op)
            t = time.perf_counter()
            tokens = sum(len(generate(model, [s])[0][0].tokens) for s in srcs)
            times[name].append((time.perf_counter() - t) / len(srcs))
    kernels._loaded.pop("decoder_step", None)
    print(f"(2) generate, batch 1, greedy, {len(srcs)} sentences ({tokens} tokens), {model.linear_dtype}, median of "
          f"{rounds} interleaved rounds:")
    base = statistics.median(times[PATHS[1]])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"    {name:<20} {m * 1e3:6.2f} ms/sentence  {m * len(srcs) / tokens * 1e3:5.3f} ms/token  {base / m:4.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.bench.fused_step", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--checkpoint", default="model/checkpoints/de-en")
    ap.add_argument("--sentences", type=int, default=100, help="(2): sentences translated per round (>= 1)")
    ap.add_argument("--parts", default="1,2", help="1 (one step), 2 (batch-1 latency), or both")
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or not parts <= {"1", "2"}:
        ap.error(f"--parts must be 1, 2 or 1,2, got {args.parts!r}")
    if args.sentences < 1:
        ap.error(f"--sentences must be >= 1, got {args.sentences}")
    import torch
    from model import kernels
    from model.checkpoint import load_checkpoint
    torch.set_num_threads(1)
    if kernels.decoder_step_op() is None:
        print("the compiled CPU kernels are unavailable here (MT_CPU_KERNELS=0, or no compiler)", file=sys.stderr)
        return 1
    try:
        model, tok, _ = load_checkpoint(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = gzip.open(SOURCES, "rt", encoding="utf-8").read().splitlines()
    srcs = [tok.encode(s) + [model.cfg.eos_id] for s in lines]
    if "1" in parts:
        steps(model, srcs)
    if "2" in parts:
        latency(model, srcs[:args.sentences])
    return 0


if __name__ == "__main__":
    sys.exit(main())
