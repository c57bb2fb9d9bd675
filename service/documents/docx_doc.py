"""Word documents (.docx, python-docx). Every paragraph (``w:p``) of the body, tables (nested too),
text boxes, headers, footers, footnotes and endnotes is one ``RichText`` unit: its runs (``w:r``,
formatting in ``w:rPr``: bold, italic, colour, ...) and hyperlinks (``w:hyperlink``) are carried to the
translated words; paragraph properties (styles: headings, list numbering) are never touched, so the
structure stays. Runs that are not plain text (images, field characters, footnote marks, tabs and
breaks) stay as they are, at their place; so does anything else inside a paragraph or a hyperlink
(simple fields, bookmarks, proofing marks, comments, tracked changes, content controls), its text
untranslated. A complex field (``w:fldChar`` begin .. end, its ``w:instrText`` code and its result,
over paragraphs too) is kept whole: its result is what the field says until Word updates it.
"""
from __future__ import annotations

import copy
import io

import docx
from lxml import etree
from docx.opc.constants import RELATIONSHIP_TYPE as RT
from docx.oxml.ns import qn

from .common import Group, Item, Run, Segments, build, not_valid, replace_children, saved
from .safety import open_archive

_TEXT = {qn("w:t"): None, qn("w:noBreakHyphen"): "-", qn("w:softHyphen"): "\u00ad"}
_SPACES = {qn("w:tab"), qn("w:br"), qn("w:cr")}
_RUN_KEEP = {qn("w:rPr"), qn("w:lastRenderedPageBreak")}
_PARTS = (RT.HEADER, RT.FOOTER, RT.FOOTNOTES, RT.ENDNOTES, RT.COMMENTS)


class DocxDocument:
    def __init__(self, data: bytes):
        _, self.parsed_bytes = open_archive(data, "Word (.docx)", "word/document.xml")
        try:
            self.doc = docx.Document(io.BytesIO(data))
        except Exception as e:  # noqa: BLE001 - any failure of the library on an untrusted file is the file's
            raise not_valid("Word (.docx)", e) from None
        roots = [self.doc.element.body]
        for rel in self.doc.part.rels.values():      # parts python-docx parses as XML (others: left as they are)
            if rel.reltype in _PARTS and not rel.is_external and hasattr(rel.target_part, "element"):
                roots.append(rel.target_part.element)
        self._seg = Segments()
        for root in roots:
            field = _Field()            # a field's runs may span paragraphs (a table of contents)
            for p in root.iter(qn("w:p")):
                self._seg.add_runs(*_paragraph(p, field))
        self.segments = self._seg.segments

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        return saved(self.doc.save)


class _Field:
    """How deep the runs read so far are inside complex fields (``w:fldChar`` begin .. end)."""
    depth = 0


def _paragraph(p, field: _Field):
    """A ``w:p``'s runs, hyperlinks and other children as items, and the ``put`` that writes rebuilt
    items back in their place (``Segments.add_runs``)."""
    templates: dict[int, object] = {}      # key -> the w:r / w:hyperlink / other element it copies
    items = []
    inline = []                            # the children that the rebuilt items replace
    for child in p:
        if child.tag == qn("w:pPr"):
            continue
        inline.append(child)
        if child.tag == qn("w:r"):
            items += _run_items(child, templates, field)
        elif child.tag == qn("w:hyperlink"):      # its runs carried; anything else in it (w:proofErr) kept
            key = len(templates)
            templates[key] = child
            group = Group(key)
            for c in child:
                group.items += _run_items(c, templates, field) if c.tag == qn("w:r") else [_kept(c, templates)]
            items.append(group)
        else:           # a simple field (w:fldSimple), bookmark, proofing mark, ...: kept as it is
            items.append(_kept(child, templates))
    return items, lambda rebuilt: replace_children(p, inline, lambda: _elements(rebuilt, templates))


def _kept(el, templates: dict) -> Run:
    """An atomic run of an element kept as it is."""
    key = len(templates)
    templates[key] = el
    return Run(key, "", None)


def _run_items(r, templates: dict, field: _Field) -> list[Run]:
    """A ``w:r`` as runs: its text pieces (one style: its rPr) and, between them, each tab, break,
    image or field character as an atomic run holding a copy of the run with only that child. A run of
    a complex field (its code, its result: from ``fldChar`` begin to end) is kept whole: the field's
    result is what the field says until Word updates it."""
    marks = [c.get(qn("w:fldCharType")) for c in r.iter(qn("w:fldChar"))]
    inside = field.depth > 0 or bool(marks) or r.find(qn("w:instrText")) is not None
    field.depth = max(0, field.depth + marks.count("begin") - marks.count("end"))
    if inside:
        return [_kept(r, templates)]
    rpr = r.find(qn("w:rPr"))
    style = b"" if rpr is None else etree.tostring(rpr)
    out: list[Run] = []
    text = ""

    def flush():
        nonlocal text
        if text:
            key = len(templates)
            templates[key] = r
            out.append(Run(key, text, style))
            text = ""
    for child in r:
        if child.tag in _RUN_KEEP:
            continue
        if child.tag in _TEXT:
            text += child.text or "" if _TEXT[child.tag] is None else _TEXT[child.tag]
            continue
        flush()
        key = len(templates)
        templates[key] = (r, child)     # written as a run of r's formatting holding this very child
        out.append(Run(key, "", None, space=child.tag in _SPACES))
    flush()
    return out


def _elements(items: list[Item], templates: dict) -> list:
    """The XML elements of rebuilt items: text runs copied from their template with the new text,
    groups (hyperlinks) copied without their runs and filled, atomic runs as they were: the element
    itself, or a run with its run's formatting around the child itself (moved, not copied: a text
    box's paragraphs inside a drawing are units of their own, translated in place)."""
    return build(items, templates, _text_run, _hyperlink, _atomic)


def _text_run(tpl, text: str):
    r = copy.deepcopy(tpl)
    for c in list(r):
        if c.tag != qn("w:rPr"):
            r.remove(c)
    t = r.makeelement(qn("w:t"), {})
    t.text = text
    t.set("{http://www.w3.org/XML/1998/namespace}space", "preserve")
    r.append(t)
    return r


def _hyperlink(tpl, children: list):
    link = copy.deepcopy(tpl)
    for c in list(link):
        link.remove(c)
    link.extend(children)
    return link


def _atomic(tpl):
    if not isinstance(tpl, tuple):
        return tpl
    r, child = tpl
    run = r.makeelement(qn("w:r"), dict(r.attrib))
    if r.find(qn("w:rPr")) is not None:
        run.append(copy.deepcopy(r.find(qn("w:rPr"))))
    run.append(child)
    return run


def load(data: bytes) -> DocxDocument:
    return DocxDocument(data)
