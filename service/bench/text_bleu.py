"""BLEU through the translator's path, with its text processing on and off, in one run.

    python -m service.bench.text_bleu [--checkpoint DIR] [--beam-size 4] [--limit N]

Builds one ``Translator`` per setting on the same checkpoint (span protection and truecasing on:
the service's default; both off: the sentence as sent), translates every sentence of
test_2016_flickr (``model/data/multi30k/test_2016_flickr.de.gz``) as one text each, and scores the
outputs with sacrebleu against the references (``test_2016_flickr.en.gz``). Unlike
``python -m model.evaluate``, this includes sentence splitting, protection, recasing and rejoining.
Prints one line per setting and the difference (on - off).
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
from pathlib import Path

import sacrebleu

from model.checkpoint import DEFAULT_CHECKPOINT
from service.api.schemas import TranslateRequest
DATA = Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k"


async def translate_all(checkpoint: str, lines: list[str], beam_size: int, on: bool) -> list[str]:
    """Every line through a Translator with processing ``on`` (or off), 64 texts per request."""
    from service.translator import TextConfig, Translator, TranslatorSettings, model_card
    t = Translator(model_card("bench", checkpoint),
                   settings=TranslatorSettings(text=TextConfig(protect_spans=on, truecase=on)))
    await t.reconfigure({"max_num_seqs": 256})
    out: list[str] = []
    try:
        jobs = [TranslateRequest(text=lines[i:i + 64], beam_size=beam_size).job() for i in range(0, len(lines), 64)]
        for r in await asyncio.gather(*(t.translate(j) for j in jobs)):
            out += [tr.text for tr in r.translations]
    finally:
        await t.stop()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--beam-size", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None, help="first N sentences only")
    args = ap.parse_args(argv)
    read = lambda name: gzip.open(DATA / name, "rt", encoding="utf-8").read().splitlines()[: args.limit]  # noqa: E731
    src, ref = read("test_2016_flickr.de.gz"), read("test_2016_flickr.en.gz")
    scores = {}
    for on in (True, False):
        hyp = asyncio.run(translate_all(args.checkpoint, src, args.beam_size, on))
        changed = sum(h != "" for h in hyp)
        scores[on] = sacrebleu.corpus_bleu(hyp, [ref]).score
        print(f"processing {'on ' if on else 'off'}: BLEU {scores[on]:.2f} on {len(src)} sentences "
              f"({changed} non-empty), beam {args.beam_size}", flush=True)
    print(f"difference (on - off): {scores[True] - scores[False]:+.2f}")


if __name__ == "__main__":
    main()
