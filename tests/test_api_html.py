"""format=html (service/api/html.py): which text is translated, and the markup rebuilt around the
translations; no model (the "translations" here are upper-cased segments)."""
from __future__ import annotations

from service.api.html import HtmlText


def roundtrip(html: str, translate=str.upper) -> tuple[list[str], str]:
    h = HtmlText(html)
    return h.segments, h.rebuild([translate(s) for s in h.segments])


def test_text_nodes_are_translated_and_markup_kept():
    segments, out = roundtrip('<div class="x"><p> Ein Hund. </p><br/><!-- c --><p>Zwei</p></div>')
    assert segments == [" Ein Hund. ", "Zwei"]
    assert out == '<div class="x"><p> EIN HUND. </p><br/><!-- c --><p>ZWEI</p></div>'


def test_a_sentence_split_by_inline_tags_is_one_unit_with_each_tag_around_its_words():
    segments, out = roundtrip("<p>Ein Mann mit <b>rotem Hut</b> steht.</p>")
    assert segments == ["Ein Mann mit rotem Hut steht.", "rotem Hut"]     # the unit, then each inline text
    assert out == "<p>EIN MANN MIT <b>ROTEM HUT</b> STEHT.</p>"


def test_an_inline_element_whose_words_are_not_found_loses_its_tags_not_its_text():
    h = HtmlText("<p>Ein <i>kleiner</i> Hund.</p>")
    out = h.rebuild(["A small dog.", "tiny"])
    assert out == "<p>A small dog.</p>"


def test_verbatim_elements_and_entities():
    kept = '<script>var s = "Ein Hund" && n < 2;</script><code>a &lt; b</code>'
    segments, out = roundtrip(kept + "<p>Ein Mann &amp; eine Frau.</p>", translate=lambda s: "A man &amp; a woman.")
    assert segments == ["Ein Mann & eine Frau."]
    assert out == kept + "<p>A man &amp; a woman.</p>"      # the model's entity decoded, then escaped once


def test_whitespace_only_text_is_not_translated():
    segments, out = roundtrip("<ul>\n  <li>Eins</li>\n</ul>")
    assert segments == ["Eins"] and out == "<ul>\n  <li>EINS</li>\n</ul>"
