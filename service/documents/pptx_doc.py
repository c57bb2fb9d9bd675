"""PowerPoint presentations (.pptx, python-pptx). Every paragraph (``a:p``) of every slide, slide
layout-independent text (shapes, groups, tables, notes) is one ``RichText`` unit: its runs (``a:r``,
formatting and hyperlinks in ``a:rPr``) are carried to the translated words; paragraph properties
(levels, bullets) and the end-of-paragraph properties stay. Line breaks (``a:br``) and fields
(``a:fld``: slide numbers, dates) stay as they are, at their place, untranslated.
"""
from __future__ import annotations

import copy
import io

import pptx
from lxml import etree
from pptx.oxml.ns import qn

from .common import Run, Segments, build, not_valid, replace_children, saved
from .safety import open_archive


class PptxDocument:
    def __init__(self, data: bytes):
        _, self.parsed_bytes = open_archive(data, "PowerPoint (.pptx)", "ppt/presentation.xml")
        try:
            self.prs = pptx.Presentation(io.BytesIO(data))
            roots = []
            for slide in self.prs.slides:
                roots.append(slide.element)
                if slide.has_notes_slide:
                    roots.append(slide.notes_slide.element)
        except Exception as e:  # noqa: BLE001 - any failure of the library on an untrusted file is the file's
            raise not_valid("PowerPoint (.pptx)", e) from None
        self._seg = Segments.of_paragraphs((p for root in roots for p in root.iter(qn("a:p"))), _paragraph)
        self.segments = self._seg.segments

    def rebuild(self, translations: list[str]) -> bytes:
        self._seg.apply(translations)
        return saved(self.prs.save)


def _paragraph(p):
    """An ``a:p``'s runs, breaks and fields as items, and the ``put`` that writes rebuilt items back
    in their place (``Segments.add_runs``)."""
    templates: dict[int, object] = {}
    items, inline = [], []
    for child in p:
        if child.tag in (qn("a:pPr"), qn("a:endParaRPr")):
            continue
        inline.append(child)
        key = len(templates)
        templates[key] = child
        if child.tag == qn("a:r"):
            rpr = child.find(qn("a:rPr"))
            t = child.find(qn("a:t"))
            items.append(Run(key, t.text or "" if t is not None else "",
                             b"" if rpr is None else etree.tostring(rpr)))
        else:
            items.append(Run(key, "", None, space=child.tag == qn("a:br")))
    return items, lambda rebuilt: replace_children(p, inline, lambda: build(rebuilt, templates, _text_run))


def _text_run(tpl, text: str):
    """A copy of the ``a:r`` with ``text``."""
    r = copy.deepcopy(tpl)
    t = r.find(qn("a:t"))
    if t is None:
        t = etree.SubElement(r, qn("a:t"))
    t.text = text
    return r


def load(data: bytes) -> PptxDocument:
    return PptxDocument(data)
