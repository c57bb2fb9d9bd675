"""Glossary terms on Multi30k val (figures, not a test): how often the target term is in the output,
what terms cost in BLEU and speed, and that sentences without terms are unchanged.

    python -m service.bench.glossary [--data-dir ../shared/data/multi30k] [--checkpoint model/checkpoints/de-en]
                                     [--limit N] [--beam-size 4] [--concurrency 64]

Term pairs: a German->English dictionary induced from Multi30k train (Dice coefficient of each
(German Snowball stem, English word) pair over the sentence pairs; a stem's best English word with
Dice >= 0.3, both seen >= 5 times). In each val sentence, a German word of >= 4 letters whose
dictionary word occurs in the reference is a term: (the German word as written, the English word as
written in the reference); of several, the rarest in train. Even-numbered sentences with a term send
it as ``glossary``; the others ("plain") send none. Runs, in one process, on the Translator (the
service's whole path: splitting, spans, truecasing, constrained search in the continuous batch):
  base:  every sentence without a glossary, ``--concurrency`` requests in flight;
  mixed: the same, the even sentences with their term (sharing steps with the plain ones);
  speed: the term sentences alone, without and with their terms (sentences/s, same concurrency).
Printed: the share of term outputs that contain the target term (ignoring case, at a word start, so
"bikes" has "bike"), before and with the glossary; BLEU (sacrebleu) of the plain sentences in both
runs and how many are identical; BLEU of the term sentences without and with terms; the time ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gzip
import re
import time
from pathlib import Path

DATA_DIR = "../shared/data/multi30k"


def read(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def induce(de: list[str], en: list[str], min_count: int = 5, min_dice: float = 0.3) -> tuple[dict, collections.Counter]:
    """German stem -> (English word, Dice) and the stems' sentence counts (see the module docstring)."""
    from service.translator.glossary import _stemmer
    stem = functools.lru_cache(maxsize=None)(lambda w: _stemmer("de").stemWord(w.casefold()))
    c_de: collections.Counter = collections.Counter()
    c_en: collections.Counter = collections.Counter()
    pair: collections.Counter = collections.Counter()
    for d, e in zip(de, en):
        ds = {s for s in map(stem, words(d)) if s.isalpha() and len(s) >= 3}
        es = {w.lower() for w in words(e) if w.isalpha() and len(w) >= 3}
        c_de.update(ds)
        c_en.update(es)
        pair.update((a, b) for a in ds for b in es)
    best: dict[str, tuple[str, float]] = {}
    for (a, b), n in pair.items():
        if c_de[a] < min_count or c_en[b] < min_count:
            continue
        dice = 2 * n / (c_de[a] + c_en[b])
        if dice >= min_dice and dice > best.get(a, ("", 0.0))[1]:
            best[a] = (b, dice)
    return best, c_de


def term_pairs(de: list[str], en: list[str], dictionary: dict, counts: collections.Counter) -> list:
    """Per val sentence: (German word, English word) or None."""
    from service.translator.glossary import stems
    out = []
    for d, e in zip(de, en):
        ref = {w.lower(): w for w in words(e)}
        cands = []
        for stem, a, b in stems(d, "de"):
            word = d[a:b]
            if len(word) >= 4 and word.isalpha() and stem in dictionary and dictionary[stem][0] in ref:
                cands.append((counts[stem], word, ref[dictionary[stem][0]]))
        out.append(min(cands)[1:] if cands else None)
    return out


def has_term(text: str, term: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(term), text, re.IGNORECASE) is not None


async def run(translator, texts: list[str], glossaries: list, beam: int, concurrency: int) -> tuple[list[str], float]:
    """Translate each text as its own request (with its glossary or none), ``concurrency`` in flight."""
    from service.protocol import GenerationOptions, TranslateJob
    sem = asyncio.Semaphore(concurrency)
    out = [""] * len(texts)

    async def one(i):
        async with sem:
            job = TranslateJob([texts[i]], GenerationOptions(beam_size=beam), glossary=tuple(glossaries[i] or ()))
            out[i] = (await translator.translate(job)).translations[0].text
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(texts))))
    return out, time.perf_counter() - t0


async def main_async(args) -> None:
    import sacrebleu
    import torch
    from service.translator import Translator, model_card
    data = Path(args.data_dir)
    t0 = time.perf_counter()
    dictionary, counts = induce(read(data / "train.de.gz"), read(data / "train.en.gz"))
    de, en = read(data / "val.de.gz")[: args.limit], read(data / "val.en.gz")[: args.limit]
    pairs = term_pairs(de, en, dictionary, counts)
    print(f"dictionary: {len(dictionary)} stems ({time.perf_counter() - t0:.1f} s); val sentences: {len(de)}, "
          f"with a term: {sum(p is not None for p in pairs)}")
    term_idx = [i for i, p in enumerate(pairs) if p is not None and i % 2 == 0]
    plain_idx = [i for i in range(len(de)) if i not in set(term_idx)]
    print(f"term sentences: {len(term_idx)}; plain sentences: {len(plain_idx)}; examples: "
          + "; ".join(f"{pairs[i][0]} -> {pairs[i][1]}" for i in term_idx[:5]))
    torch.set_num_threads(args.threads)
    translator = Translator(model_card("de-en", args.checkpoint), device="cpu")
    await translator.reconfigure({"max_num_seqs": args.max_num_seqs})
    none = [None] * len(de)
    await run(translator, de[:32], [[pairs[i]] if pairs[i] else None for i in range(32)], args.beam_size, 32)  # warm-up
    mixed_gl = [[pairs[i]] if i in set(term_idx) else None for i in range(len(de))]
    base, t_base = await run(translator, de, none, args.beam_size, args.concurrency)
    mixed, t_mixed = await run(translator, de, mixed_gl, args.beam_size, args.concurrency)
    tgt = [pairs[i][1] for i in term_idx]
    before = sum(has_term(base[i], t) for i, t in zip(term_idx, tgt))
    after = sum(has_term(mixed[i], t) for i, t in zip(term_idx, tgt))
    print(f"beam {args.beam_size}; base run {t_base:.1f} s, mixed run {t_mixed:.1f} s ({len(de)} sentences)")
    print(f"target term in output: without glossary {before}/{len(tgt)} = {100 * before / len(tgt):.1f}%, "
          f"with glossary {after}/{len(tgt)} = {100 * after / len(tgt):.1f}%")
    hard = [(i, t) for i, t in zip(term_idx, tgt) if not has_term(base[i], t)]
    print(f"  of the {len(hard)} whose output lacked the term without glossary: "
          f"{sum(has_term(mixed[i], t) for i, t in hard)} have it with the glossary")
    missed = [(de[i], pairs[i], mixed[i]) for i, t in zip(term_idx, tgt) if not has_term(mixed[i], t)]
    for m in missed[:5]:
        print("  missed:", m)

    def bleu(idx, hyps):
        return sacrebleu.corpus_bleu([hyps[i] for i in idx], [[en[i] for i in idx]]).score
    same = sum(base[i] == mixed[i] for i in plain_idx)
    print(f"plain sentences: BLEU {bleu(plain_idx, base):.2f} alone vs {bleu(plain_idx, mixed):.2f} sharing steps "
          f"with term sentences (change {bleu(plain_idx, mixed) - bleu(plain_idx, base):+.2f}); identical outputs "
          f"{same}/{len(plain_idx)}")
    print(f"term sentences: BLEU {bleu(term_idx, base):.2f} without vs {bleu(term_idx, mixed):.2f} with their terms")
    texts = [de[i] for i in term_idx]
    for beam in sorted({args.beam_size, 1}):
        _, t_without = await run(translator, texts, [None] * len(texts), beam, args.concurrency)
        with_terms, t_with = await run(translator, texts, [[pairs[i]] for i in term_idx], beam, args.concurrency)
        hit = sum(has_term(h, pairs[i][1]) for h, i in zip(with_terms, term_idx))
        print(f"speed, beam {beam} ({'greedy; with terms: beam 4' if beam == 1 else 'with terms too'}): "
              f"{len(texts)} term sentences in {t_without:.2f} s without terms, {t_with:.2f} s with them: "
              f"x{t_with / t_without:.2f} ({1000 * (t_with - t_without) / len(texts):+.1f} ms per sentence); "
              f"term in output {hit}/{len(texts)}")
    await translator.stop()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--checkpoint", default="model/checkpoints/de-en")
    p.add_argument("--limit", type=int, default=None, help="val sentences (default all)")
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the engine's KV-cache slots")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
