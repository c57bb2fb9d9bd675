"""``python -m service.bench.memory``: what the translation memory costs and saves, in-process on the
shipped de-en model (service/translator/memory.py; docs/clients.md#translation-memory).

One request of 64 Multi30k val sentences, greedy: the engine alone and with an empty memory's lookups
(interleaved, medians of 5), then every sentence answered by the memory and by the result cache
(medians of 3); asserts the texts are equal, prints seconds per request and ratios.
"""
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from model.checkpoint import DEFAULT_CHECKPOINT
from model.tokenizer import read_lines
from service.api.schemas import TranslateRequest
from service.translator import Translator, TranslatorSettings, model_card
from service.translator.memory import MemoryStore

DATA = Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k"
DE = read_lines(DATA / "val.de.gz")[:64]


def job(scope):
    j = TranslateRequest(text=DE, beam_size=1).job()
    j.memory_scope = scope
    return j


async def timed(t, scope, n=3):
    out = []
    for _ in range(n):
        s = time.perf_counter()
        r = await t.translate(job(scope))
        out.append(time.perf_counter() - s)
    return statistics.median(out), r


async def run():
    card = model_card("de-en", DEFAULT_CHECKPOINT)
    path = tempfile.mkdtemp() + "/m.sqlite3"
    t = Translator(card, settings=TranslatorSettings(memory_file=path))
    await t.reconfigure({"max_num_seqs": 64})
    await timed(t, None, 1)                              # warm-up
    offs, ons = [], []
    for _ in range(5):                                   # interleaved: the machine's load hits both alike
        o, r0 = await timed(t, None, 1)
        n, r1 = await timed(t, "", 1)                    # empty memory: 64 lookups, all misses
        offs.append(o)
        ons.append(n)
    off, on = statistics.median(offs), statistics.median(ons)
    s = time.perf_counter()
    for _ in range(20):
        t.memory.lookup("de-en", "", DE)
    print(f"one lookup of 64 keys: {(time.perf_counter() - s) / 20 * 1e3:.2f} ms")
    assert [x.text for x in r0.translations] == [x.text for x in r1.translations]
    MemoryStore(path).put("de-en", "", [(s, x.text) for s, x in zip(DE, r0.translations)])
    hit, r2 = await timed(t, "")
    assert [x.text for x in r2.translations] == [x.text for x in r0.translations]
    t.cache.max_entries = 1000
    await t.translate(job(None))
    cached, r3 = await timed(t, None)
    assert [x.text for x in r3.translations] == [x.text for x in r0.translations]
    print(f"64 sentences, greedy, one request: engine {off:.3f} s | engine + empty-memory lookups {on:.3f} s "
          f"(x{on / off:.3f}) | all memory hits {hit:.4f} s (x{off / hit:.0f} faster) | all cache hits {cached:.4f} s "
          f"(x{off / cached:.0f} faster)")
    await t.stop()


def main() -> None:
    asyncio.run(run())


if __name__ == "__main__":
    main()
