"""The decode step with each decoder layer in one compiled call (``model/inference/fused_step.py``) against the
module path, interleaved, one torch thread:

    python -m service.bench.fused_step                         # int8 (the default linear dtype)
    MT_LINEAR_DTYPE=float32 python -m service.bench.fused_step

(1) one ``decode_step`` of R rows on the shipped model's paged cache (R German test_2016_flickr
sentences, each at target position 8), in ms per step, median of interleaved repeats, for R in
1..690; (2) ``generate`` on one sentence at a time (batch 1, greedy, the first ``--sentences``
sentences), in ms per sentence: a single client's latency. Both paths give the same bits
(``tests/test_fused_step.py``). A timing, not a test.
"""
from __future__ import annotations

import statistics
import sys
import time
from model.inference.linear import linear_dtype

ROWS = (1, 4, 16, 32, 64, 128, 256, 512, 690)   # 690: the rows of a beam-4 (c) step
PATHS = ("compiled layer step", "module path")


def _switch(name: str, op) -> None:
    from model.inference import kernels
    kernels._loaded["decoder_step"] = op if name == PATHS[0] else None


def steps(model, srcs, repeats: int = 7) -> None:
    """Part (1): one decode step of R rows, both paths."""
    import torch
    from model.inference.step import decode_step
    from model.inference.prefill import encode_into_cache
    from model.inference.generate import pad_batch
    from model.inference.paged_cache import PagedKVCache, allocate_blocks
    n = max(ROWS)
    srcs = (srcs * (-(-n // len(srcs))))[:n]
    cache = PagedKVCache.for_model(model, n, max_tgt_len=32)
    slots = torch.tensor(cache.slots.allocate(n))
    allocate_blocks(cache, slots[:, None], 8, [len(s) for s in srcs])   # positions 0..8 below
    with torch.inference_mode():
        encode_into_cache(model, cache, slots[:, None], pad_batch(srcs, model.cfg.pad_id),
                          torch.tensor([len(s) for s in srcs]))
        g = torch.Generator().manual_seed(0)
        for p in range(9):   # every row's target history up to position 8
            decode_step(model, cache, slots, torch.randint(4, model.cfg.vocab_size, (n,), generator=g),
                        torch.full((n,), p))
    from model.inference import kernels
    op = kernels.decoder_step_op()
    print(f"(1) one decode_step, {linear_dtype(model)} linear layers, ms (compiled layer step / module path)")
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


def main(argv=None) -> int:
    from .int8_layers import batch1_latency, setup
    ready = setup("python -m service.bench.fused_step", __doc__, argv, "1 (one step), 2 (batch-1 latency), or both")
    if isinstance(ready, int):
        return ready
    args, parts, model, _, srcs = ready
    if "1" in parts:
        steps(model, srcs)
    if "2" in parts:
        batch1_latency(model, srcs[:args.sentences], {PATHS[0]: {}, PATHS[1]: {"decoder_step": None}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
