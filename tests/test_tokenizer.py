"""SentencePiece tokenizer: special ids, Unicode round-trips, unknown characters."""
from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from model.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, read_lines

DATA = Path(__file__).resolve().parent.parent / "model" / "data" / "multi30k"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    lines = read_lines(DATA / "val.de.gz") + read_lines(DATA / "val.en.gz")
    return Tokenizer.train(lines, tmp_path_factory.mktemp("spm") / "spm", vocab_size=800)


def test_special_ids(tok):
    assert (tok.sp.pad_id(), tok.sp.unk_id(), tok.sp.bos_id(), tok.sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    assert tok.vocab_size == 800
    ids = tok.encode("Ein Hund läuft.")
    assert ids and all(i > EOS_ID for i in ids)


@pytest.mark.parametrize("text", [
    "Zwei Männer spielen Fußball auf einer Wiese.",
    "Crème brûlée, naïve façade, Ångström, Łódź, Ελληνικά, Русский",
    "Emoji 😀🎉👩‍👩‍👧 and flags 🇩🇪",
    "漢字とひらがな、한국어 텍스트",
    "tab\tand symbols ∑ ≠ ∞ → ©",
])
def test_unicode_round_trips(tok, text):
    # Documented behaviour: NFKC normalisation and collapsed whitespace, everything else kept;
    # unseen characters fall back to UTF-8 byte pieces instead of <unk>.
    expected = " ".join(unicodedata.normalize("NFKC", text).split())
    ids = tok.encode(text)
    assert UNK_ID not in ids
    assert tok.decode(ids) == expected


def test_unknown_characters_use_byte_pieces(tok):
    pieces = tok.pieces(tok.encode("😀"))
    assert "<0xF0>" in pieces  # first UTF-8 byte of U+1F600


def test_decode_drops_specials(tok):
    ids = tok.encode("Ein Hund.")
    assert tok.decode([BOS_ID] + ids + [EOS_ID, PAD_ID, PAD_ID]) == "Ein Hund."


def test_read_lines_plain_and_gz(tmp_path):
    import gzip
    (tmp_path / "a.txt").write_text("eins\n\nzwei\n", encoding="utf-8")
    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as f:
        f.write("eins\n\nzwei\n")
    assert read_lines(tmp_path / "a.txt") == read_lines(tmp_path / "a.txt.gz") == ["eins", "", "zwei"]
