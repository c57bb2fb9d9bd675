"""BLEU of a pair translated through a pivot language, as the service pivots (``service/pipeline/pivot.py``).

    python -m service.bench.pivot_bleu --first model/checkpoints/de-en --second model/checkpoints/en-fr \\
        --data ../shared/data/multi30k [--split test_2016_flickr] [--beam-sizes 1 4] [--limit N]

Builds one ``Translator`` per checkpoint (the service's text path: sentence splitting, protected
spans, recasing), runs every source sentence of ``{split}.{source}.gz`` through both legs with
``pivot.run`` (the first leg's 1-best into the pivot language, then the second leg), 64 texts per
request, and scores the outputs with sacreBLEU (cased, 13a) against ``{split}.{target}.gz``. The
languages are the checkpoints' (metadata.json): the first's source, its target (the pivot) = the
second's source, the second's target. Prints one line per beam size; where ``{split}.{pivot}.gz``
exists, also each leg's own BLEU on the reference text (the first against the pivot references;
the second translating the pivot references), for comparison.
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import time
from pathlib import Path

import sacrebleu

from service.pipeline import pivot
from service.api.schemas import TranslateRequest

BATCH = 64      # texts per request (MAX_TEXTS)


def read(path: Path, limit: int | None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()[:limit]


async def run(first: str, second: str, data: Path, split: str, beam_sizes: list[int], limit: int | None) -> list[dict]:
    """One row per beam size: {"beam", "bleu", "seconds", and "first_leg"/"second_leg" BLEU when the
    pivot references exist}."""
    from service.translator import Translator, model_card
    cards = [model_card("first", first), model_card("second", second)]
    source, via, target = cards[0].source_lang, cards[0].target_lang, cards[1].target_lang
    if cards[1].source_lang != via:
        raise SystemExit(f"{second} translates {cards[1].pair}; the first leg ends in {via}")
    route = pivot.routes(cards, via).get((source, target))
    if route is None:
        raise SystemExit(f"no pivot route {source}->{target} through {via} (a direct model, or the same language)")
    translators = {c.id: Translator(c) for c in cards}
    for t in translators.values():
        await t.reconfigure({"max_num_seqs": 256})

    async def translate(model, job):
        return await translators[model].translate(job)

    async def each(model_or_route, lines, beam):
        jobs = [TranslateRequest(text=lines[i:i + BATCH], beam_size=beam).job() for i in range(0, len(lines), BATCH)]
        if model_or_route is route:
            calls = [pivot.run(translate, route, j) for j in jobs]
        else:
            calls = [translate(model_or_route, j) for j in jobs]
        return [t.text for r in await asyncio.gather(*calls) for t in r.translations]

    src, ref = read(data / f"{split}.{source}.gz", limit), read(data / f"{split}.{target}.gz", limit)
    mid_path = data / f"{split}.{via}.gz"
    mid = read(mid_path, limit) if mid_path.exists() else None
    rows = []
    try:
        for beam in beam_sizes:
            t0 = time.perf_counter()
            hyp = await each(route, src, beam)
            row = {"beam": beam, "bleu": sacrebleu.corpus_bleu(hyp, [ref]).score,
                   "seconds": time.perf_counter() - t0, "sentences": len(src)}
            if mid is not None:
                row["first_leg"] = sacrebleu.corpus_bleu(await each("first", src, beam), [mid]).score
                row["second_leg"] = sacrebleu.corpus_bleu(await each("second", mid, beam), [ref]).score
            rows.append(row)
    finally:
        for t in translators.values():
            await t.stop()
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--first", required=True, help="checkpoint of the first leg (source -> pivot)")
    ap.add_argument("--second", required=True, help="checkpoint of the second leg (pivot -> target)")
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k")
    ap.add_argument("--split", default="test_2016_flickr")
    ap.add_argument("--beam-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--limit", type=int, default=None, help="first N sentences only")
    args = ap.parse_args(argv)
    rows = asyncio.run(run(args.first, args.second, args.data, args.split, args.beam_sizes, args.limit))
    for r in rows:
        legs = (f"; first leg alone {r['first_leg']:.2f}, second leg alone (on the references) {r['second_leg']:.2f}"
                if "first_leg" in r else "")
        print(f"beam {r['beam']}: pivot BLEU {r['bleu']:.2f} on {r['sentences']} sentences of {args.split} "
              f"({r['seconds']:.1f} s){legs}", flush=True)
    return rows


if __name__ == "__main__":
    main()
