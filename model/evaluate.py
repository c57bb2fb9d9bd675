"""Translate a test set and score it with sacreBLEU (cased, default 13a tokenizer) and chrF.

    python -m model.evaluate --checkpoint DIR --src FILE --ref FILE [--beam-size N] [--json]

Files are plain or .gz, one sentence per line. With --json the last line on stdout is one JSON
object with the keys bleu, chrf, bleu_details (the score line), bleu_signature (sacreBLEU's),
sentences, seconds and the settings (beam_size, linear_dtype, checkpoint); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import sacrebleu
import torch
from tqdm import tqdm

from .checkpoint import DEFAULT_CHECKPOINT
from .tokenizer import read_lines
from .inference.generate import translate_lines
from .inference.linear import linear_dtype
from .translate import add_common_args, load_for_cli


def score(hyps: list[str], refs: list[str]) -> dict:
    """Corpus BLEU and chrF of hypotheses against one reference each."""
    bleu_metric = sacrebleu.metrics.BLEU()
    bleu = bleu_metric.corpus_score(hyps, [refs])
    chrf = sacrebleu.corpus_chrf(hyps, [refs])
    return {"bleu": round(bleu.score, 2), "chrf": round(chrf.score, 2), "bleu_details": str(bleu),
            "bleu_signature": str(bleu_metric.get_signature())}


def _limit(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (all) or a number of sentences, got {n}")
    return n


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m model.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT),
                    help="checkpoint directory (default: shipped), or a MarianMT directory (converted at load)")
    ap.add_argument("--src", required=True, help="source sentences (plain or .gz)")
    ap.add_argument("--ref", required=True, help="reference translations (plain or .gz)")
    add_common_args(ap)
    ap.add_argument("--limit", type=_limit, default=0, help="only the first N sentences (0 = all)")
    ap.add_argument("--output", help="also write the translations to this file")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok, meta = load_for_cli(ap, args)
    try:
        src, ref = read_lines(args.src), read_lines(args.ref)
    except OSError as e:
        ap.error(f"{e.filename}: {e.strerror}")
    if len(src) != len(ref):
        ap.error(f"--src has {len(src)} lines but --ref has {len(ref)}")
    if args.limit:
        src, ref = src[: args.limit], ref[: args.limit]
    t0 = time.time()
    with tqdm(total=len(src), file=sys.stderr, desc="translating", unit="sent") as bar:
        hyps = translate_lines(model, tok, src, beam_size=args.beam_size, batch_size=args.batch_size,
                               length_penalty=args.length_penalty, progress=bar.update,
                               max_new_tokens=args.max_new_tokens, target_lang=args.target_lang,
                               source_lang=args.source_lang)
    seconds = time.time() - t0
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.writelines(h + "\n" for h in hyps)
        except OSError as e:
            ap.error(f"--output {e.filename}: {e.strerror}")
    result = {**score(hyps, ref), "sentences": len(src), "seconds": round(seconds, 2),
              "beam_size": args.beam_size, "max_new_tokens": args.max_new_tokens, "linear_dtype": linear_dtype(model),
              "target_lang": args.target_lang, "checkpoint": args.checkpoint}
    print(f"BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  ({len(src)} sentences, {seconds:.1f} s, "
          f"beam {args.beam_size})\n{result['bleu_details']}\n{result['bleu_signature']}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
