"""Round trips of every document format on fixed files (generated ones: test_round_trip_generated.py):
with the identity translator a file comes back as it was (text formats byte for byte, office formats
as the same normalised XML); with the marking translator each translatable word comes back once,
inside a marker, and no markup, field code, tag, timestamp or placeholder is ever sent. Then each
kind of loss issue #48 named, with a translator that changes the words (upper case or a small
dictionary), so that a kept piece shows it was not translated."""
from __future__ import annotations

import io
import zipfile

import docx
import pptx
import pytest
from docx.oxml import parse_xml
from fastapi.testclient import TestClient
from local_services import answering, local_services
from lxml import etree
from round_trip import CARD, counts, identical, marked_once, translated  # noqa: F401 - counts: a fixture
from test_documents import PNG, SRT, VTT, make_docx, make_odt

from service.api.http import build_app

W = ('xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main" '
     'xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"')


def run_xml(text: str, bold: bool = False) -> str:
    return f'<w:r>{"<w:rPr><w:b/></w:rPr>" if bold else ""}<w:t xml:space="preserve">{text}</w:t></w:r>'


def field(code: str, result: str) -> str:
    """A complex field: begin, its code, separate, its result, end."""
    return ('<w:r><w:fldChar w:fldCharType="begin"/></w:r>'
            f'<w:r><w:instrText xml:space="preserve"> {code} </w:instrText></w:r>'
            f'<w:r><w:fldChar w:fldCharType="separate"/></w:r>{run_xml(result)}'
            '<w:r><w:fldChar w:fldCharType="end"/></w:r>')


def docx_of(*paragraphs: str) -> bytes:
    """A docx whose body is these ``w:p`` contents (XML), in order."""
    d = docx.Document()
    body = d.element.body
    for xml in paragraphs:
        body.insert(len(body) - 1, parse_xml(f"<w:p {W}>{xml}</w:p>"))
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def pptx_fixture() -> bytes:
    prs = pptx.Presentation()
    s = prs.slides.add_slide(prs.slide_layouts[1])
    s.shapes.title.text = "Ein Titel"
    p = s.placeholders[1].text_frame.paragraphs[0]
    for text, bold in (("Ein Hund ", False), ("im Garten", True), (" bellt.", False)):
        r = p.add_run()
        r.text, r.font.bold = text, bold
    p._p.append(etree.fromstring('<a:br xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main"/>'))
    r = p.add_run()
    r.text = "Zwei Katzen."
    s.notes_slide.notes_text_frame.text = "Eine Notiz."
    buf = io.BytesIO()
    prs.save(buf)
    return buf.getvalue()


MD = ('---\ntitle: Ein Titel\n---\n# Ein **großer** Titel\n\nEin Hund läuft [über](http://x.de "ein \\"t\\"") die '
      "`Wiese` und\nspringt &amp; bellt\\.  \nZwei Katzen.\\\nDrei Vögel.<br>Vier Kühe.\n\n- Eins\n- Zwei *drei*\n\n"
      "> Ein Zitat\n> über zwei Zeilen.\n\n| A | B |\n|---|---|\n| Hund | snake_case |\n\n"
      "![ein Bild](b.png 'T') und <http://x.de> hier.\n\n```\nCode bleibt\n```\n")
HTML = ('<!DOCTYPE html>\n<html><head><title>Ein Titel</title></head>\n<body>\n  <p>Ein <b>roter</b>\n    Hut &amp; '
        'ein&nbsp;<a href="/x">Link</a>.</p>\n  <p>Seite <span translate="no">CODE</span> hier.<br>Zwei.</p>\n'
        '  <pre>bleibt</pre>\n</body></html>\n')
TXT = "  Ein Hund läuft.\nEr springt.\n\n\nZwei Katzen.  \n"
SRT_TAGS = ("1\n00:00:01,000 --> 00:00:02,500\n{\\an8}Ein <i>Hund</i> läuft\nüber die Wiese & den Weg.\n\n"
            "2\n00:01:03,040 --> 00:01:04,999\n<font color=\"#ff0000\">Zwei</font> Männer.\n")
VTT_TAGS = ("WEBVTT\n\n00:00:01.000 --> 00:00:05.000 align:start position:10%\n<v Anna>Ein <00:00:03.500>Hund "
            "<c.loud>bellt</c> laut.</v>\n\n00:00:06.000 --> 00:00:07.000\n<v.first Bob>Zwei Katzen &amp; ein Hund.\n")
DOCX_FIELDS = docx_of(run_xml("Seite ") + field("PAGE", "3") + run_xml(" von ") + field("NUMPAGES", "9"),
                      run_xml("Siehe ") + field('REF Abb1 \\h', "Abbildung 1") + run_xml(" oben."),
                      run_xml("Besuchen Sie ") + field('HYPERLINK "http://x.de"', "die Seite") + run_xml(" heute."),
                      run_xml("Heute ist ") + '<w:fldSimple w:instr=" DATE "><w:r><w:t>1.1.2026</w:t></w:r></w:fldSimple>'
                      + run_xml(" ein Tag."),
                      run_xml("Besuchen Sie ") + '<w:hyperlink r:id="rId9"><w:proofErr w:type="spellStart"/>'
                      + run_xml("Wikipdia") + '<w:proofErr w:type="spellEnd"/></w:hyperlink>' + run_xml(" heute."))
FIXTURES = {"a.txt": TXT.encode(), "a.html": HTML.encode(), "a.md": MD.encode(), "a.srt": SRT.encode(),
            "tags.srt": SRT_TAGS.encode(), "a.vtt": VTT.encode(), "tags.vtt": VTT_TAGS.encode(),
            "a.docx": make_docx(), "fields.docx": DOCX_FIELDS, "a.pptx": pptx_fixture(), "a.odt": make_odt()}
# what must never be sent to the translator, per fixture
KEPT = {"a.html": ["CODE", "bleibt", "<"], "a.md": ["Code bleibt", "http", "b.png", "\\"],
        "tags.srt": ["{", "<", "an8"], "tags.vtt": ["<", "00:00", "Anna", "Bob", "loud"], "a.vtt": ["<", "align"],
        "fields.docx": ["PAGE", "NUMPAGES", "REF", "HYPERLINK", "DATE", "1.1.2026", "Abbildung", "die Seite", " 3",
                        " 9"]}


@pytest.mark.parametrize("name", FIXTURES)
def test_identity_round_trip_of_each_fixture(name):
    identical(FIXTURES[name], name)


@pytest.mark.parametrize("name", FIXTURES)
def test_marking_round_trip_of_each_fixture(name):
    words = {"fields.docx": ["Seite", "von", "Siehe", "oben", "Besuchen", "heute", "Wikipdia", "ein", "Tag"],
             "tags.vtt": ["Hund", "bellt", "laut", "Zwei", "Katzen"], "tags.srt": ["Hund", "Wiese", "Weg", "Zwei"],
             "a.md": ["Hund", "springt", "bellt", "Katzen", "Vögel", "Kühe", "Zitat", "Zeilen", "snake_case"],
             }.get(name, ["Hund", "Titel", "Katzen", "Frau"])
    marked_once(FIXTURES[name], name, KEPT.get(name, []), [w for w in words if w.encode() in FIXTURES[name]])


def test_xml_through_deepl_tag_handling_comes_back_whole():
    xml = ('<doc><title>Ein Titel</title><par>Drücken Sie <x id="1">Weiter</x>, um <ph/> fortzufahren.</par>'
           '<par>Ein\n  Hund &amp; <keep>CODE</keep> bellt.</par><!-- Notiz --></doc>')
    seen: list = []
    for run, want in ((answering(lambda t: t), xml), (answering(lambda t: f"[{t}]", seen), None)):
        client = TestClient(build_app(local_services([CARD], run)))
        r = client.post("/v2/translate", json={"text": [xml], "source_lang": "DE", "target_lang": "EN-GB",
                                               "tag_handling": "xml", "ignore_tags": ["keep"]})
        assert r.status_code == 200, r.text
        out = r.json()["translations"][0]["text"]
        if want is not None:
            assert out == want
    assert out.replace("[", "").replace("]", "") == xml
    texts = [t for job in seen for t in job.texts]
    assert not any(k in t for t in texts for k in ("<", "CODE", "Notiz", "id="))


# ---- the kinds issue #48 named, each with a translator that changes the words -------------------------
DICT = {"Ein Hund.": "A dog.", "Zwei Katzen.": "Two cats.", "Ein Hund. Zwei Katzen.": "A dog. Two cats.",
        "Ein Link hier.": "A link here.", "Link": "link"}


def dictionary(t: str) -> str:
    return DICT.get(t, t.upper())


@pytest.mark.parametrize("brk", ["  \n", "\\\n", "<br>", "<br/>\n"])
def test_markdown_hard_break_between_sentences_stays_between_them(brk):
    out = translated(f"Ein Hund.{brk}Zwei Katzen.\n".encode(), "a.md", answering(dictionary)).decode()
    assert out == f"A dog.{brk}Two cats.\n"


def test_markdown_link_title_with_escaped_quotes_stays_escaped():
    out = translated(b'Ein [Link](http://x.de "ein \\"t\\" x") hier.\n', "a.md", answering(dictionary)).decode()
    assert out == 'A [link](http://x.de "ein \\"t\\" x") here.\n'


def test_subrip_override_tags_stay_verbatim_in_place_and_are_not_sent():
    jobs: list = []
    src = "1\n00:00:01,000 --> 00:00:02,000\n{\\an8}{\\i1}Ein Hund{\\i0} läuft.\n\n"
    out = translated(src.encode(), "a.srt", answering(str.upper, jobs)).decode()
    assert out == "1\n00:00:01,000 --> 00:00:02,000\n{\\an8}{\\i1}EIN HUND{\\i0} LÄUFT.\n\n"
    assert [t for j in jobs for t in j.texts] == ["Ein Hund läuft."]


def test_webvtt_timestamp_voice_and_class_tags_stay_verbatim_never_escaped():
    jobs: list = []
    src = "WEBVTT\n\n00:00:01.000 --> 00:00:05.000\n<v Anna>Ein <00:00:03.500>Hund <c.x>läuft</c>.</v>\n"
    out = translated(src.encode(), "a.vtt", answering(str.upper, jobs)).decode()
    assert out == "WEBVTT\n\n00:00:01.000 --> 00:00:05.000\n<v Anna>EIN <00:00:03.500>HUND <c.x>LÄUFT</c>.</v>\n"
    assert "&lt;" not in out and not any("<" in t or "Anna" in t for j in jobs for t in j.texts)


def test_docx_fields_stay_whole_and_the_words_around_them_are_translated():
    out = docx.Document(io.BytesIO(translated(DOCX_FIELDS, "a.docx", answering(str.upper))))
    xml = [etree.tostring(p._p).decode() for p in out.paragraphs]
    texts = ["".join(t.text or "" for t in p._p.iter("{*}t")) for p in out.paragraphs]
    assert texts == ["SEITE 3 VON 9", "SIEHE Abbildung 1 OBEN.", "BESUCHEN SIE die Seite HEUTE.",
                     "HEUTE IST 1.1.2026 EIN TAG.", "BESUCHEN SIE WIKIPDIA HEUTE."]
    assert all(c in xml[0] for c in (" PAGE ", " NUMPAGES ")) and 'w:instr=" DATE "' in xml[3]
    assert xml[4].count("proofErr") == 2 and 'r:id="rId9"' in xml[4]


def test_docx_field_result_spanning_paragraphs_is_left_as_the_field_says():
    data = docx_of(run_xml("Inhalt ") + '<w:r><w:fldChar w:fldCharType="begin"/></w:r><w:r><w:instrText> TOC '
                   '</w:instrText></w:r><w:r><w:fldChar w:fldCharType="separate"/></w:r>' + run_xml("Kapitel eins"),
                   run_xml("Kapitel zwei") + '<w:r><w:fldChar w:fldCharType="end"/></w:r>', run_xml("Ein Hund."))
    out = docx.Document(io.BytesIO(translated(data, "a.docx", answering(str.upper))))
    assert [p.text for p in out.paragraphs] == ["INHALT Kapitel eins", "Kapitel zwei", "EIN HUND."]


def test_an_image_between_words_keeps_the_space_on_both_sides():
    d = docx.Document()
    p = d.add_paragraph("Ein Bild ")
    p.add_run().add_picture(io.BytesIO(PNG))
    p.add_run(" hier.")
    buf = io.BytesIO()
    d.save(buf)
    out = docx.Document(io.BytesIO(translated(buf.getvalue(), "a.docx", answering(str.upper))))
    assert [r.text for r in out.paragraphs[0].runs] == ["EIN BILD ", "", " HIER."]


def test_odt_runs_of_spaces_a_translation_keeps_are_written_as_odf_shows_them():
    from odf.opendocument import OpenDocumentText
    from odf.opendocument import load as odf_load
    from odf.text import P, S
    doc = OpenDocumentText()
    p = P(text="Ein")
    p.addElement(S(c=3))
    p.addText("Hund.")
    doc.text.addElement(p)
    buf = io.BytesIO()
    doc.write(buf)
    out = odf_load(io.BytesIO(translated(buf.getvalue(), "a.odt", answering(lambda t: t))))
    para = out.text.getElementsByType(P)[0]
    assert [(n.qname[1], n.attributes.get((n.qname[0], "c"))) if n.nodeType == 1 else str(n)
            for n in para.childNodes] == ["Ein ", ("s", "2"), "Hund."]      # 3 spaces, as ODF writes them


# ---- what the real files of test_round_trip_real.py found, each with a small file of its kind -------
def test_an_odt_with_an_empty_xml_member_as_libreoffice_writes_it_is_translated():
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(make_odt())) as src, zipfile.ZipFile(buf, "w") as out:
        for info in src.infolist():
            out.writestr(info, src.read(info))
        out.writestr("Configurations2/accelerator/current.xml", b"")     # every LibreOffice file has it
    data = buf.getvalue()
    assert "Configurations2/accelerator/current.xml" in zipfile.ZipFile(io.BytesIO(data)).namelist()
    identical(data, "a.odt")


@pytest.mark.parametrize("name", ["a.txt", "a.html", "a.md", "a.srt", "tags.vtt"])
def test_a_text_file_keeps_its_byte_order_mark(name):
    data = b"\xef\xbb\xbf" + FIXTURES[name]
    assert translated(data, name, answering(lambda t: t)) == data
    assert translated(data, name, answering(str.upper)).startswith(b"\xef\xbb\xbf")


def test_webvtt_is_edited_in_place_around_its_cues():
    src = ("WEBVTT - Ein Titel\r\n\r\n00:16.500 --> 00:18.500\r\nEin <00:17.500>Hund\r\n\r\n\r\nNOTE bleibt\r\n\r\n"
           "00:00:18.500 --> 00:00:20.500 align:start\r\nZwei Katzen\r\n00:00:20.500 --> 00:00:21.500\r\nDrei")
    out = translated(src.encode(), "a.vtt", answering(str.upper)).decode()
    assert out == src.replace("Ein <00:17.500>Hund", "EIN <00:17.500>HUND").replace("Zwei Katzen", "ZWEI KATZEN") \
        .replace("\nDrei", "\nDREI")
    identical(src.encode(), "a.vtt")


@pytest.mark.parametrize("src, upper", [
    ("this will<b> happen</b> is", "THIS WILL<b> HAPPEN</b> IS"),                # the space inside it: once
    ("a<00:01.000><c> will</c><c.x> be</c>", "A<00:01.000><c> WILL</c><c.x> BE</c>"),
    ("XXX<b>XX</b> yy", "XXX<b>XX</b> YY"),                                     # a tag inside a word
    ("Ein Hund: <i> bellt</i> laut", "EIN HUND: <i> BELLT</i> LAUT"),            # a space on both sides: both
])
def test_an_element_keeps_its_place_and_its_spaces_in_a_cue(src, upper):
    cue = f"WEBVTT\n\n00:01.000 --> 00:02.000\n{src}\n"
    assert translated(cue.encode(), "a.vtt", answering(lambda t: t)).decode() == cue
    assert translated(cue.encode(), "a.vtt", answering(str.upper)).decode() == cue.replace(src, upper)


def test_an_element_is_found_in_a_translation_that_wraps_its_words():
    out = translated(b"Ein Port von [markdown-it], **siehe auch:** hier.\n\n[markdown-it]: http://x.de\n", "a.md",
                     answering(lambda t: f"\u00ab{t}\u00bb")).decode()
    assert out.startswith("\u00abEin Port von [markdown-it], **siehe auch:** hier.\u00bb")
    html = ('<!DOCTYPE html><p><b>Text mit</b> einem Stil<b>.</b></p>').encode()
    out = translated(html, "a.html", answering(lambda t: f"[{t}]")).decode()
    assert out == '<!DOCTYPE html><p><b>[Text mit</b> einem Stil<b>.]</b></p>'     # "." alone in its element


def test_text_that_looks_like_an_entity_stays_text():
    data = b"<p>Ein &amp;#98765432; Hund &amp;copy; bellt.</p>\n"          # the text "&#98765432;", "&copy;"
    assert translated(data, "a.html", answering(lambda t: t)) == data
    out = translated(data, "a.html", answering(lambda t: t.replace("Hund", "dog")))
    assert out == b"<p>Ein &amp;#98765432; dog &amp;copy; bellt.</p>\n"


def test_the_end_of_a_cell_closes_a_code_element_left_open_in_it():
    data = b"<table><tr><td>Ein <code>&lt;div&gt;</td><td>Zwei Hunde.</td></tr></table><p>Drei Katzen.</p>"
    out = translated(data, "a.html", answering(str.upper))
    assert out == data.replace(b"Ein", b"EIN").replace(b"Zwei Hunde", b"ZWEI HUNDE").replace(b"Drei Katzen",
                                                                                             b"DREI KATZEN")


def test_odt_line_indented_after_a_break_keeps_its_spaces():
    from odf.opendocument import OpenDocumentText
    from odf.opendocument import load as odf_load
    from odf.text import LineBreak, P, S
    doc = OpenDocumentText()
    p = P(text="Ein Hund,")
    p.addElement(LineBreak())
    p.addText(" ")
    p.addElement(S(c=7))
    p.addText("der bellt.")
    doc.text.addElement(p)
    buf = io.BytesIO()
    doc.write(buf)
    out = odf_load(io.BytesIO(translated(buf.getvalue(), "a.odt", answering(str.upper))))
    para = out.text.getElementsByType(P)[0]
    assert [(n.qname[1], n.attributes.get((n.qname[0], "c"))) if n.nodeType == 1 else str(n)
            for n in para.childNodes] == ["EIN HUND,", ("line-break", None), " ", ("s", "7"), "DER BELLT."]


def test_a_subrip_cue_without_its_timing_line_keeps_the_blank_line_before_it():
    src = "1\n00:00:01,000 --> 00:00:02,000\nEin Hund.\n\n2\nZwei Katzen.\n\n3\n00:00:03,000 --> 00:00:04,000\nDrei.\n"
    identical(src.encode(), "a.srt")
    assert translated(src.encode(), "a.srt", answering(str.upper)).decode() == src.replace(
        "Ein Hund.\n\n2\nZwei Katzen.", "EIN HUND.\n\n2\nZWEI KATZEN.").replace("Drei.", "DREI.")


def test_a_webvtt_cue_with_a_malformed_timing_is_kept_as_it_is():
    src = ("WEBVTT\n\n00:00:01.000 --> 00:00:02.000\nEin Hund.\n\n00:00:03.000 --> 00:00:0x.000\nZwei Katzen.\n\n"
           "00:00:05.000 --> 00:00:06.000\nDrei.\n")
    identical(src.encode(), "a.vtt")
    assert translated(src.encode(), "a.vtt", answering(str.upper)).decode() == src.replace(
        "Ein Hund.", "EIN HUND.").replace("Drei.", "DREI.")       # webvtt-py skips the second cue: it stays


def test_a_bookmark_inside_a_word_stays_inside_it():
    data = docx_of(run_xml("Ein Para") + '<w:bookmarkStart w:id="0" w:name="_GoBack"/><w:bookmarkEnd w:id="0"/>'
                   + run_xml("graph hier."))
    identical(data, "a.docx")


def test_a_comment_before_a_quoted_word_stays_before_that_word():
    data = (b'<p>The key words "MUST", "MUST NOT", <!--"REQUIRED",--> <!--"SHALL", "SHALL NOT",--> "SHOULD", "SHOULD\n'
            b'  NOT", <!--"RECOMMENDED", "NOT RECOMMENDED",--> "MAY", and "OPTIONAL" in the normative parts.</p>')
    assert translated(data, "a.html", answering(lambda t: t)) == data       # from the HTML standard's source
