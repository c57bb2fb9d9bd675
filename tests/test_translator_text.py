"""Sentence splitting and rejoining (service/translator/text.py); no service needed."""
from __future__ import annotations

import random

import pytest

from service.translator.text import Split, has_text, split_text


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
