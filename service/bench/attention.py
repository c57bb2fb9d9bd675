"""The compiled decode-step attention (``csrc/decode_attention.cpp``): its eight-heads-at-a-time loop
(float32, H and Dh multiples of 8, AVX2) against its generic loop, interleaved in one run, one torch
thread:

    python -m service.bench.attention
    python -m service.bench.attention --heads 8 --head-dim 64 --keys 10,30

R rows (one query each, as a greedy decode step; ``--queries`` per row for a beam against one source)
attend over L keys each, the keys of a row contiguous in a pool of R * L cache rows, as in a paged
cache's blocks. Prints ms per call (median of interleaved repeats) and the ratio. Both loops give the
same values to float rounding (``tests/test_kernels.py``). A timing, not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need comma-separated integers >= 1, got {text!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m service.bench.attention", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=_ints, default=[1, 32, 135, 512], help="rows per call (comma-separated)")
    ap.add_argument("--keys", type=_ints, default=[15, 40], help="keys per row (comma-separated)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads (the shipped model: 8)")
    ap.add_argument("--head-dim", type=int, default=32, help="per-head size Dh (the shipped model: 32)")
    ap.add_argument("--queries", type=int, default=1, help="queries per row (a beam's hypotheses)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved repeats; the median is printed")
    args = ap.parse_args(argv)
    if min(args.heads, args.head_dim, args.queries, args.repeats) < 1:
        ap.error("--heads, --head-dim, --queries and --repeats must be >= 1")
    import torch
    from model.inference import kernels
    if kernels.decode_attention() is None:
        print("the compiled kernels are unavailable here (MT_CPU_KERNELS=0 or no compiler)", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    H, D, NQ = args.heads, args.head_dim, args.queries
    fast = "eight heads at a time" if H % 8 == 0 and D % 8 == 0 else "(not applicable: generic)"
    print(f"packed decode attention, H={H}, Dh={D}, {NQ} quer{'y' if NQ == 1 else 'ies'} per row, ms per call")
    print(f"{'rows':>6} {'keys':>5} {fast:>22} {'generic loop':>13} {'ratio':>7}")
    g = torch.Generator().manual_seed(0)
    for R in args.rows:
        for L in args.keys:
            k, v = torch.randn(R * L, H, D, generator=g), torch.randn(R * L, H, D, generator=g)
            q = torch.randn(R, NQ, H, D, generator=g)
            key_index, starts = torch.arange(R * L), torch.arange(0, R * L + 1, L)
            inner = max(3, 2000 // (R * L // 16 + 1))
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                for generic in (False, True):
                    t = time.perf_counter()
                    for _ in range(inner):
                        kernels.packed_decode_attention(q, k, v, key_index, starts, L, generic=generic)
                    times[generic].append((time.perf_counter() - t) / inner)
            a, b = (statistics.median(times[x]) * 1e3 for x in (False, True))
            print(f"{R:>6} {L:>5} {a:22.4f} {b:13.4f} {b / a:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
