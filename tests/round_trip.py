"""``round_trip``: a document through the document route's translation (``routes.translated``, the
pipeline, a test double of the translator from ``local_services``) and the checks the round-trip
tests share: text formats byte for byte, office formats as the same XML once normalised (runs of one
formatting merged, ``xml:space`` dropped: what python-docx, python-pptx and odfpy may write either way;
whitespace at a run's edge moved to the next run, or the run before: where it goes is the placement's
choice, as it cannot follow words; whitespace next to a tab or break dropped: it stands for it)."""
from __future__ import annotations

import asyncio
import copy
import io
import os
import re
import zipfile
from collections import Counter

import docx
import pptx
import pytest
from local_services import CLOSE, OPEN, identity, local_services, marked
from lxml import etree

from model.config import ModelConfig
from service import documents
from service.api import documents as routes
from service.translator import ModelCard

CARD = ModelCard("de-en", "", "de", "en", ModelConfig.from_name("tiny", vocab_size=500, max_len=64))
OFFICE = ("docx", "pptx", "odt")
# translatable words of generated documents: lower-case, 3+ letters, none inside another
WORDS = ["hund", "katze", "baum", "wiese", "vogel", "sonne", "regen", "brot", "milch", "fenster", "garten", "stuhl"]


COUNTS: Counter = Counter()     # (round trip, extension) -> documents checked in this process


@pytest.fixture(scope="module", autouse=True)
def counts():
    """With ``ROUND_TRIP_COUNTS=1``, the documents each module checked, per format (pytest -s)."""
    yield
    if os.environ.get("ROUND_TRIP_COUNTS"):
        print("\nround trips (documents):", ", ".join(f"{ext} {COUNTS['identity', ext]} identity / "
                                                    f"{COUNTS['marking', ext]} marking"
                                                    for ext in sorted({e for _, e in COUNTS})))
        COUNTS.clear()


def translated(data: bytes, name: str, run) -> bytes:
    """``data`` (a file called ``name``) translated by ``run`` as the document routes translate."""
    svc = local_services([CARD], run)
    return asyncio.run(routes.translated(svc, documents.load(data, name), CARD.id, None))[0]


def identical(data: bytes, name: str) -> bytes:
    """Asserts the identity round trip: the same bytes (text formats) or the same normalised XML.
    Returns the file that came back."""
    COUNTS["identity", name.rsplit(".", 1)[-1]] += 1
    out = translated(data, name, identity())
    if name.rsplit(".", 1)[-1] in OFFICE:
        assert normalised(out) == normalised(written(data, name))
    else:
        assert out.decode() == data.decode()
    return out


def marked_once(data: bytes, name: str, kept: list[str], words: list[str] = WORDS) -> list[str]:
    """Asserts the marking round trip: no job's text holds any of ``kept`` (markup, codes, timestamps,
    placeholders), the output less its markers is the identity output, and each of ``words`` in the
    output's text is inside markers, as often as in the input. Returns the segments sent."""
    COUNTS["marking", name.rsplit(".", 1)[-1]] += 1
    jobs: list = []
    out = translated(data, name, marked(jobs))
    sent = [t for job in jobs for t in job.texts]
    for piece in kept:
        assert not any(piece in t for t in sent), (piece, sent)
    office = name.rsplit(".", 1)[-1] in OFFICE
    text_in, text_out = (xml_text(data), xml_text(out)) if office else (data.decode(), out.decode())
    if office:
        assert normalised(out, unmark=True) == normalised(written(data, name))
    else:
        assert text_out.replace(OPEN, "").replace(CLOSE, "") == text_in
    for word in words:
        found = [m.start() for m in re.finditer(rf"\b{word}\b", text_out)]
        assert len(found) == len(re.findall(rf"\b{word}\b", text_in)), (word, text_out)
        assert all(text_out.count(OPEN, 0, at) > text_out.count(CLOSE, 0, at) for at in found), (word, text_out)
    return sent


def written(data: bytes, name: str) -> bytes:
    """An office file as its library writes it unchanged, what a translated file is compared with:
    odfpy rewrites an .odt's package (ODF 1.2, its generator, the header and footer styles moved to
    styles.xml and renamed, the manifest's order), python-pptx adds an empty slide list, ..."""
    buf = io.BytesIO()
    if name.endswith(".docx"):
        docx.Document(io.BytesIO(data)).save(buf)
    elif name.endswith(".pptx"):
        prs = pptx.Presentation(io.BytesIO(data))
        prs.slides          # (reading the slides adds an empty list where there is none, as the rebuild does)
        prs.save(buf)
    else:
        from odf.opendocument import load
        doc = load(io.BytesIO(data))
        for node in list(doc.meta.childNodes):      # odfpy's save takes each for an element
            if node.nodeType != node.ELEMENT_NODE:
                doc.meta.childNodes.remove(node)
        doc.write(buf)
    return buf.getvalue()


def xml_text(data: bytes) -> str:
    """The text of every XML member of an archive (its text nodes, in order, a line each)."""
    zf = zipfile.ZipFile(io.BytesIO(data))
    return "\n".join("\n".join(etree.fromstring(zf.read(n)).itertext()) for n in sorted(zf.namelist())
                      if n.endswith(".xml") and zf.getinfo(n).file_size)


_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
_A = "http://schemas.openxmlformats.org/drawingml/2006/main"
_TEXT = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"
_MANIFEST = "urn:oasis:names:tc:opendocument:xmlns:manifest:1.0"
_SPACE = "{http://www.w3.org/XML/1998/namespace}space"


_CT = "{http://schemas.openxmlformats.org/package/2006/content-types}"
_PARAGRAPH = {f"{{{_TEXT}}}p", f"{{{_TEXT}}}h"}


def normalised(data: bytes, unmark: bool = False) -> dict[str, bytes]:
    """Each XML member of an office archive as canonical XML once normalised: adjacent text runs of
    one formatting merged (``w:r``/``a:r`` holding only text; odt's adjacent text and ``text:s``),
    ``xml:space`` dropped; whitespace between elements dropped where it is layout (OOXML has no mixed
    content; ODF's outside paragraphs); ``[Content_Types].xml`` as each member's content type (the
    order of its entries, and Defaults standing for Overrides, are the writer's choice);
    ``w:lastRenderedPageBreak`` dropped (where Word last broke the page: stale once the text changes,
    and left out by the rebuild); empty members (no XML: LibreOffice's
    ``Configurations2/accelerator/current.xml``) as empty; ``unmark``: the markers of ``marked``
    taken out of the text first."""
    zf = zipfile.ZipFile(io.BytesIO(data))
    out = {}
    for name in sorted(zf.namelist()):
        if not name.endswith(".xml"):
            continue
        if not zf.getinfo(name).file_size:
            out[name] = b""
            continue
        root = etree.fromstring(zf.read(name))
        if name == "[Content_Types].xml":
            _content_types(root, zf.namelist())
        _drop_layout(root, odf=name.endswith(("content.xml", "styles.xml", "meta.xml", "settings.xml",
                                                "manifest.xml")) and "mimetype" in zf.namelist())
        for el in list(root.iter(f"{{{_W}}}lastRenderedPageBreak")):
            el.getparent().remove(el)
        for r in list(root.iter(f"{{{_W}}}r")):      # a run of formatting only (no content); revision ids
            if all(c.tag == f"{{{_W}}}rPr" for c in r):
                r.getparent().remove(r)
            for a in [a for a in r.attrib if a.startswith(f"{{{_W}}}rsid")]:
                del r.attrib[a]
        for entry in root.findall("{*}file-entry"):      # odfpy's manifest names the package itself
            if entry.get(f"{{{_MANIFEST}}}full-path") == "/":
                root.remove(entry)
        for el in root.iter():
            if unmark and el.text:
                el.text = el.text.replace(OPEN, "").replace(CLOSE, "")
            if unmark and el.tail:
                el.tail = el.tail.replace(OPEN, "").replace(CLOSE, "")
            el.attrib.pop(_SPACE, None)
        for ns in (_W, _A):
            _split_runs(root, ns)
            _merge_runs(root, ns, "t", "rPr")
            _shift_spaces(root, ns)
            _merge_runs(root, ns, "t", "rPr")
        _merge_odf(root)
        out[name] = etree.tostring(root, method="c14n", exclusive=True)
    return out


def _content_types(root, members: list[str]) -> None:
    """``[Content_Types].xml`` rewritten as an Override per member (its Override, else its extension's Default)."""
    default = {d.get("Extension").lower(): d.get("ContentType") for d in root.iter(f"{_CT}Default")}
    override = {o.get("PartName"): o.get("ContentType") for o in root.iter(f"{_CT}Override")}
    for child in list(root):
        root.remove(child)
    for m in sorted(members):
        kind = override.get("/" + m) or default.get(m.rsplit(".", 1)[-1].lower())
        if kind and not m.endswith("/") and m != "[Content_Types].xml":
            etree.SubElement(root, f"{_CT}Override", PartName="/" + m, ContentType=kind)


def _drop_layout(root, odf: bool) -> None:
    """Whitespace-only text between elements dropped (OOXML: everywhere but in a leaf; ODF: outside
    ``text:p`` and ``text:h``, where it is the writer's indentation)."""
    inside = {el for p in root.iter(*_PARAGRAPH) for el in p.iter()} if odf else set()
    for el in root.iter():
        if len(el) and el not in inside and el.text is not None and not el.text.strip():
            el.text = None
        parent = el.getparent()
        if parent is not None and parent not in inside and el.tail is not None and not el.tail.strip():
            el.tail = None


def _split_runs(root, ns: str) -> None:
    """Each run with more than one child besides its properties split into runs of one child each
    (``<w:r><w:tab/><w:t>x</w:t></w:r>`` is ``<w:r><w:tab/></w:r><w:r><w:t>x</w:t></w:r>``)."""
    for r in list(root.iter(f"{{{ns}}}r")):
        props = r.find(f"{{{ns}}}rPr")
        content = [c for c in r if c is not props]
        at = r
        for c in content[1:]:
            new = etree.Element(r.tag, dict(r.attrib))
            if props is not None:
                new.append(copy.deepcopy(props))
            new.append(c)
            at.addnext(new)
            at = new


def _merge_runs(root, ns: str, t: str, props: str) -> None:
    def text_only(r) -> bool:
        return all(c.tag in (f"{{{ns}}}{t}", f"{{{ns}}}{props}") for c in r) and r.find(f"{{{ns}}}{t}") is not None
    for r in list(root.iter(f"{{{ns}}}r")):
        if not text_only(r):
            continue
        ts = r.findall(f"{{{ns}}}{t}")
        ts[0].text = "".join(x.text or "" for x in ts)
        for x in ts[1:]:
            r.remove(x)
        prev = r.getprevious()
        if prev is not None and prev.tag == r.tag and text_only(prev) and not (prev.tail or "").strip():
            p1, p2 = prev.find(f"{{{ns}}}{props}"), r.find(f"{{{ns}}}{props}")
            same = (p1 is None and p2 is None) or (p1 is not None and p2 is not None and
                                                   etree.tostring(p1, method="c14n") == etree.tostring(p2, method="c14n"))
            if same:
                prev.find(f"{{{ns}}}{t}").text += ts[0].text
                r.getparent().remove(r)
        if r.getparent() is not None and not ts[0].text:
            r.getparent().remove(r)


def _shift_spaces(root, ns: str) -> None:
    """The whitespace at the end of a text run moved to the start of the next text run (where a
    run's edge whitespace goes is the translator's choice: it cannot follow the words)."""
    def text_only(r) -> bool:
        return r is not None and r.tag == f"{{{ns}}}r" and [c.tag for c in r if c.tag != f"{{{ns}}}rPr"] == [f"{{{ns}}}t"]
    for r in list(root.iter(f"{{{ns}}}r")):
        nxt = r.getnext()
        if text_only(r) and text_only(nxt):
            t, t2 = r.find(f"{{{ns}}}t"), nxt.find(f"{{{ns}}}t")
            core = (t.text or "").rstrip()
            t2.text, t.text = (t.text or "")[len(core):] + (t2.text or ""), core
            if not core:
                r.getparent().remove(r)
    breaks = {f"{{{ns}}}{b}" for b in ("tab", "br", "cr")}
    for r in list(root.iter(f"{{{ns}}}r", f"{{{ns}}}br")):    # whitespace next to a tab or break: it stands for it
        if r.tag in breaks or any(c.tag in breaks for c in r):
            for other, strip in ((r.getprevious(), str.rstrip), (r.getnext(), str.lstrip)):
                if text_only(other):
                    other.find(f"{{{ns}}}t").text = strip(other.find(f"{{{ns}}}t").text or "")
    for r in list(root.iter(f"{{{ns}}}r")):           # a run of whitespace only: the run before's
        prev = r.getprevious()
        if text_only(r) and text_only(prev) and not (r.find(f"{{{ns}}}t").text or "").strip():
            prev.find(f"{{{ns}}}t").text = (prev.find(f"{{{ns}}}t").text or "") + r.find(f"{{{ns}}}t").text
            r.getparent().remove(r)


def _merge_odf(root) -> None:
    for s in list(root.iter(f"{{{_TEXT}}}s")):        # text:s c=N as N spaces
        n = int(s.get(f"{{{_TEXT}}}c", "1"))
        _put_text(s, " " * n + (s.tail or ""))
    for span in list(root.iter(f"{{{_TEXT}}}span", f"{{{_TEXT}}}a")):   # adjacent spans of one style: one
        prev = span.getprevious()
        if (prev is not None and prev.tag == span.tag and dict(prev.attrib) == dict(span.attrib)
                and not (prev.tail or "").strip() and len(prev) == 0 and len(span) == 0):
            prev.text = (prev.text or "") + (prev.tail or "") + (span.text or "")
            prev.tail = span.tail
            span.getparent().remove(span)
    for el in root.iter():                            # whitespace next to a tab or line break: it stands for it
        if el.tag in (f"{{{_TEXT}}}tab", f"{{{_TEXT}}}line-break"):
            el.tail = (el.tail or "").lstrip() or None
            prev, parent = el.getprevious(), el.getparent()
            if prev is not None:
                prev.tail = (prev.tail or "").rstrip() or None
            else:
                parent.text = (parent.text or "").rstrip() or None


def _put_text(el, text: str) -> None:
    parent, prev = el.getparent(), el.getprevious()
    if prev is None:
        parent.text = (parent.text or "") + text
    else:
        prev.tail = (prev.tail or "") + text
    parent.remove(el)
