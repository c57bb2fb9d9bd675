"""Sentence splitting and rejoining (service/translator/text.py); no service needed."""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from service.api.schemas import TranslateRequest
from service.translator import text as text_module
from service.translator.text import (Split, cut_long, has_text, needs_model, simple_split, split_sentences,
                                    split_text)


def test_paragraph_of_three_sentences():
    text = "Ein Mann fährt Fahrrad. Zwei Hunde spielen im Schnee!  Ist das z.B. ein Test?"
    s = split_text(text, "de")
    assert s.pieces == ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee!", "Ist das z.B. ein Test?"]
    assert s.glue == ["", " ", "  ", ""]
    assert s.join(["A.", "B!", "C?"]) == "A. B!  C?"


def test_lines_and_outer_whitespace_are_kept():
    text = "  Erste Zeile.\n\nZweite Zeile ohne Punkt\r\n\tDritte. Vierte.  "
    s = split_text(text, "de")
    assert s.pieces == ["Erste Zeile.", "Zweite Zeile ohne Punkt", "Dritte.", "Vierte."]
    assert s.join(["1", "2", "3", "4"]) == "  1\n\n2\r\n\t3 4  "


def test_abbreviations_and_quotes_stay_in_their_sentence():
    s = split_text('Dr. Müller sagt: "Hallo." Das ist gut.', "de")
    assert s.pieces == ['Dr. Müller sagt: "Hallo."', "Das ist gut."]


@pytest.mark.parametrize("text", ["", " ", "\n\n", " \t \r\n ", "\x7f", "\u200b\u200b", " \x00 \x07"])
def test_whitespace_or_invisible_only_has_no_pieces(text):
    s = split_text(text, "de")
    assert s.pieces == [] and s.join([]) == text
    assert not has_text(text)


@pytest.mark.parametrize("tail", ["\x7f", " \u200b", " \x00", "\ufeff "])
def test_invisible_characters_after_a_sentence_stay_in_the_glue(tail):
    s = split_text("Ein Hund rennt." + tail, "de")
    assert s.pieces == ["Ein Hund rennt."] and s.glue == ["", tail]
    assert has_text("a\u200b") and has_text("ß") and has_text("…")


def test_join_is_identity_on_random_layouts():
    rng = random.Random(0)
    words = ["Ein", "Mann.", "Hund!", "z.B.", "Frau?", "3.5", "(Test)", '"Hallo."', "ok", "…"]
    seps = [" ", "  ", "\n", "\n\n", "\t", " \n "]
    for _ in range(200):
        text = "".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randint(1, 12)))
        s = split_text(text, "de")
        assert s.join(s.pieces) == text
        assert all(p and p == p.strip() for p in s.pieces)
        assert all(not g.strip() for g in s.glue)  # only whitespace between and around pieces
        assert len(s.glue) == len(s.pieces) + 1


def test_join_checks_the_count():
    with pytest.raises(ValueError, match="expected 2"):
        Split(["a", "b"], ["", " ", ""]).join(["x"])


# ---- the fallback splitter: splitting never fails ------------------------------------------------------
def test_segmenter_error_falls_back_to_the_simple_split():
    """pysbd 0.3.4 raises re.error on this text (HTTP 500 before); the fallback still cuts it."""
    text = "Sie hat einen B.A. in Sport. Dazu eine Trainer B(asic) Lizenz."
    with pytest.raises(Exception):
        split_sentences(text, "de")
    s = split_text(text, "de")
    assert s.pieces == ["Sie hat einen B.A. in Sport.", "Dazu eine Trainer B(asic) Lizenz."]
    assert s.fallbacks == ["error"] and s.join(s.pieces) == text


def test_any_segmenter_exception_falls_back_per_line(monkeypatch):
    class Broken:
        def segment(self, line):
            if "Kaputt" in line:
                raise IndexError("pysbd bug")
            return [line]
    monkeypatch.setattr(text_module, "_segmenter", lambda language: Broken())
    text = "Gut so.\nKaputt. Wirklich kaputt!\n\nWieder gut."
    s = split_text(text, "de")
    assert s.pieces == ["Gut so.", "Kaputt.", "Wirklich kaputt!", "Wieder gut."]
    assert s.fallbacks == ["error"] and s.join(s.pieces) == text


def test_segmenter_time_budget_sends_later_lines_to_the_fallback(monkeypatch):
    class Slow:
        def segment(self, line):
            time.sleep(0.03)
            return [line]
    monkeypatch.setattr(text_module, "_segmenter", lambda language: Slow())
    monkeypatch.setattr(text_module, "SEGMENTER_BUDGET_S", 0.01)
    text = "Erste Zeile. Bleibt ganz\nZweite. Dritte.\nVierte. Fünfte."
    s = split_text(text, "de")
    # line 1 is pysbd's (one piece, as the stub returns it), lines 2 and 3 come after the budget
    assert s.pieces == ["Erste Zeile. Bleibt ganz", "Zweite.", "Dritte.", "Vierte.", "Fünfte."]
    assert s.fallbacks == ["timeout", "timeout"] and s.join(s.pieces) == text


@pytest.mark.parametrize("line, want", [
    ("Ein Hund rennt. Zwei Katzen schlafen!  Wirklich? Ja.",
     ["Ein Hund rennt.", "Zwei Katzen schlafen!", "Wirklich?", "Ja."]),
    ('Er sagte: „Hallo.“ Dann ging er. "Gut." (Sehr gut.) Ende…  Aus',
     ["Er sagte: „Hallo.“", "Dann ging er.", '"Gut."', "(Sehr gut.)", "Ende…", "Aus"]),
    ("Am 3. Oktober kam J. Müller mit z.B. Äpfeln. Ölfässer auch.",
     ["Am 3. Oktober kam J. Müller mit z.B. Äpfeln.", "Ölfässer auch."]),
    ("kein Satzende hier. und klein weiter", ["kein Satzende hier. und klein weiter"]),
    ("Nur eins.", ["Nur eins."]),
])
def test_simple_split_rules(line, want):
    assert simple_split(line) == want
    assert all(p in line for p in want)


def test_random_texts_never_raise_and_keep_the_invariant():
    """Texts of brackets, abbreviations and punctuation (where pysbd raises on some) always split."""
    rng = random.Random(1)
    alphabet = list("aB .,!?()[]\"'1-:;") + ["Dr.", "z.B.", "...", "B.A.", "B(asic)", "\n"]
    fallbacks = 0
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300)))
        s = split_text(text, "de")
        assert s.join(s.pieces) == text
        assert all(p and p == p.strip() for p in s.pieces)
        fallbacks += len(s.fallbacks)
    assert fallbacks > 0    # the sample does reach the fallback


# ---- the source language's rules ------------------------------------------------------------------------
@pytest.mark.parametrize("text, german", [
    ("Am 3. Oktober ist Feiertag. Dann gehen wir.", ["Am 3. Oktober ist Feiertag.", "Dann gehen wir."]),
    ("Das kostet ca. 5 Euro. Gut.", ["Das kostet ca. 5 Euro.", "Gut."]),
    ("Wir trafen uns usw. und dann.", ["Wir trafen uns usw. und dann."]),
])
def test_german_rules_for_german(text, german):
    assert split_text(text, "de").pieces == german
    assert split_text(text, "en").pieces != german     # English rules cut these differently


def test_translator_splits_with_its_source_language(monkeypatch, tmp_path):
    """Translator.prepare passes the model card's source language to split_text."""
    import asyncio
    from conftest import build_tiny_checkpoint
    from service.translator import Translator, model_card
    seen = []

    def spy(text, language="en"):
        seen.append(language)
        return split_text(text, language)
    monkeypatch.setattr(text_module, "split_text", spy)
    t = Translator(model_card("tiny", build_tiny_checkpoint(tmp_path, "de", "en", max_len=64)))

    async def prepare():
        await t.reconfigure({"max_num_seqs": 4})
        try:
            return t.prepare(TranslateRequest(text=["Am 3. Oktober ist Feiertag. Dann gehen wir."]).job())
        finally:
            await t.stop()
    splits, pieces, _ = asyncio.run(prepare())
    assert seen == ["de"] and splits[0].pieces == ["Am 3. Oktober ist Feiertag.", "Dann gehen wir."]
    assert len(pieces) == 2


# ---- pieces without letters pass through ----------------------------------------------------------------
@pytest.mark.parametrize("text, pieces, glue", [
    ("1. Ein Hund rennt.", ["Ein Hund rennt."], ["1. ", ""]),
    ("2) Zwei Katzen spielen.", ["Zwei Katzen spielen."], ["2) ", ""]),
    ("(3)  Ein Mann lacht.", ["Ein Mann lacht."], ["(3)  ", ""]),
    ("a) Ein Hund.\n(b) Zwei Hunde.", ["Ein Hund.", "Zwei Hunde."], ["a) ", "\n(b) ", ""]),
    ("- Ein Hund rennt.\n\u2013 Komm her!\n\u2022 Punkt", ["Ein Hund rennt.", "Komm her!", "Punkt"],
     ["- ", "\n\u2013 ", "\n\u2022 ", ""]),
    ("1. Ein Hund rennt. 2. Eine Katze schl\u00e4ft.", ["Ein Hund rennt.", "Eine Katze schl\u00e4ft."],
     ["1. ", " 2. ", ""]),
    # not markers: a number inside the sentence, a decimal, a count, a marker with no words after it
    ("Am 3. Mai kostet es ca. 5 Euro.", ["Am 3. Mai kostet es ca. 5 Euro."], ["", ""]),
    ("1.5 Liter Wasser.", ["1.5 Liter Wasser."], ["", ""]),
    ("5 M\u00e4nner laufen.", ["5 M\u00e4nner laufen."], ["", ""]),
    ("1)2 Hunde", ["1)2 Hunde"], ["", ""]),
    ("- 5 -", ["- 5 -"], ["", ""]),
])
def test_a_list_marker_starting_a_sentence_stays_in_the_glue(text, pieces, glue):
    split = split_text(text, "de")
    assert (split.pieces, split.glue) == (pieces, glue) and split.join(split.pieces) == text


@pytest.mark.parametrize("piece, model", [
    ("1.", False), ("12345", False), ("-", False), ("...", False), ("€ 5,00", False), ("🐶", False),
    ("3.14 %", False), ("(1)", False), ("a", True), ("1 Hund", True), ("°C", True), ("日本", True),
    ("B(asic)", True), ("ß.", True),
])
def test_needs_model_means_has_a_letter(piece, model):
    assert needs_model(piece) is model


def test_translatable_moves_pieces_without_letters_into_the_glue():
    text = "Ein Hund rennt.\n2.\nZwei Katzen. 🐶 ...\n12345"
    s = split_text(text, "de")
    assert s.pieces == ["Ein Hund rennt.", "2.", "Zwei Katzen.", "🐶 ...", "12345"]
    t = s.translatable()
    assert t.pieces == ["Ein Hund rennt.", "Zwei Katzen."]
    assert t.glue == ["", "\n2.\n", " 🐶 ...\n12345"]
    assert t.join(["A.", "B."]) == "A.\n2.\nB. 🐶 ...\n12345"
    only = split_text("1.\n- 12345 ...", "de").translatable()
    assert only.pieces == [] and only.join([]) == "1.\n- 12345 ..."


@pytest.mark.parametrize("c", ["\u200b", "\u200e", "\u202e", "\u00ad", "\ufeff", "\x07"])
def test_control_and_format_characters_at_sentence_edges_are_glue(c):
    """Cf and Cc characters around sentences stay in the glue (kept as sent, like whitespace);
    inside a sentence they stay in it (protect.py keeps them out of the model)."""
    text = f"{c}Ein Hund rennt.{c} Zwei{c} Katzen schlafen.{c}\n{c}"
    split = split_text(text, "de")
    assert split.pieces == ["Ein Hund rennt.", f"Zwei{c} Katzen schlafen."]
    assert split.glue == [c, f"{c} ", f"{c}\n{c}"] and split.join(split.pieces) == text
    assert simple_split(f"{c}Ein Hund rennt.{c} Eine Katze.{c}") == ["Ein Hund rennt.", "Eine Katze."]


def test_one_sentence_fast_path_agrees_with_pysbd():
    """A line of words with at most one final ".", "!" or "?" skips pysbd (``_ONE_SENTENCE``): for
    every such line (Multi30k lines and random ones) pysbd would have returned it whole too."""
    from model.tokenizer import read_lines
    from service.translator.text import _ONE_SENTENCE, _segmenter
    data = Path(__file__).resolve().parent.parent / "model" / "data" / "multi30k"
    lines = read_lines(data / "val.de.gz")[:300] + read_lines(data / "val.en.gz")[:300]
    rng = random.Random(0)
    alphabet = list("abcXYZ äöüß 12 ,;:-()\"'„“»«•/&%€'’–+_.!?") + ["Dr", "z", "B", "ii", "1)", "a)", " - ", "\u200b"]
    lines += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(3000)]
    fast = [line for line in lines if _ONE_SENTENCE.fullmatch(line)]
    assert len(fast) > 700     # most Multi30k lines and a few hundred random ones take the fast path
    for language in ("de", "en"):
        for line in fast:
            assert [s.strip() for s in _segmenter(language).segment(line) if s.strip()] == [line.strip()], line
            assert split_sentences(line, language) == [line.strip()]


# ---- sentences longer than the model reads -----------------------------------------------------------------
def test_cut_long_prefers_clauses_then_words_then_characters():
    fits = lambda s: len(s) <= 20       # a window of 20 characters stands for the model's tokens
    s = cut_long(Split(["Ein Hund läuft, eine Katze schläft und ein Vogel singt laut.", "Kurz."], ["", " ", "\n"]),
                 fits)
    assert s.pieces == ["Ein Hund läuft,", "eine Katze schläft", "und ein Vogel singt", "laut.", "Kurz."]
    assert s.glue == ["", " ", " ", " ", " ", "\n"] and s.fallbacks == ["too_long"]
    one_word = cut_long(Split(["x" * 45], ["", ""]), fits)          # no whitespace: between characters
    assert one_word.pieces == ["x" * 20, "x" * 20, "x" * 5] and one_word.glue == ["", "", "", ""]


def test_cut_long_keeps_spans_and_combining_marks_whole():
    fits = lambda s: len(s) <= 10
    text = "abcdefghij" + "e\u0301" * 6     # a cut never separates a combining accent from its letter
    got = cut_long(Split([text], ["", ""]), fits, lambda s: [(8, 14)]).pieces
    assert "".join(got) == text and all(len(p) <= 10 for p in got)
    assert not any(p[0] == "\u0301" for p in got)
    assert any("ij" + "e\u0301" * 2 in p for p in got)     # the span [8, 14) is in one chunk


def test_cut_long_on_random_texts_keeps_the_text_and_fits():
    rng = random.Random(5)
    alphabet = list("abc ,;:-") + ["\n", "  ", "Straße", "e\u0301"]
    for n in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        s = split_text(text, "de")
        window = rng.randint(4, 60)
        cut = cut_long(s, lambda p: len(p) <= window)
        assert cut.join(cut.pieces) == text
        assert all(len(p) <= window and p for p in cut.pieces)
        assert len(cut.pieces) >= len(s.pieces)
        assert cut.fallbacks.count("too_long") == sum(len(p) > window for p in s.pieces)


def test_terminal_escape_sequences_at_a_sentences_edges_are_glue_whole():
    from service.translator.text import has_text, split_text, trim
    for text, pieces in (("\x1b[1;31mEin Hund rennt.\x1b[0m", ["Ein Hund rennt."]),
                         ("\x1b]0;Titel\x07Ein Hund rennt. Zwei Katzen schlafen.\x1bM",
                          ["Ein Hund rennt.", "Zwei Katzen schlafen."])):
        split = split_text(text, "de")
        assert split.pieces == pieces and split.join(split.pieces) == text, split
    assert trim("\x1b[31m\u200b Hund \x1b[0m\x07") == "Hund" and not has_text("\x1b[0m \x1b[31m")
    assert trim("\x1b[31") == "[31" and trim("Hund\x1b[") == "Hund\x1b["     # unfinished: not a sequence
