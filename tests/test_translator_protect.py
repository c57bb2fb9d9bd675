"""Protected spans (service/translator/protect.py): URLs, e-mail addresses, numbers, code tokens and
characters outside the model's alphabet come back verbatim, once, where they belong.

Span finding and restoring run on the shipped tokenizer alone (restoring with made-up tokens and
attention, so every branch is reached); the rest runs the shipped model in-process through the
Translator, on the issue's inputs and on validation sentences with spans inserted at random places.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import unicodedata

import pytest
import torch
from fastapi import FastAPI

from conftest import DATA
from model.checkpoint import DEFAULT_CHECKPOINT
from model.tokenizer import read_lines
from service.api.errors import add_exception_handlers
from service.pipeline.markup import HtmlText
from service.api.schemas import TranslateRequest
from service.protocol import MAX_KEEP_CHARS, MAX_KEEP_TERMS
from service.translator.protect import Protected, Protector
from service.translator.spans import MAX_STORED_TERMS, Terms
from service.translator.text import Split
from service.translator.truecase import Truecaser

app = FastAPI()                 # the request model behind the service's error handlers (keep's 422s)
add_exception_handlers(app)

EMOJI = ["😆", "🐶", "👍🏽", "👨‍👩‍👧", "🇩🇪", "❄️", "✨", "€", "→", "™", "日本", "★"]
URLS = ["https://example.com/path?x=1", "http://www.beispiel.de/a/b.html?q=Hund&lang=de#oben",
        "https://de.wikipedia.org/wiki/Hund_(Begriff)", "www.example.org/suche?q=a+b",
        "ftp://files.example.com/x.tar.gz", "example.com", "https://example.com/#/route?id=42&x=%20y"]
EMAILS = ["max.mustermann@example.de", "info+news@firma-x.com"]
NUMBERS = ["3,50", "1.000", "12:30", "2024-01-05", "10%", "5km", "1.234,56", "+49", "3/4"]
CODE = ["get_value", "camelCaseName", "/usr/local/bin/python3", "my_function()", "os.path.join()", "C:\\Temp\\x.txt"]


@pytest.fixture(scope="module")
def protector(tok) -> Protector:
    return Protector(tok, Truecaser.load(DEFAULT_CHECKPOINT, "de", tok))


def distinct(rng: random.Random, pool: list[str], n: int) -> list[str]:
    """n spans of pool, none inside another (so that counting each in the output is meaningful)."""
    while True:
        spans = rng.sample(pool, n)
        if not any(a != b and a in b for a in spans for b in spans):
            return spans


def byte_noise(tok, text: str) -> bool:
    """Whether text holds a character the model can only spell in byte-fallback pieces."""
    return any(p.startswith("<0x") for p in tok.pieces(tok.encode(text)))


# ---- the model's alphabet, span finding, model input ---------------------------------------------
def test_known_characters_come_from_the_vocabulary(tok, protector):
    """A character is known exactly when the tokenizer spells it without byte-fallback or <unk>;
    letters that NFKC maps to known ones (full-width, ligatures) are known, other characters that
    NFKC changes ("™" -> "TM") are not: the model would not write them back."""
    import unicodedata
    for c in "aZäßé0:,.?!\"'()-" + "".join(EMOJI) + "ａ２ﬁ€°©½™":
        changed = not c.isalpha() and unicodedata.normalize("NFKC", c) != c
        assert protector.known(c) == (not byte_noise(tok, c) and not changed), c
    assert protector.known("ä") and protector.known("ﬁ")
    assert not protector.known("😆") and not protector.known("™")


@pytest.mark.parametrize("span", URLS + EMAILS + NUMBERS + CODE + EMOJI)
def test_each_kind_of_span_is_found_whole_and_left_out_of_the_model_input(protector, span):
    for sentence in [f"Ein Mann sieht {span} heute.", f"Wir treffen uns bei {span}, dann essen wir.",
                     f"({span}) steht auf dem Schild."]:
        spans = [sentence[s.start:s.end] for s in protector.find_spans(sentence)]
        assert span in spans, (sentence, spans)
        p = protector.prepare(sentence)
        assert p.spans.count(span) == 1 and span not in p.model_text and p.needs_model
        assert not any(not protector.known(c) for c in p.model_text)      # the model sees its alphabet only


def test_trailing_punctuation_is_not_part_of_a_url(protector):
    for url in URLS:
        for tail in [".", ",", "!", "?", ")."]:
            sentence = f"(Siehe {url}{tail}" if tail == ")." else f"Siehe {url}{tail}"
            found = [sentence[s.start:s.end] for s in protector.find_spans(sentence)]
            assert found == [url], (sentence, found)


def test_edge_spans_are_cut_off_and_put_back_at_their_edge(protector):
    p = protector.prepare("Ein Hund rennt. 🐶 ✨")
    assert (p.model_text, p.suffix, p.spans) == ("Ein Hund rennt.", " 🐶 ✨", [])
    p = protector.prepare("🐶  Ein Hund rennt.")
    assert (p.model_text, p.prefix, p.spans) == ("Ein Hund rennt.", "🐶  ", [])
    p = protector.prepare("https://example.com")     # nothing left for the model: the sentence is verbatim
    assert not p.needs_model


def test_spans_separated_by_whitespace_are_one_span(protector):
    p = protector.prepare("Das kostet 3,50 € pro Stück.")
    assert p.spans == ["3,50 €"]
    p = protector.prepare("Zwei Hunde 🐶 🐕 spielen.")
    assert p.spans == ["🐶 🐕"]


def test_a_url_cut_by_the_sentence_splitter_is_joined_back(protector):
    text = "Besuchen Sie https://example.com/path?x=1 heute. Ein Hund rennt."
    cut = Split(["Besuchen Sie https://example.com/path?", "x=1 heute.", "Ein Hund rennt."], ["", "", " ", ""])
    joined = protector.rejoin(cut)
    assert joined.pieces == ["Besuchen Sie https://example.com/path?x=1 heute.", "Ein Hund rennt."]
    assert joined.join(joined.pieces) == text


def test_protection_off_leaves_the_sentence_as_sent(tok):
    off = Protector(tok, None, protect=False, recase=False)
    for s in ["Ein Hund 😆 rennt.", "EIN HUND LÄUFT.", "Siehe https://example.com."]:
        p = off.prepare(s)
        assert (p.model_text, p.spans, p.prefix, p.suffix, p.style) == (s, [], "", "", None)


# ---- restoring: every branch with made-up hypotheses ---------------------------------------------
def test_restore_puts_every_span_back_once_whatever_the_model_does(tok, protector):
    """Random target sequences (with copies of the placeholders, extra copies, none) and random
    attention, with and without attention: every span comes back verbatim exactly once, and the
    words of the target around them stay in order."""
    rng = random.Random(0)
    words = [w for w in tok.encode("A dog runs in the snow with a red ball and two children play .")]
    for trial in range(300):
        spans = distinct(rng, EMOJI + URLS + NUMBERS, rng.randint(1, 3))
        sentence = "Ein Hund " + " und ".join(f"{s} rennt" for s in spans) + "."
        p = protector.prepare(sentence)
        src = protector.encode(p)
        ph = sorted(frozenset().union(*protector.word_ids.values()))
        tokens = [rng.choice(words + ph) for _ in range(rng.randint(0, 12))]
        cross = torch.rand(3, 4, len(tokens), len(src)).softmax(-1) if rng.random() < 0.8 else None
        out = protector.restore(p, src, tokens, cross)
        for s in p.spans:
            assert out.count(s) == 1, (sentence, tokens, out)
        rest = out
        for s in p.spans:
            rest = rest.replace(s, " ")
        # the words: not a placeholder of a kind the sentence's spans have, nor a piece glued to one
        used = frozenset().union(*(protector.word_ids[protector.candidates[k][0]] for k in p.kinds))
        plain, after = [], False
        for t, piece in zip(tokens, tok.pieces(tokens)):
            if t in used or (after and not piece.startswith("\u2581") and any(c.isalnum() for c in piece)):
                after = True
            else:
                plain.append(t)
                after = False
        assert " ".join(rest.split()).replace(" ", "") == tok.decode(plain).replace(" ", "")


def test_restore_uses_copies_then_neighbours_then_the_end(tok, protector):
    p = protector.prepare("Ein Hund 😆 rennt.")
    src = protector.encode(p)                                       # ▁Ein ▁Hund ▁Seattle ▁rennt . </s>
    ph = src.index(next(iter(protector.word_ids[protector.candidates["other"][0]])))
    a, dog, runs, dot = tok.encode("A dog runs.")
    copy = next(iter(protector.word_ids[protector.candidates["other"][0]]))
    # copied: the span replaces the copy
    assert protector.restore(p, src, [a, dog, copy, runs, dot], None) == "A dog 😆 runs."
    # dropped: after the target word that attends most to the source word before the placeholder
    att = torch.zeros(1, 1, 4, len(src))
    att[0, 0, [0, 1, 2, 3], [0, ph - 1, ph + 1, ph + 2]] = 1.0
    att[0, 0, 0, ph] = 5.0                  # the placeholder's own column is not what decides
    assert protector.restore(p, src, [a, dog, runs, dot], att) == "A dog 😆 runs."
    # without attention: at the end, before the final punctuation
    assert protector.restore(p, src, [a, dog, runs, dot], None) == "A dog runs 😆."


def test_the_placeholder_word_itself_and_digits_glued_to_a_copy(tok, protector):
    """A real "Seattle" (the first other-kind placeholder) in a sentence whose only span is a number
    stays a word; with a span of its kind too, the sentence gets the next placeholder ("Miami"), so
    "Seattle" stays a word and repeated copies of the placeholder are dropped; digits the model
    glued to a copied number ("5" "0" "8" for "5") go with the copy."""
    (five,), (seattle,) = tok.encode("5"), tok.encode("Seattle")     # the placeholders, word-initial
    head, runs, dot = tok.encode("A man from"), tok.encode("runs"), tok.sp.piece_to_id(".")
    p = protector.prepare("Ein Mann aus Seattle läuft 7 km.")
    assert p.spans == ["7"] and "Seattle" in p.model_text
    src = protector.encode(p)
    tokens = head + [seattle] + runs + [five, dot]
    for cross in (None, torch.rand(3, 4, len(tokens), len(src)).softmax(-1)):
        assert protector.restore(p, src, tokens, cross) == "A man from Seattle runs 7."
    p = protector.prepare("Ein Mann aus Seattle mag \U0001F600 sehr.")
    assert p.spans == ["\U0001F600"] and p.kinds == ["other"] and p.placeholders == ["Miami"]
    (miami,) = tok.encode("Miami")
    out = protector.restore(p, protector.encode(p), head + [seattle] + runs + [miami, miami, dot], None)
    assert out.count("Seattle") == 1 and out.count("\U0001F600") == 1 and "Miami" not in out
    p = protector.prepare("Es kostet ca. 5 Euro.")
    zero, eight = (tok.sp.piece_to_id(d) for d in ("0", "8"))
    assert tok.unk_id not in (zero, eight, dot)
    tokens = tok.encode("It costs") + [five, zero, eight] + tok.encode("euros") + [dot]
    assert protector.restore(p, protector.encode(p), tokens, None) == "It costs 5 euros."


# ---- the shipped model, in-process ---------------------------------------------------------------
STORED = ["# the server's do-not-translate list", "", "Kölner Dom", "  Multi30k  "]


@pytest.fixture(scope="module")
def translate(tok, tmp_path_factory):
    """translate(texts, **options) -> list of Translation, through one Translator on the shipped model
    (with a stored do-not-translate list, STORED)."""
    from service.translator import TextConfig, Translator, TranslatorSettings, model_card
    loop = asyncio.new_event_loop()
    stored = tmp_path_factory.mktemp("keep") / "keep.txt"
    stored.write_text("\n".join(STORED) + "\n", encoding="utf-8")
    t = Translator(model_card("de-en", DEFAULT_CHECKPOINT), settings=TranslatorSettings(text=TextConfig(keep_file=str(stored))))
    loop.run_until_complete(t.reconfigure({"max_num_seqs": 64}))

    def run(texts, **kw):
        job = TranslateRequest(text=texts, **{"beam_size": 1, **kw}).job()
        return loop.run_until_complete(t.translate(job)).translations
    run.translator, run.loop = t, loop
    yield run
    loop.run_until_complete(t.stop())
    loop.close()


def test_the_issue_inputs(tok, translate):
    texts = ["Ein Hund 😆 rennt.", "Ein Hund rennt. 🐶", "Besuchen Sie https://example.com/path?x=1 heute.",
             "EIN HUND LÄUFT.", "Ein Hund rennt.", "Ein Hund läuft."]
    emoji_in, emoji_after, url, caps, plain, plain2 = [t.text for t in translate(texts, beam_size=4)]
    assert emoji_in.count("😆") == 1 and not byte_noise(tok, emoji_in.replace("😆", ""))
    assert len(emoji_in.split()) <= len(plain.split()) + 3                 # no runaway noise
    assert emoji_after == plain + " 🐶"                                    # cut off, translated, put back
    assert url.count("https://example.com/path?x=1") == 1
    assert caps == plain2.upper() and caps.isupper()                       # recased, translated, capitals again


def test_random_spans_in_real_sentences_come_back_verbatim_once(tok, translate):
    """Validation sentences with 1-2 spans of every kind inserted between words."""
    rng = random.Random(1)
    pool = EMOJI + URLS + EMAILS + NUMBERS + CODE
    texts, inserted = [], []
    for s in read_lines(DATA / "val.de.gz")[:24]:
        words = s.split()
        spans = distinct(rng, pool, rng.randint(1, 2))
        for span in spans:
            words.insert(rng.randrange(1, len(words)), span)
        texts.append(" ".join(words))
        inserted.append(spans)
    for text, spans, tr in zip(texts, inserted, translate(texts)):
        for span in spans:
            assert tr.text.count(span) == 1, (text, tr.text)
        rest = tr.text
        for span in spans:
            rest = rest.replace(span, "")
        assert not byte_noise(tok, rest), (text, tr.text)
        assert len(rest.split()) <= 2 * len(text.split()) + 4, (text, tr.text)


def test_tokens_and_attention_are_what_the_model_saw(tok, translate):
    [tr] = translate(["Ein Hund 😆 rennt mit dem Ball 🎾 zu 3 Kindern."], return_attention=True)
    assert "😆" in tr.text and "🎾" in tr.text and "3" in tr.text
    assert tr.source_tokens.count("▁Seattle") == 2 and "▁5" in tr.source_tokens   # the placeholders
    assert not any(p.startswith("<0x") for p in tr.source_tokens)
    cross = tr.attention["cross"]
    assert len(cross[0][0]) == len(tr.tokens) and len(cross[0][0][0]) == len(tr.source_tokens)


def test_streamed_deltas_add_up_to_the_final_text(translate):
    t, loop = translate.translator, translate.loop
    texts = ["Ein Hund 😆 rennt. Zwei Katzen schlafen.", "EIN MANN FÄHRT FAHRRAD. 🚲",
             "Siehe https://example.com/a?b=1#c heute."]

    async def collect():
        got, final = {}, None
        async for item in t.stream(TranslateRequest(text=texts, beam_size=1, stream=True).job()):
            if hasattr(item, "index"):
                got[item.index] = got.get(item.index, "") + item.text
            elif hasattr(item, "translations"):
                final = item
        return got, final
    got, final = loop.run_until_complete(collect())
    assert [got.get(i, "") for i in range(len(texts))] == [tr.text for tr in final.translations]
    assert "😆" in got[0] and got[1].endswith(" 🚲") and "https://example.com/a?b=1#c" in got[2]


def test_html_paragraph_with_indentation_is_one_sentence(translate):
    html = "<p>\n\tEin Mann\n\tfährt Fahrrad.\n</p>"
    h = HtmlText(html)
    out = h.rebuild([tr.text for tr in translate(h.segments, beam_size=4)])
    [one] = translate(["Ein Mann fährt Fahrrad."], beam_size=4)
    assert out == f"<p>\n\t{one.text}\n</p>"
    assert "\n" not in one.text and re.fullmatch(r"[A-Z][^.]*\.", one.text)


def test_protected_from_prepare_is_a_dataclass_of_the_source(protector):
    p = protector.prepare("Um 12:30 Uhr ruft anna_b@example.de an.")
    assert isinstance(p, Protected) and p.spans == ["12:30", "anna_b@example.de"]
    assert p.kinds == ["number", "other"] and p.source == "Um 12:30 Uhr ruft anna_b@example.de an."


INVISIBLE = ["\u200b", "\u200e", "\u202e", "\u00ad", "\u2060", "\ufeff", "\x07"]   # Cf and Cc, not whitespace


def test_control_and_format_characters_are_glue_around_sentences_and_kept_out_of_the_model(tok, translate):
    """At a sentence's edges they come back verbatim where they were; inside it they are left out of
    the model's input (no byte pieces, the same translation as without them)."""
    plain = ["Ein Hund rennt.", "Zwei Katzen schlafen."]
    base = [t.text for t in translate(plain)]
    texts = []
    for c in INVISIBLE:
        texts += [c + plain[0], plain[0] + c, f"{plain[0]}{c} {plain[1]}", "Ein Hu" + c + "nd rennt.",
                  "Ein " + c + "Hund rennt."]
    out = translate(texts)
    for k, c in enumerate(INVISIBLE):
        lead, trail, between, in_word, before_word = out[5 * k: 5 * k + 5]
        assert lead.text == c + base[0] and trail.text == base[0] + c, (c, lead.text, trail.text)
        assert between.text == f"{base[0]}{c} {base[1]}", (c, between.text)
        assert before_word.text == base[0] and (in_word.text == base[0] or c == "\u200b"), (c, in_word.text)
        assert not any(p.startswith("<0x") for t in (lead, in_word, before_word) for p in t.source_tokens)


def test_a_zero_width_space_between_words_is_read_as_a_space(translate):
    """U+200B marks a word break: "Ein\u200bHund" is the model's "Ein Hund", not "EinHund"."""
    spaced, zwsp, joined = translate(["Ein Hund rennt.", "Ein\u200bHund rennt.", "EinHund rennt."])
    assert zwsp.source_tokens == spaced.source_tokens != joined.source_tokens and zwsp.text == spaced.text


def test_combining_marks_the_vocabulary_lacks_are_left_out_after_composition(tok, translate):
    """A mark that composes with its letter stays ("Cafe" + U+0301 -> "Café"); marks left over after
    composition (three diaereses on one "u") are left out of the model's input, not byte pieces."""
    plain, marked, composed = translate(["Ein Hund rennt.", "Ein Hu\u0308\u0308\u0308nd rennt.", "Ein Hu\u0308nd rennt."])
    assert not any(p.startswith("<0x") for p in marked.source_tokens), marked.source_tokens
    assert marked.source_tokens == composed.source_tokens and marked.text == composed.text
    assert "ü" in "".join(composed.source_tokens) and plain.source_tokens != composed.source_tokens
    [cafe] = translate(["Ein Mann im Cafe\u0301."])
    assert "é" in "".join(cafe.source_tokens) and not any(p.startswith("<0x") for p in cafe.source_tokens)


def test_nested_inline_elements_are_one_sentence_without_repeated_text(translate):
    """Inline elements inside inline elements: the run is translated as one sentence (the text without
    tags is exactly its translation, nothing repeated) and every tag comes back byte for byte, in order."""
    htmls = ["<b>Ein <i>Hund</i></b> rennt.", "<b><i>Ein Hund</i></b> rennt.",
             "<b>Ein <i>großer</i> Hund</b> rennt.",
             "<p>Zwei <span class='x'>Kinder <em>spielen</em> im <a href=\"/s?a=1&amp;b=2\">Schnee</a></span>.</p>"]
    tags = lambda h: re.findall(r"<[^>]+>", h)  # noqa: E731
    for html in htmls:
        h = HtmlText(html)
        out = h.rebuild([tr.text for tr in translate(h.segments, beam_size=4)])
        [whole] = translate([re.sub(r"<[^>]+>", "", html).replace("&amp;", "&")], beam_size=4)
        assert tags(out) == tags(html), (html, out)
        assert re.sub(r"<[^>]+>", "", out) == whole.text, (html, out)



# ---- nothing is dropped: U+FFFD, private use, entities; numbers keep their units ------------------
ODD = ["\ufffd", "\ufffd\ufffd\ufffd", "\ue000", "\U000f0001", "&unknown;", "&x;", "&#0;", "&#x110000;", "&nbsp;"]
UNITS = ["25°C", "30 °F", "5km", "10%", "3,50 €", "5 €/kg", "-4 °C"]


def test_characters_the_tokenizer_drops_or_cannot_encode_are_unknown(protector):
    for c in ["\ufffd", "\ue000", "\U000f0001", "\ud800"]:      # dropped by SentencePiece, byte pieces, a surrogate
        assert not protector.known(c), repr(c)


@pytest.mark.parametrize("span", ODD + UNITS)
def test_odd_characters_entities_and_numbers_with_units_are_spans_found_whole(protector, span):
    for sentence in [f"Ein Hund läuft bei {span} heute.", f"Bei {span}, sagt er.", f"{span} Ein Hund läuft."]:
        spans = [sentence[s.start:s.end] for s in protector.find_spans(sentence)]
        assert span in spans, (sentence, spans)


def test_odd_characters_entities_and_units_come_back_verbatim_once(translate):
    texts = [f"Ein Hund läuft bei {span} schnell." for span in ODD + UNITS] + \
            [f"{span} Ein Hund läuft." for span in ODD] + ["Es ist warm bei 25°C."]
    for text, tr in zip(texts, translate(texts)):
        span = next(s for s in sorted(ODD + UNITS, key=len, reverse=True) if s in text)
        assert tr.text.count(span) == 1, (text, tr.text)


def test_a_span_glued_to_a_word_stays_glued(tok, protector):
    """A span with a letter or digit right before / after it in the source gets no space on that side
    in the translation; a span between spaces keeps them."""
    p = protector.prepare("Der Wert <schnell> ist gut.")
    assert p.spans == ["<", ">"] and p.glued == [(False, True), (True, False)]
    seattle = tok.encode("Seattle")
    assert len(seattle) == 1 and seattle[0] in protector.word_ids[protector.candidates["other"][0]]
    tokens = tok.encode("The value") + seattle + tok.encode("quick") + seattle + tok.encode("is good.")
    assert protector.restore(p, protector.encode(p), tokens, None) == "The value <quick> is good."
    p = protector.prepare("Der Wert < schnell > ist gut.")
    assert p.glued == [(False, False)] * len(p.spans)
    assert protector.restore(p, protector.encode(p), tokens, None) == "The value < quick > is good."


def test_html_references_and_glued_spans_on_the_model(translate):
    h = HtmlText("<p>Ein &#xD800; Hund &#0; &#x110000; läuft.</p><p>Der Wert &lt;schnell&gt; ist gut.</p>")
    out = h.rebuild([t.text for t in translate(h.segments)])
    assert [out.count(r) for r in ("&#xD800;", "&#0;", "&#x110000;")] == [1, 1, 1] and "\ufffd" not in out
    assert re.search(r"&lt;\w", out) and re.search(r"\w&gt;", out), out


def test_decomposed_accents_translate_as_their_composed_form(translate):
    """Text typed with combining marks (NFD, as macOS sends it) is the same sentence as its composed
    form (NFC): the same model input and translation (up to canonical equivalence: a text with nothing
    to translate comes back as sent), no byte pieces, the accented letter verbatim."""
    pairs = [("a\u0301", "\u00e1"), ("Ein Mann isst in Sa\u0303o Paulo.", "Ein Mann isst in S\u00e3o Paulo."),
             ("Ein Hund rennt im Cafe\u0301.", "Ein Hund rennt im Caf\u00e9.")]
    out = translate([t for pair in pairs for t in pair])
    for k, (nfd, nfc) in enumerate(pairs):
        a, b = out[2 * k], out[2 * k + 1]
        assert a.source_tokens == b.source_tokens and unicodedata.normalize("NFC", a.text) == b.text, (nfd, a.text, b.text)
        assert not any(p.startswith("<0x") for p in a.source_tokens), a.source_tokens
    assert unicodedata.normalize("NFC", out[0].text) == "\u00e1" and "S\u00e3o" in out[3].text


def test_a_word_with_letters_the_model_lacks_comes_back_whole(translate, protector):
    """"Łódź" (Ł and ź are outside the model's alphabet, ó is not) is one verbatim span, not two
    letters around a translated "ód"; a symbol the model lacks (an emoji) glued to a word is still
    only itself."""
    sentence = "Ein Mann aus Łódź singt."
    [span] = protector.find_spans(sentence)
    assert sentence[span.start: span.end] == "Łódź" and span.kind == "word"
    [emoji] = protector.find_spans("Ein Hund🐕 rennt.")
    assert "Ein Hund🐕 rennt."[emoji.start: emoji.end] == "🐕"
    [t] = translate([sentence])
    assert t.text.count("Łódź") == 1 and "Ł" not in t.text.replace("Łódź", ""), t.text
    assert not any(p.startswith("<0x") for p in t.source_tokens), t.source_tokens


# ---- placeholders that cannot collide with the sentence -----------------------------------------
def forms(kind: str, word: str) -> list[str]:
    """Ways a sentence can hold a placeholder candidate outside its spans: as a word, in capitals
    (recased to the word itself), lowercase, inside a longer word, glued to letters."""
    if kind == "number":
        return [f"Typ{word}", f"A{word}B"]            # digits alone would be number spans
    return [word, word.upper(), word.lower(), word + "er", "X" + word]


@pytest.mark.parametrize("kind, span", [("number", "12"), ("other", "😆")])
def test_a_placeholder_is_never_a_word_of_the_sentence(tok, protector, kind, span):
    """A sentence that holds a candidate in any form gets another placeholder: the source holds the
    placeholder's pieces exactly where its spans were, so every copy in a translation is a span's."""
    assert len(protector.candidates[kind]) >= 4
    for word in protector.candidates[kind]:
        for form in forms(kind, word):
            p = protector.prepare(f"Ein Mann aus {form} sieht {span} und {span} heute.")
            assert p.spans == [span, span] and p.kinds == [kind, kind], (form, p.spans)
            [chosen] = set(p.placeholders)
            assert chosen != word and chosen.casefold() not in form.casefold(), (form, chosen)
            src = protector.encode(p)
            assert sum(i in protector.word_ids[chosen] for i in src) == 2, (form, tok.pieces(src))
            assert form in p.model_text or form.lower() in p.model_text.lower()


def test_a_city_named_like_the_placeholder_keeps_its_place(tok, protector):
    """The issue's swap: "Seattle" and a URL in one sentence. The URL's placeholder is another word,
    so the translation's "Seattle" is the city and the copy of the placeholder is the URL, wherever
    the model puts them, with attention or without."""
    p = protector.prepare("Ein Mann aus Seattle besucht https://example.com/path heute.")
    assert p.placeholders == ["Miami"] and "Seattle" in p.model_text and "Miami" in p.model_text
    src = protector.encode(p)
    (seattle,), (miami,) = tok.encode("Seattle"), tok.encode("Miami")
    tokens = tok.encode("A man from") + [seattle] + tok.encode("visits") + [miami] + tok.encode("today.")
    for cross in (None, torch.rand(3, 4, len(tokens), len(src)).softmax(-1)):
        assert protector.restore(p, src, tokens, cross) == "A man from Seattle visits https://example.com/path today."
    swapped = tok.encode("A man from") + [miami] + tok.encode("visits") + [seattle] + tok.encode("today.")
    assert protector.restore(p, src, swapped, None) == "A man from https://example.com/path visits Seattle today."


def test_a_sentence_with_every_candidate_still_gets_each_span_once(tok, protector):
    """The last resort: every candidate of a kind is a word of the sentence. The first one is used;
    the spans still come back once each, whatever the model does."""
    rng = random.Random(2)
    names = " ".join(protector.candidates["other"])
    p = protector.prepare(f"Wir sehen {names} und 😆 und 🐶 heute.")
    assert p.spans == ["😆", "🐶"] and p.placeholders == [protector.candidates["other"][0]] * 2
    src = protector.encode(p)
    pool = tok.encode("We see the dogs today and") + sorted(frozenset().union(*protector.word_ids.values()))
    for _ in range(100):
        tokens = [rng.choice(pool) for _ in range(rng.randint(0, 14))]
        cross = torch.rand(3, 4, len(tokens), len(src)).softmax(-1) if rng.random() < 0.5 else None
        out = protector.restore(p, src, tokens, cross)
        assert out.count("😆") == 1 and out.count("🐶") == 1, (tokens, out)


# ---- spans are found before anything is recased -------------------------------------------------
@pytest.mark.parametrize("sentence, span", [
    ("BESUCHEN SIE HTTPS://EXAMPLE.COM/PATH HEUTE.", "HTTPS://EXAMPLE.COM/PATH"),
    ("BESUCHEN SIE WWW.EXAMPLE.ORG/SUCHE?Q=HUND HEUTE.", "WWW.EXAMPLE.ORG/SUCHE?Q=HUND"),
    ("EIN MANN LIEST EXAMPLE.COM IM PARK.", "EXAMPLE.COM"),
    ("SCHREIBEN SIE AN INFO@EXAMPLE.DE IM PARK.", "INFO@EXAMPLE.DE"),
    ("BESUCHEN SIE https://example.com/Pfad HEUTE.", "https://example.com/Pfad"),
    ("Besuchen Sie Https://Example.Com/Pfad Heute Mit Dem Hund.", "Https://Example.Com/Pfad"),
])
def test_spans_in_capitals_are_found_and_recasing_leaves_them_out(protector, sentence, span):
    """A URL or address in capitals is a span like any other (schemes and "www." in any case,
    top-level domains in lowercase or capitals); the sentence's style is judged and its words
    recased without it, and the placeholder stays as it is."""
    p = protector.prepare(sentence)
    assert p.spans == [span] and p.placeholders == ["Seattle"], (p.spans, p.model_text)
    assert span.lower() not in p.model_text.lower() and " Seattle " in p.model_text
    assert p.style in ("upper", "title") and p.model_text != sentence


# ---- restoring: copies bid for their span, dropped spans go where the alignment says ------------
def test_a_repeated_copy_gets_no_span_and_the_other_span_is_aligned(tok, protector):
    """Two number spans; the model writes the placeholder twice, both copies attending most to the
    second span's placeholder: the copy attending most gets that span, the other copy is a repeat
    (dropped), and the first span goes where the alignment puts its source position."""
    p = protector.prepare("Ein Mann im weißen 3,50 Hemd macht 25 Fotos.")
    assert p.spans == ["3,50", "25"] and p.placeholders == ["5", "5"]
    src = protector.encode(p)                  # ▁Ein ▁Mann ▁im ▁weißen ▁5 ▁Hemd ▁macht ▁5 ▁Fotos .
    pieces = tok.pieces(src)
    ph = [i for i, t in enumerate(src) if t in protector.word_ids["5"]]
    (five,) = tok.encode("5")
    words = ["A", "man", "in", "a", "white", "shirt", "takes", "5", "5", "pictures"]
    tokens = [five if w == "5" else tok.encode(w)[0] for w in words] + [tok.sp.piece_to_id(".")]
    assert len(tokens) == len(words) + 1 and tok.unk_id not in tokens
    att = torch.zeros(1, 1, len(tokens), len(src))
    aligned = {"A": "Ein", "man": "Mann", "in": "im", "a": "im", "white": "weißen", "shirt": "Hemd",
               "takes": "macht", "pictures": "Fotos"}
    for t, w in enumerate(words):
        if w in aligned:
            att[0, 0, t, column(pieces, aligned[w])] = 1.0
    att[0, 0, 7, ph[1]], att[0, 0, 7, ph[0]] = 0.5, 0.1        # both copies: the second placeholder
    att[0, 0, 8, ph[1]], att[0, 0, 8, ph[0]] = 0.2, 0.05
    att[0, 0, 10, -1] = 1.0
    assert protector.restore(p, src, tokens, att) == "A man in a white 3,50 shirt takes 25 pictures."


def test_a_dropped_span_follows_its_aligned_neighbour(tok, protector):
    """A span whose placeholder the model left out goes after the translation of the nearest source
    word before it that is aligned both ways, else before that of the nearest one after it; a word
    whose best target word prefers another source word (an article attending to its noun) is no
    anchor. Never at the end when the alignment says otherwise."""
    p = protector.prepare("Der große braune Hund rennt durch seichtes 7 Wasser.")
    src = protector.encode(p)
    pieces = tok.pieces(src)
    words = ["The", "large", "brown", "dog", "runs", "through", "shallow", "water"]
    tokens = [tok.encode(w)[0] for w in words] + [tok.sp.piece_to_id(".")]
    assert len(tok.pieces(tokens)) == 9 and tok.unk_id not in tokens
    ph = src.index(tok.encode("5")[0])
    german = ["Der", "große", "braune", "Hund", "rennt", "durch", "seichtes", "Wasser"]
    att = torch.zeros(1, 1, len(tokens), len(src))
    for t, w in enumerate(german):
        att[0, 0, t, column(pieces, w)] = 1.0
    att[0, 0, 8, len(src) - 2] = 1.0           # "." -> "."
    seichtes = column(pieces, "seichtes")
    att[0, 0, 7, seichtes] = 0.6               # "water" also attends to "seichtes": still "Wasser"'s
    att[0, 0, 6, ph] = att[0, 0, 7, ph] = 0.8  # the left-out placeholder's own column decides nothing
    assert protector.restore(p, src, tokens, att) == "The large brown dog runs through shallow 7 water."
    att[0, 0, 6, seichtes] = 0.0               # "shallow" aligned nowhere: "seichtes" is no anchor, so
    att[0, 0, 6, 0] = 0.3                      # the span goes before the translation of "Wasser"
    assert protector.restore(p, src, tokens, att) == "The large brown dog runs through shallow 7 water."
    att[0, 0, 7, column(pieces, "Wasser")] = att[0, 0, 7, seichtes] = 0.0    # "water" aligned nowhere either:
    assert protector.restore(p, src, tokens, att) == "The large brown dog runs through 7 shallow water."   # "durch"


def column(pieces: list[str], word: str) -> int:
    """The position of the first piece of a source word."""
    return next(i for i, p in enumerate(pieces) if p.startswith("▁") and len(p) > 1 and word.startswith(p[1:]))


# ---- do-not-translate terms ---------------------------------------------------------------------
def spans_of(protector, text, *terms):
    return [text[s.start:s.end] for s in protector.find_spans(text, keep=Terms(terms))]


def test_keep_terms_are_whole_words_case_sensitive_and_overlaps_are_one_span(protector):
    assert spans_of(protector, "Wir nutzen Multi30k und ACME Pro.", "Multi30k", "ACME Pro") == ["Multi30k", "ACME Pro"]
    assert spans_of(protector, "ACME Professional und acme pro und XACME Pro.", "ACME Pro") == []
    assert spans_of(protector, "ACME  Pro und ACME\u00a0Pro.", "ACME Pro") == ["ACME  Pro", "ACME\u00a0Pro"]
    assert spans_of(protector, "ACME Pro ist besser als ACME Pro.", "ACME Pro") == ["ACME Pro", "ACME Pro"]
    assert spans_of(protector, "In New York City ist es laut.", "New York", "York City") == ["New York City"]
    assert spans_of(protector, "Die ACME Pro Max ist neu.", "ACME Pro", "ACME Pro Max", "Pro") == ["ACME Pro Max"]
    assert spans_of(protector, "Siehe https://acme.com/ACME heute.", "ACME") == ["https://acme.com/ACME"]
    assert spans_of(protector, "Wir lernen C++ und .NET heute.", "C++", ".NET") == ["C++", ".NET"]
    assert spans_of(protector, "Der Hund rennt.", " ", "") == []
    p = protector.prepare("Die ACME Pro steht vor 3 Häusern.", Terms(["ACME Pro"]))
    assert p.spans == ["ACME Pro", "3"] and "ACME" not in p.model_text and p.placeholders == ["Seattle", "5"]


def test_a_keep_term_cut_by_the_sentence_splitter_is_joined_back(protector):
    text = "Wir mögen Yahoo! Mail sehr. Ein Hund rennt."
    cut = Split(["Wir mögen Yahoo!", "Mail sehr.", "Ein Hund rennt."], ["", " ", " ", ""])
    joined = protector.rejoin(cut, Terms(["Yahoo! Mail"]))
    assert joined.pieces == ["Wir mögen Yahoo! Mail sehr.", "Ein Hund rennt."] and joined.join(joined.pieces) == text


def test_a_stored_list_is_one_term_a_line(tmp_path):
    path = tmp_path / "keep.txt"
    path.write_text("\n".join(STORED) + "\n", encoding="utf-8")
    assert Terms.load(path).terms == ("Kölner Dom", "Multi30k")
    path.write_text("ok\n" + "x" * (MAX_KEEP_CHARS + 1) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"keep.txt:2: .*at most {MAX_KEEP_CHARS}"):
        Terms.load(path)
    path.write_text("\n".join(f"t{i}" for i in range(MAX_STORED_TERMS + 1)), encoding="utf-8")
    with pytest.raises(ValueError, match=f"more than {MAX_STORED_TERMS} terms"):
        Terms.load(path)


@app.post("/v1/translate")
async def _echo_keep(body: TranslateRequest):
    return {"keep": list(body.job().keep)}


@pytest.mark.parametrize("keep, words", [
    ([""], "keep[0]: must not be empty"), (["ok", "   "], "keep[1]: must not be empty"),
    (["ok", 3], "keep[1]: must be a string, got int"), ([None], "keep[0]: must be a string"),
    (["x" * (MAX_KEEP_CHARS + 1)], f"keep[0]: at most {MAX_KEEP_CHARS} characters, got {MAX_KEEP_CHARS + 1}"),
    (["t"] * (MAX_KEEP_TERMS + 1), f"keep: at most {MAX_KEEP_TERMS} terms, got {MAX_KEEP_TERMS + 1}"),
    ("ACME", "keep: must be a list of strings"), ({"a": 1}, "keep: must be a list of strings"),
    (["a\ud800"], "keep[0]: not valid Unicode"),
])
def test_bad_keep_is_a_422_naming_the_field_and_the_limit(keep, words):
    """Through the service's request model and error handlers (no Ray): a 422 naming keep (or
    keep[i]) and the limit, never a 500; the next request is served as usual."""
    from fastapi.testclient import TestClient
    client = TestClient(app)
    body = json.dumps({"text": "Hallo", "keep": keep}, ensure_ascii=True)   # lone surrogates as \\ud800
    r = client.post("/v1/translate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == "keep" and err["message"].startswith(words), err
    ok = client.post("/v1/translate", json={"text": "Hallo", "keep": ["ACME Pro", "x" * MAX_KEEP_CHARS]})
    assert ok.status_code == 200 and ok.json() == {"keep": ["ACME Pro", "x" * MAX_KEEP_CHARS]}
    assert client.post("/v1/translate", json={"text": "Hallo", "keep": None}).json() == {"keep": []}


# ---- the faults and the keep field on the shipped model -----------------------------------------
def test_a_city_named_like_the_placeholder_and_a_url_stay_in_their_places(translate):
    url = "https://example.com/path"
    [tr] = translate([f"Ein Mann aus Seattle besucht {url} heute."])
    assert tr.source_tokens.count("▁Seattle") == 1 and "▁Miami" in tr.source_tokens, tr.source_tokens
    assert tr.text.count("Seattle") == 1 and tr.text.count(url) == 1, tr.text
    assert tr.text.index("Seattle") < tr.text.index(url), tr.text       # "from Seattle", then the URL


def test_a_url_in_a_sentence_in_capitals_comes_back(translate):
    """Found in capitals (it used to be recased as words and lost: "/EXAMPLE.COM/PATH"), kept out
    of the model, back verbatim; the rest of the translation in capitals."""
    spans = ["HTTPS://EXAMPLE.COM/PATH", "WWW.EXAMPLE.ORG", "EXAMPLE.COM", "INFO@EXAMPLE.DE"]
    texts = [f"BESUCHEN SIE {spans[0]} HEUTE.", f"BESUCHEN SIE {spans[1]} HEUTE.",
             f"EIN MANN LIEST {spans[2]} IM PARK.", f"SCHREIBEN SIE AN {spans[3]}."]
    for span, tr in zip(spans, translate(texts)):
        assert tr.text.count(span) == 1 and tr.text == tr.text.upper(), (span, tr.text)
        assert "▁Seattle" in tr.source_tokens, tr.source_tokens      # the model saw the placeholder


@pytest.mark.parametrize("beam_size", [1, 4])
def test_a_number_the_model_leaves_out_goes_before_its_noun(translate, beam_size):
    """The model drops the placeholder of some numbers; the number then goes where the alignment
    puts its place, next to the translation of its neighbours, not at the end or next to another
    number ("tall cats and 3 7 birds")."""
    cases = [("Wir sehen 3 Katzen und 7 Vögel im Park.", ["3 cats", "7 birds"]),
             ("Der große braune 4 Hund rennt durch seichtes 7 Wasser.", ["4 dog", "7 water"]),
             ("Zwei Mädchen essen Kuchen und eines hat blaue Glasur auf seinem 3 Gesicht.", ["3 face"]),
             ("Ein Kind hält einen roten Ball an seinen 6 Mund.", ["6 mouth"])]
    out = translate([s for s, _ in cases], beam_size=beam_size, return_attention=False)
    dropped = 0
    for (sentence, want), tr in zip(cases, out):
        numbers = re.findall(r"\d+", sentence)
        dropped += tr.tokens.count("▁5") < len(numbers)
        assert all(tr.text.count(n) == 1 for n in numbers) and all(w in tr.text for w in want), (sentence, tr.text)
    assert dropped >= 3           # the model left placeholders out: the alignment placed those numbers


def test_keep_terms_come_back_verbatim_once_each(translate):
    keep = ["ACME Pro", "ACME Pro Max", "ACME", "New York", "York City"]
    texts = ["Ich arbeite mit Multi30k und ACME Pro.", "ACME Pro ist besser als ACME Pro Max.",
             "Siehe https://acme.com/ACME heute.", "In New York City wohnt ein Hund.",
             "Wir besuchen den Kölner Dom."]          # Multi30k and Kölner Dom: the stored list
    a, b, c, d, e = (tr.text for tr in translate(texts, keep=keep))
    assert a.count("Multi30k") == 1 and a.count("ACME Pro") == 1, a
    assert b.count("ACME Pro Max") == 1 and b.count("ACME Pro") == 2, b
    assert c.count("https://acme.com/ACME") == 1 and c.count("ACME") == 1, c
    assert d.count("New York City") == 1 and "York" not in d.replace("New York City", ""), d
    assert e.count("Kölner Dom") == 1, e
    [alone] = translate(["Wir besuchen den Kölner Dom."])     # the stored list needs no request field
    assert alone.text == e


def test_keep_is_the_requests_own(translate):
    """Two requests at once, one keeping "Hund": the other is translated as without it."""
    t, loop = translate.translator, translate.loop
    jobs = [TranslateRequest(text=["Ein Hund rennt."], beam_size=1, keep=["Hund"]).job(),
            TranslateRequest(text=["Ein Hund rennt."], beam_size=1).job()]

    async def both():
        return await asyncio.gather(*(t.translate(j) for j in jobs))
    kept, plain = (r.translations[0].text for r in loop.run_until_complete(both()))
    assert kept.count("Hund") == 1 and "Hund" not in plain and "dog" in plain, (kept, plain)


@pytest.mark.parametrize("escape", ["\x1b[31m", "\x1b[0m", "\x1b[1;4;38;5;208m", "\x1b]0;title\x07", "\x1bM"])
def test_a_terminal_escape_sequence_is_one_span_and_its_final_letter_joins_no_word(protector, translate, escape):
    sentence = f"Ein {escape}Hund rennt."
    spans = protector.find_spans(sentence)
    assert [sentence[s.start:s.end] for s in spans] == [escape] and spans[0].kind == "escape"
    plain, colored = translate(["Ein Hund rennt.", f"{escape}Ein Hund rennt.\x1b[0m"])
    assert colored.text == f"{escape}{plain.text}\x1b[0m", colored.text
    assert colored.source_tokens == plain.source_tokens


def test_an_element_not_translated_keeps_its_place_through_the_model(translate):
    """``translate="no"`` inside a sentence, on the shipped model: the sentence is translated as one,
    the element's sentinel (a private-use character, markup.py) protected like any character the
    model cannot know, so the element comes back byte for byte, once, among the translated words."""
    kept = '<span translate="no">Einstellungen</span>'
    h = HtmlText(f"<p>Ein Mann öffnet die {kept} und liest die Zeitung.</p>")
    out = h.rebuild([t.text for t in translate(h.segments)])
    words = out.replace(kept, " ")
    assert out.count(kept) == 1 and re.fullmatch(r"<p>[^<>]+</p>", words), out
    assert "man" in words.lower() and "Mann" not in words and "Zeitung" not in words, out
