"""format=html (service/pipeline/markup.py): which text is translated, and the markup rebuilt around the
translations; no model (the "translations" here are upper-cased segments)."""
from __future__ import annotations

import re

import pytest

from service.pipeline.markup import HtmlText


def roundtrip(html: str, translate=str.upper) -> tuple[list[str], str]:
    h = HtmlText(html)
    return h.segments, h.rebuild([translate(s) for s in h.segments])


def test_text_nodes_are_translated_and_markup_kept():
    segments, out = roundtrip('<div class="x"><p> Ein Hund. </p><br/><!-- c --><p>Zwei</p></div>')
    assert segments == ["Ein Hund.", "Zwei"]
    assert out == '<div class="x"><p> EIN HUND. </p><br/><!-- c --><p>ZWEI</p></div>'


def test_a_sentence_split_by_inline_tags_is_one_unit_with_each_tag_around_its_words():
    segments, out = roundtrip("<p>Ein Mann mit <b>rotem Hut</b> steht.</p>")
    assert segments == ["Ein Mann mit rotem Hut steht.", "rotem Hut"]     # the unit, then each inline text
    assert out == "<p>EIN MANN MIT <b>ROTEM HUT</b> STEHT.</p>"


def test_an_inline_element_whose_words_are_not_found_goes_around_the_words_at_its_place():
    """Its own translation ("tiny") is not in the sentence's: it goes around the whole words at the
    same relative place; with no words there its tags stay, empty, where it was (no tag is dropped),
    and its text is never repeated."""
    h = HtmlText("<p>Ein <i>kleiner</i> Hund.</p>")
    assert h.rebuild(["A small dog.", "tiny"]) == "<p>A <i>small</i> dog.</p>"
    assert h.rebuild(["...", "tiny"]) == "<p><i></i>...</p>"
    h = HtmlText('<p>Ein <b>Hund</b> <a href="x">liest</a>.</p>')     # the model merged the words away
    out = h.rebuild(["A.", "dog", "reads"])
    assert out.count("<b>") == out.count("</b>") == 1 and out.count('<a href="x">') == out.count("</a>") == 1, out


def test_nested_inline_elements_are_one_unit_and_each_goes_around_its_own_words():
    """A run of text and inline elements of any depth is one segment; an element holding all of its
    parent's text has no segment of its own; the others go inside their parent's words."""
    segments, out = roundtrip("<b>Ein <i>Hund</i></b> rennt.")
    assert segments == ["Ein Hund rennt.", "Ein Hund", "Hund"]
    assert out == "<b>EIN <i>HUND</i></b> RENNT."
    segments, out = roundtrip("<p><b><i>Ein Hund</i></b> rennt.</p>")
    assert segments == ["Ein Hund rennt.", "Ein Hund"] and out == "<p><b><i>EIN HUND</i></b> RENNT.</p>"
    # the model's translations of the short pieces are noisy: the unit's text is never repeated
    h = HtmlText("<b>Ein <i>großer</i> Hund</b> rennt.")
    out = h.rebuild(["A large dog runs.", "A large dog is running.", "Large large."])
    assert out == "<b>A <i>large</i> dog</b> runs."        # "A" stands right before its words: its own
    # an inline element never closed (a browser closes it at the end of the block) does not split the
    # sentence: its tag stays, an element without text, before the word that follows it
    segments, out = roundtrip("<p>Ein <b>Hund</p> rennt.")
    assert segments == ["Ein Hund", "rennt."] and out == "<p>EIN <b>HUND</p> RENNT."
    segments, out = roundtrip("<p>Ein <b>großer <i>Hund läuft.</p><!-- x -->")
    assert segments == ["Ein großer Hund läuft."] and out == "<p>EIN <b>GROSSER <i>HUND LÄUFT.</p><!-- x -->"
    segments, out = roundtrip("Ein <b>großer <i>Hund</b> läuft.")    # </b> leaves the <i> inside it unclosed
    assert segments == ["Ein großer Hund läuft.", "großer Hund"]
    assert out == "EIN <b>GROSSER <i>HUND</b> LÄUFT."
    # an element without text stays, byte for byte, where its siblings' words end
    segments, out = roundtrip('<p><a id="x"></a>Ein <b>Hund</b><span class="i"></span> rennt.</p>')
    assert segments == ["Ein Hund rennt.", "Hund"]
    assert out == '<p><a id="x"></a>EIN <b>HUND</b><span class="i"></span> RENNT.</p>'


def test_verbatim_elements_and_entities():
    kept = '<script>var s = "Ein Hund" && n < 2;</script><code>a &lt; b</code>'
    segments, out = roundtrip(kept + "<p>Ein Mann &amp; eine Frau.</p>", translate=lambda s: "A man &amp; a woman.")
    assert segments == ["Ein Mann & eine Frau."]
    assert out == kept + "<p>A man &amp; a woman.</p>"      # the model's entity decoded, then escaped once


def test_whitespace_only_text_is_not_translated():
    segments, out = roundtrip("<ul>\n  <li>Eins</li>\n</ul>")
    assert segments == ["Eins"] and out == "<ul>\n  <li>EINS</li>\n</ul>"


def test_whitespace_inside_a_block_is_collapsed_for_translation_and_kept_around_it():
    """Indented HTML: line breaks and tabs inside a <p> do not cut its sentence (the translator would
    split lines into sentences); the whitespace before and after the text stays."""
    segments, out = roundtrip("<p>\n\tEin Mann\n\tfährt Fahrrad.\n</p>")
    assert segments == ["Ein Mann fährt Fahrrad."]
    assert out == "<p>\n\tEIN MANN FÄHRT FAHRRAD.\n</p>"
    html = ("<div>\n  <p>\r\n    Zwei   Hunde\u00a0spielen\n    im Schnee.\r\n  </p>\n"
            "  <p>Ein <b>roter\n  Ball</b>.</p>\n</div>")
    segments, out = roundtrip(html)
    assert all(s == " ".join(s.split()) and "\n" not in s and "\t" not in s for s in segments)
    assert segments[0] == "Zwei Hunde spielen im Schnee."
    assert out.startswith("<div>\n  <p>\r\n    ZWEI HUNDE SPIELEN IM SCHNEE.\r\n  </p>\n  <p>")
    assert out.endswith("</p>\n</div>") and "<b>ROTER BALL</b>" in out


def test_markup_comments_and_verbatim_elements_pass_through_byte_for_byte():
    """Everything that is not prose comes back as sent: tags as written (case, attribute quoting and
    values, entities in attributes), comments, doctype, and the whole content of script, style, pre
    and code, entities and odd spacing included."""
    verbatim = [
        "<!DOCTYPE html>",
        "<!-- Ein Kommentar mit <p>Markup</p> &amp; Entitäten -->",
        '<SCRIPT type="text/javascript">if (a < b && c > d) { s = "Ein Hund"; }</SCRIPT>',
        "<style>\n  p > a { content: '&quot;'; }\n</style>",
        "<pre>  Ein  Hund\n\tläuft &quot;schnell&quot; &#x27;</pre>",
        "<code>x &lt; y &amp;&amp; z</code>",
        "<pre><code>def f():\n    return 1  # Ein Hund</code></pre>",
    ]
    attrs = '<a HREF="/x?a=1&amp;b=2" title=\'Ein Hund läuft\' data-x=Ein>'
    html = "".join(verbatim) + "<p>Ein Hund läuft.</p>" + attrs + "Zwei Katzen.</a>"
    segments, out = roundtrip(html)
    assert segments == ["Ein Hund läuft.", "Zwei Katzen."]
    assert out.startswith("".join(verbatim))
    assert attrs + "ZWEI KATZEN.</a>" in out and "<p>EIN HUND LÄUFT.</p>" in out


def test_nested_inline_markup_keeps_every_tag_in_order():
    """Inline elements inside inline elements: every tag comes back, in order, exactly once, and every
    text node with letters is translated."""
    import re
    for html in ["<p>Ein <b>großer <i>brauner</i> Hund</b> läuft <a href='#x'>über <em>die</em> Wiese</a>.</p>",
                 "<div><span>Zwei <strong><u>Kinder</u></strong> spielen.</span></div>"]:
        segments, out = roundtrip(html)
        tags = lambda h: re.findall(r"<[^>]+>", h)  # noqa: E731
        assert tags(out) == tags(html)
        assert re.sub(r"<[^>]+>", "", out) == re.sub(r"<[^>]+>", "", html).upper()


def model_like(text: str) -> str:
    """A stand-in for the model: words upper-cased, character references copied as they are."""
    return re.sub(r"(&[^;\s]+;)|[^\W\d_]+", lambda m: m.group(1) or m.group().upper(), text)


def test_character_references_the_model_cannot_translate_come_back_as_written():
    """Invalid (surrogate, NUL, out of range), control and unknown references are sent as written and
    put back byte for byte; valid ones are decoded for the model and escaped again."""
    refs = "&#xD800; Hund &#0; &#x110000; &#1; &bogus;"
    segments, out = roundtrip(f"<p>Ein {refs} läuft &amp; rennt.</p>", translate=model_like)
    assert segments == [f"Ein {refs} läuft & rennt."]
    assert out == f"<p>EIN {refs.replace('Hund', 'HUND')} LÄUFT &amp; RENNT.</p>"
    assert "\ufffd" not in out


def test_non_breaking_spaces_around_the_text_stay_as_written():
    segments, out = roundtrip("<p>&nbsp;Ein&nbsp;Hund läuft.&#160;</p>")
    assert segments == ["Ein Hund läuft."]
    assert out == "<p>&nbsp;EIN HUND LÄUFT.&#160;</p>"


def test_markup_the_parser_leaves_unfinished_stays_verbatim_and_untranslated():
    assert roundtrip("<p") == ([], "<p")
    assert roundtrip("<p>Ein Mann ruht. <p") == (["Ein Mann ruht."], "<p>EIN MANN RUHT. <p")
    assert roundtrip("Ein Hund <!-- Ein Mann") == (["Ein Hund"], "EIN HUND <!-- Ein Mann")


def test_an_element_without_text_stays_next_to_its_word():
    """Before the word that followed it where the translation has that word, else at the word start
    (or end, when it was glued to the word before) at its relative place."""
    h = HtmlText("<p>Ein <span></span>Hund läuft.</p>")
    assert h.rebuild(["A dog runs."]) == "<p>A <span></span>dog runs.</p>"
    h = HtmlText('<p>Er sieht <a id="m"></a>Maria.</p>')
    assert h.rebuild(["Maria sees him."]) == '<p><a id="m"></a>Maria sees him.</p>'
    h = HtmlText("<p>Ein großer Hund<span class='k'></span> läuft schnell.</p>")
    assert h.rebuild(["A big dog runs fast."]) == "<p>A big dog<span class='k'></span> runs fast.</p>"


def test_inline_nesting_deeper_than_the_limit_is_a_413_not_a_recursion_error():
    from service.pipeline.markup import MAX_INLINE_DEPTH
    from service.protocol import ServiceError
    n = MAX_INLINE_DEPTH
    h = HtmlText("<b>" * n + "Ein Hund läuft." + "</b>" * n)
    assert h.segments == ["Ein Hund läuft."]
    assert h.rebuild(["A dog runs."]) == "<b>" * n + "A dog runs." + "</b>" * n
    for deep in ("<b>" * (n + 1) + "Ein Hund läuft." + "</b>" * (n + 1), "<i>" * 7_000 + "x" + "</i>" * 7_000):
        with pytest.raises(ServiceError) as e:
            HtmlText(deep)
        assert (e.value.status, e.value.field) == (413, "q") and f"more than {n} levels" in e.value.message


def test_a_comment_inside_a_sentence_is_kept_and_does_not_split_it():
    for html in ("<p>Ein Mann <!-- x --> fährt Fahrrad.</p>", "Ein <b>Hund <!--c--> läuft</b>.",
                 "<!-- top --><p>Ein Hund.</p>"):
        segments, out = roundtrip(html)
        comment = re.search(r"<!--.*?-->", html).group()
        assert segments[0] == re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html)).strip(), segments
        assert out.count(comment) == 1 and re.sub(r"<[^>]+>", "", out).split() == segments[0].upper().split(), out


def test_after_voiding_the_unclosed_every_run_ends_at_the_next_other_part():
    """What keeps a fragment's run scans linear (html._run_end): once ``_void_unclosed`` has turned each
    inline element never closed into an element without text, a run started anywhere ends right before
    the next part that is not text, a comment or an inline tag it closes (or at the end), never earlier;
    and only inline start tags change."""
    import random

    from service.pipeline.markup import _run_end, _void_unclosed
    rng = random.Random(7)
    kinds = [("start", "<b>", "b"), ("start", "<i>", "i"), ("end", "</b>", "b"), ("end", "</i>", "i"),
             ("text", "x", ""), ("comment", "<!---->", ""), ("start", "<p>", "p"), ("end", "</p>", "p"),
             ("markup", "<br>", "")]
    for _ in range(2_000):
        parts = [rng.choice(kinds) for _ in range(rng.randint(0, 30))]
        voided = _void_unclosed(parts)
        assert [p[1] for p in voided] == [p[1] for p in parts]
        assert all(v == p or (p[0] == "start" and v == ("comment", p[1], "")) for v, p in zip(voided, parts))
        i = 0
        while i < len(voided):
            end = _run_end(voided, i)
            if end == i:    # no run here: a part that ends every run
                i += 1
                continue
            stack = []      # the run closes every element it opens, and what follows it ends it
            for kind, _, tag in voided[i:end]:
                if kind == "start":
                    stack.append(tag)
                elif kind == "end":
                    assert stack.pop() == tag
            assert not stack and (end == len(voided) or _run_end(voided, end) == end), (parts, i, end)
            i = end


@pytest.mark.parametrize("html", [
    "Ein " + "<i>" * 12_000 + "Hund läuft.",                       # unclosed inline tags
    "Ein " + "<i>a " * 9_000 + "Hund läuft.",                      # ... each before some text
    "Ein " + "<b></b>" * 6_000 + " Hund läuft.",                   # empty elements inside one sentence
    "Ein " + "<!--c-->" * 5_000 + " Hund läuft.",                  # comments inside one sentence
])
def test_thousands_of_tags_in_a_text_are_translated_around_and_every_tag_kept(html):
    """A fragment of many tags costs time in proportion to its size (the run ends and the placement of
    empty elements were quadratic: minutes for these, with the replica's event loop held); the guard
    below catches a hang, not a speed."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        segments, out = pool.submit(roundtrip, html).result(timeout=60)
    assert re.findall(r"<[^>]*>", out) == re.findall(r"<[^>]*>", html)
    assert re.sub(r"<[^>]*>", "", out).split() == re.sub(r"<[^>]*>", "", html).upper().split()
    assert "EIN" in out and "HUND LÄUFT." in re.sub(r"<[^>]*>", "", out)


# ---- what is not translated: translate="no", class="notranslate", DeepL's tag options ----------------
def test_an_element_not_translated_inside_a_sentence_stays_in_place_and_once():
    """``translate="no"`` / ``class="notranslate"`` on an inline element: the sentence around it is one
    segment, the element's place a sentinel the translator keeps (a private-use character); the
    element comes back byte for byte where the sentinel lands, once even when the model drops or
    repeats the sentinel."""
    html = '<p>Ein <span translate="no">Foo &amp; Bar</span> läuft <b class="x notranslate">heute</b>.</p>'
    h = HtmlText(html)
    [segment] = h.segments
    marks = [c for c in segment if 0xF0000 <= ord(c)]
    assert len(marks) == 2 and segment == f"Ein {marks[0]} läuft {marks[1]}." and "Foo" not in segment
    kept = '<span translate="no">Foo &amp; Bar</span>', '<b class="x notranslate">heute</b>'
    assert h.rebuild([f"A {marks[0]} runs {marks[1]}."]) == f"<p>A {kept[0]} runs {kept[1]}.</p>"
    assert h.rebuild([f"{marks[1]} {marks[0]} runs."]) == f"<p>{kept[1]} {kept[0]} runs.</p>"    # reordered
    out = h.rebuild([f"A {marks[0]} {marks[0]} runs."])           # one repeated, one left out
    assert out.count(kept[0]) == out.count(kept[1]) == 1 and out.startswith(f"<p>A {kept[0]}"), out
    # an inline element holding only such an element goes around its sentinel; a run of only that: no segment
    kept = '<p><code>y</code> <span translate=no>Z</span></p>'
    segments, out = roundtrip('Ein <i><span translate="no">X</span></i> läuft.' + kept)
    assert len(segments) == 1 and out == 'EIN <i><span translate="no">X</span></i> LÄUFT.' + kept


def test_translate_no_is_inherited_and_translate_yes_inside_translates_again():
    segments, out = roundtrip('<div translate="no"><p>Ein Hund.</p><p>Zwei <span translate="yes">Katzen</span> '
                              '<i>laufen</i>.</p></div><p class="notranslate">Drei.</p><p>Vier.</p>')
    assert segments == ["Katzen", "Vier."]
    assert out == ('<div translate="no"><p>Ein Hund.</p><p>Zwei <span translate="yes">KATZEN</span> <i>laufen</i>.'
                   '</p></div><p class="notranslate">Drei.</p><p>VIER.</p>')
    # HTML's implied end tags close an element not translated; an invalid value is no value (inherited);
    # an element whose text is never prose (code) stays verbatim even with translate="yes"
    segments, out = roundtrip('<p translate="no">Eins<p>Zwei</p><ul class="notranslate"><li>Drei<li>Vier</ul>'
                              '<p translate="maybe">Fünf</p><code translate="yes">sechs</code>')
    assert segments == ["Zwei", "Fünf"]
    assert out == ('<p translate="no">Eins<p>ZWEI</p><ul class="notranslate"><li>Drei<li>Vier</ul>'
                   '<p translate="maybe">FÜNF</p><code translate="yes">sechs</code>')


def test_tag_options_change_where_sentences_end():
    """DeepL's options in the one segmenter: splitting tags end a sentence, non-splitting ones join
    it, without outline detection only splitting tags split; ignored tags are kept as they are. In
    XML, outline detection puts an element that occurs between text inside its sentence."""
    from service.pipeline.markup_parse import tags

    def segments(html, **options):
        return HtmlText(html, options=tags(**options)).segments
    assert segments("Ein <b>Hund</b> läuft.") == ["Ein Hund läuft.", "Hund"]
    assert segments("Ein <B>Hund</B> läuft.", splitting=["b"]) == ["Ein", "Hund", "läuft."]
    assert segments("<p>Ein </p><p>Hund.</p>") == ["Ein", "Hund."]
    assert segments("<p>Ein </p><p>Hund.</p>", non_splitting=["P"])[0] == "Ein Hund."
    assert segments("<div><h1>Titel</h1><p>Ein</p> <p>Hund.</p></div>", outline=False, splitting=["h1"]) == \
        ["Titel", "Ein Hund.", "Ein", "Hund."]
    assert segments("Ein <x>Hund</x> läuft.<y><z>Zwei</z></y>", xml=True) == ["Ein Hund läuft.", "Hund", "Zwei"]
    assert segments("Ein <x>Hund</x> läuft.", xml=True, splitting=["x"]) == ["Ein", "Hund", "läuft."]
    assert segments("Ein <X>Hund</X> läuft.", xml=True, ignore=["x"]) == ["Ein Hund läuft.", "Hund"]  # XML: case counts
    [one] = segments("Ein <X>Hund</X> läuft.", xml=True, ignore=["X"])
    assert "Hund" not in one and HtmlText("Ein <X>Hund</X> läuft.", options=tags(ignore=["X"], xml=True)).rebuild(
        [one.upper()]) == "EIN <X>Hund</X> LÄUFT."
