"""Case (service/translator/truecase.py): sentences in capitals or title case are recased to their
usual form for the model and the translation gets the style back. Held-out text (the validation
set; the shipped table is built from the training set) measures the truecaser."""
from __future__ import annotations

import gzip

import pytest

from conftest import DATA
from model.checkpoint import DEFAULT_CHECKPOINT
from model.tokenizer import Tokenizer, read_lines
from service.translator.truecase import WORD, Truecaser, apply_style, build_table, main, table_path


def title(s: str) -> str:
    return WORD.sub(lambda m: m.group()[:1].upper() + m.group()[1:], s)


@pytest.fixture(scope="module")
def truecaser() -> Truecaser:
    if not table_path(DEFAULT_CHECKPOINT, "de").exists():
        pytest.skip("the shipped truecasing table is not in this checkout")
    return Truecaser.load(DEFAULT_CHECKPOINT, "de", Tokenizer(DEFAULT_CHECKPOINT / "tokenizer.model"))


@pytest.fixture(scope="module")
def val() -> list[str]:
    return read_lines(DATA / "val.de.gz")


def test_table_counts_casings_outside_sentence_starts(tmp_path):
    lines = ["Der Hund läuft.", "Ein großer Hund.", "Laufen ist gut.", "Sie laufen schnell.", "Wir laufen.",
             "Mit dem Ball.", "USA und die USA."]
    forms = {w.lower(): w for w in build_table(lines)}
    assert forms["hund"] == "Hund" and forms["laufen"] == "laufen" and forms["usa"] == "USA"
    assert forms["mit"] == "Mit"          # seen only sentence-initially: that form
    src = tmp_path / "train.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "truecase.de.txt.gz"
    main(["--train", str(src), "--out", str(out)])
    first = out.read_bytes()
    main(["--train", str(src), "--out", str(out)])
    assert out.read_bytes() == first      # reproducible bytes
    assert gzip.decompress(first).decode().split() == build_table(lines)


def test_shipped_table_is_small(truecaser):
    path = table_path(DEFAULT_CHECKPOINT, "de")
    assert path.stat().st_size < 300_000 and len(truecaser.forms) > 10_000


def test_ordinary_sentences_have_no_style_and_are_left_alone(truecaser, val):
    """No false alarms on held-out caption German: style None, and the text unchanged."""
    assert all(truecaser.style(s) is None for s in val)
    assert sum(truecaser.recase(s, None) == s for s in val) >= 0.99 * len(val)


def test_capitals_are_recased_to_the_usual_form(truecaser, val):
    """Every held-out sentence in capitals is detected, and recasing restores its words: nouns
    capitalized, the rest lowercase (measured: about 96% of words)."""
    words = right = 0
    for s in val:
        up = s.upper()
        assert truecaser.style(up) == "upper", up
        got = WORD.findall(truecaser.recase(up, "upper"))
        want = WORD.findall(s)
        assert len(got) == len(want)
        words += len(want)
        right += sum(g == w for g, w in zip(got, want))
    assert right / words > 0.94
    assert truecaser.recase("EIN HUND LÄUFT ÜBER DIE STRASSE.", "upper") == "Ein Hund läuft über die Straße."


def test_title_case_is_recognised_where_unambiguous(truecaser, val):
    detected = sum(truecaser.style(title(s)) == "title" for s in val)
    assert detected >= 0.98 * len(val)
    assert truecaser.recase("Ein Mann Fährt Mit Dem Fahrrad", "title") == "Ein Mann fährt mit dem Fahrrad"
    for ambiguous in ["Besuchen Sie London", "Das Laufen macht Spaß.", "Hunde", "Zwei Hunde.", "Ein Mann Läuft."]:
        assert truecaser.style(ambiguous) is None, ambiguous


def test_acronyms_and_mixed_capitals(truecaser):
    assert truecaser.style("USA.") is None and truecaser.style("NASA") is None
    assert truecaser.recase("Ein HUND läuft.", None) == "Ein Hund läuft."
    assert truecaser.recase("Ein Mann aus den USA fährt BMW.", None) == "Ein Mann aus den USA fährt BMW."
    assert truecaser.recase("Texas AM spielt.", None) == "Texas AM spielt."     # two letters: kept


def test_fixed_ranges_are_left_as_they_are(truecaser):
    """Words overlapping a fixed range (a protected span's placeholder) are not recased; the rest is,
    and the sentence's first word is still the first word."""
    text = "EIN HUND SIEHT SEATTLE UND MIAMI-STRAND."
    fixed = [(text.index("SEATTLE"), text.index("SEATTLE") + 7), (text.index("MIAMI"), text.index("MIAMI") + 5)]
    assert truecaser.recase(text, "upper", fixed) == "Ein Hund sieht SEATTLE und MIAMI-STRAND."
    assert truecaser.recase("5 HUNDE LAUFEN.", "upper", [(0, 1)]) == "5 Hunde laufen."
    assert truecaser.recase("Seattle Hunde Laufen Über Die Straße", "title", [(0, 7)]) == \
        "Seattle Hunde laufen über die Straße"


def test_styles_applied_to_the_translation():
    assert apply_style("upper", "A dog runs through the street.") == "A DOG RUNS THROUGH THE STREET."
    assert apply_style("title", "a man is riding a bicycle.") == "A Man Is Riding A Bicycle."
    assert apply_style(None, "a Dog.") == "a Dog."


def test_without_a_table_the_vocabulary_decides(tmp_path):
    tok = Tokenizer(DEFAULT_CHECKPOINT / "tokenizer.model")
    tc = Truecaser.load(tmp_path, "de", tok)      # no table there
    assert not tc.forms and tc.recase("EIN HUND LÄUFT.", "upper")[:4] == "Ein "


@pytest.fixture(scope="module")
def translate():
    import asyncio
    from service.api.schemas import TranslateRequest
    from service.translator import Translator, model_card
    loop = asyncio.new_event_loop()
    t = Translator(model_card("de-en", DEFAULT_CHECKPOINT))
    loop.run_until_complete(t.reconfigure({"max_num_seqs": 64}))
    yield lambda texts: [tr.text for tr in loop.run_until_complete(
        t.translate(TranslateRequest(text=texts, beam_size=4).job())).translations]
    loop.run_until_complete(t.stop())
    loop.close()


def test_translations_keep_the_style_of_the_source(translate, truecaser, val):
    """A sentence in capitals translates as its usual form does, in capitals; a title-cased one as
    its usual form does, every word capitalized; words in capitals inside a sentence are recased.
    (Where the truecaser restores the sentence exactly, the words are the same as for the original.)"""
    plain = val[:12]
    got = translate([s.upper() for s in plain] + [title(s) for s in plain] + plain
                    + ["EIN HUND LÄUFT.", "Ein Hund läuft.", "Ein HUND läuft."])
    upper, titled, normal, tail = got[:12], got[12:24], got[24:36], got[36:]
    assert all(u == u.upper() and any(c.isupper() for c in u) for u in upper)
    assert all(w[:1].isupper() for t in titled for w in WORD.findall(t))
    same_up = [i for i, s in enumerate(plain) if truecaser.recase(s.upper(), "upper") == s]
    same_title = [i for i, s in enumerate(plain) if truecaser.recase(title(s), "title") == s]
    assert len(same_up) >= 4 and len(same_title) >= 8
    assert [upper[i] for i in same_up] == [normal[i].upper() for i in same_up]
    assert [titled[i] for i in same_title] == [title(normal[i]) for i in same_title]
    assert tail[0] == tail[1].upper() and tail[2] == tail[1]
