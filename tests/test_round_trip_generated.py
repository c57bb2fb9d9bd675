"""Round trips (tests/round_trip.py) of generated documents: hypothesis builds files of each format
from random nestings of formatting, links, fields, breaks, tags, timestamps and cue settings around
words, each its own; each comes back as it was through the identity translator, and through the
marking one with each word once inside a marker and nothing of ``KEPT`` ever sent. Bounded
(``max_examples``) so that the module runs in seconds."""
from __future__ import annotations

import os

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from local_services import answering, local_services
from round_trip import CARD, counts, identical, marked_once  # noqa: F401 - counts: a fixture
from test_round_trip import docx_of, field, run_xml

from service.api.http import build_app


# derandomized (the same examples each run; ``ROUND_TRIP_RANDOM=1``: new ones, as a search for misses)
def examples(n: int) -> settings:
    """``n`` examples (``ROUND_TRIP_EXAMPLES`` overrides)."""
    return settings(max_examples=int(os.environ.get("ROUND_TRIP_EXAMPLES", n)), deadline=None,
                    derandomize=not os.environ.get("ROUND_TRIP_RANDOM"), database=None,
                    suppress_health_check=[HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.generate] + ([] if os.environ.get("ROUND_TRIP_NO_SHRINK") else [Phase.shrink]))


SLOT = "\x00"          # a word's place: each gets its own word once the file is built (``unique``)
words = st.integers(1, 4).map(lambda n: " ".join([SLOT] * n))
sentence = st.tuples(words, st.sampled_from(["", ".", "!", ","])).map("".join)
# what no generated file may send to the translator: codes, URLs, tags, timestamps, field codes
KEPT = ["CODE", "http", "<", "{", "00:0", "PAGE", "REF", "DATE", "ERGEBNIS", "Anna", "ATTR"]
_SYLLABLES = ["ka", "lo", "mi", "ren", "tus", "bel", "dor", "fin", "gar", "sol"]
VOCABULARY = [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES]   # 1,000 distinct words


def unique(text: str) -> tuple[str, list[str]]:
    """``text`` with each SLOT a word of its own (the same word twice would make where a piece of
    formatting goes ambiguous: that is the placement's guess, not what is tested here)."""
    used = VOCABULARY[:text.count(SLOT)]
    for w in used:
        text = text.replace(SLOT, w, 1)
    return text, used


def check(text: str, name: str, build=str.encode) -> None:
    text, used = unique(text)
    data = build(text)
    identical(data, name)
    marked_once(data, name, KEPT, used)


# ---- Markdown --------------------------------------------------------------------------------------
md_inline = st.one_of(
    sentence, words.map(lambda w: f"**{w}**"), words.map(lambda w: f"*{w}*"), words.map(lambda w: f"~~{w}~~"),
    words.map(lambda w: f'[{w}](http://x.de/CODE "ATTR \\"CODE\\"")'), words.map(lambda w: f"[{w}](<http://x.de/a b>)"),
    st.just("`CODE`"), st.just("``CODE ` CODE``"), words.map(lambda w: f"![CODE](http://x.de/c.png) {w}"),
    words.map(lambda w: f"<http://x.de> {w}"),
    words.map(lambda w: f"{w} &amp; {w}"), words.map(lambda w: f"{w}\\*"))
md_gap = st.sampled_from([" ", " ", "  \n", "\\\n", "<br>", "\n", " <br/> "])


@st.composite
def md_paragraph(draw, breaks: bool = True) -> str:
    items = draw(st.lists(md_inline, min_size=1, max_size=3))
    out = items[0]
    for it in items[1:]:
        out += (draw(md_gap) if breaks else " ") + it
    return out


md_block = st.one_of(
    md_paragraph(), md_paragraph(False).map(lambda p: "# " + p), md_paragraph().map(lambda p: "- " + p),
    md_paragraph().map(lambda p: "> " + p.replace("\n", "\n> ")),
    st.tuples(words, words).map(lambda c: f"| {c[0]} | {c[1]} |\n|---|---|\n| {c[1]} | {c[0]} |"),
    st.just("```\nCODE\n```"))


@examples(25)
@given(st.lists(md_block, min_size=1, max_size=4))
def test_markdown(blocks):
    check("\n\n".join(blocks) + "\n", "a.md")


# ---- HTML ------------------------------------------------------------------------------------------
def html_inline(children):
    return st.one_of(
        st.tuples(st.sampled_from(["b", "i", "em", "span"]), children).map(lambda t: f"<{t[0]}>{t[1]}</{t[0]}>"),
        children.map(lambda c: f'<a href="http://x.de/CODE" title="ATTR">{c}</a>'))


html_text = st.recursive(sentence, lambda c: st.one_of(
    st.tuples(c, st.sampled_from([" ", "\n    ", " &amp; ", "&nbsp;", " <br> ", ' <span translate="no">CODE</span> ',
                                  " <!-- CODE --> ", " <img src=CODE> "]), c).map("".join),
    html_inline(c)), max_leaves=4)


@examples(25)
@given(st.lists(st.tuples(st.sampled_from(["p", "li", "h2", "td"]), html_text), min_size=1, max_size=4))
def test_html(blocks):
    body = "\n".join(f"  <{tag}>{text}</{tag}>" for tag, text in blocks)
    check(f"<!DOCTYPE html>\n<html><body>\n{body}\n<script>CODE</script>\n</body></html>\n", "a.html")


# ---- subtitles ---------------------------------------------------------------------------------------
srt_item = st.one_of(sentence, words.map(lambda w: f"<i>{w}</i>"), words.map(lambda w: f"<b>{w}</b>"),
                     words.map(lambda w: f'<font color="#ff0000">{w}</font>'), words.map(lambda w: f"{{\\i1}}{w}{{\\i0}}"))
srt_line = st.lists(srt_item, min_size=1, max_size=2).map(" ".join)


@examples(25)
@given(st.lists(st.tuples(st.booleans(), st.lists(srt_line, min_size=1, max_size=3)), min_size=1, max_size=4))
def test_subrip(cues):
    out = [f"{i + 1}\n00:00:{i:02d},000 --> 00:00:{i:02d},900\n" + ("{\\an8}" if top else "") + "\n".join(lines)
           for i, (top, lines) in enumerate(cues)]
    check("\n\n".join(out) + "\n", "a.srt")


vtt_item = st.one_of(sentence, words.map(lambda w: f"<c.CODE>{w}</c>"), words.map(lambda w: f"<i>{w}</i>"),
                     st.sampled_from(["<00:00:01.500>", "<00:00:02.250>"]), words.map(lambda w: f"<b>{w}</b>"),
                     words.map(lambda w: f"{w} &amp; {w}"), words.map(lambda w: f"<lang en>{w}</lang>"))
vtt_line = st.lists(vtt_item, min_size=1, max_size=2).map(" ".join)
vtt_cue = st.tuples(st.sampled_from(["", "c1\n"]), st.sampled_from(["", " align:start position:10%", " line:0"]),
                    st.sampled_from(["", "<v Anna>", "<v.CODE Anna>"]), st.lists(vtt_line, min_size=1, max_size=3))


@examples(25)
@given(st.lists(vtt_cue, min_size=1, max_size=4))
def test_webvtt(cues):
    out = []
    for i, (ident, cue_settings, voice, lines) in enumerate(cues):
        text = voice + "\n".join(lines) + ("</v>" if voice and i % 2 else "")
        out.append(f"{ident}00:00:{i:02d}.000 --> 00:00:{i:02d}.900{cue_settings}\n{text}")
    check("WEBVTT\n\n" + "\n\n".join(out) + "\n", "a.vtt")


# ---- docx ------------------------------------------------------------------------------------------
docx_run = st.tuples(words, st.booleans()).map(lambda t: run_xml(t[0] + " ", t[1]))
docx_item = st.one_of(
    docx_run, docx_run,
    st.lists(docx_run, min_size=1, max_size=2).map(
        lambda rs: '<w:hyperlink r:id="rId9"><w:proofErr w:type="spellStart"/>' + "".join(rs)
                   + '<w:proofErr w:type="spellEnd"/></w:hyperlink>'),
    st.sampled_from([field("PAGE", "ERGEBNIS"), field("REF CODE \\h", "ERGEBNIS"),
                     '<w:fldSimple w:instr=" DATE "><w:r><w:t>ERGEBNIS</w:t></w:r></w:fldSimple>',
                     "<w:r><w:tab/></w:r>", "<w:r><w:br/></w:r>", '<w:proofErr w:type="gramStart"/>',
                     '<w:bookmarkStart w:id="1" w:name="CODE"/><w:bookmarkEnd w:id="1"/>']))


@examples(25)
@given(st.lists(st.lists(docx_item, min_size=1, max_size=3).map("".join), min_size=1, max_size=3))
def test_docx(paragraphs):
    check("\x01".join(paragraphs), "a.docx", lambda text: docx_of(*text.split("\x01")))


# ---- XML through DeepL's tag handling ------------------------------------------------------------------
xml_text = st.recursive(sentence, lambda c: st.one_of(
    st.tuples(c, st.sampled_from([" ", " <ph/> ", " <keep>CODE</keep> ", "\n  "]), c).map("".join),
    st.tuples(st.sampled_from(["x", "b"]), c).map(lambda t: f'<{t[0]} id="ATTR">{t[1]}</{t[0]}>')),
    max_leaves=4)


@examples(25)
@given(st.lists(xml_text, min_size=1, max_size=3))
def test_deepl_xml(pars):
    xml, used = unique("<doc>" + "".join(f"<par>{p}</par>" for p in pars) + "</doc>")
    seen: list = []
    for run in (answering(lambda t: t), answering(lambda t: f"\u27e6{t}\u27e7", seen)):
        client = TestClient(build_app(local_services([CARD], run)))
        r = client.post("/v2/translate", json={"text": [xml], "source_lang": "DE", "target_lang": "EN-GB",
                                               "tag_handling": "xml", "ignore_tags": ["keep"]})
        assert r.status_code == 200, r.text
        out = r.json()["translations"][0]["text"]
        assert out.replace("\u27e6", "").replace("\u27e7", "") == xml
    assert not any(k in t for job in seen for t in job.texts for k in KEPT)
    for w in used:
        assert out.count(w) == xml.count(w) == 1


# ---- pptx ------------------------------------------------------------------------------------------
A = 'xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main"'
BOLD = ' b="1"'
pptx_run = st.tuples(words, st.booleans()).map(lambda t: f'<a:r><a:rPr lang="de-DE"{BOLD if t[1] else ""}/>'
                                                         f'<a:t>{t[0]} </a:t></a:r>')
pptx_item = st.one_of(pptx_run, pptx_run, st.sampled_from([
    "<a:br/>", '<a:fld id="{B6F15528-21DE-4FAA-801E-634DDDAF4B2B}" type="slidenum"><a:t>ERGEBNIS</a:t></a:fld>']))


def pptx_of(text: str) -> bytes:
    """A one-slide presentation whose text box holds these ``a:p`` contents (``\\x01`` between them)."""
    import io

    import pptx
    from lxml import etree
    prs = pptx.Presentation()
    slide = prs.slides.add_slide(prs.slide_layouts[6])
    body = slide.shapes.add_textbox(0, 0, 100, 100).text_frame._txBody
    for p in body.findall("{*}p"):
        body.remove(p)
    for xml in text.split("\x01"):
        body.append(etree.fromstring(f"<a:p {A}>{xml}</a:p>"))
    out = io.BytesIO()
    prs.save(out)
    return out.getvalue()


@examples(25)
@given(st.lists(st.lists(pptx_item, min_size=1, max_size=4).map("".join), min_size=1, max_size=3))
def test_pptx(paragraphs):
    check("\x01".join(paragraphs), "a.pptx", pptx_of)


# ---- odt -------------------------------------------------------------------------------------------
odt_item = st.one_of(
    words.map(lambda w: ("text", w)), words.map(lambda w: ("span", w)), words.map(lambda w: ("a", w)),
    st.sampled_from([("tab", ""), ("break", ""), ("s", "")]))


def odt_of(text: str) -> bytes:
    """An odt whose paragraphs hold these items (``kind\\x02text``, ``\\x03`` between, ``\\x01`` between paragraphs)."""
    import io

    from odf.opendocument import OpenDocumentText
    from odf.style import Style, TextProperties
    from odf.text import A as Link
    from odf.text import LineBreak, P, S, Span, Tab
    doc = OpenDocumentText()
    bold = Style(name="Bold", family="text")
    bold.addElement(TextProperties(fontweight="bold"))
    doc.automaticstyles.addElement(bold)
    for para in text.split("\x01"):
        p = P()
        for k, item in enumerate(para.split("\x03")):
            kind, words_ = item.split("\x02")
            if k:
                p.addText(" ")         # items apart: their words are words of their own
            if kind == "text":
                p.addText(words_)
            elif kind == "span":
                p.addElement(Span(stylename=bold, text=words_))
            elif kind == "a":
                p.addElement(Link(href="http://x.de/CODE", text=words_))
            else:
                p.addElement({"tab": Tab, "break": LineBreak}.get(kind, lambda: S(c=2))())
        doc.text.addElement(p)
    out = io.BytesIO()
    doc.write(out)
    return out.getvalue()


@examples(25)
@given(st.lists(st.lists(odt_item, min_size=1, max_size=4).map(lambda items: "\x03".join(f"{k}\x02{t}" for k, t in items)),
                min_size=1, max_size=3))
def test_odt(paragraphs):
    check("\x01".join(paragraphs), "a.odt", odt_of)
