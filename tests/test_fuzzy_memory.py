"""Fuzzy matches from the translation memory (service/translator/fuzzy.py): the index against a full
rapidfuzz scan, the threshold's edge, rebuilds after any process's write, a Translator answering
from fuzzy matches (translate and stream) with origin and memory_score, and the native API's
memory_threshold field."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from fastapi.testclient import TestClient
from rapidfuzz import fuzz, process

from conftest import DATA, build_tiny_checkpoint
from local_services import local_services
from model.tokenizer import read_lines
from service.api.http import build_app
from service.api.schemas import TranslateRequest
from service.protocol import ServiceError, TranslateResponse, Translation, Usage
from service.replica import run_within
from service.translator import Translator, TranslatorSettings, model_card
from service.translator.fuzzy import FULL_SCAN, FuzzyIndex, FuzzyMemory
from service.translator.memory import MemoryStore, normalize

STORED = "Ein Hund läuft über die grüne Wiese."
AT_75 = "Ein Hund sitzt auf der grünen Wiese."      # fuzz.ratio with STORED: exactly 75


def edited(line: str, rnd: random.Random) -> str:
    """A line with one word replaced: a near match of it."""
    words = line.split()
    words[rnd.randrange(len(words))] = rnd.choice(["Hund", "cat", "rouge", "Mann", "blue"])
    return " ".join(words)


def test_the_index_finds_what_a_full_scan_finds():
    sources = list(dict.fromkeys(normalize(x) for lang in ("de", "en") for x in read_lines(DATA / f"val.{lang}.gz")))
    assert len(sources) > FULL_SCAN          # the indexed path, not the whole-memory scan
    index = FuzzyIndex(sources, [s.upper() for s in sources])
    assert index.vocab
    rnd = random.Random(0)
    queries = [edited(rnd.choice(sources), rnd) for _ in range(150)]
    found = 0
    for q in queries:
        full = process.extractOne(q, sources, scorer=fuzz.ratio, score_cutoff=75)
        match = index.best(q, 75)
        assert (match is None) == (full is None), q
        if match is not None:
            found += 1
            assert match.score == full[1] and fuzz.ratio(q, match.source) == match.score
            assert match.target == match.source.upper()
    assert found > 100
    assert index.best("Völlig anders: xyzzy plugh.", 75) is None


def test_the_threshold_is_inclusive_and_100_is_the_same_text_only():
    index = FuzzyIndex([STORED, "Zwei Männer."], ["A dog (stored).", "Two men (stored)."])
    assert fuzz.ratio(STORED, AT_75) == 75.0
    assert index.best(AT_75, 75).target == "A dog (stored)." and index.best(AT_75, 75).score == 75.0
    assert index.best(AT_75, 75.01) is None
    assert index.best(STORED, 100).score == 100.0 and index.best(STORED + "!", 100) is None
    assert FuzzyIndex([], []).best(STORED, 0) is None


def test_any_processes_write_rebuilds_the_index(tmp_path):
    store, other = MemoryStore(tmp_path / "m.sqlite3"), MemoryStore(tmp_path / "m.sqlite3")
    fuzzy = FuzzyMemory(store)
    assert store.generation("de-en", "k") == 0
    assert fuzzy.index("de-en", "k").best(AT_75, 75) is None
    other.put("de-en", "k", [(STORED, "A dog (stored).")])       # another process's connection
    g = store.generation("de-en", "k")
    assert g > 0 and fuzzy.index("de-en", "k").best(AT_75, 75).target == "A dog (stored)."
    other.put("de-en", "k", [(STORED, "A dog (replaced).")])
    assert fuzzy.index("de-en", "k").best(AT_75, 75).target == "A dog (replaced)."
    assert store.generation("de-en", "other-key") == 0 and store.generation("de-en", "k") > g
    other.delete("de-en", "k")
    assert fuzzy.index("de-en", "k").best(AT_75, 75) is None


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return model_card("tiny", build_tiny_checkpoint(tmp_path_factory.mktemp("fuzzy"), "de", "en", max_len=64))


def test_a_translator_takes_fuzzy_matches_at_the_threshold_and_reports_them(card, tmp_path):
    async def main():
        t = Translator(card, settings=TranslatorSettings(memory_file=str(tmp_path / "m.sqlite3")))
        await t.reconfigure({"max_num_seqs": 4, "cpu_kernels": False})
        t.memory.put("tiny", "k", [(STORED, "A dog (stored)."), ("Zwei Männer spielen.", "Two men play (stored).")])

        def job(texts, threshold):
            j = TranslateRequest(text=texts, beam_size=1, max_new_tokens=4, memory_threshold=threshold).job()
            j.memory_scope = "k"
            return j
        r = await t.translate(job([AT_75, f"{AT_75} Zwei Männer spielen!"], 75))
        one, two = r.translations
        assert (one.text, one.origin, one.memory_score, one.tokens) == ("A dog (stored).", "memory", 75.0, [])
        assert two.text == "A dog (stored). Two men play (stored)." and two.origin == "memory"
        assert two.memory_score == 75.0       # the lowest of its sentences'
        r = await t.translate(job([AT_75, "Zwei Männer spielen."], 76))
        assert r.translations[0].origin == "engine" and r.translations[0].memory_score is None
        assert r.translations[0].text != "A dog (stored)." and r.translations[0].tokens
        assert (r.translations[1].origin, r.translations[1].memory_score) == ("memory", 100.0)   # exact
        mixed = (await t.translate(job([f"{AT_75} Zwei Männer spielen."], 76))).translations[0]
        assert mixed.origin == "mixed" and mixed.text.endswith(" Two men play (stored).")
        plain = TranslateRequest(text=AT_75, beam_size=1, max_new_tokens=4).job()
        plain.memory_scope = "k"
        exact_only = (await t.translate(plain)).translations[0]
        assert exact_only.text != "A dog (stored)." and exact_only.origin is None      # no threshold: as before
        events = [e async for e in t.stream(job([AT_75], 75))]
        assert "".join(e.text for e in events if hasattr(e, "index")) == "A dog (stored)."
        assert events[-1].translations[0].origin == "memory" and events[-1].translations[0].memory_score == 75.0
        await t.stop()
    asyncio.run(main())


def test_a_deadline_already_passed_cancels_only_texts_with_something_to_translate(card, tmp_path):
    """memory_threshold with texts without a letter: answered at once, as without it (no index to
    build, nothing to wait for), even at a deadline already passed (schemathesis: timeout_s 5e-324);
    a text with letters at that deadline is the deadline's 504, never a 500."""
    async def main():
        t = Translator(card, settings=TranslatorSettings(memory_file=str(tmp_path / "m.sqlite3")))
        await t.reconfigure({"max_num_seqs": 4, "cpu_kernels": False})
        t.memory.put("tiny", "k", [(STORED, "A dog (stored).")])

        def job(texts):
            j = TranslateRequest(text=texts, beam_size=1, max_new_tokens=4, memory_threshold=0.0).job()
            j.memory_scope = "k"
            return j
        r = await run_within(t.translate(job(["0", "12 €", ""])), time.time(), 5e-324)
        assert [x.text for x in r.translations] == ["0", "12 €", ""]
        assert [x.origin for x in r.translations] == [None, None, None]
        with pytest.raises(ServiceError) as e:
            await run_within(t.translate(job(["Ein Hund."])), time.time(), 5e-324)
        assert (e.value.status, e.value.field) == (504, "timeout_s")
        r = await t.translate(job(["Ein Hund."]))       # the index was built by then or now: a match at 0
        assert (r.translations[0].text, r.translations[0].origin) == ("A dog (stored).", "memory")
        await t.stop()
    asyncio.run(main())


def test_native_memory_threshold_is_checked_and_needs_the_memory(tmp_path):
    jobs = []

    async def run(model, job):
        jobs.append(job)
        return TranslateResponse(model=model, usage=Usage(source_tokens=1, generated_tokens=1), translations=[
            Translation(text=x, tokens=[], source_tokens=[], score=0.0, finish_reason="eos") for x in job.texts])
    from service.translator import ModelCard
    from model.config import ModelConfig
    cards = [ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))]
    with TestClient(build_app(local_services(cards, run, memory_file=str(tmp_path / "m.sqlite3")))) as client:
        r = client.post("/v1/translate", json={"text": "Hallo.", "memory_threshold": 80})
        assert r.status_code == 200 and jobs[-1].memory_threshold == 80.0 and jobs[-1].memory_scope == ""
        for bad in (-1, 100.5, "80", True):
            r = client.post("/v1/translate", json={"text": "Hallo.", "memory_threshold": bad})
            assert r.status_code == 422 and r.json()["error"]["field"] == "memory_threshold", (bad, r.text)
    with TestClient(build_app(local_services(cards, run))) as client:      # the memory off
        r = client.post("/v1/translate", json={"text": "Hallo.", "memory_threshold": 80})
        assert r.status_code == 422 and "memory is off" in r.json()["error"]["message"], r.text
