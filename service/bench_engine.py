"""``python -m service.bench_engine``: the engine benchmark (``service/bench/engine.py`` parts (a)-(d),
``protocol.py`` part (e), ``same_weights.py`` part (f))."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.bench.engine import beams_and_layouts, run_model_parts
from service.bench.engine import __doc__ as bench_doc
from service.bench.protocol import run_protocol
from service.bench.same_weights import run_same_weights
from service.loadtest.config import DEFAULT_SENTENCES, load_sentences


# ---- main -----------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m service.bench_engine", description=bench_doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="a,b,c,d,e", help="comma-separated subset of a,b,c,d,e,f")
    ap.add_argument("--limit", type=int, default=None, help="use the first N sentences (default: all 1,000)")
    ap.add_argument("--beams", default="1,4", help="beam sizes to run (1 = greedy)")
    ap.add_argument("--checkpoint", default=None, help="model for (a)-(d) (default: model/checkpoints/de-en)")
    ap.add_argument("--tokenizer", default=None, help="8k SentencePiece model for (e) (default: the checkpoint's)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for (a)-(d)")
    ap.add_argument("--engine-slots", type=int, default=256,
                    help="(c)/(d): sentences in flight; the engine's max_num_seqs (KV-cache slots, one per "
                         "hypothesis) is this x beam; (f): max_num_seqs")
    ap.add_argument("--policy", default="decode_first", help="engine scheduling policy for (c)/(d)")
    ap.add_argument("--admission", default="fifo", choices=("fifo", "shortest_first"),
                    help="engine admission order for (c)/(d) (EngineConfig.admission)")
    ap.add_argument("--prefill-every", type=int, default=4, help="engine prefill_every (k) for (c)/(d)")
    ap.add_argument("--layouts", default="1x2,2x1", help="(e), (f): processes x threads per process")
    ap.add_argument("--e-systems", default="engine,static", help="(e): engine and/or static")
    ap.add_argument("--rounds", type=int, default=1,
                    help="(b)/(c), (e) and (f): interleaved rounds; the median is printed")
    ap.add_argument("--f-systems", default="engine,engine int8,transformers,CTranslate2 float32,CTranslate2 int8",
                    help="(f): systems to run, comma-separated")
    ap.add_argument("--json", default=None, metavar="FILE", help="(f): write the table's rows as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where (a)-(e) run")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="weights and KV cache, every part (auto: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--preset", default=None, choices=["tiny", "small", "base", "big"],
                    help="(a)-(f): random weights of this ModelConfig preset instead of the checkpoint "
                         "((e) default: small), with the checkpoint's tokenizer")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="(f) with --preset: output vocabulary rows (default: the tokenizer's pieces; more are "
                         "synthetic ids)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="(f): every system generates exactly this many tokens per sentence (default: the "
                         "engine's length budgets, EOS ends a sentence)")
    ap.add_argument("--linear-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                    help="linear layers' arithmetic in (a)-(e) ((f) names its own per system; default: "
                         "MT_LINEAR_DTYPE, else int8)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or not parts <= set("abcdef"):
        ap.error(f"--parts must be a non-empty subset of a,b,c,d,e,f, got {args.parts!r}")
    beams, layouts = beams_and_layouts(ap, args.beams, args.layouts)
    for name, ok in (("--beams", all(b >= 1 for b in beams)), ("--threads", args.threads >= 1),
                     ("--layouts", all(len(x) == 2 and min(x) >= 1 for x in layouts)),
                     ("--limit", args.limit is None or args.limit >= 1), ("--rounds", args.rounds >= 1),
                     ("--engine-slots", args.engine_slots >= 1),
                     ("--tokens", args.tokens is None or args.tokens >= 1),
                     ("--vocab-size", args.vocab_size is None or args.vocab_size >= 1)):
        if not ok:
            ap.error(f"{name}: every value must be >= 1 (see --help)")
    if args.vocab_size is not None and not (args.preset and "f" in parts):
        ap.error("--vocab-size applies to part (f) with --preset")
    if args.device != "cpu":
        import torch
        try:
            cuda = torch.device(args.device).type == "cuda" and torch.cuda.is_available()
        except RuntimeError:
            cuda = False
        if not cuda:
            ap.error(f"--device {args.device}: no such device here (cpu, or cuda where PyTorch sees a GPU)")

    import torch
    from model.checkpoint import DEFAULT_CHECKPOINT
    torch.set_grad_enabled(False)
    ckpt = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    lines = load_sentences(DEFAULT_SENTENCES)[: args.limit]
    need_model = bool(parts & set("abcdf"))
    if need_model and not args.preset and not (ckpt / "model.safetensors").exists():
        print(f"parts (a)-(d) and (f) need the shipped model, and {ckpt} has none (training may still be running).\n"
              f"Pass --checkpoint DIR, or run only part (e): --parts e --tokenizer PATH.", file=sys.stderr)
        return 2

    if parts & set("abcd"):
        run_model_parts(args, parts, beams, ckpt, lines)

    status = 0
    if "e" in parts:
        status = run_protocol(args, lines, beams, ckpt)
    if "f" in parts and status == 0:
        status = run_same_weights(args, beams, ckpt)
    return status


if __name__ == "__main__":
    sys.exit(main())
