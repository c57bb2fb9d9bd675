"""KV-cache memory of the engine, contiguous (every slot reserves max_len for its target and its
source) against paged (blocks taken as sequences grow), on the shipped model and test_2016_flickr:

    python -m service.bench.kv_memory                    # 1,000 sentences, greedy and beam 4
    python -m service.bench.kv_memory --limit 300 --beams 1

For each beam size the engine runs with slots for 256 running sentences (256 × beam), every
sentence submitted at once; the figures are the bytes a contiguous cache of those slots reserves,
the bytes of the paged pool (default ``kv_blocks``) and the most bytes its blocks held at any step
(with the number of sentences running then). Then the same 256-slot contiguous memory given to a
paged engine with 4× the slots (1,024 × beam): how many ran at once and how often it preempted.
Memory figures, not timings: they do not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from service.loadtest.config import DEFAULT_SENTENCES, load_sentences

RUNNING = 256     # running sentences the figures are taken at


def contiguous_bytes(cfg, num_slots: int, elem: int) -> int:
    """What ``KVCache`` reserves: 4 buffers (self/cross K/V) of [L, slots, max_len, d_model]."""
    return 4 * cfg.n_decoder_layers * num_slots * 2 * cfg.max_len * cfg.d_model * elem


async def measure(model, srcs, beam: int, num_seqs: int, kv_blocks=None) -> dict:
    """Run the engine over srcs; the peak of the blocks held (bytes) and of the sentences running."""
    from service.engine import Engine, EngineConfig, GenerationOptions
    peak = {"held": 0, "running": 0, "running_at_peak": 0, "preempted": 0}
    engine = Engine(model, EngineConfig(max_num_seqs=num_seqs, max_waiting=len(srcs), kv_blocks=kv_blocks))
    pool = engine.runner.cache.slots

    def on_step(st) -> None:
        held = pool.num_blocks - pool.num_free_blocks
        if held > peak["held"]:
            peak.update(held=held, running_at_peak=st.running_requests)
        peak["running"] = max(peak["running"], st.running_requests)
        peak["preempted"] += st.num_preempted
    engine.on_step = on_step
    opts = GenerationOptions(beam_size=beam, n_best=1)
    await asyncio.gather(*[engine.translate(s, opts) for s in srcs])
    await engine.stop()
    per_block = engine.runner.cache.bytes_per_block
    return {**peak, "held_bytes": peak["held"] * per_block, "pool_bytes": engine.runner.cache.nbytes,
            "blocks": pool.num_blocks, "bytes_per_block": per_block}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="model/checkpoints/de-en")
    ap.add_argument("--sentences", default=str(DEFAULT_SENTENCES))
    ap.add_argument("--limit", type=int, default=1000)
    ap.add_argument("--beams", default="1,4")
    args = ap.parse_args(argv)
    import torch
    from model.load import load_model
    from model.tokenizer import encode_source
    torch.set_num_threads(1)
    if not (Path(args.checkpoint) / "config.json").exists():
        print(f"{args.checkpoint} holds no model", file=sys.stderr)
        return 2
    model, tok, _ = load_model(args.checkpoint)
    srcs = [encode_source(tok, line, model.cfg.max_len) for line in load_sentences(args.sentences)[: args.limit]]
    elem = next(model.parameters()).element_size()
    print(f"{args.checkpoint}: {len(srcs)} sentences, mean source {sum(map(len, srcs)) / len(srcs):.1f} tokens; "
          f"max_len {model.cfg.max_len}, {model.cfg.n_decoder_layers} decoder layers, d_model {model.cfg.d_model}")
    print("| beam | slots | contiguous cache | paged pool (default kv_blocks) | paged peak held "
          "(sentences running) | held / contiguous | 4× slots in the contiguous bytes: most running, preemptions |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    mb = 2 ** 20
    for beam in (int(b) for b in args.beams.split(",")):
        slots = RUNNING * beam
        before = contiguous_bytes(model.cfg, slots, elem)
        after = asyncio.run(measure(model, srcs, beam, slots))
        four = asyncio.run(measure(model, srcs, beam, 4 * slots, kv_blocks=before // after["bytes_per_block"]))
        print(f"| {beam} | {slots} | {before / mb:,.0f} MiB | {after['pool_bytes'] / mb:,.0f} MiB | "
              f"{after['held_bytes'] / mb:,.1f} MiB ({after['running_at_peak']}) | "
              f"{after['held_bytes'] / before:.1%} | {four['running']} sentences, {four['preempted']} preemptions |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
