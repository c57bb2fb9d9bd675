"""One decode_step on the contiguous (indirect) KV cache against the paged one, interleaved:

    python -m service.bench.kv_step

256 greedy rows at position 15 over 16-token sources, the shipped model, one torch thread; median of
15 interleaved steps each. The compiled decode attention reads keys through an index in both: the
paged cache only changes how that index is computed (through the block table). A timing, not a test.
"""
from __future__ import annotations

import sys
import time


def main(checkpoint: str = "model/checkpoints/de-en", rows: int = 256, src_len: int = 16, position: int = 15) -> int:
    import torch
    from model.load import load_model
    from model.inference.step import decode_step
    from model.inference.prefill import encode_into_cache
    from model.inference.kv_cache import KVCache
    from model.inference.paged_cache import PagedKVCache, allocate_blocks
    torch.set_num_threads(1)
    model, _, _ = load_model(checkpoint)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, model.cfg.vocab_size, (rows, src_len), generator=g)
    src[:, -1] = model.cfg.eos_id
    caches = {"contiguous (indirect)": KVCache.for_model(model, rows, indirect=True),
              "paged": PagedKVCache.for_model(model, rows)}
    slots = torch.arange(rows)
    tokens = torch.full((rows,), 5)
    for c in caches.values():
        c.slots.allocate(rows)
        allocate_blocks(c, slots[:, None], position, [src_len] * rows)   # nothing on the contiguous cache
        encode_into_cache(model, c, slots[:, None], src)
        for p in range(position):
            decode_step(model, c, slots, tokens, torch.full((rows,), p))
    times: dict[str, list[float]] = {k: [] for k in caches}
    for _ in range(15):
        for name, c in caches.items():   # the same position is rewritten each time
            t = time.perf_counter()
            decode_step(model, c, slots, tokens, torch.full((rows,), position))
            times[name].append(time.perf_counter() - t)
    for name, v in times.items():
        v.sort()
        print(f"{name}: median decode_step {1000 * v[len(v) // 2]:.2f} ms ({rows} rows at position {position}, "
              f"source {src_len})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
