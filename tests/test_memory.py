"""The translation memory (service/translator/memory.py) and its HTTP formats (service/api/memory.py),
in-process: the store, a tiny Translator answering from it, the result cache, TSV and TMX."""
from __future__ import annotations

import asyncio

import pytest

from conftest import build_tiny_checkpoint
from service.protocol import ServiceError
from service.api.memory import check_entries, parse_tmx, parse_tsv, read_import, write_tmx, write_tsv
from service.api.schemas import TranslateRequest
from service.protocol import MAX_MEMORY_IMPORT
from service.translator import Translator, TranslatorSettings, model_card
from service.translator.memory import MemoryStore, ResultCache, memory_model, normalize
from service.translator.text import split_sentences_of


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return model_card("tiny", build_tiny_checkpoint(tmp_path_factory.mktemp("mem"), "de", "en", max_len=64))


def job(texts, scope="", stream=False, **kw):
    req = {"text": texts, "beam_size": 2, "max_new_tokens": 6}
    req.update(kw)
    j = TranslateRequest(**req).job()
    j.memory_scope = scope
    return j


def test_store_keys_are_normalized_and_scoped(tmp_path):
    store = MemoryStore(tmp_path / "m.sqlite3")
    assert normalize("  Hallo \u00a0 Welt.\n") == "Hallo Welt." == normalize("Hallo Welt.")
    assert normalize("ﬁx") == "fix"                      # NFKC, as SentencePiece normalizes
    assert store.put("de-en", "", [("Hallo  Welt.", "Hi world."), ("Ein Hund.", "A dog.")]) == 2
    assert store.lookup("de-en", "", ["Hallo Welt.", "Zwei Hunde."]) == {"Hallo Welt.": "Hi world."}
    assert store.lookup("de-en", "k1", ["Hallo Welt."]) == {}            # another key's memory
    assert store.lookup("en-de", "", ["Hallo Welt."]) == {}              # another model's
    store.put("de-en", "", [("Hallo Welt.", "Hello, world.")])          # replaced, not added
    assert store.count("de-en", "") == 2 and store.export("de-en", "")[1] == ("Hallo Welt.", "Hello, world.")
    other = MemoryStore(tmp_path / "m.sqlite3")                           # another process's view of the file
    assert other.lookup("de-en", "", ["Hallo Welt."]) == {"Hallo Welt.": "Hello, world."}
    assert store.delete("de-en", "", ["Ein  Hund."]) == 1 and other.count("de-en", "") == 1
    assert memory_model("opus-mul", "fr") == "opus-mul>>fr" and memory_model("de-en") == "de-en"
    store.add_usage("", 5)
    store.add_usage("", 7)
    assert other.usage("") == 12 and other.usage("k1") == 0


def test_result_cache_is_lru_and_off_at_zero():
    off = ResultCache(0)
    off.put("a", 1)
    assert off.get("a") is None and len(off) == 0
    c = ResultCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1            # a is now the most recent
    c.put("c", 3)
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3


def test_a_suggestion_replaces_that_sentence_only_for_that_key_and_streams(card, tmp_path):
    async def main():
        t = Translator(card, settings=TranslatorSettings(memory_file=str(tmp_path / "m.sqlite3")))
        await t.reconfigure({"max_num_seqs": 4})
        text = "Ein Hund läuft. Zwei Männer spielen."
        before = (await t.translate(job([text, "Ein Hund läuft."]))).translations
        t.memory.put("tiny", "", [("Ein Hund läuft.", "A dog is running (stored).")])
        after = (await t.translate(job([text, "Ein Hund läuft."]))).translations
        second = before[0].text[len(before[1].text):]          # the second sentence's translation, with its space
        assert after[1].text == "A dog is running (stored)."
        assert after[0].text == "A dog is running (stored)." + second     # the other sentence: the model's, unchanged
        assert after[1].tokens == [] and after[1].source_tokens == []     # the model ran for none of it
        other = (await t.translate(job([text], scope="another-key"))).translations
        assert other[0].text == before[0].text                               # another key: no suggestion
        unscoped = (await t.translate(job([text], scope=None))).translations  # memory off for the job
        assert unscoped[0].text == before[0].text
        t.memory.put("tiny", "", [("  Zwei Männer spielen. Ein Hund läuft.", "Whole text (stored).")])
        whole = (await t.translate(job(["Zwei Männer spielen.  Ein Hund läuft.\n"]))).translations[0]
        assert whole.text == "Whole text (stored).\n"     # the whole text matched (normalized), its glue kept
        t.memory.put("tiny", "", [("12345", "not a number")])
        assert (await t.translate(job(["12345"]))).translations[0].text == "12345"   # no letters: never looked up
        events = [e async for e in t.stream(job([text]))]
        streamed = "".join(e.text for e in events if hasattr(e, "index"))
        assert streamed == after[0].text == events[-1].translations[0].text
        await t.stop()
    asyncio.run(main())


def test_the_result_cache_answers_repeated_sentences_with_the_engines_result(card, tmp_path):
    async def main():
        t = Translator(card, settings=TranslatorSettings(cache_entries=16))
        await t.reconfigure({"max_num_seqs": 4})
        seen = []
        real = t.metrics.memory_lookup
        t.metrics.memory_lookup = lambda result: (seen.append(result), real(result))
        first = await t.translate(job(["Ein Hund läuft. Ein Hund läuft.", "Zwei Männer."]))
        assert seen == ["model", "model", "model"] and len(t.cache) == 2     # two distinct sentences cached
        seen.clear()
        steps = t.engine.stats().as_dict().get("steps")
        again = await t.translate(job(["Zwei Männer.", "Ein Hund läuft."]))
        assert seen == ["cache", "cache"]
        assert t.engine.stats().as_dict().get("steps") == steps                # the engine did not run
        assert again.translations[0].text == first.translations[1].text
        assert first.translations[0].text == again.translations[1].text + " " + again.translations[1].text
        seen.clear()
        await t.translate(job(["Zwei Männer."], beam_size=1))               # other options: another key
        assert seen == ["model"]
        await t.stop()
    asyncio.run(main())


def test_tsv_round_trip_keeps_tabs_quotes_and_line_breaks():
    pairs = [("Ein Hund.", "A dog."), ('Er sagt "ja".', 'He says "yes".'), ("Tab\there", "line\nbreak")]
    assert parse_tsv(write_tsv(pairs)) == pairs
    assert parse_tsv("a\tb\n\n c \t d \n") == [("a", "b"), (" c ", " d ")]
    with pytest.raises(ServiceError) as e:
        parse_tsv("a\tb\nonly one field\n")
    assert e.value.status == 422 and "line 2" in e.value.message


def test_tmx_round_trip_and_inline_code_left_out():
    pairs = [("Ein Hund <läuft> & bellt.", "A dog <runs> & barks."), ("Zwei.", "Two.")]
    assert parse_tmx(write_tmx(pairs, "de", "en"), "de", "en") == pairs
    tmx = (b'<?xml version="1.0"?><tmx version="1.4"><header srclang="de-DE"/><body>'
           b'<tu><tuv xml:lang="de-DE"><seg>Ein <bpt i="1">&lt;b&gt;</bpt>Hund<ept i="1">&lt;/b&gt;</ept>.</seg></tuv>'
           b'<tuv xml:lang="EN-GB"><seg>A <hi>dog</hi>.</seg></tuv></tu>'
           b'<tu><tuv xml:lang="fr"><seg>Un chien.</seg></tuv><tuv xml:lang="en"><seg>A dog.</seg></tuv></tu>'
           b'</body></tmx>')
    assert parse_tmx(tmx, "de", "en") == [("Ein Hund.", "A dog.")]


@pytest.mark.parametrize("body, words", [
    (b'<?xml version="1.0"?><!DOCTYPE tmx [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;">]>'
     b'<tmx version="1.4"><body><tu><tuv xml:lang="de"><seg>&b;</seg></tuv></tu></body></tmx>', "DTD"),
    (b'<?xml version="1.0"?><!DOCTYPE tmx [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
     b'<tmx version="1.4"><body><tu><tuv xml:lang="de"><seg>&x;</seg></tuv></tu></body></tmx>', "DTD"),
    (b"<tmx><body><tu>", "well-formed"),
    (b"<html><body/></html>", "not TMX"),
    (b'<tmx version="1.4"><body><tu><tuv xml:lang="fr"><seg>x</seg></tuv></tu></body></tmx>', "both de and en"),
])
def test_hostile_or_wrong_tmx_is_a_422_naming_why(body, words):
    with pytest.raises(ServiceError) as e:
        read_import(body, "application/x-tmx+xml", "de", "en")
    assert e.value.status == 422 and e.value.field == "body" and words in e.value.message, e.value.message


def test_import_limits_and_media_types():
    with pytest.raises(ServiceError) as e:
        check_entries([("a", "b")] * (MAX_MEMORY_IMPORT + 1), 0)
    assert e.value.status == 413 and str(MAX_MEMORY_IMPORT) in e.value.message
    with pytest.raises(ServiceError) as e:
        read_import(b"x", "text/csv", "de", "en")
    assert e.value.status == 415 and "text/tab-separated-values" in e.value.message
    with pytest.raises(ServiceError) as e:
        read_import(b'{"entries": [{"source": "a"}]}', "application/json", "de", "en")
    assert e.value.status == 422 and e.value.field == "entries.0.target", e.value.message
    assert read_import(b'{"entries": [{"source": "a", "target": "b"}]}', "application/json", "de", "en") == [("a", "b")]


@pytest.mark.parametrize("mode, pieces, glue", [
    ("1", ["Ein Hund", "läuft.", "Zwei Männer."], ["", "\n", " ", ""]),
    ("nonewlines", ["Ein Hund läuft.", "Zwei Männer."], ["", " ", ""]),
    ("0", ["Ein Hund läuft. Zwei Männer."], ["", ""]),
])
def test_split_sentences_modes_keep_the_text_around_the_pieces(mode, pieces, glue):
    split = split_sentences_of("Ein Hund\nläuft. Zwei Männer.", "de", mode)
    assert split.pieces == pieces and split.glue == glue
    assert split_sentences_of("  A b.\n", "de", "0").glue == ["  ", "\n"]


def test_an_unusable_memory_file_never_stops_translation(tmp_path):
    from service.replica import to_service_error
    from service.protocol import Unavailable
    (tmp_path / "file").write_text("not a directory")
    store = MemoryStore(tmp_path / "file" / "m.sqlite3")       # its directory cannot be made
    assert store.lookup("de-en", "", ["Hallo."]) == {}         # lookups find nothing: the model translates
    with pytest.raises(Unavailable) as e:
        store.put("de-en", "", [("Hallo.", "Hi.")])
    err = to_service_error(e.value, "memory")
    assert err.status == 503 and "m.sqlite3" in err.message and err.retry_after


@pytest.mark.parametrize("body, field, words", [
    (b'{"entries": [{"source": "a", "target": 1' + b"0" * 5000 + b'}]}', "entries.0.target",
     "valid string (got <an integer of 5001 digits>)"),
    (b'{"entries": 1' + b"0" * 5000 + b'}', "entries", "valid list (got <an integer of 5001 digits>)"),
    (b"1" + b"0" * 5000, "body", "valid dictionary"),
    (b'{"entries": [{"source": "Hund \\ud800", "target": "dog"}]}', "entries.0.source",
     "valid string, unable to parse raw data as a unicode string"),
    (b'{"entries": [{"source": "a", "target": "b"}], "entries": []}', "entries", "more than once"),
])
def test_a_json_import_that_pydantic_cannot_read_is_a_422_naming_the_field(body, field, words):
    """Integers longer than int() takes and lone surrogates failed pydantic's JSON parser with an
    error without a location (a 500); they are named like on every other route."""
    with pytest.raises(ServiceError) as e:
        read_import(body, "application/json", "de", "en")
    assert e.value.status == 422 and e.value.field == field and words in e.value.message, e.value.message
