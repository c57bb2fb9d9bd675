"""Protected spans (service/translator/protect.py): URLs, e-mail addresses, numbers, code tokens and
characters outside the model's alphabet come back verbatim, once, where they belong.

Span finding and restoring run on the shipped tokenizer alone (restoring with made-up tokens and
attention, so every branch is reached); the rest runs the shipped model in-process through the
Translator, on the issue's inputs and on validation sentences with spans inserted at random places.
"""
from __future__ import annotations

import asyncio
import random
import re
import unicodedata

import pytest
import torch

from conftest import DATA
from model.checkpoint import DEFAULT_CHECKPOINT
from model.tokenizer import read_lines
from service.api.html import HtmlText
from service.api.schemas import TranslateRequest
from service.translator.protect import Protected, Protector
from service.translator.text import Split
from service.translator.truecase import Truecaser

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
        ph = sorted(protector._ph)
        tokens = [rng.choice(words + ph) for _ in range(rng.randint(0, 12))]
        cross = torch.rand(3, 4, len(tokens), len(src)).softmax(-1) if rng.random() < 0.8 else None
        out = protector.restore(p, src, tokens, cross)
        for s in p.spans:
            assert out.count(s) == 1, (sentence, tokens, out)
        rest = out
        for s in p.spans:
            rest = rest.replace(s, " ")
        # the words: not a placeholder of a kind the sentence's spans have, nor a piece glued to one
        used = frozenset().union(*(protector.placeholder_ids[k] for k in p.kinds))
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
    ph = src.index(next(iter(protector.placeholder_ids["other"])))
    a, dog, runs, dot = tok.encode("A dog runs.")
    copy = next(iter(protector.placeholder_ids["other"]))
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
    """A real "Seattle" (the other-kind placeholder) in a sentence whose only span is a number stays
    a word; with a span of its kind too, the copies beyond the spans are that word; digits the model
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
    assert p.spans == ["\U0001F600"] and p.kinds == ["other"]
    out = protector.restore(p, protector.encode(p), head + [seattle] + runs + [seattle, seattle, dot], None)
    assert out.count("Seattle") == 1 and out.count("\U0001F600") == 1
    p = protector.prepare("Es kostet ca. 5 Euro.")
    zero, eight = (tok.sp.piece_to_id(d) for d in ("0", "8"))
    assert tok.unk_id not in (zero, eight, dot)
    tokens = tok.encode("It costs") + [five, zero, eight] + tok.encode("euros") + [dot]
    assert protector.restore(p, protector.encode(p), tokens, None) == "It costs 5 euros."


# ---- the shipped model, in-process ---------------------------------------------------------------
@pytest.fixture(scope="module")
def translate(tok):
    """translate(texts, **options) -> list of Translation, through one Translator on the shipped model."""
    from service.translator import Translator, model_card
    loop = asyncio.new_event_loop()
    t = Translator(model_card("de-en", DEFAULT_CHECKPOINT))
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
        assert in_word.text == before_word.text == base[0], (c, in_word.text, before_word.text)
        assert not any(p.startswith("<0x") for t in (lead, in_word, before_word) for p in t.source_tokens)


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
ODD = ["\ufffd", "\ufffd\ufffd\ufffd", "\ue000", "\U000f0001", "&unknown;", "&#0;", "&#x110000;", "&nbsp;"]
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
    assert len(seattle) == 1 and seattle[0] in protector.placeholder_ids["other"]
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
