"""How well ``confidence`` ranks translations: its Spearman correlation with sentence-level chrF.

    python -m service.bench.confidence [--directions de-en en-de] [--beam-size 4] [--limit N]

For each direction, builds a ``Translator`` on the shipped checkpoint (``model/checkpoints/<dir>``),
translates every sentence of Multi30k test_2016_flickr (``model/data/multi30k/``) as one text each,
through the service's path (sentence splitting, span protection, recasing; 64 texts per request),
and correlates each translation's ``confidence`` (``service/translator/output.confidence``) with
its sentence-level chrF against the reference (sacrebleu's ``sentence_chrf``), by Spearman's rho
(scipy). Prints one line per direction: sentences, rho, its p-value, mean confidence, mean chrF.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import sacrebleu

from model.tokenizer import read_lines
from service.api.schemas import TranslateRequest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "model" / "data" / "multi30k"


async def confidences(direction: str, lines: list[str], beam_size: int) -> list[tuple[str, float]]:
    """(translation, confidence) per line, through a Translator on the shipped ``direction`` model."""
    from service.translator import Translator, model_card
    t = Translator(model_card(direction, str(ROOT / "model" / "checkpoints" / direction)))
    await t.reconfigure({"max_num_seqs": 256})
    out: list[tuple[str, float]] = []
    try:
        jobs = [TranslateRequest(text=lines[i:i + 64], beam_size=beam_size).job() for i in range(0, len(lines), 64)]
        for r in await asyncio.gather(*(t.translate(j) for j in jobs)):
            out += [(tr.text, tr.confidence) for tr in r.translations]
    finally:
        await t.stop()
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m service.bench.confidence", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--directions", nargs="+", default=["de-en", "en-de"], help="shipped models to measure")
    ap.add_argument("--beam-size", type=int, default=4, help="beam size (default: the API's, 4)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N sentences (0 = all 1,000)")
    args = ap.parse_args(argv)
    from scipy.stats import spearmanr   # the dev extra's (pyproject.toml)
    rows = []
    for d in args.directions:
        src_lang, tgt_lang = d.split("-")
        src = read_lines(DATA / f"test_2016_flickr.{src_lang}.gz")
        ref = read_lines(DATA / f"test_2016_flickr.{tgt_lang}.gz")
        if args.limit:
            src, ref = src[:args.limit], ref[:args.limit]
        t0 = time.perf_counter()
        got = asyncio.run(confidences(d, src, args.beam_size))
        chrf = [sacrebleu.sentence_chrf(h, [r]).score for (h, _), r in zip(got, ref)]
        conf = [c for _, c in got]
        rho, p = spearmanr(conf, chrf)
        row = {"direction": d, "sentences": len(src), "spearman": round(float(rho), 3), "p_value": float(p),
               "mean_confidence": round(sum(conf) / len(conf), 3), "mean_chrf": round(sum(chrf) / len(chrf), 1),
               "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"{d}: {row['sentences']} sentences, beam {args.beam_size}: Spearman rho(confidence, sentence chrF) = "
              f"{row['spearman']:.3f} (p = {row['p_value']:.1e}); mean confidence {row['mean_confidence']:.3f}, "
              f"mean chrF {row['mean_chrf']:.1f} ({row['seconds']} s)", flush=True)
    return rows


if __name__ == "__main__":
    main()
