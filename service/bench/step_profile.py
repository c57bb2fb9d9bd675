"""Where the engine's time goes on a model shape: one process, the engine alone, for a sampling profiler.

    perf record -g -o step.data -- python -m service.bench.step_profile --preset base --vocab-size 32000 --beam 4
    perf report -i step.data --no-children --sort dso,sym

Random weights of a ``ModelConfig`` preset (``--vocab-size`` output rows, as part (f) of
``python -m service.bench_engine`` writes them) or a checkpoint (``--checkpoint``), int8 linear layers
(the CPU default), ``--threads`` torch threads; the first ``--limit`` German test_2016_flickr sentences
all submitted at once, each generating exactly ``--tokens`` tokens. The timed part runs ``--repeat``
times after a warm-up, so that it outweighs loading and set-up in a profile of the whole process.
Printed: tokens/s and the engine's own split of its steps (prefill, decode, search update, the rest
of the loop) from its per-step statistics. The compiled kernels (int8 layers, the decoder-layer step,
decode attention, top-k) bypass torch's dispatcher, so ``torch.profiler`` does not see them; a
sampling profiler of the process (``perf``, ``py-spy --native``) does. Figures, not a test.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

CHECKPOINT = Path(__file__).resolve().parents[2] / "model" / "checkpoints" / "de-en"
DATA = Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help="random weights of this ModelConfig preset (default: the checkpoint)")
    ap.add_argument("--vocab-size", type=int, default=None, help="with --preset: output vocabulary rows")
    ap.add_argument("--checkpoint", type=Path, default=CHECKPOINT, help="model, or with --preset its tokenizer's source")
    ap.add_argument("--beam", type=int, default=1, help="beam size (1 = greedy)")
    ap.add_argument("--limit", type=int, default=150, help="sentences per repeat")
    ap.add_argument("--tokens", type=int, default=20, help="tokens generated per sentence (0: the engine's length budgets, EOS ends a sentence)")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--slots", type=int, default=256, help="the engine's max_num_seqs")
    args = ap.parse_args(argv)
    import torch
    from model.load import load_model
    from model.tokenizer import encode_source, read_lines
    from service.engine import torch_threads, tune_process
    from .engine import run_engine
    from .same_weights import random_checkpoint
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint
        if args.preset:
            ckpt = random_checkpoint(Path(tmp) / "random", args.preset, args.checkpoint / "tokenizer.model",
                                     args.vocab_size)
        with torch_threads(1):
            model, tok, _ = load_model(ckpt, linear_dtype="int8")
    torch.set_num_threads(args.threads)
    tune_process()
    srcs = [encode_source(tok, line, model.cfg.max_len)
            for line in read_lines(DATA / "test_2016_flickr.de.gz")[: args.limit]]
    asyncio.run(run_engine(model, srcs[:32], args.beam, args.slots, part="(f)", warmup=False, fixed_len=args.tokens or None))
    tokens, wall, split = 0, 0.0, {}
    for _ in range(args.repeat):
        run = asyncio.run(run_engine(model, srcs, args.beam, args.slots, part="(f)", warmup=False,
                                     fixed_len=args.tokens or None))
        wall += run.wall_s          # from the first submission to the last result (the engine built before)
        tokens += run.tokens
        for k in ("prefill_s", "decode_s", "update_s", "loop_s"):
            split[k] = split.get(k, 0.0) + run.profile[k]
    cfg = model.cfg
    print(f"{args.preset or ckpt} (d_model {cfg.d_model}, {cfg.n_encoder_layers}+{cfg.n_decoder_layers} layers, "
          f"vocabulary {cfg.vocab_size}), beam {args.beam}, {args.threads} thread(s), {len(srcs)} sentences x "
          f"{args.tokens or 'budgeted'} tokens x {args.repeat}: {tokens / wall:.0f} tokens/s")
    print("engine steps: " + ", ".join(f"{k[:-2]} {v:.2f} s ({v / wall:.0%})" for k, v in split.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
